"""The data pipeline's entry point: ``prepare_data(cfg.data)`` turns a :class:`DataConfig` into packed token files.

Steps, each cached under ``data.cache_dir`` and skipped when its cache entry exists:

1. resolve ``data.source`` and write its documents into jsonl split files (``corpora/<name>/`` or
   ``sources/<hash>/``);
2. build the tokenizer (a ``bpe`` one is trained on the corpus' train split, never on synthetic documents;
   ``tokenizers/``);
3. tokenize every split into ``tokens/<hash>/{train,validation,test}.bin`` with ``meta.json`` and a copy of the
   tokenizer; the hash covers the source identity, the split files (so the split rule and content), the tokenizer
   fingerprint and the packing format;
4. with ``data.mix``, rewrite ``train.bin`` with synthetic documents interleaved (:mod:`satlab.data.synthetic`); the
   mix is then part of the hash (a mixed and an unmixed run never share token files) and ``meta.json`` records it
   under ``mix`` (requested and achieved shares, tokens and documents per source); ``tokens.train`` counts them
   all. Validation and test are never mixed, and a ``bpe`` tokenizer is trained on the corpus alone, so those
   files are identical with and without a mix.

A second call with the same configuration only reads metadata. In a multi-process run call it on one process first
(Lightning's ``prepare_data`` hook), then on all; concurrent calls are safe (writes are atomic) but duplicate work.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from satlab.config.schema import DataConfig
from satlab.data.common import (
    META_FILE,
    SPLITS,
    atomic_directory,
    read_json,
    require_nonempty_splits,
    stable_hash,
    write_json,
)
from satlab.data.packing import open_tokens, pack_splits, split_path
from satlab.data.sources import load_documents, prepare_split_files, resolve_source
from satlab.data.synthetic import check_mix, mix_key, mix_train_split
from satlab.data.tokenizer import TextTokenizer, build_tokenizer

TOKENS_VERSION = 1
"""Bump when the packed format changes; token caches are then rebuilt."""
TOKENIZER_DIR = "tokenizer"
COPIED_SOURCE_META = ("documents_are", "held_out", "package", "python_version")


@dataclass
class PreparedData:
    """Packed token files of the three splits and everything needed to read and decode them."""

    tokenizer: TextTokenizer
    vocab_size: int
    eos_id: int
    dtype: str
    directory: Path
    paths: dict[str, Path]
    meta: dict[str, Any]

    def open(self, split: str = "train") -> np.ndarray:
        """The token ids of ``split`` (``train``, ``validation`` or ``test``) as a read-only numpy memmap."""
        return open_tokens(split_path(self.directory, split), self.dtype)


def _text_batches(dataset: Any, batch_size: int = 256) -> Iterator[list[str]]:
    for batch in dataset.iter(batch_size=batch_size):
        yield batch["text"]


def prepare_data(data_cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Prepare (or find in the cache) the packed token files for ``data_cfg``; see the module docstring.

    Raises :class:`~satlab.config.errors.ConfigError` for every user mistake (unknown corpus or tokenizer kind,
    missing files, unreachable hub, a split left empty, ...).
    """
    cache_dir = Path(data_cfg.cache_dir).expanduser()
    data_cfg = replace(data_cfg, cache_dir=str(cache_dir))
    check_mix(data_cfg.mix)
    source = resolve_source(data_cfg)
    tokenizer = None
    if data_cfg.tokenizer.kind != "bpe":  # needs no corpus: made (or fetched) first, so a failure writes nothing
        tokenizer = build_tokenizer(data_cfg.tokenizer, cache_dir, "", lambda: iter(()), 0, progress)
    split_dir, split_meta = prepare_split_files(source, data_cfg, progress)
    require_nonempty_splits(split_meta, source.description)
    tokenizer = tokenizer or build_tokenizer(
        data_cfg.tokenizer,
        cache_dir,
        train_sha256=split_meta["sha256"]["train"],
        train_batches=lambda: _text_batches(load_documents(split_dir)["train"]),
        num_train_documents=split_meta["documents"]["train"],
        progress=progress,
    )
    key_fields = {
        "version": TOKENS_VERSION,
        "source": source.identity,
        "split_rule": split_meta["split_rule"],
        "split_files": split_meta["sha256"],
        "tokenizer": tokenizer.fingerprint,
    }
    if data_cfg.mix:  # only then, so unmixed caches keep their keys
        key_fields["mix"] = mix_key(data_cfg.mix)
    key = stable_hash(key_fields)
    target = cache_dir / "tokens" / key
    meta = read_json(target / META_FILE)
    if meta is None:
        with atomic_directory(target) as tmp:
            packed = pack_splits(load_documents(split_dir), split_meta["documents"], tokenizer, tmp, progress)
            mix = {}
            if data_cfg.mix:
                mix = {"mix": mix_train_split(tmp, tokenizer, packed["dtype"], data_cfg.mix, progress)}
                packed["tokens"]["train"] = sum(mix["mix"]["tokens"].values())
            meta = {
                "key": key,
                "format_version": TOKENS_VERSION,
                "source": {"kind": source.kind, "name": source.name, "description": source.description,
                           "identity": source.identity},
                "split_rule": split_meta["split_rule"],
                "documents": split_meta["documents"],
                "text_bytes": split_meta["text_bytes"],
                **packed,
                **mix,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
                "tokenizer": {"kind": tokenizer.kind, "name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
                **{k: split_meta[k] for k in COPIED_SOURCE_META if k in split_meta},
            }
            tokenizer.save(tmp / TOKENIZER_DIR)
            write_json(tmp / META_FILE, meta)
    return PreparedData(
        tokenizer=tokenizer,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        dtype=meta["dtype"],
        directory=target,
        paths={s: split_path(target, s) for s in SPLITS},
        meta=meta,
    )
