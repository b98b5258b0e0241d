"""Tokenizers behind one small interface: ``byte`` (raw UTF-8 bytes), ``bpe`` (byte-level BPE trained on the train
split with Hugging Face ``tokenizers``, cached on disk) and ``hub`` (a pretrained tokenizer by name, e.g. the
Llama-2 tokenizer ``meta-llama/Llama-2-7b-hf`` used in the paper).

A :class:`TextTokenizer` saves to and loads from a folder, so a checkpoint can carry it, and has a ``fingerprint``
that changes exactly when the token ids would; packed token caches are keyed by it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from satlab.config.errors import ConfigError, unknown_name
from satlab.data.common import atomic_directory, read_json, stable_hash

if TYPE_CHECKING:  # the schema imports the model zoo (torch); a tokenizing worker process needs neither
    from satlab.config.schema import TokenizerConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BYTE_EOS, BYTE_PAD, BYTE_VOCAB = 256, 257, 258
HUB_EOS_CANDIDATES = ("</s>", EOS_TOKEN, "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
BPE_VERSION = 1
"""Bump when the BPE recipe below changes; cached tokenizers are then retrained."""
HF_FILE, META_FILE = "tokenizer.json", "satlab_tokenizer.json"


class TextTokenizer:
    """Text <-> token ids. ``hf`` is the wrapped ``tokenizers.Tokenizer``; None for the byte tokenizer, the only
    kind with a padding id (``pad_id`` 257; None otherwise, as packed sequences need no padding)."""

    def __init__(self, kind: str, eos_id: int, hf: tokenizers.Tokenizer | None = None, name: str | None = None):
        self.kind = kind
        self.eos_id = eos_id
        self.name = name
        self.hf = hf
        self.pad_id = BYTE_PAD if hf is None else None
        self.vocab_size = BYTE_VOCAB if hf is None else hf.get_vocab_size(with_added_tokens=True)
        content = "byte: ids 0-255 are bytes, 256 eos, 257 pad" if hf is None else hf.to_str()
        self.fingerprint = f"{kind}-{self.vocab_size}-{hashlib.sha256(content.encode('utf-8')).hexdigest()[:16]}"

    def __repr__(self) -> str:
        return f"TextTokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts; for ``bpe``/``hub`` encoded in parallel by ``tokenizers``."""
        if self.hf is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens are written out (``<|endoftext|>``) rather than dropped."""
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        parts, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            parts.append(EOS_TOKEN if i == BYTE_EOS else PAD_TOKEN)
            run.clear()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def save(self, directory: str | Path) -> None:
        """Write ``satlab_tokenizer.json`` (kind, name, eos id, fingerprint) and, unless byte, ``tokenizer.json``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.hf is not None:
            self.hf.save(str(directory / HF_FILE))
        meta = {"kind": self.kind, "name": self.name, "eos_id": self.eos_id, "vocab_size": self.vocab_size,
                "fingerprint": self.fingerprint}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    def to_dict(self) -> dict:
        """A JSON-able description that :meth:`from_dict` turns back into this tokenizer (for checkpoints)."""
        return {"kind": self.kind, "name": self.name, "eos_id": self.eos_id,
                "hf": None if self.hf is None else self.hf.to_str()}

    @classmethod
    def from_dict(cls, data: dict) -> TextTokenizer:
        hf = None if data["hf"] is None else tokenizers.Tokenizer.from_str(data["hf"])
        return cls(data["kind"], data["eos_id"], hf, data.get("name"))

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        """The tokenizer saved in ``directory`` by :meth:`save`."""
        directory = Path(directory)
        meta = read_json(directory / META_FILE)
        if meta is None:
            raise ConfigError(f"no saved tokenizer in '{directory}' ({META_FILE} is missing).")
        hf = None if meta["kind"] == "byte" else tokenizers.Tokenizer.from_file(str(directory / HF_FILE))
        return cls(meta["kind"], meta["eos_id"], hf, meta.get("name"))


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer("byte", BYTE_EOS)


