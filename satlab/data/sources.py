"""Where the documents come from: ``data.source`` resolved to an embedded corpus, local files or a hub dataset.

Every source becomes a list of :class:`Segment` s: ``datasets`` streams read in a fixed order, which the packer
tokenizes straight into the split token files. Local files and hub datasets are streamed from where they are
(nothing is copied: a 100-billion-token corpus is not written out again as jsonl) and each document goes to the
split of its text's hash. Only the embedded corpora have jsonl split files (under ``corpora/<name>/``): they are a
few megabytes, cleaned once from their packages' formats, and the evaluation's text tasks read the held-out
documents from them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from satlab.config.errors import ConfigError, did_you_mean, excerpt, shown, unknown_name
from satlab.config.schema import SOURCE_KINDS, DataConfig
from satlab.data.common import (
    SPLITS,
    check_val_fraction,
    file_sha256,
    hash_split,
    hash_split_rule,
    stable_hash,
)
from satlab.data.corpora import CORPORA, corpus_identity, ensure_corpus
from satlab.data.files import (
    COMPRESSIONS,
    FILE_FORMATS,
    file_fields,
    file_format,
    file_rows,
    is_empty,
    json_line_problem,
    quiet_readers,
    read_errors,
)

if TYPE_CHECKING:
    import datasets

@dataclass
class Source:
    """A resolved ``data.source``: what it is, how it is described, and what identifies its content."""

    kind: str
    name: str
    description: str
    identity: dict[str, Any]
    files: list[Path] = field(default_factory=list)


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or any(c in source for c in "*?[")
        or file_format(Path(source)) is not None
    )


def _find_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = (p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        files = (Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
    return sorted(p for p in files if p.is_file())


def _files_source(source: str, files: list[Path], text_field: str, rule: str) -> Source:
    supported = ", ".join(sorted(FILE_FORMATS) + [f"+{c}" for c in sorted(COMPRESSIONS)])
    unknown = [p for p in files if file_format(p) is None]
    if len(files) == 1 and unknown:
        raise ConfigError(f"data.source '{source}' has an unsupported file type; supported: {supported}.")
    files = [p for p in files if file_format(p) is not None]
    if not files:
        raise ConfigError(f"data.source '{source}' holds no text, jsonl or parquet files; supported: {supported}.")
    root = Path(os.path.commonpath([p.resolve().parent for p in files]))
    content = [(p.resolve().relative_to(root).as_posix(), file_sha256(p)) for p in files]
    identity = {"kind": "files", "content": stable_hash(content, 64), "text_field": text_field, "split_rule": rule}
    description = f"{len(files)} local file(s) from '{source}'"
    return Source("files", source, description, identity, files)


def resolve_source(cfg: DataConfig) -> Source:
    """Decide what ``cfg.source`` is (``source_kind: auto``: corpus name, then existing path or glob, then hub).

    Cheap: local files are hashed, nothing is read through ``datasets`` and the hub is not contacted. The identity
    covers the split rule, so it names the split documents, not only the source.
    """
    kind, source = cfg.source_kind, cfg.source
    if kind not in SOURCE_KINDS:
        raise ConfigError(unknown_name("data.source_kind", kind, SOURCE_KINDS))
    if kind == "corpus" or (kind == "auto" and source in CORPORA):
        if source not in CORPORA:
            raise ConfigError(unknown_name("embedded corpus (data.source)", source, CORPORA))
        return Source("corpus", source, f"embedded corpus '{source}'", corpus_identity(source, cfg.val_fraction))
    check_val_fraction(cfg.val_fraction)
    rule = hash_split_rule(cfg.val_fraction, "document text")
    if kind in ("files", "auto"):
        files = _find_files(source)
        if files:
            return _files_source(source, files, cfg.text_field, rule)
        if kind == "files" or _looks_like_path(source):
            raise ConfigError(
                f"data.source '{source}' does not exist: no file, folder or glob match{did_you_mean(source, CORPORA)}."
                f" Give a text/jsonl/parquet file, a folder of them or a glob, or an embedded corpus name "
                f"({', '.join(CORPORA)}), or a hub dataset name."
            )
    if kind == "auto" and "/" not in source and did_you_mean(source, CORPORA):
        raise ConfigError(
            f"'{source}' is not an embedded corpus{did_you_mean(source, CORPORA)}; embedded corpora: "
            f"{', '.join(CORPORA)}. To use a hub dataset of that name, set data.source_kind: hub."
        )
    identity = {"kind": "hub", "name": source, "config": cfg.hub_config, "split": cfg.hub_split,
                "max_documents": cfg.hub_max_documents, "text_field": cfg.text_field, "split_rule": rule}
    config = f", config '{cfg.hub_config}'" if cfg.hub_config else ""
    cap = f", first {cfg.hub_max_documents} documents" if cfg.hub_max_documents else ""
    return Source("hub", source, f"hub dataset '{source}'{config}, split '{cfg.hub_split}'{cap}", identity)


def _offline_error(name: str, error: BaseException) -> ConfigError:
    return ConfigError(
        f"could not reach the Hugging Face hub for dataset '{name}' (offline?) ({type(error).__name__}: {error}); "
        f"embedded corpora that work offline: {', '.join(CORPORA)}{did_you_mean(name, CORPORA)}; or point "
        "data.source at local files (a text/jsonl/parquet file, a folder of them or a glob)."
    )


def _first_undecodable(source: Source) -> ConfigError | None:
    """The first text file of a files source that is not UTF-8, named with the offending byte offset."""
    for path in source.files if source.kind == "files" else ():
        if file_format(path) != "text":
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            return ConfigError(
                f"{path} is not UTF-8 text: the byte at offset {e.start} (0x{e.object[e.start]:02x}) cannot be "
                f"decoded as utf-8 ({e.reason}); convert the file (for example `iconv -f latin1 -t utf-8`) or leave "
                "it out of data.source")
    return None


def load_stream(*args: Any, **kwargs: Any) -> datasets.IterableDataset:
    """``datasets.load_dataset(..., streaming=True)``, imported here: a run whose tokens are already prepared never
    reads a source, and importing ``datasets`` (with pandas) costs about a second in every training process."""
    import datasets

    return datasets.load_dataset(*args, streaming=True, **kwargs)


def _hub_stream(source: Source, cfg: DataConfig) -> Iterable[dict[str, Any]]:
    try:
        stream = load_stream(source.name, cfg.hub_config, split=cfg.hub_split)
    except FileNotFoundError as e:  # DatasetNotFoundError included
        raise ConfigError(
            f"the Hugging Face hub has no dataset '{source.name}' (or it is gated and needs `hf auth login`, or it "
            f"is not cached while offline): {e}"
        ) from e
    except OSError as e:  # ConnectionError and other network failures
        raise _offline_error(source.name, e) from e
    except ValueError as e:
        raise ConfigError(
            f"hub dataset '{source.name}' rejected data.hub_config={shown(cfg.hub_config)} / data.hub_split="
            f"{shown(cfg.hub_split)}: {e}"
        ) from e
    return stream.take(cfg.hub_max_documents) if cfg.hub_max_documents else stream


@dataclass
class Segment:
    """A stretch of documents read in a fixed order through a ``datasets`` stream in Arrow format (whose
    ``state_dict`` marks a resumable position); ``split`` is the split of all of them, or None for "each by the hash
    of its text"."""

    source: Source
    label: str
    stream: datasets.IterableDataset
    text_field: str
    split: str | None = None

    def __post_init__(self) -> None:
        self.stream = self.stream.with_format("arrow")  # Arrow batches: ~5x the rows per second of Python rows

    def batches(self, size: int) -> Iterator[list[str | None]]:
        """The texts of ``size`` rows at a time (the last batch may be shorter; a null value as is), with read
        failures as one-paragraph ConfigErrors naming the file (and line) at fault, a missing text field named with
        the fields there are, and a text field that does not hold text refused."""
        tables = iter(self.stream.iter(batch_size=size))
        while True:
            try:
                with quiet_readers():
                    table = next(tables, None)
            except ConnectionError as e:
                raise _offline_error(self.source.name, e) from e
            except read_errors() as e:
                raise _read_error(self.source, self.text_field, e) from e
            if table is None:
                return
            if self.text_field not in table.column_names:
                raise _missing_field(self.source, self.label, self.text_field, table.column_names)
            column = table.column(self.text_field)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                    or pa.types.is_null(column.type)):
                raise _not_text(self.source, self.text_field, column)
            yield column.to_pylist()


