"""Local source files: their formats, and what is wrong with one that cannot be read.

``datasets`` reads local files in blocks and reports a broken one in its own words: the row within a block (row 37
for line 201 of a jsonl file), a message nested in another, a log line of its own before the exception. The
functions here look at the file itself once a read failed, so that satlab's message names the file and its 1-based
line, or the fields a file has, in one paragraph.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import logging
import lzma
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from satlab.config.errors import excerpt

FILE_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                ".parquet": "parquet"}
COMPRESSIONS = {".gz", ".bz2", ".xz", ".zst"}


def file_format(path: Path) -> str | None:
    """The ``datasets`` reader of ``path`` (``text``, ``json``, ``parquet``) by its suffix, or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return FILE_FORMATS.get(suffixes[-1]) if suffixes else None


@contextmanager
def quiet_readers() -> Iterator[None]:
    """Mute the log records of ``datasets``' file readers (the json reader logs "Failed to load JSON ..." before it
    raises): every read failure becomes satlab's own message, which must be the only thing printed."""
    builders = logging.getLogger("datasets.packaged_modules")
    level = builders.level
    builders.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        builders.setLevel(level)


def open_text(path: Path) -> IO[str]:
    """``path`` opened as UTF-8 text, through its decompressor when it has a compression suffix."""
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix.lower())
    if opener is not None:
        return opener(path, "rt", encoding="utf-8")
    if path.suffix.lower() == ".zst":
        import zstandard  # datasets needs it to read such a file at all

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")),  # noqa: SIM115
                                encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 (the caller closes it)


def json_line_problem(path: Path, text_field: str) -> str | None:
    """The first line of a JSON-lines file that is not a JSON object or whose text field holds something other than
    text, described with its 1-based line number; None when every line is fine (or the file is one JSON document,
    which the reader accepts as a whole)."""
    try:
        with open_text(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    if number == 1 and _is_json_document(path):
                        return None
                    return (f"{path} line {number} is not valid JSON ({excerpt(getattr(e, 'msg', str(e)), 80)}): "
                            f"{excerpt(line)!r}")
                if not isinstance(row, dict):
                    return f"{path} line {number} is {_json_kind(row)}, not a JSON object: {excerpt(line)!r}"
                value = row.get(text_field)
                if value is not None and not isinstance(value, str):
                    return (f"{path} line {number} has {_json_kind(value)} in data.text_field='{text_field}', not "
                            f"text: {excerpt(json.dumps(value))}")
    except (OSError, UnicodeDecodeError, ImportError):
        return None
    return None


def _json_kind(value: Any) -> str:
    """A JSON value's kind in JSON's words ("a number", "an array", ...)."""
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
             (dict, "an object"))
    return next((name for types, name in kinds if isinstance(value, types)), "null")


def _is_json_document(path: Path) -> bool:
    try:
        with open_text(path) as f:
            json.load(f)
    except (OSError, ValueError, ImportError):
        return False
    return True


def file_fields(path: Path) -> list[str] | None:
    """The field names of a parquet file's schema or of a JSON-lines file's first row; None when unknown."""
    try:
        if file_format(path) == "parquet":
            return list(pq.read_schema(path).names)
        with open_text(path) as f:
            first = next((line for line in f if line.strip()), None)
        row = json.loads(first) if first is not None else None
    except (OSError, ValueError, pa.ArrowException, ImportError):
        return None
    return list(row) if isinstance(row, dict) else None


def read_errors() -> tuple[type[BaseException], ...]:
    """What a ``datasets`` reader raises on a file it cannot read (an empty json file: StopIteration); imported
    when needed, as a run whose tokens are prepared never imports ``datasets``."""
    from datasets.exceptions import DatasetGenerationError

    return OSError, ValueError, StopIteration, pa.ArrowException, DatasetGenerationError


def is_empty(path: Path) -> bool:
    """Whether a file holds nothing but whitespace (an uncompressed one; a compressed file is never empty)."""
    if path.suffix.lower() in COMPRESSIONS or path.stat().st_size > 1 << 16:
        return False
    return not path.read_bytes().strip()


def file_rows(path: Path) -> int | None:
    """The number of rows of one file when it is cheap to know (parquet metadata, a newline count, one text
    document); None for compressed files."""
    fmt = file_format(path)
    if path.suffix.lower() in COMPRESSIONS:
        return None
    if fmt == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    if fmt == "text":
        return 1
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