def train_bpe(batches: Iterable[list[str]], vocab_size: int, num_documents: int | None,
              progress: bool) -> TextTokenizer:
    """Byte-level BPE with ``<|endoftext|>`` (id 0) as its one special token. Training is deterministic: the same
    texts and size give the same merges."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    hf.train_from_iterator(batches, trainer, length=num_documents)
    return TextTokenizer("bpe", hf.token_to_id(EOS_TOKEN), hf)


def _hub_eos_id(hf: tokenizers.Tokenizer, name: str) -> int:
    for token in HUB_EOS_CANDIDATES:
        if (token_id := hf.token_to_id(token)) is not None:
            return token_id
    raise ConfigError(
        f"the hub tokenizer '{name}' has none of the end-of-text tokens satlab knows ({', '.join(HUB_EOS_CANDIDATES)});"
        " pick another data.tokenizer.name or use kind 'bpe'."
    )


def _hub_target(name: str, cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "tokenizers" / ("hub-" + re.sub(r"[^A-Za-z0-9._-]", "--", name))


def _local_tokenizer_file(name: str) -> Path | None:
    """A ``tokenizer.json`` that ``name`` points at on disk (the file, or a folder holding one), else None."""
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / HF_FILE
    return path if path.is_file() else None


def hub_tokenizer(name: str, cache_dir: str | Path) -> TextTokenizer:
    """The pretrained tokenizer ``name``: a local ``tokenizer.json`` (or a folder with one, e.g. a downloaded model)
    when the name is such a path, else ``tokenizers.Tokenizer.from_pretrained(name)``, kept under
    ``<cache_dir>/tokenizers`` so later runs are offline."""
    if (local := _local_tokenizer_file(name)) is not None:
        hf = tokenizers.Tokenizer.from_file(str(local))
        return TextTokenizer("hub", _hub_eos_id(hf, name), hf, name)
    target = _hub_target(name, cache_dir)
    if (target / META_FILE).exists():
        return TextTokenizer.load(target)
    try:
        hf = tokenizers.Tokenizer.from_pretrained(name)
    except Exception as e:  # the hub client raises many types (offline, not found, gated); all mean "not usable"
        raise ConfigError(
            f"could not fetch the hub tokenizer data.tokenizer.name='{name}' ({type(e).__name__}: {e}). It needs "
            "the network the first time (offline?), an existing repo with a tokenizer.json, and for gated models "
            "such as meta-llama/Llama-2-7b-hf an accepted licence and `hf auth login`; a local tokenizer.json (or "
            "a folder with one) works offline, and so do kinds 'byte' and 'bpe'."
        ) from e
    tokenizer = TextTokenizer("hub", _hub_eos_id(hf, name), hf, name)
    with atomic_directory(target) as tmp:
        tokenizer.save(tmp)
    return tokenizer


def _bpe_target(cfg: TokenizerConfig, cache_dir: str | Path, train_identity: str) -> Path:
    key = stable_hash({"train": train_identity, "vocab_size": cfg.vocab_size, "version": BPE_VERSION})
    return Path(cache_dir) / "tokenizers" / f"bpe-{cfg.vocab_size}-{key}"


def cached_tokenizer(cfg: TokenizerConfig, cache_dir: str | Path, train_identity: str) -> TextTokenizer | None:
    """The tokenizer ``cfg`` asks for when it is at hand without training or fetching anything, else None."""
    if cfg.kind == "byte":
        return byte_tokenizer()
    if cfg.kind == "hub":
        if cfg.name and (_local_tokenizer_file(cfg.name) or (_hub_target(cfg.name, cache_dir) / META_FILE).exists()):
            return hub_tokenizer(cfg.name, cache_dir)
        return None
    target = _bpe_target(cfg, cache_dir, train_identity)
    return TextTokenizer.load(target) if (target / META_FILE).exists() else None


def build_tokenizer(
    cfg: TokenizerConfig,
    cache_dir: str | Path,
    train_identity: str,
    train_batches: Callable[[], Iterable[list[str]]],
    num_train_documents: int | None,
    progress: bool = True,
    corpus: str = "the train split",
) -> TextTokenizer:
    """The tokenizer ``cfg`` asks for. A ``bpe`` one is trained on ``train_batches()`` (the train split's texts)
    only when no tokenizer for the same ``train_identity`` (what identifies the train split's documents) and
    settings is cached; ``num_train_documents`` (when known) sizes its progress bar. One that comes out smaller than
    ``vocab_size`` (BPE on ``corpus`` ran out of pairs to merge) is refused before it is cached."""
    from satlab.config.schema import TOKENIZER_KINDS

    if cfg.kind not in TOKENIZER_KINDS:
        raise ConfigError(unknown_name("data.tokenizer.kind", cfg.kind, TOKENIZER_KINDS))
    if cfg.kind == "hub" and not cfg.name:
        raise ConfigError(
            "data.tokenizer.kind is 'hub' but data.tokenizer.name is not set; give a hub model name such as "
            "'meta-llama/Llama-2-7b-hf' (the paper's tokenizer) or 'gpt2', or a local tokenizer.json."
        )
    if cfg.kind == "bpe" and cfg.vocab_size <= BYTE_VOCAB:
        raise ConfigError(
            f"data.tokenizer.vocab_size is {cfg.vocab_size}; a byte-level BPE needs more than {BYTE_VOCAB} (256 "
            "bytes, the end-of-text token and at least one merge), e.g. 8192."
        )
    if (tokenizer := cached_tokenizer(cfg, cache_dir, train_identity)) is not None:
        return tokenizer
    if cfg.kind == "hub":
        return hub_tokenizer(cfg.name, cache_dir)
    tokenizer = train_bpe(train_batches(), cfg.vocab_size, num_train_documents, progress)
    if tokenizer.vocab_size < cfg.vocab_size:
        raise ConfigError(
            f"data.tokenizer.vocab_size={cfg.vocab_size} is more than this corpus allows: BPE on {corpus} stops at "
            f"{tokenizer.vocab_size:,} tokens (by then every word of it is a single token); use at most "
            f"data.tokenizer.vocab_size={tokenizer.vocab_size}, or a larger corpus"
        )
    with atomic_directory(_bpe_target(cfg, cache_dir, train_identity)) as tmp:
        tokenizer.save(tmp)
    return tokenizer