def _missing_field(source: Source, label: str, text_field: str, fields: list[str]) -> ConfigError:
    """A missing text field, named with the first file that lacks it (local files) and the fields it has."""
    where = f"the rows of {source.description} ({label})"
    for path in source.files:
        found = file_fields(path)
        if found is not None and text_field not in found:
            where, fields = f"the rows of {path}", found
            break
    return ConfigError(
        f"{where} have no field data.text_field='{text_field}'{did_you_mean(text_field, fields)}; their fields: "
        f"{excerpt(', '.join(sorted(fields)), 300)}. Set data.text_field to the field that holds the text.")


def _not_text(source: Source, text_field: str, column: pa.ChunkedArray) -> ConfigError:
    for path in source.files:
        if file_format(path) == "json" and (problem := json_line_problem(path, text_field)):
            return ConfigError(f"{problem}. data.text_field must name a field that holds text (a string).")
    first = next((v for v in column.to_pylist() if v is not None), None)
    return ConfigError(
        f"data.text_field='{text_field}' of {source.description} holds {column.type} values, not text (for example "
        f"{excerpt(repr(first))}); it must name a field that holds text (a string).")


def _read_error(source: Source, text_field: str, error: BaseException) -> ConfigError:
    """One paragraph for a source that cannot be read: the first file that is not UTF-8 text or the first bad
    line of a JSON-lines file when one is found, else the reader's own words (cut to a readable length)."""
    if isinstance(error, ConfigError):
        return error
    if (undecodable := _first_undecodable(source)) is not None:
        return undecodable
    for path in source.files:
        if file_format(path) == "json" and (problem := json_line_problem(path, text_field)):
            return ConfigError(f"{problem}. Each line of a .jsonl file must be one JSON object with a "
                               f"'{text_field}' text field (data.text_field); fix or remove that line.")
    return ConfigError(f"could not read {source.description}: {type(error).__name__}: {excerpt(str(error), 300)}")


