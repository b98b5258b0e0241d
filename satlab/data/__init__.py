"""The data pipeline: sources (embedded corpora, local files, hub datasets) -> tokenizer -> packed token files ->
deterministic, resumable training batches and fixed validation windows.

Typical use::

    data = prepare_data(cfg.data)
    train = TrainBatches(data, cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.seed, start_token=position)
    loader = DataLoader(train, batch_size=None, num_workers=cfg.data.num_workers)
    val = ValidationWindows(data, cfg.data.seq_len, cfg.train.val_tokens)
"""

from satlab.data.corpora import CORPORA, available_corpora, ensure_corpus
from satlab.data.prepare import PreparedData, prepare_data
from satlab.data.sampler import TrainBatches, ValidationWindows
from satlab.data.tokenizer import TextTokenizer, build_tokenizer

__all__ = [
    "CORPORA",
    "PreparedData",
    "TextTokenizer",
    "TrainBatches",
    "ValidationWindows",
    "available_corpora",
    "build_tokenizer",
    "ensure_corpus",
    "prepare_data",
]
