"""The data pipeline's entry point: ``prepare_data(cfg.data)`` turns a :class:`DataConfig` into packed token files.

Steps, each cached under ``data.cache_dir`` and skipped when its cache entry exists:

1. resolve ``data.source`` into document segments (:mod:`satlab.data.sources`): an embedded corpus' jsonl split
   files (``corpora/<name>/``), or local files or a hub dataset streamed from where they are;
2. build the tokenizer (a ``bpe`` one is trained on the train split, never on synthetic documents; ``tokenizers/``);
3. tokenize every document into ``tokens/<key>/{train,validation,test}.bin`` with ``meta.json`` and a copy of the
   tokenizer, in ``data.num_proc`` processes (:mod:`satlab.data.packing`); the key covers the source identity (with
   its split rule; an embedded corpus' build signature), the tokenizer fingerprint and the packing format. The work
   happens in ``tokens/.<key>.partial/``, which a killed preparation resumes, and is renamed into place when done;
4. with ``data.mix``, rewrite ``train.bin`` with synthetic documents interleaved (:mod:`satlab.data.synthetic`); the
   mix is then part of the key (a mixed and an unmixed run never share token files) and ``meta.json`` records it
   under ``mix`` (requested and achieved shares, tokens and documents per source); ``tokens.train`` counts them
   all. Validation and test are never mixed, and a ``bpe`` tokenizer is trained on the corpus alone, so those
   files are identical with and without a mix.

A second call with the same configuration only reads metadata (:func:`find_prepared` does only that). Two
processes that prepare the same key at once take turns (a file lock), so the second finds the first's result; in
a multi-process job one process prepares and the others wait (:mod:`satlab.data.handoff`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from satlab.config.schema import DataConfig
from satlab.data.common import META_FILE, SPLITS, read_json, require_nonempty_splits, stable_hash, write_json
from satlab.data.packing import PROGRESS_FILE, default_num_proc, open_tokens, pack_documents, split_path, token_dtype
from satlab.data.sources import Segment, Source, document_segments, resolve_source, train_texts
from satlab.data.synthetic import check_mix, mix_key, mix_train_split
from satlab.data.tokenizer import TextTokenizer, build_tokenizer, cached_tokenizer

TOKENS_VERSION = 2
"""Bump when the packed format or the cache key changes; token caches are then rebuilt."""
TOKENIZER_DIR = "tokenizer"
MIX_FILE = "mix.json"
COPIED_SOURCE_META = ("documents_are", "held_out", "package", "python_version")


@dataclass
class PreparedData:
    """Packed token files of the three splits and everything needed to read and decode them."""

    tokenizer: TextTokenizer
    vocab_size: int
    eos_id: int
    dtype: str
    directory: Path
    paths: dict[str, Path]
    meta: dict[str, Any]

    @classmethod
    def from_directory(cls, directory: Path, meta: dict[str, Any], tokenizer: TextTokenizer) -> PreparedData:
        return cls(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                   dtype=meta["dtype"], directory=directory, paths={s: split_path(directory, s) for s in SPLITS},
                   meta=meta)

    def open(self, split: str = "train") -> np.ndarray:
        """The token ids of ``split`` (``train``, ``validation`` or ``test``) as a read-only numpy memmap."""
        return open_tokens(split_path(self.directory, split), self.dtype)


def _resolved(data_cfg: DataConfig) -> tuple[DataConfig, Source]:
    data_cfg = replace(data_cfg, cache_dir=str(Path(data_cfg.cache_dir).expanduser()))
    check_mix(data_cfg.mix)
    return data_cfg, resolve_source(data_cfg)


def _train_identity(source: Source) -> str:
    return stable_hash(source.identity, 64)


def _tokens_dir(data_cfg: DataConfig, source: Source, tokenizer: TextTokenizer) -> Path:
    key_fields = {"version": TOKENS_VERSION, "source": source.identity, "tokenizer": tokenizer.fingerprint}
    if data_cfg.mix:  # only then, so unmixed caches keep their keys
        key_fields["mix"] = mix_key(data_cfg.mix)
    return Path(data_cfg.cache_dir) / "tokens" / stable_hash(key_fields)


def _find(data_cfg: DataConfig, source: Source) -> PreparedData | None:
    tokenizer = cached_tokenizer(data_cfg.tokenizer, data_cfg.cache_dir, _train_identity(source))
    if tokenizer is None:
        return None
    target = _tokens_dir(data_cfg, source, tokenizer)
    meta = read_json(target / META_FILE)
    return None if meta is None else PreparedData.from_directory(target, meta, tokenizer)


def cached_data_tokenizer(data_cfg: DataConfig) -> TextTokenizer | None:
    """The tokenizer ``data_cfg`` asks for when it is at hand without training or fetching anything (a ``bpe`` one
    trained on the same train split before, a cached or local hub one, the byte one), else None; never writes."""
    data_cfg = replace(data_cfg, cache_dir=str(Path(data_cfg.cache_dir).expanduser()))
    identity = _train_identity(resolve_source(data_cfg)) if data_cfg.tokenizer.kind == "bpe" else ""
    return cached_tokenizer(data_cfg.tokenizer, data_cfg.cache_dir, identity)


def find_prepared(data_cfg: DataConfig) -> PreparedData | None:
    """The prepared data of ``data_cfg`` when everything is in the cache, else None; reads metadata only (local
    files are hashed to know their identity), never writes, trains, tokenizes or contacts the hub."""
    return _find(*_resolved(data_cfg))


@contextmanager
def _exclusive(lock_path: Path, say: Any) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (two processes preparing one cache entry take turns).

    The lock file exists only while a process holds it or waits for it: the holder removes it before it lets go,
    and a waiter that then gets the lock of a file no longer at ``lock_path`` opens the path again (the next
    holder's file), so two processes never hold "the" lock at once and a failed preparation leaves no lock behind.
    """
    told = False
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            f = open(lock_path, "a+")  # noqa: SIM115 (closed below, or after the block)
        except FileNotFoundError:  # a failed preparation removed the empty folder just now
            continue
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    say(f"another process is preparing {lock_path.parent / lock_path.stem.lstrip('.')}; waiting "
                        "for it")
                    told = True
                fcntl.flock(f, fcntl.LOCK_EX)
            if _same_file(f, lock_path):
                break
        except BaseException:
            f.close()
            raise
        f.close()  # the previous holder removed this file as it finished: take the lock of the one there now
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _same_file(f: Any, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


@contextmanager
def _undone_on_failure(cache_dir: Path, work: Path, lock: Path, say: Any) -> Iterator[None]:
    """Hold the lock of ``work``'s entry; on a failure inside the block, leave the cache as it was: the work folder
    goes when this call made it (a Ctrl-C keeps one that holds committed, resumable work), and so do the folders
    made for it when left empty. A work folder of an earlier, killed preparation stays: its committed work is still
    valid. The work folder is removed before the lock is let go, so no other preparer is working in it."""
    made = [d for d in (cache_dir, cache_dir / "tokens") if not d.exists()]
    try:
        with _exclusive(lock, say):
            fresh = not work.exists()
            try:
                yield
            except BaseException as error:
                resumable = (work / PROGRESS_FILE).exists() and not isinstance(error, Exception)
                if fresh and not resumable:
                    shutil.rmtree(work, ignore_errors=True)
                raise
    except BaseException:
        for folder in reversed(made):
            with suppress(OSError):  # not empty: it holds something else now
                folder.rmdir()
        raise


def _mix(work: Path, tokenizer: TextTokenizer, dtype: str, data_cfg: DataConfig, progress: bool) -> dict[str, Any]:
    """Mix synthetic documents into ``work/train.bin`` once, even across a kill: the packed corpus stays as
    ``train.corpus.part`` until the mix is recorded, and an interrupted mix starts again from it."""
    done = read_json(work / MIX_FILE)
    corpus = work / "train.corpus.part"
    if done is None:
        if corpus.exists():
            os.replace(corpus, split_path(work, "train"))
        done = mix_train_split(work, tokenizer, dtype, data_cfg.mix, progress)
        write_json(work / MIX_FILE, done)
    corpus.unlink(missing_ok=True)
    return done


def prepare_data(data_cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Prepare (or find in the cache) the packed token files for ``data_cfg``; see the module docstring.

    Raises :class:`~satlab.config.errors.ConfigError` for every user mistake (unknown corpus or tokenizer kind,
    missing files, unreachable hub, a split left empty, a disk too small, ...).
    """
    data_cfg, source = _resolved(data_cfg)
    if (found := _find(data_cfg, source)) is not None:
        return found
    cache_dir = data_cfg.cache_dir
    tokenizer = None
    if data_cfg.tokenizer.kind != "bpe":  # needs no corpus: made (or fetched) first, so a failure writes nothing
        tokenizer = build_tokenizer(data_cfg.tokenizer, cache_dir, "", lambda: iter(()), 0, progress)

    def train_tokenizer(segments: list[Segment], total_rows: int | None) -> None:
        """Train (or find) the BPE tokenizer before anything of the source is cached: an empty split or a vocabulary
        larger than the corpus allows is refused with nothing written."""
        nonlocal tokenizer

        def checked_train_texts() -> Iterator[list[str]]:
            """The train texts; at their end a source with an empty split is refused before the tokenizer is kept."""
            counts = dict.fromkeys(SPLITS, 0)
            yield from train_texts(segments, data_cfg.val_fraction, counts)
            require_nonempty_splits({"documents": counts, "split_rule": source.identity["split_rule"]},
                                    source.description)

        tokenizer = build_tokenizer(data_cfg.tokenizer, cache_dir, _train_identity(source), checked_train_texts,
                                    total_rows, progress, f"the train split of {source.description}")

    segments, total_rows, source_meta = document_segments(source, data_cfg, None if tokenizer else train_tokenizer)
    assert tokenizer is not None  # made above, or by train_tokenizer
    token_dtype(tokenizer.vocab_size)  # a vocabulary the token files cannot hold fails before they are begun
    target = _tokens_dir(data_cfg, source, tokenizer)
    work = target.with_name(f".{target.name}.partial")
    lock = target.with_name(f".{target.name}.lock")
    with _undone_on_failure(Path(cache_dir), work, lock, print if progress else lambda _: None):
        meta = read_json(target / META_FILE)
        if meta is None:  # else another process prepared it while this one waited for the lock
            meta = _pack(work, target, segments, total_rows, source, source_meta, tokenizer, data_cfg, progress)
    return PreparedData.from_directory(target, meta, tokenizer)


def _pack(work: Path, target: Path, segments: list[Segment], total_rows: int | None, source: Source,
          source_meta: dict[str, Any], tokenizer: TextTokenizer, data_cfg: DataConfig, progress: bool,
          ) -> dict[str, Any]:
    """Tokenize (and mix) into ``work``, write the metadata and rename it to ``target``; returns the metadata."""
    work.mkdir(parents=True, exist_ok=True)
    packed = pack_documents(segments, tokenizer, work, data_cfg.num_proc or default_num_proc(),
                            data_cfg.val_fraction, total_rows, progress)
    require_nonempty_splits({**packed, "split_rule": source.identity["split_rule"]}, source.description)
    mix = {}
    if data_cfg.mix:
        mix = {"mix": _mix(work, tokenizer, packed["dtype"], data_cfg, progress)}
        packed["tokens"]["train"] = sum(mix["mix"]["tokens"].values())
    meta = {
        "key": target.name,
        "format_version": TOKENS_VERSION,
        "source": {"kind": source.kind, "name": source.name, "description": source.description,
                   "identity": source.identity},
        "split_rule": source.identity["split_rule"],
        **packed,
        **mix,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": {"kind": tokenizer.kind, "name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
        **{k: source_meta[k] for k in COPIED_SOURCE_META if k in source_meta},
    }
    tokenizer.save(work / TOKENIZER_DIR)
    (work / PROGRESS_FILE).unlink(missing_ok=True)
    (work / MIX_FILE).unlink(missing_ok=True)
    write_json(work / META_FILE, meta)
    os.rename(work, target)
    return meta