def document_segments(source: Source, cfg: DataConfig,
                      first_use: Callable[[list[Segment], int | None], None] | None = None,
                      ) -> tuple[list[Segment], int | None, dict[str, Any]]:
    """The documents of ``source`` as segments in their fixed order, the number of rows when it is known (an upper
    bound on the documents: empty rows are skipped), and an embedded corpus' metadata (else ``{}``).

    An embedded corpus is read from its prepared jsonl split files, one segment per split; local files (grouped by
    format) and a hub dataset are streamed straight from the source, each document split by its text's hash.
    ``first_use(segments, rows)`` runs once on the documents before any of them is cached: an embedded corpus this
    call builds is kept only when it returns (``prepare_data`` checks its BPE tokenizer there).
    """
    if source.kind == "corpus":
        used: list[bool] = []

        def before_keep(folder: Path, meta: dict[str, Any]) -> None:
            assert first_use is not None
            first_use(_corpus_segments(source, folder), sum(meta["documents"].values()))
            used.append(True)

        folder, meta = ensure_corpus(source.name, cfg.cache_dir, cfg.val_fraction, before_keep if first_use else None)
        segments, rows = _corpus_segments(source, folder), sum(meta["documents"].values())
        if first_use is not None and not used:  # the corpus was there already
            first_use(segments, rows)
        return segments, rows, meta
    if source.kind == "hub":
        segments, rows = [Segment(source, source.name, _hub_stream(source, cfg), cfg.text_field)], cfg.hub_max_documents
        if first_use is not None:
            first_use(segments, rows)
        return segments, rows, {}
    files = [p for p in source.files if not is_empty(p)]  # no documents, and the json reader fails on them
    if not files:
        which = f"{source.files[0]} is" if len(source.files) == 1 else f"all {len(source.files)} files of it are"
        raise ConfigError(f"data.source '{source.name}' has no documents: {which} empty. Give a text/jsonl/parquet "
                          "file with at least one document, a folder of them or a glob.")
    segments, counts = [], []
    for fmt in sorted({file_format(p) for p in files}):
        paths = [p for p in files if file_format(p) == fmt]
        extra = {"sample_by": "document"} if fmt == "text" else {}
        text_field = "text" if fmt == "text" else cfg.text_field
        try:
            counts += [file_rows(p) for p in paths]
            with quiet_readers():
                stream = load_stream(fmt, data_files=[str(p) for p in paths], split="train", **extra)
        except read_errors() as e:
            raise _read_error(source, text_field, e) from e
        segments.append(Segment(source, f"{fmt} files", stream, text_field))
    rows = None if None in counts else sum(counts)
    if first_use is not None:
        first_use(segments, rows)
    return segments, rows, {}


def _corpus_segments(source: Source, folder: Path) -> list[Segment]:
    return [Segment(source, f"{s}.jsonl", _json_stream([folder / f"{s}.jsonl"]), "text", s) for s in SPLITS]


def _json_stream(paths: list[Path]) -> datasets.IterableDataset:
    return load_stream("json", data_files=[str(p) for p in paths], split="train")


def train_texts(segments: list[Segment], val_fraction: float, counts: dict[str, int]) -> Iterator[list[str]]:
    """Batches of the train split's non-empty texts (to train a BPE tokenizer on), counting every split's documents
    into ``counts`` (split -> number) on the way."""
    for segment in segments:
        for batch in segment.batches(256):
            texts = [t for t in batch if isinstance(t, str) and t.strip()]
            splits = [segment.split or hash_split(t, val_fraction) for t in texts]
            for split in splits:
                counts[split] += 1
            if train := [t for t, s in zip(texts, splits, strict=True) if s == "train"]:
                yield train
