"""What one tokenizing process does with a batch of documents: drop the empty ones, put each in its split, encode
it, append EOS, and hand back one token array per split.

This module runs in the worker processes of :func:`satlab.data.packing.pack_documents`, so it imports only numpy,
``tokenizers`` and the light parts of :mod:`satlab.data`: a spawned worker starts in a fraction of a second,
without torch or ``datasets``.

Each document is encoded alone (``Tokenizer.encode``, one thread): the processes are the parallelism, so the
tokenizer's own thread pool, which ``encode_batch`` would start in every worker, never competes with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from satlab.data.common import SPLITS, hash_split
from satlab.data.tokenizer import TextTokenizer


@dataclass
class SplitPart:
    """The packed tokens of the documents of one batch that fall in one split."""

    tokens: np.ndarray
    documents: int
    text_bytes: int


@dataclass
class BatchResult:
    rows: int
    parts: dict[str, SplitPart] = field(default_factory=dict)


_worker: dict[str, Any] = {}


def init_worker(tokenizer: dict, dtype: str, val_fraction: float) -> None:
    """Set up this process: the tokenizer (from :meth:`TextTokenizer.to_dict`), the token dtype and the split rule."""
    _worker.update(tokenizer=TextTokenizer.from_dict(tokenizer), dtype=np.dtype(dtype), val_fraction=val_fraction)


def tokenize_batch(texts: list[str | None], split: str | None) -> BatchResult:
    """Pack ``texts`` (None or blank: skipped) into per-split token arrays, each document followed by EOS.

    ``split`` None puts each document in the split of its text's hash (:func:`satlab.data.common.hash_split`);
    otherwise every document goes to ``split``. Documents keep their order within a split.
    """
    tokenizer: TextTokenizer = _worker["tokenizer"]
    dtype: np.dtype = _worker["dtype"]
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    result = BatchResult(rows=len(texts))
    for text in texts:
        if not isinstance(text, str) or not text.strip():
            continue
        target = split or hash_split(text, _worker["val_fraction"])
        pieces[target] += [np.asarray(tokenizer.encode(text), dtype=dtype), eos]
        part = result.parts.setdefault(target, SplitPart(eos[:0], 0, 0))
        part.documents += 1
        part.text_bytes += len(text.encode("utf-8"))
    for target, part in result.parts.items():
        part.tokens = np.concatenate(pieces[target])
    return result
