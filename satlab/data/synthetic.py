"""Synthetic training documents mixed into the train split (``data.mix``), the Zoology practice that lets small
models learn to retrieve: a share of associative-recall documents among the corpus documents.

Sources (:data:`GENERATORS`, names listed in :data:`satlab.config.schema.MIX_SOURCES`):

* ``recall``: key-value pairs, then queries that re-state keys defined earlier (some more than once) whose values
  must be copied from the definitions. Keys are invented 4-letter lowercase pseudo-words (consonant, vowel,
  consonant, then ``i`` or ``u``: ``bafu``, ``kemi``); values are 2-digit numbers or common nouns (``otter``,
  ``slate``), distinct within a document, so a value can only be predicted by looking back at its key's
  definition. Four layouts, chosen per document::

      pairs      record:\\n bafu => 42\\n kemi => 17\\n ...\\n\\nrecall:\\n kemi => 17\\n bafu => 42\\n ...
      inline     bafu->42 kemi->otter dori->slate ...\\nkemi->otter bafu->42 ...
      sentences  the bafu is 42. the kemi is 17. ...\\nwhat is the kemi? 17\\nwhat is the bafu? 42\\n...
      setget     set bafu -> 42. set kemi -> 17. get bafu -> 42. set dori -> 55. get kemi -> 17. ...

  (``=>`` or ``->`` per document in ``pairs`` and ``inline``; ``setget`` interleaves definitions and queries so the
  look-back distance varies.)

* ``copy``: a sequence of 12 to 40 random items (keys, values and the layouts' words), then the same sequence
  again, after ``again:`` (``bafu 42 otter kemi ...\nagain:\nbafu 42 otter kemi ...``). Every token of the repeat
  is predictable only by finding the same item earlier and copying what followed it: the induction-head
  curriculum (Olsson et al., 2022). With a word-piece tokenizer trained on prose, keys, separators and digits are
  one or two characters a token, so a ``recall`` query must match several tokens back; the copy documents give
  that mechanism a dense training signal (every token of the repeat). See ``experiments/recall/``.

None of this is an evaluation format: the evaluation's recall tasks (:mod:`satlab.evaluation.tasks.recall`) use
two-letter keys with ``:`` and 3-digit values, ``name:``/``city:`` records of person names, cities and employers,
and ``First Last: 123-4567`` phone books with ``Look up``; the training documents use none of those keys, words,
separators or phrases (checked by the tests).

Document ``i`` of a source is drawn from its own generator seeded by ``(seed, source, i)``, so the first ``k``
documents do not depend on how many are made.

Mixing (:func:`mix_train_split`): after the corpus' train split has been packed, each source makes documents, in
index order, until its tokens (EOS included, counted with the run's tokenizer) reach ``share × total`` where
``total = corpus_tokens / (1 - sum of shares)``; so the achieved share exceeds the request by at most one
document, and is recorded. The train file is then rewritten with the documents of all sources interleaved in a
seeded random order (each source keeps its own document order; corpus documents stay whole, EOS after every
document). Only the train split is mixed.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from satlab.config.errors import ConfigError
from satlab.config.loader import mix_problems
from satlab.data.common import make_progress
from satlab.data.packing import open_tokens, split_path
from satlab.data.tokenizer import TextTokenizer

SYNTHETIC_VERSION = 2
"""Bump when a generator or the mixing rule changes; mixed token caches are then rebuilt."""
MIX_SEED = 0
"""Seed of the synthetic documents and of the interleaving order (fixed: the data cache does not depend on
``train.seed``)."""

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
KEY_ENDINGS = "iu"
"""Keys are consonant-vowel-consonant-(i|u): 1960 pseudo-words, none a name, city or employer word of the
evaluation."""
KEYS = tuple(a + b + c + d for a in CONSONANTS for b in VOWELS for c in CONSONANTS for d in KEY_ENDINGS)
VALUE_WORDS = (
    "apple", "pear", "plum", "lemon", "olive", "melon", "grape", "peach", "cherry", "fig", "otter", "badger",
    "heron", "raven", "trout", "moth", "beetle", "lynx", "crane", "robin", "maple", "cedar", "birch", "aspen",
    "hazel", "fern", "moss", "reed", "chalk", "flint", "slate", "copper", "tin", "wool", "silk", "linen", "salt",
    "honey", "bread", "cheese", "butter", "candle", "lantern", "anchor", "bucket", "ladder", "hammer", "needle",
    "basket", "kettle", "mirror", "pillow", "saddle", "violet", "scarlet", "indigo", "ochre", "teal", "crimson",
    "yellow", "pebble", "acorn", "thistle", "walrus",
)
NUMBER_VALUES = tuple(str(v) for v in range(10, 100))
MIN_PAIRS, MAX_PAIRS = 8, 24


@dataclass
class Query:
    """One query of a document: ``key`` asked at character ``start`` (where ``value`` begins in the text)."""

    key: str
    value: str
    start: int


@dataclass
class SyntheticDocument:
    text: str
    layout: str
    pairs: dict[str, str] = field(default_factory=dict)
    queries: list[Query] = field(default_factory=list)


class _Builder:
    """Appends text and records where each queried value starts."""

    def __init__(self, layout: str, pairs: dict[str, str]):
        self.parts: list[str] = []
        self.size = 0
        self.doc = SyntheticDocument("", layout, pairs)

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)

    def query(self, prefix: str, key: str, suffix: str = "") -> None:
        """``prefix`` (ending with the query), then the value of ``key``, then ``suffix``."""
        self.add(prefix)
        value = self.doc.pairs[key]
        self.doc.queries.append(Query(key, value, self.size))
        self.add(value + suffix)

    def build(self) -> SyntheticDocument:
        self.doc.text = "".join(self.parts)
        return self.doc


def _queries(rng: random.Random, keys: list[str]) -> list[str]:
    """Between half and all as many queries as keys, drawn with replacement (so some keys are asked twice)."""
    return [rng.choice(keys) for _ in range(rng.randint(max(1, len(keys) // 2), len(keys)))]


COPY_ITEMS = 12, 40


def copy_document(rng: random.Random) -> SyntheticDocument:
    """A random sequence of items, then the same sequence again (see the module docstring)."""
    items = [rng.choice((KEYS, NUMBER_VALUES, VALUE_WORDS)) for _ in range(rng.randint(*COPY_ITEMS))]
    sequence = " ".join(rng.choice(pool) for pool in items)
    return SyntheticDocument(f"{sequence}\nagain:\n{sequence}\n", "copy")


def recall_document(rng: random.Random) -> SyntheticDocument:
    """One associative-recall document; see the module docstring for the layouts."""
    n = rng.randint(MIN_PAIRS, MAX_PAIRS)
    keys = rng.sample(KEYS, n)
    values = rng.sample(NUMBER_VALUES if rng.random() < 0.5 else VALUE_WORDS, n)
    pairs = dict(zip(keys, values, strict=True))
    layout = rng.choice(("pairs", "inline", "sentences", "setget"))
    sep = rng.choice(("=>", "->"))
    b = _Builder(layout, pairs)
    if layout == "pairs":
        b.add("record:\n" + "".join(f"{k} {sep} {pairs[k]}\n" for k in keys) + "\nrecall:\n")
        for k in _queries(rng, keys):
            b.query(f"{k} {sep} ", k, "\n")
    elif layout == "inline":
        b.add(" ".join(f"{k}{sep}{pairs[k]}" for k in keys) + "\n")
        for j, k in enumerate(_queries(rng, keys)):
            b.query(("" if j == 0 else " ") + f"{k}{sep}", k)
        b.add("\n")
    elif layout == "sentences":
        b.add(" ".join(f"the {k} is {pairs[k]}." for k in keys) + "\n")
        for k in _queries(rng, keys):
            b.query(f"what is the {k}? ", k, "\n")
    else:  # setget: a definition or a query of a key already defined, interleaved
        defined: list[str] = []
        pending = list(keys)
        asked = 0
        while pending or asked < n // 2:
            space = "" if b.size == 0 else " "
            if pending and (len(defined) < 2 or rng.random() < 0.55):
                k = pending.pop(0)
                defined.append(k)
                b.add(f"{space}set {k} -> {pairs[k]}.")
            else:
                k = rng.choice(defined)
                asked += 1
                b.query(f"{space}get {k} -> ", k, ".")
        b.add("\n")
    return b.build()


GENERATORS: dict[str, Callable[[random.Random], SyntheticDocument]] = {"recall": recall_document,
                                                                      "copy": copy_document}
"""Each ``data.mix`` source: a function of a seeded ``random.Random`` returning one document."""


def synthetic_document(name: str, index: int, seed: int = MIX_SEED) -> SyntheticDocument:
    """Document ``index`` of source ``name`` (independent of how many are made)."""
    return GENERATORS[name](random.Random(f"{seed}:{name}:{index}"))


def check_mix(mix: dict[str, float]) -> None:
    """Raise a :class:`ConfigError` for an unknown source name or a share out of range (as the config loader)."""
    problems = mix_problems(mix)
    if problems:
        raise ConfigError(problems)


def mix_key(mix: dict[str, float]) -> dict[str, Any]:
    """What identifies a mix in the token cache key."""
    return {"shares": {k: float(v) for k, v in sorted(mix.items())}, "seed": MIX_SEED, "version": SYNTHETIC_VERSION}


GENERATED_BATCH = 64
"""Synthetic documents per ``encode_batch`` call."""


def _write_source(name: str, target: float, tokenizer: TextTokenizer, path: Path, dtype: np.dtype,
                  progress: bool) -> np.ndarray:
    """Documents ``0, 1, ...`` of ``name``, tokenized with EOS, until ``target`` tokens; returns their lengths."""
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    lengths: list[int] = []
    written, index = 0, 0
    with open(path, "wb") as f, make_progress(progress) as bar:
        task = bar.add_task(f"generating {name} documents", total=None)
        while written < target:
            texts = [synthetic_document(name, index + j).text for j in range(GENERATED_BATCH)]
            index += GENERATED_BATCH
            chunks = []
            for ids in tokenizer.encode_batch(texts):
                if written >= target:
                    break
                chunks += [np.asarray(ids, dtype=dtype), eos]
                lengths.append(len(ids) + 1)
                written += len(ids) + 1
            f.write(np.concatenate(chunks).tobytes())
            bar.advance(task, len(chunks) // 2)
    return np.asarray(lengths, dtype=np.int64)


def _document_lengths(tokens: np.ndarray, eos_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """Lengths (EOS included) of the documents of a packed split, cut after every EOS (read in chunks)."""
    ends = [np.flatnonzero(tokens[start:start + chunk] == eos_id) + start for start in range(0, len(tokens), chunk)]
    cuts = np.concatenate([[-1], *ends]) + 1
    if cuts[-1] != len(tokens):
        raise ValueError("a packed split must end with an EOS")
    return np.diff(cuts).astype(np.int64)


def mix_train_split(directory: Path, tokenizer: TextTokenizer, dtype: str | np.dtype, mix: dict[str, float],
                    progress: bool = True) -> dict[str, Any]:
    """Rewrite ``directory/train.bin`` (the packed corpus train split) as the corpus interleaved with synthetic
    documents; see the module docstring. Corpus documents are found by their EOS (a text that itself encodes to the
    EOS id is only cut in two there, where an EOS already is).

    The packed corpus is left as ``train.corpus.part`` (the caller removes it once the result is recorded, so a
    mix killed midway can start again from it). Returns the ``mix`` block of ``meta.json``: the requested shares,
    tokens, documents and achieved share per source (``corpus`` included), the seed and the generator version.
    """
    check_mix(mix)
    dtype = np.dtype(dtype)
    train = split_path(directory, "train")
    corpus_path = directory / "train.corpus.part"
    os.replace(train, corpus_path)
    lengths = {"corpus": _document_lengths(open_tokens(corpus_path, dtype), tokenizer.eos_id)}
    paths = {"corpus": corpus_path}
    corpus_tokens = int(lengths["corpus"].sum())
    total = corpus_tokens / (1.0 - sum(mix.values()))
    for name in sorted(mix):
        paths[name] = directory / f"train.{name}.part"
        lengths[name] = _write_source(name, mix[name] * total, tokenizer, paths[name], dtype, progress)
    names = list(paths)
    # A uniformly random interleaving: a seeded shuffle of one label per document, each source in its own order.
    labels = np.repeat(np.arange(len(names)), [len(lengths[n]) for n in names])
    labels = np.random.default_rng(MIX_SEED).permutation(labels)
    run_starts = np.flatnonzero(np.diff(labels, prepend=-1))
    run_ends = np.append(run_starts[1:], len(labels))
    offsets = {n: np.concatenate([[0], np.cumsum(lengths[n])]) for n in names}
    tokens = {n: open_tokens(paths[n], dtype) for n in names}
    cursor = dict.fromkeys(names, 0)
    with open(train, "wb") as f:
        for start, end in zip(run_starts, run_ends, strict=True):
            n = names[labels[start]]
            first, last = cursor[n], cursor[n] + int(end - start)
            f.write(np.ascontiguousarray(tokens[n][offsets[n][first]:offsets[n][last]]).tobytes())
            cursor[n] = last
    del tokens
    for name in names[1:]:  # the corpus part stays for the caller, who removes it once the mix is recorded
        paths[name].unlink()
    counts = {n: int(lengths[n].sum()) for n in names}
    grand_total = sum(counts.values())
    return {
        "requested": {k: float(v) for k, v in sorted(mix.items())},
        "tokens": counts,
        "documents": {n: len(lengths[n]) for n in names},
        "share": {n: counts[n] / grand_total for n in names},
        "seed": MIX_SEED,
        "version": SYNTHETIC_VERSION,
        "tokenizer_trained_on": "corpus only",
    }
