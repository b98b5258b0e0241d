"""The data pipeline: sources (embedded corpora, local files, hub datasets) -> tokenizer -> packed token files ->
deterministic, resumable training batches and fixed validation windows.

Typical use::

    data = prepare_data(cfg.data)
    train = TrainBatches(data, cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.seed, start_token=position)
    loader = DataLoader(train, batch_size=None, num_workers=cfg.data.num_workers)
    val = ValidationWindows(data, cfg.data.seq_len, cfg.train.val_tokens)

The names below are imported on first use (PEP 562), so that a tokenizing worker process, which imports only
:mod:`satlab.data.pack_worker`, starts without torch or ``datasets``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CORPORA": "satlab.data.corpora",
    "available_corpora": "satlab.data.corpora",
    "ensure_corpus": "satlab.data.corpora",
    "PreparedData": "satlab.data.prepare",
    "find_prepared": "satlab.data.prepare",
    "prepare_data": "satlab.data.prepare",
    "TrainBatches": "satlab.data.sampler",
    "ValidationWindows": "satlab.data.sampler",
    "TextTokenizer": "satlab.data.tokenizer",
    "build_tokenizer": "satlab.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'satlab.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
