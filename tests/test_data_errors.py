"""A data source that cannot be used: one paragraph naming the file, its 1-based line or its fields, nothing printed
before it, and the token cache left as it was (no work folder, no lock, no empty folders)."""

from __future__ import annotations

import fcntl
import gzip
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import satlab.data.packing as packing
import satlab.data.prepare as prepare_module
from satlab.config.errors import ConfigError
from satlab.config.schema import DataConfig, TokenizerConfig
from satlab.data import prepare_data


def lines(n: int = 400, words: int = 40) -> list[str]:
    return [json.dumps({"text": f"document {i}: " + "word " * words, "id": i}) for i in range(n)]


def broken_at_201(path: Path) -> Path:
    """Long lines, so that ``datasets`` reads the file in several blocks and its own row number is not the line's."""
    rows = lines(words=3000)
    rows[200] = '{"text": "a line cut short", '
    path.write_text("\n".join(rows) + "\n")
    return path


def gz_broken_at_201(path: Path) -> Path:
    plain = broken_at_201(path.with_suffix(""))
    path.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    return path


def number_at_150(path: Path) -> Path:
    rows = lines()
    rows[149] = json.dumps({"text": 5, "id": 149})
    path.write_text("\n".join(rows) + "\n")
    return path


def array_at_10(path: Path) -> Path:
    rows = lines()
    rows[9] = json.dumps(["not", "an", "object"])
    path.write_text("\n".join(rows) + "\n")
    return path


def parquet_without_text(path: Path) -> Path:
    pq.write_table(pa.table({"body": [f"doc {i}" for i in range(50)], "id": list(range(50))}), path)
    return path


def parquet_of_numbers(path: Path) -> Path:
    pq.write_table(pa.table({"text": list(range(50))}), path)
    return path


def jsonl_without_text(path: Path) -> Path:
    path.write_text("\n".join(json.dumps({"body": f"doc {i}", "lang": "en"}) for i in range(50)) + "\n")
    return path


def empty(path: Path) -> Path:
    path.write_text("\n")
    return path


def not_parquet(path: Path) -> Path:
    path.write_bytes(b"PAR1 this is not a parquet file")
    return path


def csv(path: Path) -> Path:
    path.write_text("text\nhello\n")
    return path


CASES: dict[str, tuple[str, Callable[[Path], Path], list[str]]] = {
    "jsonl-bad-line-201": ("bad.jsonl", broken_at_201, ["bad.jsonl line 201 is not valid JSON", "a line cut short"]),
    "gz-bad-line-201": ("bad.jsonl.gz", gz_broken_at_201, ["bad.jsonl.gz line 201 is not valid JSON"]),
    "jsonl-number-in-text": ("n.jsonl", number_at_150, ["n.jsonl line 150 has a number in data.text_field='text'"]),
    "jsonl-array-line": ("a.jsonl", array_at_10, ["a.jsonl line 10 is an array, not a JSON object"]),
    "parquet-without-field": ("p.parquet", parquet_without_text,
                              ["p.parquet have no field data.text_field='text'", "fields: body, id"]),
    "parquet-of-numbers": ("q.parquet", parquet_of_numbers, ["data.text_field='text'", "int64 values, not text"]),
    "jsonl-without-field": ("f.jsonl", jsonl_without_text, ["f.jsonl have no field", "fields: body, lang"]),
    "empty-jsonl": ("e.jsonl", empty, ["has no documents", "e.jsonl is empty"]),
    "not-parquet": ("c.parquet", not_parquet, ["could not read", "c.parquet", "magic bytes"]),
    "csv": ("t.csv", csv, ["unsupported file type", ".jsonl", ".parquet"]),
}


def files_in(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_a_bad_source_is_one_paragraph_and_leaves_the_cache_as_it_was(case, kind, tmp_path: Path, capfd,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``byte`` starts tokenizing at once (the work folder and lock exist when the error comes); ``bpe`` reads the
    whole source to train first. Small shards: the broken line comes after resumable commits."""
    monkeypatch.setattr(packing, "SHARD_ROWS", 64)
    monkeypatch.setattr(packing, "BATCH_ROWS", 16)
    name, make, fragments = CASES[case]
    source = make(tmp_path / name)
    cache = tmp_path / "cache"
    cfg = DataConfig(source=str(source), cache_dir=str(cache), num_proc=1,
                     tokenizer=TokenizerConfig(kind=kind, vocab_size=300))
    with pytest.raises(ConfigError) as refused:
        prepare_data(cfg, progress=False)
    message = str(refused.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message and message.count("could not read") <= 1 and "ConfigError" not in message
    assert len(message) < 600, message
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)  # no log line of datasets' own before satlab's message
    assert files_in(cache) == []


def test_a_failure_keeps_what_was_in_the_cache(tmp_path: Path) -> None:
    """A cache with an entry already: a failed preparation of another source adds nothing and takes nothing."""
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines()) + "\n")
    cache = tmp_path / "cache"
    byte = TokenizerConfig(kind="byte")
    prepare_data(DataConfig(source=str(good), cache_dir=str(cache), num_proc=1, tokenizer=byte), progress=False)
    before = files_in(cache)
    assert not [f for f in before if f.endswith((".lock", ".partial"))]  # a finished preparation leaves no lock
    bad = broken_at_201(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="line 201"):
        prepare_data(DataConfig(source=str(bad), cache_dir=str(cache), num_proc=1, tokenizer=byte), progress=False)
    assert files_in(cache) == before


def test_the_lock_file_exists_only_while_held_and_a_waiter_takes_the_next_one(tmp_path: Path) -> None:
    """The holder removes the lock file as it lets go; a process that waited on the removed file must not think it
    holds the lock: it takes the lock of the file at the path, so a third process waits for it."""
    lock = tmp_path / "tokens" / ".entry.lock"
    first_in, waiter_in, release_first, release_waiter = (threading.Event() for _ in range(4))

    def hold(entered: threading.Event, release: threading.Event) -> None:
        with prepare_module._exclusive(lock, lambda _: None):
            entered.set()
            release.wait(10)

    first = threading.Thread(target=hold, args=(first_in, release_first))
    first.start()
    assert first_in.wait(10)
    waiter = threading.Thread(target=hold, args=(waiter_in, release_waiter))
    waiter.start()
    time.sleep(0.2)  # the waiter blocks on the first holder's file
    assert not waiter_in.is_set()
    release_first.set()
    assert waiter_in.wait(10)
    with open(lock) as third, pytest.raises(BlockingIOError):  # the file at the path is the one the waiter holds
        fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
    release_waiter.set()
    first.join(10)
    waiter.join(10)
    assert not lock.exists()
