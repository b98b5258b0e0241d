"""Packed token files: every document tokenized once, an EOS appended after each, all of a split concatenated into
one flat binary file (``train.bin``, ``validation.bin``, ``test.bin``) read back as a numpy memmap.

The ids are stored as uint16 when the vocabulary has fewer than 65536 entries, else as uint32, in native byte
order (little-endian on every platform torch supports).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from satlab.data.common import SPLITS, make_progress
from satlab.data.tokenizer import TextTokenizer

BATCH_DOCUMENTS = 64
"""Documents per ``encode_batch`` call: enough for the Rust tokenizer to use every core, small enough for memory."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def split_path(directory: str | Path, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; splits: {', '.join(SPLITS)}")
    return Path(directory) / f"{split}.bin"


def open_tokens(path: str | Path, dtype: str | np.dtype) -> np.ndarray:
    """A packed token file as a read-only memmap (an empty array for an empty file, which mmap cannot map)."""
    path = Path(path)
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _pack_split(
    texts: Iterable[list[str]], tokenizer: TextTokenizer, path: Path, dtype: np.dtype, advance: Callable[[int], None]
) -> int:
    """Tokenize batches of texts into ``path``; returns the number of tokens written (EOS included)."""
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    written = 0
    with open(path, "wb") as f:
        for batch in texts:
            ids = tokenizer.encode_batch(batch)
            chunk = np.concatenate([part for doc in ids for part in (np.asarray(doc, dtype=dtype), eos)])
            f.write(chunk.tobytes())
            written += chunk.size
            advance(len(batch))
    return written


def pack_splits(
    documents: dict[str, Any],
    num_documents: dict[str, int],
    tokenizer: TextTokenizer,
    directory: Path,
    progress: bool = True,
) -> dict[str, Any]:
    """Write the packed token file of every split into ``directory``.

    ``documents`` maps each split to a ``datasets`` (streaming) dataset with a ``text`` column; ``num_documents``
    gives the progress totals. Returns ``{"dtype", "tokens": {split: count}}`` for the metadata.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    tokens = {}
    with make_progress(progress) as bar:
        for split in SPLITS:
            task = bar.add_task(f"tokenizing {split} ({tokenizer.kind})", total=num_documents[split])
            batches = (batch["text"] for batch in documents[split].iter(batch_size=BATCH_DOCUMENTS))
            advance = partial(bar.advance, task)
            tokens[split] = _pack_split(batches, tokenizer, split_path(directory, split), dtype, advance)
    return {"dtype": dtype.name, "tokens": tokens}
