"""Shared helpers of the data pipeline: the document split rule, hashing, atomic cache directories, JSON files and
the progress display. Light on purpose (no torch, no ``datasets``): the tokenizing worker processes import it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from satlab.config.errors import ConfigError, shown

SPLITS = ("train", "validation", "test")
META_FILE = "meta.json"


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hex sha256 of the canonical JSON of ``obj`` (sorted keys), cut to ``length`` characters."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:length]


def check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 0.5:
        raise ConfigError(
            f"data.val_fraction is {shown(val_fraction)}; it must lie strictly between 0 and 0.5 (the validation split "
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
    """The file's content hash, computed once per process for each (path, size, modification time): a process
    waiting for another to prepare the data asks for it every few seconds."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
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


def replace_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` atomically and durably: into a temporary file of this host and process, synced,
    then renamed over ``path``, so a reader (or a restart after a kill) sees the old content or the new, whole."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def si(value: float, unit: str = "") -> str:
    """``1.23 k``, ``45.6 M``, ``7.89 G``: a count or size in three significant digits."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 999.5 or prefix == "P":
            return f"{value:.3g} {prefix}{unit}".rstrip()
        value /= 1000
    raise AssertionError("unreachable")


class _RateColumn(ProgressColumn):
    """Documents (and, where counted, tokens) per second, averaged since this process started the task: rich's own
    speed estimate needs several updates within its window and shows nothing for a fast or slow-starting task."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        if elapsed <= 0:
            return Text("")
        docs = (task.completed - task.fields.get("start_rows", 0)) / elapsed
        text = f"{si(docs)} docs/s"
        if "tokens" in task.fields:
            text += f" {si((task.fields['tokens'] - task.fields.get('start_tokens', 0)) / elapsed)} tok/s"
        return Text(text, style="progress.data.speed")


class _RemainingColumn(ProgressColumn):
    """Time left at the average rate since the start (blank when the total is unknown)."""

    def render(self, task: Task) -> Text:
        done = task.completed - task.fields.get("start_rows", 0)
        if task.total is None or not task.elapsed or done <= 0:
            return Text("")
        seconds = int((task.total - task.completed) * task.elapsed / done)
        return Text(f"ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}",
                    style="progress.remaining")


def make_progress(enabled: bool) -> Progress:
    """A rich progress display counting documents (count, rate, elapsed, ETA); a silent one when disabled."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        _RemainingColumn(),
        disable=not enabled,
    )
