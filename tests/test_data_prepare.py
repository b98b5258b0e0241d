"""Preparation at scale: the token files do not depend on the number of processes, a killed preparation resumes
to the same bytes, a corpus is streamed from where it is, a full disk is refused before the work, and the progress
display reports rates a user can plan with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import satlab.data.packing as packing
import satlab.data.prepare as prepare_module
import satlab.data.synthetic as synthetic
from satlab.config.errors import ConfigError
from satlab.config.schema import DataConfig, TokenizerConfig
from satlab.data import prepare_data
from satlab.data.common import SPLITS, make_progress
from satlab.data.generated import write_fineweb_like

ROWS = 1500


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two FineWeb-shaped parquet files, 1500 rows in all (~5 MB of text)."""
    root = tmp_path_factory.mktemp("fineweb")
    write_fineweb_like(root / "data", ROWS, files=2, cache_dir=root / "corpora")
    return root / "data"


def config(cache: Path, source: Path | str, num_proc: int = 1, **kw) -> DataConfig:
    tokenizer = TokenizerConfig(kind="bpe", vocab_size=512)
    return DataConfig(source=str(source), cache_dir=str(cache), num_proc=num_proc, tokenizer=tokenizer, **kw)


def token_bytes(data) -> dict[str, bytes]:
    return {s: data.paths[s].read_bytes() for s in SPLITS}


