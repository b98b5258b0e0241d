"""The model's vocabulary as a run derives it: the one derivation that ``train`` and ``satlab train --dry-run`` share.

A config's ``model.vocab_size`` (from its size preset) is not what a run trains with: the embedding and the LM head
are sized from the tokenizer (or a synthetic task's token ids). :func:`model_vocabulary` says what that size is:

- from the tokenizer itself when it is at hand (the run passes the one its data were prepared with);
- ``synthetic:mqar``: ``data.mqar.vocab_size``, the LM head run at the answers only;
- ``byte``: 258 (256 bytes, end-of-text, padding);
- ``bpe``: a cached tokenizer of the same corpus and size when there is one, else ``data.tokenizer.vocab_size``
  (a BPE that the corpus cannot fill to that size is refused before the run starts, so the run has exactly it);
- ``hub``: the size of the tokenizer file (local, or fetched before and cached); unknown before the first fetch,
  which the dry run says instead of guessing.

Nothing here trains, fetches or tokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from satlab.config.errors import ConfigError
from satlab.config.schema import ExperimentConfig
from satlab.data.tokenizer import BYTE_VOCAB, TextTokenizer


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary a run's model gets.

    Attributes:
        size: token ids of the model's embedding and LM head; None when it is known only once a hub tokenizer is
            fetched.
        head_fraction: the share of positions the LM head runs at (FLOPs): 1 for text, the answers of a recall
            task.
        origin: where ``size`` comes from, in words (the dry run prints it).
    """

    size: int | None
    head_fraction: float
    origin: str

    def sized(self, cfg: ExperimentConfig) -> ExperimentConfig:
        """``cfg`` with ``model.vocab_size`` set to this vocabulary's size (unchanged when it is unknown)."""
        return cfg if self.size is None else replace(cfg, model=replace(cfg.model, vocab_size=self.size))


def model_vocabulary(cfg: ExperimentConfig, tokenizer: TextTokenizer | None = None) -> Vocabulary:
    """The vocabulary ``cfg``'s run trains with; ``tokenizer``: the one its data were prepared with, when at hand
    (the run's), else derived from the settings and the cache as the module docstring says."""
    data = cfg.data
    if data.synthetic_task == "mqar":
        return Vocabulary(data.mqar.vocab_size, data.mqar.queries / data.seq_len,
                          "data.mqar.vocab_size (the recall task's token ids)")
    if tokenizer is not None:
        return Vocabulary(tokenizer.vocab_size, 1.0, f"the {tokenizer.kind} tokenizer of the prepared data")
    kind = data.tokenizer.kind
    if kind == "byte":
        return Vocabulary(BYTE_VOCAB, 1.0, "the byte tokenizer (256 bytes, end-of-text, padding)")
    cached = _cached(cfg)
    if cached is not None:
        return Vocabulary(cached.vocab_size, 1.0, f"the cached {kind} tokenizer")
    if kind == "bpe":
        return Vocabulary(data.tokenizer.vocab_size, 1.0,
                          "data.tokenizer.vocab_size (the BPE tokenizer is trained when the run starts; a corpus too "
                          "small for that many tokens is refused then)")
    return Vocabulary(None, 1.0, f"unknown until the hub tokenizer '{data.tokenizer.name}' is fetched (the run "
                                 "fetches it); sizes below use model.vocab_size")


def _cached(cfg: ExperimentConfig) -> TextTokenizer | None:
    """The tokenizer of ``cfg.data`` when it is in the cache or on disk (never trained or fetched here); None when
    it is not, or the data source cannot be resolved (the run says why)."""
    from satlab.data.prepare import cached_data_tokenizer

    try:
        return cached_data_tokenizer(cfg.data)
    except ConfigError:
        return None
