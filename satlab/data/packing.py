"""Packed token files: every document tokenized once, an EOS appended after each, all of a split concatenated into
one flat binary file (``train.bin``, ``validation.bin``, ``test.bin``) read back as a numpy memmap.

The ids are stored as uint16 when the vocabulary has fewer than 65536 entries, else as uint32, in native byte
order (little-endian on every platform torch supports).

:func:`pack_documents` reads the documents in their fixed order in this process and hands batches of them to
``num_proc`` worker processes (:mod:`satlab.data.pack_worker`), then appends the results in submission order. We
chose a bounded process pool over the alternatives because it keeps three properties the others lose:

* the files are byte-identical for every ``num_proc`` (results are written in document order, whoever computed
  them), so caches and results do not depend on the machine;
* nothing is copied: ``datasets.Dataset.map(num_proc=...)`` would first convert the whole corpus to an Arrow cache
  (a second copy, the size of the text), and splitting the source into per-process shards needs a shard layout
  that differs between sources (a hub stream, one big jsonl file) plus a merge pass over the token files;
* it resumes: every :data:`SHARD_ROWS` source rows the files are flushed and ``progress.json`` records their sizes
  with the stream's position (``datasets``' ``state_dict``); a restarted preparation truncates the files to those
  sizes and continues the stream from there, so a half-written tail is never taken as done.

Reading stays in one process, in Arrow batches: ~70-90k FineWeb-sized rows per second here, enough to feed ~100
tokenizing cores (``satlab bench --data`` measures both rates).
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from satlab.config.errors import ConfigError
from satlab.data.common import SPLITS, make_progress, read_json, replace_json, si
from satlab.data.pack_worker import BatchResult, init_worker, tokenize_batch
from satlab.data.tokenizer import TextTokenizer

BATCH_ROWS = 256
"""Source rows per worker task: about a second of one core's work for FineWeb-sized documents."""
SHARD_ROWS = 8192
"""Source rows between two resumable commits; the unit of work a killed preparation can lose."""
PROGRESS_FILE = "progress.json"
DISK_MARGIN = 1.1
"""The free space a preparation wants beyond its estimated token files (they are estimated from the first batch)."""


