"""Shared helpers of the data pipeline: the document split rule, hashing, atomic cache directories and the jsonl
split files every source is turned into (``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` plus ``meta.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TextIO

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from satlab.config.errors import ConfigError

SPLITS = ("train", "validation", "test")
META_FILE = "meta.json"


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hex sha256 of the canonical JSON of ``obj`` (sorted keys), cut to ``length`` characters."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:length]


def check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 0.5:
        raise ConfigError(
            f"data.val_fraction is {val_fraction!r}; it must lie strictly between 0 and 0.5 (the validation split "
            "takes that fraction of the documents and the test split as many again), e.g. 0.05."
        )


def hash_split(key: str, val_fraction: float) -> str:
    """The split of one document, fixed by the sha256 of its key (id or text) and independent of any seed.

    The first 64 bits of the hash, read as a number ``u`` in [0, 1), give validation when ``u < f``, test when
    ``f <= u < 2f`` and train otherwise, so growing ``val_fraction`` only moves documents out of train.
    """
    u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < val_fraction:
        return "validation"
    return "test" if u < 2 * val_fraction else "train"


def hash_split_rule(val_fraction: float, key: str) -> str:
    """A description of :func:`hash_split` with its parameters; it goes into every cache key that depends on it."""
    return f"sha256({key}): validation < {val_fraction!r} <= test < {2 * val_fraction!r} <= train"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def atomic_directory(target: Path, is_current: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``target`` and rename it to ``target`` when the block succeeds.

    A killed or failing preparation leaves at most a ``.<name>.tmp-*`` directory behind, never a half-written
    ``target``. When ``target`` exists by then (another process prepared it meanwhile, or a stale entry was there
    from the start), it is kept if ``is_current(target)`` says so (default: always, cache entries keyed by content
    are equal), and swapped out otherwise. Never replacing a current entry matters: another process may be reading
    it (two sweep trials preparing one cache side by side).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if target.exists() and is_current is not None and not is_current(target):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def require_nonempty_splits(meta: dict[str, Any], description: str) -> None:
    """Train and validation must hold documents; test may be empty (evaluation then has nothing to score)."""
    docs = meta["documents"]
    empty = [s for s in ("train", "validation") if docs[s] == 0]
    if empty:
        total = sum(docs.values())
        raise ConfigError(
            f"the {' and '.join(empty)} split of {description} is empty: its {total} document(s) are split by "
            f"document hash ({meta['split_rule']}). Use a source with more documents (one per text file, or one "
            "per jsonl/parquet row) or a larger data.val_fraction."
        )


class _RateColumn(ProgressColumn):
    """Documents per second (rich only ships a bytes-per-second column)."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0:,.0f} docs/s", style="progress.data.speed")


def make_progress(enabled: bool) -> Progress:
    """A rich progress display counting documents (count, rate, elapsed, ETA); a silent one when disabled."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )
