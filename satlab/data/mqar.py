"""Multi-query associative recall (MQAR, Zoology) generated on the fly: ``data.source=synthetic:mqar``.

A sequence of ``seq_len`` tokens is ``num_pairs`` key-value pairs, then a query region of filler tokens in which
keys appear again; targets are -100 (ignored) everywhere except at the last token of each query key, where the
target is that key's value. Token ids (see :class:`~satlab.config.schema.MQARConfig`): 0 end-of-text (unused), 1
the separator of the ``separated`` layout, then the keys, then the values; filler tokens are drawn from keys and
values alike, and query keys sit in uniformly drawn, non-overlapping slots of the query region (Zoology draws the
gaps from a power law; uniform slots put more queries far from their pair, which is no easier).

Determinism: the training stream is a sequence of rows, and row ``j`` depends only on ``(seed, j)``: rows are
generated in blocks of :data:`BLOCK` from a numpy generator seeded with ``(seed, block)``. Micro-batch ``k`` of rank
``r`` of ``world_size`` holds rows ``start + (k * world_size + r) * B ... + B``, so a run resumed at token position
``N`` continues at row ``N / seq_len`` whatever the number of workers. The held-out rows come from a generator
seeded by the task's settings alone (not ``train.seed``); a training row equal to a held-out row is redrawn, so no
held-out item is ever trained on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import tokenizers
import torch
from tokenizers import models, pre_tokenizers
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from satlab.config.schema import MQARConfig
from satlab.data.common import stable_hash
from satlab.data.tokenizer import EOS_TOKEN, TextTokenizer

IGNORE_INDEX = -100
"""The target of every position that is not an answer (``torch.nn.functional.cross_entropy``'s default)."""
BLOCK = 64
"""Rows generated per numpy call; part of what fixes a row's content, so changing it changes every stream."""
SEPARATOR = "="
_TRAIN_STREAM, _HELD_OUT_STREAM, _REDRAW = 0, 1, 2


def mqar_tokenizer(cfg: MQARConfig) -> TextTokenizer:
    """A word-level tokenizer over the task's ids (``k0 k1 ... v0 v1 ...``), so that checkpoints, decoding and the
    gate analysis treat a recall model like any other."""
    values = cfg.vocab_size - cfg.first_key - cfg.num_keys
    vocab = {EOS_TOKEN: 0, SEPARATOR: 1}
    vocab |= {f"k{i}": cfg.first_key + i for i in range(cfg.num_keys)}
    vocab |= {f"v{i}": cfg.first_key + cfg.num_keys + i for i in range(values)}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=EOS_TOKEN))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TextTokenizer("mqar", 0, hf)


