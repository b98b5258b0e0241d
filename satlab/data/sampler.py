"""Deterministic, resumable streams of training sequences and the fixed validation windows.

Training: the train tokens are cut into windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens (the
inputs ``x = w[:-1]`` never overlap; consecutive windows share one boundary token, so every token is a target
exactly once per epoch). Epoch ``e`` visits the windows in the permutation drawn by ``numpy`` from ``seed + e``; the
concatenation of these permutations is the *global order*, which depends only on the seed and the data. The
position in it is counted in tokens consumed (``seq_len`` per window, summed over all ranks), so it is the same on
every rank and ``start_token=N`` resumes exactly after the first ``N / seq_len`` windows of the global order.

Rank ``r`` of ``world_size`` takes global windows ``r, r + world_size, ...`` (counted from ``start_token``), in
micro-batches of ``micro_batch_size``: micro-batch ``k`` of rank ``r`` holds windows
``k * B * W + i * W + r`` for ``i < B``. After every rank has yielded ``k`` micro-batches the global position is
``start_token + k * B * W * seq_len``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from satlab.config.errors import ConfigError
from satlab.data.packing import open_tokens
from satlab.data.prepare import PreparedData


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def _check_windows(num_tokens: int, seq_len: int, split: str) -> int:
    count = (num_tokens - 1) // seq_len if num_tokens > 1 else 0
    if count == 0:
        raise ConfigError(
            f"the {split} split has {num_tokens} tokens, fewer than one window of data.seq_len + 1 = {seq_len + 1}; "
            "use more data or a smaller data.seq_len."
        )
    return count


class TrainBatches(IterableDataset):
    """Endless training micro-batches ``(x, y)``, int64 tensors of shape ``(micro_batch_size, seq_len)``, where
    ``y`` is ``x`` shifted by one token; see the module docstring for the order.

    Yields whole micro-batches so the order does not depend on DataLoader workers: use
    ``DataLoader(batches, batch_size=None, num_workers=n)``; worker ``w`` of ``n`` makes micro-batches ``w, w + n,
    ...`` and the DataLoader returns them in order. The memmap is opened lazily in each worker (a memmap would be
    copied when pickled).

    :meth:`state_dict` gives the global token position after the micro-batches yielded *by this object*; with
    ``num_workers > 0`` the iteration runs in worker copies, so resume from the trainer's own count of tokens
    consumed (all ranks together), which is the same number.
    """

    def __init__(
        self,
        data: PreparedData,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        start_token: int = 0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if start_token % seq_len:
            raise ValueError(f"start_token {start_token} is not a multiple of seq_len {seq_len}")
        self.path: Path = data.paths["train"]
        self.dtype = data.dtype
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.num_windows = _check_windows(int(data.meta["tokens"]["train"]), seq_len, "train")
        self.position = start_token
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def tokens_per_step(self) -> int:
        """Global tokens consumed per micro-batch step (every rank yielding one micro-batch)."""
        return self.micro_batch_size * self.world_size * self.seq_len

    def state_dict(self) -> dict[str, int]:
        return {"tokens": self.position, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len:
            raise ValueError(f"the saved stream used seq_len {state['seq_len']}, this one {self.seq_len}")
        self.position = int(state["tokens"])

    def window_starts(self, global_indices: np.ndarray) -> np.ndarray:
        """Token offsets of the windows at ``global_indices`` of the global order (across epochs)."""
        epochs, slots = np.divmod(global_indices, self.num_windows)
        starts = np.empty(len(global_indices), dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            starts[epochs == epoch] = self._epoch_order(epoch)[slots[epochs == epoch]] * self.seq_len
        return starts

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The window permutation of ``epoch``, drawn from ``seed + epoch`` (the last one is kept)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.num_windows))
        return self._order[1]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        tokens = open_tokens(self.path, self.dtype)
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        first = self.position // self.seq_len
        per_step = self.micro_batch_size * self.world_size
        lanes = np.arange(self.micro_batch_size) * self.world_size + self.rank
        step = worker_id
        while True:
            starts = self.window_starts(first + step * per_step + lanes)
            step += num_workers
            if worker is None:
                self.position = (first + step * per_step) * self.seq_len
            yield _windows(tokens, starts, self.seq_len)


class ValidationWindows(Dataset):
    """The first ``val_tokens`` tokens of a split (default ``validation``) in contiguous windows of ``seq_len + 1``
    tokens starting every ``seq_len`` tokens: the same for every architecture and seed. Items are ``(x, y)`` int64
    tensors of shape ``(seq_len,)``; a map-style dataset, so DataLoader batching and distributed samplers apply.
    """

    def __init__(self, data: PreparedData, seq_len: int, val_tokens: int, split: str = "validation"):
        self.path: Path = data.paths[split]
        self.dtype, self.seq_len = data.dtype, seq_len
        available = _check_windows(int(data.meta["tokens"][split]), seq_len, split)
        self.num_windows = min(available, max(1, val_tokens // seq_len))
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(index)
        if self._tokens is None:
            self._tokens = open_tokens(self.path, self.dtype)
        x, y = _windows(self._tokens, np.array([index * self.seq_len]), self.seq_len)
        return x[0], y[0]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}
