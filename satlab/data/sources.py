"""Where the documents come from: ``data.source`` resolved to an embedded corpus, local files or a hub dataset.

Every source is turned once into the same on-disk form, three jsonl split files plus ``meta.json`` (see
:mod:`satlab.data.common`), and read back from there through Hugging Face ``datasets``. Local files and hub
datasets are read with ``datasets`` too (streaming, so nothing is converted twice) and split by the hash of each
document's text; the hub stream is thus fetched once, after which preparation works offline.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
from datasets.exceptions import DatasetGenerationError

from satlab.config.errors import ConfigError, did_you_mean, unknown_name
from satlab.config.schema import SOURCE_KINDS, DataConfig
from satlab.data.common import (
    META_FILE,
    SPLITS,
    SplitWriter,
    atomic_directory,
    check_val_fraction,
    file_sha256,
    hash_split,
    hash_split_rule,
    make_progress,
    read_json,
    require_nonempty_splits,
    stable_hash,
    write_json,
)
from satlab.data.corpora import CORPORA, ensure_corpus

FILE_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                ".parquet": "parquet"}
COMPRESSIONS = {".gz", ".bz2", ".xz", ".zst"}
SOURCES_VERSION = 1


@dataclass
class Source:
    """A resolved ``data.source``: what it is, how it is described, and what identifies its content."""

    kind: str
    name: str
    description: str
    identity: dict[str, Any]
    files: list[Path] = field(default_factory=list)


def _file_format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return FILE_FORMATS.get(suffixes[-1]) if suffixes else None


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or any(c in source for c in "*?[")
        or _file_format(Path(source)) is not None
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


def _files_source(source: str, files: list[Path], text_field: str) -> Source:
    supported = ", ".join(sorted(FILE_FORMATS) + [f"+{c}" for c in sorted(COMPRESSIONS)])
    unknown = [p for p in files if _file_format(p) is None]
    if len(files) == 1 and unknown:
        raise ConfigError(f"data.source '{source}' has an unsupported file type; supported: {supported}.")
    files = [p for p in files if _file_format(p) is not None]
    if not files:
        raise ConfigError(f"data.source '{source}' holds no text, jsonl or parquet files; supported: {supported}.")
    root = Path(os.path.commonpath([p.resolve().parent for p in files]))
    content = [(p.resolve().relative_to(root).as_posix(), file_sha256(p)) for p in files]
    identity = {"kind": "files", "content": stable_hash(content, 64), "text_field": text_field}
    description = f"{len(files)} local file(s) from '{source}'"
    return Source("files", source, description, identity, files)


def resolve_source(cfg: DataConfig) -> Source:
    """Decide what ``cfg.source`` is (``source_kind: auto``: corpus name, then existing path or glob, then hub).

    Cheap: local files are hashed, nothing is read through ``datasets`` and the hub is not contacted.
    """
    kind, source = cfg.source_kind, cfg.source
    if kind not in SOURCE_KINDS:
        raise ConfigError(unknown_name("data.source_kind", kind, SOURCE_KINDS))
    if kind == "corpus" or (kind == "auto" and source in CORPORA):
        if source not in CORPORA:
            raise ConfigError(unknown_name("embedded corpus (data.source)", source, CORPORA))
        return Source("corpus", source, f"embedded corpus '{source}'", {"kind": "corpus", "name": source})
    if kind in ("files", "auto"):
        files = _find_files(source)
        if files:
            return _files_source(source, files, cfg.text_field)
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
                "max_documents": cfg.hub_max_documents, "text_field": cfg.text_field}
    config = f", config '{cfg.hub_config}'" if cfg.hub_config else ""
    cap = f", first {cfg.hub_max_documents} documents" if cfg.hub_max_documents else ""
    return Source("hub", source, f"hub dataset '{source}'{config}, split '{cfg.hub_split}'{cap}", identity)


def _offline_error(name: str, error: BaseException) -> ConfigError:
    return ConfigError(
        f"could not reach the Hugging Face hub for dataset '{name}' (offline?) ({type(error).__name__}: {error}); "
        f"embedded corpora that work offline: {', '.join(CORPORA)}{did_you_mean(name, CORPORA)}; or point "
        "data.source at local files (a text/jsonl/parquet file, a folder of them or a glob)."
    )


def _rows(stream: Iterable[dict[str, Any]], source: Source) -> Iterator[dict[str, Any]]:
    """Rows of a ``datasets`` stream, with read failures turned into ConfigErrors naming the source."""
    try:
        yield from stream
    except ConnectionError as e:
        raise _offline_error(source.name, e) from e
    except (OSError, ValueError, pa.ArrowException, DatasetGenerationError) as e:
        undecodable = _first_undecodable(source)
        raise (undecodable or ConfigError(f"could not read {source.description}: {type(e).__name__}: {e}")) from e


def _first_undecodable(source: Source) -> ConfigError | None:
    """The first text file of a files source that is not UTF-8, named with the offending byte offset."""
    for path in source.files if source.kind == "files" else ():
        if _file_format(path) != "text":
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            return ConfigError(
                f"{path} is not UTF-8 text: the byte at offset {e.start} (0x{e.object[e.start]:02x}) cannot be "
                f"decoded as utf-8 ({e.reason}); convert the file (for example `iconv -f latin1 -t utf-8`) or leave "
                "it out of data.source")
    return None


def _hub_stream(source: Source, cfg: DataConfig) -> Iterable[dict[str, Any]]:
    try:
        stream = datasets.load_dataset(source.name, cfg.hub_config, split=cfg.hub_split, streaming=True)
    except FileNotFoundError as e:  # DatasetNotFoundError included
        raise ConfigError(
            f"the Hugging Face hub has no dataset '{source.name}' (or it is gated and needs `hf auth login`, or it "
            f"is not cached while offline): {e}"
        ) from e
    except OSError as e:  # ConnectionError and other network failures
        raise _offline_error(source.name, e) from e
    except ValueError as e:
        raise ConfigError(
            f"hub dataset '{source.name}' rejected data.hub_config={cfg.hub_config!r} / data.hub_split="
            f"{cfg.hub_split!r}: {e}"
        ) from e
    return stream.take(cfg.hub_max_documents) if cfg.hub_max_documents else stream


def _documents(source: Source, cfg: DataConfig) -> Iterator[dict[str, str]]:
    """``{"id", "text"}`` for every non-empty document of a files or hub source, in a fixed order."""
    if source.kind == "hub":
        groups = [(source.name, cfg.text_field, _hub_stream(source, cfg))]
    else:
        groups = []
        for fmt in sorted({_file_format(p) for p in source.files}):
            paths = [str(p) for p in source.files if _file_format(p) == fmt]
            extra = {"sample_by": "document"} if fmt == "text" else {}
            stream = datasets.load_dataset(fmt, data_files=paths, split="train", streaming=True, **extra)
            groups.append((f"{fmt} files", "text" if fmt == "text" else cfg.text_field, stream))
    for label, text_field, stream in groups:
        for index, row in enumerate(_rows(stream, source)):
            if text_field not in row:
                raise ConfigError(
                    f"the rows of {source.description} ({label}) have no field data.text_field='{text_field}'"
                    f"{did_you_mean(text_field, row)}; fields: {', '.join(sorted(row))}."
                )
            text = row[text_field]
            if isinstance(text, str) and text.strip():
                yield {"id": f"{label}#{index}", "text": text}


def prepare_split_files(source: Source, cfg: DataConfig, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """The folder of ``source``'s jsonl split files and their metadata, writing them on first use."""
    if source.kind == "corpus":
        return ensure_corpus(source.name, cfg.cache_dir, cfg.val_fraction)
    check_val_fraction(cfg.val_fraction)
    rule = hash_split_rule(cfg.val_fraction, "document text")
    key = stable_hash({"identity": source.identity, "split_rule": rule, "version": SOURCES_VERSION})
    target = Path(cfg.cache_dir) / "sources" / key
    meta = read_json(target / META_FILE)
    if meta is not None:
        return target, meta
    with atomic_directory(target) as tmp:
        with make_progress(progress) as bar, SplitWriter(tmp) as writer:
            total = cfg.hub_max_documents if source.kind == "hub" else None
            task = bar.add_task(f"reading {source.description}", total=total)
            for doc in _documents(source, cfg):
                writer.add(hash_split(doc["text"], cfg.val_fraction), doc)
                bar.advance(task)
        meta = {"description": source.description, "identity": source.identity, "split_rule": rule,
                **writer.summary()}
        require_nonempty_splits(meta, source.description)  # before the entry exists: a bad source leaves nothing
        write_json(tmp / META_FILE, meta)
    return target, meta


def load_documents(split_dir: Path) -> dict[str, datasets.IterableDataset]:
    """The split files of ``split_dir`` as streaming ``datasets`` (columns ``text`` and ``id``, maybe ``title``)."""
    files = {s: str(split_dir / f"{s}.jsonl") for s in SPLITS}
    loaded = datasets.load_dataset("json", data_files=files, streaming=True)
    return {s: loaded[s] for s in SPLITS}