def _distinct(rng: np.random.Generator, rows: int, k: int, high: int) -> np.ndarray:
    """(rows, k) integers in [0, high), distinct within each row."""
    if 4 * k > high:
        return np.argsort(rng.random((rows, high)), axis=1)[:, :k]
    out = rng.integers(0, high, (rows, k))
    while True:
        ordered = np.sort(out, axis=1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if not repeated.any():
            return out
        out[repeated] = rng.integers(0, high, (int(repeated.sum()), k))


def generate(cfg: MQARConfig, seq_len: int, rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` sequences: inputs (rows, seq_len) int64 and targets of the same shape (-100 except at answers)."""
    pairs, queries, key_len = cfg.num_pairs, cfg.queries, cfg.key_len
    num_keys, value_base = cfg.num_keys, cfg.first_key + cfg.num_keys
    key_index = _distinct(rng, rows, pairs, num_keys**key_len)
    digits = [key_index // num_keys, key_index % num_keys] if key_len == 2 else [key_index]
    keys = np.stack(digits, axis=-1) + cfg.first_key  # (rows, pairs, key_len)
    values = _distinct(rng, rows, pairs, cfg.vocab_size - value_base) + value_base  # (rows, pairs)
    parts = [keys] + ([np.ones((rows, pairs, 1), np.int64)] if cfg.layout == "separated" else []) + [values[..., None]]
    context = np.concatenate(parts, axis=-1).reshape(rows, pairs * cfg.pair_len)

    region = seq_len - context.shape[1]
    asked = (np.argsort(rng.random((rows, pairs)), axis=1)[:, :queries] if queries <= pairs
             else rng.integers(0, pairs, (rows, queries)))
    slots = np.argsort(rng.random((rows, region // key_len)), axis=1)[:, :queries]
    filler = rng.integers(cfg.first_key, cfg.vocab_size, (rows, region))
    row = np.arange(rows)[:, None]
    for j in range(key_len):
        filler[row, slots * key_len + j] = keys[row, asked, j]
    inputs = np.concatenate([context, filler], axis=1)
    targets = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    targets[row, context.shape[1] + slots * key_len + key_len - 1] = values[row, asked]
    return inputs.astype(np.int64), targets


@dataclass
class MQARTask:
    """One recall setting (``data.mqar`` at ``data.seq_len``): its tokenizer, its held-out set and its streams."""

    cfg: MQARConfig
    seq_len: int

    def __post_init__(self) -> None:
        self.tokenizer = mqar_tokenizer(self.cfg)
        self.vocab_size = self.cfg.vocab_size
        setting = {"task": "mqar", "seq_len": self.seq_len, "vocab_size": self.cfg.vocab_size,
                   "num_pairs": self.cfg.num_pairs, "queries": self.cfg.queries, "layout": self.cfg.layout,
                   "block": BLOCK}
        self.setting_id = stable_hash(setting)
        setting_seed = int(self.setting_id[:15], 16)
        n = self.cfg.eval_sequences
        blocks = [generate(self.cfg, self.seq_len, np.random.default_rng([_HELD_OUT_STREAM, setting_seed, b]), BLOCK)
                  for b in range(math.ceil(n / BLOCK))]
        inputs, targets = (np.concatenate(parts)[:n] for parts in zip(*blocks, strict=True))
        self.held_out = (torch.from_numpy(inputs), torch.from_numpy(targets))
        self._held_out_rows = {r.tobytes() for r in inputs}

    @property
    def answers_per_sequence(self) -> int:
        return self.cfg.queries

    def train_block(self, seed: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Training rows ``block * BLOCK ... + BLOCK`` of the stream of ``seed``; any row equal to a held-out row is
        redrawn (deterministically) until none is."""
        inputs, targets = generate(self.cfg, self.seq_len, np.random.default_rng([_TRAIN_STREAM, seed, block]), BLOCK)
        attempt = 0
        while clash := [i for i, r in enumerate(inputs) if r.tobytes() in self._held_out_rows]:
            attempt += 1
            rng = np.random.default_rng([_REDRAW, seed, block, attempt])
            inputs[clash], targets[clash] = generate(self.cfg, self.seq_len, rng, len(clash))
        return inputs, targets

    def train_rows(self, seed: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training rows ``first ... first + count`` as int64 tensors."""
        blocks = range(first // BLOCK, (first + count - 1) // BLOCK + 1)
        inputs, targets = (np.concatenate(p) for p in zip(*(self.train_block(seed, b) for b in blocks), strict=True))
        offset = first - blocks[0] * BLOCK
        return (torch.from_numpy(inputs[offset: offset + count]), torch.from_numpy(targets[offset: offset + count]))

    def provenance(self) -> dict[str, str | int]:
        cfg = self.cfg
        return {"data.tokenizer_fingerprint": self.tokenizer.fingerprint, "data.vocab_size_actual": self.vocab_size,
                "data.source": "synthetic:mqar", "data.mqar_setting_id": self.setting_id,
                "data.mqar_context_tokens": cfg.num_pairs * cfg.pair_len,
                "data.mqar_answers_per_sequence": cfg.queries}


class MQARBatches(IterableDataset):
    """Endless training micro-batches ``(x, y)`` of shape ``(micro_batch_size, seq_len)``, resumable at a token
    position (see the module docstring for the order). Use ``DataLoader(batches, batch_size=None)``; with
    ``num_workers = n`` worker ``w`` makes micro-batches ``w, w + n, ...`` and the DataLoader returns them in order."""

    def __init__(self, task: MQARTask, micro_batch_size: int, seed: int, *, rank: int = 0, world_size: int = 1,
                 start_token: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if start_token % task.seq_len:
            raise ValueError(f"start_token {start_token} is not a multiple of seq_len {task.seq_len}")
        self.task, self.micro_batch_size, self.seed = task, micro_batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.first_row = start_token // task.seq_len

    def micro_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``k``-th micro-batch after the start."""
        first = self.first_row + (k * self.world_size + self.rank) * self.micro_batch_size
        return self.task.train_rows(self.seed, first, self.micro_batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        k, stride = (worker.id, worker.num_workers) if worker else (0, 1)
        while True:
            yield self.micro_batch(k)
            k += stride


class MQARHeldOut(Dataset):
    """The task's held-out sequences as ``(x, y)`` items: the same for every architecture, seed and run."""

    def __init__(self, task: MQARTask):
        self.inputs, self.targets = task.held_out

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]