class Segment(Protocol):
    """Documents in a fixed order: a ``datasets`` stream (with ``state_dict``) and the split of its documents
    (None: each by the hash of its text); see :class:`satlab.data.sources.Segment`."""

    split: str | None
    stream: Any

    def batches(self, size: int) -> Iterator[list[str | None]]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 below 65,536 ids, else uint32; a vocabulary beyond uint32 (a hub tokenizer's) cannot be stored."""
    if vocab_size > 2**32:
        raise ConfigError(f"the tokenizer has {vocab_size:,} tokens; token ids are stored as uint32, so at most "
                          f"{2**32:,}: pick another data.tokenizer.name")
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


def default_num_proc() -> int:
    """The cores this process may run on (its CPU affinity, which SLURM and containers set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class Progress:
    """Where a preparation stands; written to ``progress.json`` at every commit."""

    segment: int = 0
    stream: dict | None = None
    rows: int = 0
    documents: dict[str, int] | None = None
    text_bytes: dict[str, int] | None = None
    tokens: dict[str, int] | None = None

    def __post_init__(self) -> None:
        for name in ("documents", "text_bytes", "tokens"):
            if getattr(self, name) is None:
                setattr(self, name, dict.fromkeys(SPLITS, 0))

    def add(self, result: BatchResult) -> None:
        self.rows += result.rows
        for split, part in result.parts.items():
            self.documents[split] += part.documents
            self.text_bytes[split] += part.text_bytes
            self.tokens[split] += part.tokens.size

    @classmethod
    def read(cls, directory: Path) -> Progress | None:
        data = read_json(directory / PROGRESS_FILE)
        return None if data is None else cls(**data)

    def write(self, directory: Path) -> None:
        replace_json(directory / PROGRESS_FILE, self.__dict__)


@dataclass
class _Task:
    result: Future
    commit: tuple[int, dict | None] | None
    """(segment, stream state) to record once this task's tokens are written; None between commits."""


def _tasks(segments: list[Segment], start: Progress) -> Iterator[tuple[list[str | None], str | None, tuple | None]]:
    """(texts, split, commit) batches from ``start`` on: a commit every :data:`SHARD_ROWS` rows and at the end of
    every segment (then with an empty batch)."""
    assert SHARD_ROWS % BATCH_ROWS == 0, "a commit must fall between two batches"
    for index in range(start.segment, len(segments)):
        segment = segments[index]
        if index == start.segment and start.stream is not None:
            segment.stream.load_state_dict(start.stream)
        rows_in_shard = 0
        for batch in segment.batches(BATCH_ROWS):
            rows_in_shard += len(batch)
            if rows_in_shard == SHARD_ROWS:
                yield batch, segment.split, (index, segment.stream.state_dict())
                rows_in_shard = 0
            else:
                yield batch, segment.split, None
        yield [], segment.split, (index + 1, None)


def _open_outputs(directory: Path, state: Progress, dtype: np.dtype, stack: ExitStack) -> dict[str, Any]:
    """The split files opened for appending at the committed sizes (a tail written after the last commit is cut)."""
    files = {}
    for split in SPLITS:
        path = split_path(directory, split)
        path.touch()
        f = files[split] = stack.enter_context(open(path, "r+b"))  # noqa: SIM115 (the stack closes it)
        f.truncate(state.tokens[split] * dtype.itemsize)
        f.seek(0, os.SEEK_END)
    return files


def _commit(directory: Path, files: dict[str, Any], state: Progress) -> None:
    for f in files.values():
        f.flush()
        os.fsync(f.fileno())
    state.write(directory)


def _check_disk(directory: Path, first: BatchResult, state: Progress, total_rows: int | None, dtype: np.dtype,
                say: Callable[[str], None]) -> None:
    """Print the planned size of the token files, estimated from the first batch, and refuse to start on a disk
    that cannot hold it (the preparation resumes once space is freed)."""
    tokens = sum(part.tokens.size for part in first.parts.values())
    if total_rows is None or first.rows == 0:
        say(f"token files: ~{tokens / max(first.rows, 1):,.0f} tokens per document (the number of documents is "
            "not known in advance)")
        return
    remaining = (total_rows - state.rows) * tokens / first.rows * dtype.itemsize
    planned = (state.rows * tokens / first.rows * dtype.itemsize) + remaining
    free = shutil.disk_usage(directory).free
    say(f"token files: ~{si(planned, 'B')} planned for {total_rows:,} documents (~{tokens / first.rows:,.0f} tokens "
        f"each in the first {first.rows}); {si(free, 'B')} free in {directory.parent}")
    if free < DISK_MARGIN * remaining:
        raise ConfigError(
            f"not enough disk space to prepare the data: the token files need ~{si(remaining, 'B')} more and "
            f"{directory.parent} has {si(free, 'B')} free. Free some space (or set data.cache_dir to a larger "
            "disk) and run again: the preparation continues from where it stopped.")


def pack_documents(
    segments: list[Segment],
    tokenizer: TextTokenizer,
    directory: Path,
    num_proc: int,
    val_fraction: float,
    total_rows: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``segments`` into the split files of ``directory``, continuing a preparation killed there before.

    Returns ``{"dtype", "tokens", "documents", "text_bytes"}`` (per split) for the metadata. ``progress.json``
    stays, marking the files complete, until the caller has finished with the directory: a later step that
    rewrites a file (the mix) must not see it packed again.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    state = Progress.read(directory) or Progress()
    if state.segment >= len(segments):
        return _summary(state, dtype)
    resumed_rows = state.rows
    init_args = (tokenizer.to_dict(), dtype.name, val_fraction)
    # Workers even for num_proc 1: a worker's rate is then what one core does, in the same lean process at every
    # count (tokenizing in this process, which holds torch and datasets, measured 10-30 % slower and noisier).
    pool = ProcessPoolExecutor(num_proc, get_context("spawn"), init_worker, init_args)
    window: deque[_Task] = deque()
    first = True
    with ExitStack() as stack:
        files = _open_outputs(directory, state, dtype, stack)
        with make_progress(progress) as bar, pool:
            task = bar.add_task(f"tokenizing ({tokenizer.kind}, {num_proc} process{'es' * (num_proc > 1)})",
                                total=total_rows, completed=state.rows, tokens=sum(state.tokens.values()),
                                start_rows=state.rows, start_tokens=sum(state.tokens.values()))
            if resumed_rows:
                bar.console.print(f"resuming the preparation in {directory.name} after {resumed_rows:,} rows")

            def write_oldest() -> None:
                nonlocal first
                done = window.popleft()
                result: BatchResult = done.result.result()
                if first:
                    _check_disk(directory, result, state, total_rows, dtype, bar.console.print if progress else
                                lambda _: None)
                    first = False
                for split, part in result.parts.items():
                    files[split].write(part.tokens.tobytes())
                state.add(result)
                if done.commit is not None:
                    state.segment, state.stream = done.commit
                    _commit(directory, files, state)
                bar.update(task, completed=state.rows, tokens=sum(state.tokens.values()))

            for texts, split, commit in _tasks(segments, state):
                window.append(_Task(pool.submit(tokenize_batch, texts, split), commit))
                if first or len(window) > 2 * num_proc:
                    write_oldest()
            while window:
                write_oldest()
    return _summary(state, dtype)


def _summary(state: Progress, dtype: np.dtype) -> dict[str, Any]:
    return {"dtype": dtype.name, "tokens": dict(state.tokens), "documents": dict(state.documents),
            "text_bytes": dict(state.text_bytes)}