@pytest.fixture(scope="module")
def reference(parquet: Path, tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted one-process preparation every other one must equal."""
    return prepare_data(config(tmp_path_factory.mktemp("reference"), parquet), progress=False)


def small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "SHARD_ROWS", 64)
    monkeypatch.setattr(packing, "BATCH_ROWS", 16)


@pytest.mark.slow  # make test-full; the crashed preparation below is the fast case
def test_one_and_two_processes_write_the_same_bytes(parquet: Path, reference, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    small_shards(monkeypatch)  # many batches in flight, so an out-of-order write would show
    two = prepare_data(config(tmp_path, parquet, num_proc=2), progress=False)
    assert two.directory.name == reference.directory.name  # the cache key does not depend on it either
    assert sum(reference.meta["documents"].values()) == ROWS and min(reference.meta["tokens"].values()) > 0
    assert token_bytes(two) == token_bytes(reference)


def test_a_corpus_is_streamed_not_copied(parquet: Path, reference) -> None:
    cache = Path(reference.directory).parents[1]
    copies = [p for p in cache.rglob("*") if p.suffix in (".jsonl", ".parquet", ".arrow")]
    assert not copies, f"documents copied into the cache: {copies}"
    text_bytes = sum(f.stat().st_size for f in parquet.iterdir())
    cached = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert cached < 2 * text_bytes  # token files (uint16, ~4 bytes of text each) and a tokenizer


def test_a_crashed_preparation_resumes_to_the_same_bytes(parquet: Path, reference, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    small_shards(monkeypatch)
    real, commits = packing.Progress.write, []

    def crash_at_the_third_commit(self, directory):
        commits.append(self.rows)
        if len(commits) == 3:  # the files already hold this shard's tokens, beyond the second commit's sizes
            raise KeyboardInterrupt
        real(self, directory)

    monkeypatch.setattr(packing.Progress, "write", crash_at_the_third_commit)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(config(tmp_path, parquet), progress=False)
    work = next((tmp_path / "tokens").glob(".*.partial"))
    committed = packing.Progress.read(work)
    assert committed is not None and committed.rows == commits[1] == 2 * packing.SHARD_ROWS
    written = (work / "train.bin").stat().st_size
    assert written > committed.tokens["train"] * 2  # batches after the last commit were written: resume cuts them
    assert not any(p.name[0] != "." for p in (tmp_path / "tokens").iterdir())  # no entry that looks done

    monkeypatch.setattr(packing.Progress, "write", real)
    resumed = prepare_data(config(tmp_path, parquet), progress=False)
    assert token_bytes(resumed) == token_bytes(reference)
    assert resumed.meta["documents"] == reference.meta["documents"]
    assert not work.exists() and not (resumed.directory / packing.PROGRESS_FILE).exists()


KILLED_PREPARATION = """
import sys
import satlab.data.packing as packing
from satlab.config.schema import DataConfig, TokenizerConfig
from satlab.data import prepare_data
packing.SHARD_ROWS, packing.BATCH_ROWS = 64, 16
prepare_data(DataConfig(source=sys.argv[1], cache_dir=sys.argv[2], num_proc=2,
                        tokenizer=TokenizerConfig(kind="bpe", vocab_size=512)), progress=False)
"""


@pytest.mark.slow  # make test-full; the crashed preparation below is the fast case
@pytest.mark.process
def test_a_killed_preparation_resumes_to_the_same_bytes(parquet: Path, reference, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL (no cleanup at all) in the middle of tokenizing, with two worker processes."""
    child = subprocess.Popen([sys.executable, "-c", KILLED_PREPARATION, str(parquet), str(tmp_path)],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        progress = None
        while time.monotonic() < deadline and child.poll() is None:
            work = next((tmp_path / "tokens").glob(".*.partial"), None) if (tmp_path / "tokens").exists() else None
            progress = work and packing.Progress.read(work)
            if progress and progress.rows >= 256:
                break
            time.sleep(0.05)
        assert child.poll() is None, "the preparation ended before it could be killed"
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert progress and progress.rows < ROWS
    small_shards(monkeypatch)
    resumed = prepare_data(config(tmp_path, parquet, num_proc=2), progress=False)
    assert token_bytes(resumed) == token_bytes(reference)


def test_an_interrupted_mix_starts_again_from_the_packed_corpus(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DataConfig(source="kjv", cache_dir=str(tmp_path / "a"), num_proc=1, mix={"recall": 0.05},
                     tokenizer=TokenizerConfig(kind="byte"))
    uninterrupted = prepare_data(cfg, progress=False)
    real = synthetic._write_source

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # after train.bin was moved aside and a source written

    monkeypatch.setattr(synthetic, "_write_source", interrupted)
    cfg.cache_dir = str(tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, progress=False)
    monkeypatch.setattr(synthetic, "_write_source", real)
    resumed = prepare_data(cfg, progress=False)
    assert token_bytes(resumed) == token_bytes(uninterrupted)
    assert resumed.meta["mix"] == uninterrupted.meta["mix"]


def test_a_disk_too_small_is_refused_and_the_preparation_resumes_later(parquet: Path, reference, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = packing.shutil.disk_usage
    monkeypatch.setattr(packing.shutil, "disk_usage", lambda path: SimpleNamespace(free=100_000))
    with pytest.raises(ConfigError, match=r"not enough disk space .* need ~[\d.]+ MB more .* 100 kB free"):
        prepare_data(config(tmp_path, parquet), progress=False)
    monkeypatch.setattr(packing.shutil, "disk_usage", real)
    assert token_bytes(prepare_data(config(tmp_path, parquet), progress=False)) == token_bytes(reference)


def test_progress_shows_rates_and_time_left() -> None:
    columns = make_progress(True).columns
    task = SimpleNamespace(completed=1500, total=4500, elapsed=2.0, fields={"start_rows": 500, "tokens": 3_000_000,
                                                                            "start_tokens": 1_000_000})
    ours = [c for c in columns if type(c).__module__ == "satlab.data.common"]
    rendered = " ".join(str(c.render(task)) for c in ours)
    assert "500 docs/s" in rendered and "1 M tok/s" in rendered and "ETA 0:00:06" in rendered


def test_a_failed_source_leaves_no_work_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "one.txt").write_text("a single document cannot fill three splits\n")
    with pytest.raises(ConfigError, match="is empty"):
        prepare_data(DataConfig(source=str(tmp_path / "one.txt"), cache_dir=str(tmp_path / "cache"), num_proc=1,
                                tokenizer=TokenizerConfig(kind="byte")), progress=False)
    assert not list((tmp_path / "cache" / "tokens").glob(".*.partial"))
    assert prepare_module.find_prepared(DataConfig(source=str(tmp_path / "one.txt"),
                                                   cache_dir=str(tmp_path / "cache"))) is None


def test_the_paper_presets_data_path_offline(parquet: Path, reference, tmp_path: Path) -> None:
    """A paper preset's data settings (hub tokenizer, 0.5 % held out, 4096-token windows) on a local FineWeb-shaped
    parquet, the hub tokenizer replaced by a local tokenizer.json: the corpus is read where it is."""
    from satlab.config.loader import load_experiment

    local = next(Path(reference.directory).parents[1].glob("tokenizers/bpe-*/tokenizer.json"))
    cfg = load_experiment("paper/small/satformer", [f"data.source={parquet}", "data.source_kind=files",
                                                    f"data.tokenizer.name={local}", f"data.cache_dir={tmp_path}"])
    assert (cfg.data.tokenizer.kind, cfg.data.val_fraction, cfg.data.seq_len) == ("hub", 0.005, 4096)
    data = prepare_data(cfg.data, progress=False)
    assert data.tokenizer.kind == "hub" and data.vocab_size == reference.vocab_size
    assert sum(data.meta["documents"].values()) == ROWS and data.meta["documents"]["validation"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]  # nothing else: no corpus copy, no tokenizer fetch
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".jsonl", ".parquet", ".arrow")]
    assert prepare_module.find_prepared(cfg.data).directory == data.directory
