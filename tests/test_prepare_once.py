"""One data preparation per multi-process job (satlab.data.handoff): who prepares, how the others wait, when they
give up, and a real 2-process torchrun job on gloo where one rank prepares and both train on its files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from satlab.config.errors import ConfigError
from satlab.config.schema import DataConfig, TokenizerConfig
from satlab.data import handoff
from satlab.data import prepare as pipeline
from satlab.data.handoff import LaunchRanks, is_preparer, job_id, launch_ranks, prepare_once, status_key

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
               "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch):
    """A clean launch environment; ``env(RANK="1", ...)`` sets variables for the test."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_vars(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_vars


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(handoff, "POLL_S", 0.05)
    monkeypatch.setattr(handoff, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(handoff, "ANNOUNCE_AFTER_S", 0.2)


def data_cfg(tmp_path: Path, **changes) -> DataConfig:
    return replace(DataConfig(source="kjv", cache_dir=str(tmp_path / "cache"),
                              tokenizer=TokenizerConfig(kind="byte")), **changes)


def fake_find(monkeypatch, result=None, misses: int = 0) -> list:
    """``find_prepared`` returning None ``misses`` times, then ``result``; the list records the calls."""
    calls = []

    def find_prepared(cfg):
        calls.append(cfg)
        return result if len(calls) > misses else None

    monkeypatch.setattr(pipeline, "find_prepared", find_prepared)
    return calls


def no_prepare(monkeypatch) -> None:
    def prepare_data(cfg, progress=True):
        raise AssertionError("a waiting process prepared the data")

    monkeypatch.setattr(pipeline, "prepare_data", prepare_data)


def waited(cfg: DataConfig, limit: float = 10.0):
    """``prepare_once(cfg)`` in a thread, so that a waiter that never gives up fails the test instead of hanging
    it: its result, or its exception raised here."""
    outcome = {}

    def target():
        try:
            outcome["result"] = prepare_once(cfg)
        except BaseException as error:  # handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"prepare_once neither returned nor gave up within {limit} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def status(cfg: DataConfig, job: str | None, state: str, updated: float | None = None, **fields) -> Path:
    path = handoff.status_path(cfg)
    handoff.write_status(path, {"state": state, "pid": 4242, "host": "node0", "job": job,
                                "updated": time.time() if updated is None else updated, **fields})
    return path


# --- who prepares --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("variables", "expected", "prepares", "prepares_per_node"), [
    ({}, LaunchRanks(None, 0, 0), True, True),
    ({"RANK": "0", "LOCAL_RANK": "0"}, LaunchRanks("torchrun", 0, 0), True, True),
    ({"RANK": "1", "LOCAL_RANK": "1"}, LaunchRanks("torchrun", 1, 1), False, False),
    ({"RANK": "8", "LOCAL_RANK": "0"}, LaunchRanks("torchrun", 8, 0), False, True),
    ({"RANK": "3", "LOCAL_RANK": "3", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, LaunchRanks("torchrun", 3, 3),
     False, False),
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, LaunchRanks("slurm", 0, 0), True, True),
    ({"SLURM_PROCID": "9", "SLURM_LOCALID": "1"}, LaunchRanks("slurm", 9, 1), False, False),
    ({"SLURM_PROCID": "8", "SLURM_LOCALID": "0"}, LaunchRanks("slurm", 8, 0), False, True),
    ({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "LOCAL_RANK": "1"}, LaunchRanks("slurm", 9, 1), False, False),
    ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, LaunchRanks("lightning", 1, 1, 0), False, False),
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, LaunchRanks("lightning", None, 0, 1), False, True),
    ({"NODE_RANK": "1"}, LaunchRanks("lightning", None, 0, 1), False, True),  # the launcher's parent on node 1
    # an interactive SLURM shell where Lightning launches the processes: its LOCAL_RANK, not SLURM's, is this one's
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "LOCAL_RANK": "1", "NODE_RANK": "0"},
     LaunchRanks("lightning", 1, 1, 0), False, False),
])
def test_rank_decision(variables, expected, prepares, prepares_per_node):
    ranks = launch_ranks(variables)
    assert ranks == expected
    assert is_preparer(ranks, per_node=False) is prepares
    assert is_preparer(ranks, per_node=True) is prepares_per_node


def test_prepare_once_dispatches_on_the_environment(env, fast, monkeypatch, tmp_path):
    cfg = data_cfg(tmp_path)
    prepared = SimpleNamespace(directory=tmp_path / "tokens" / "x")
    monkeypatch.setattr(pipeline, "prepare_data", lambda c, progress=True: prepared)
    fake_find(monkeypatch, "found")
    assert prepare_once(cfg) is prepared  # a single process prepares, and writes no status (no one waits)
    assert not handoff.status_path(cfg).parent.exists()
    env(RANK="1", LOCAL_RANK="1", MASTER_ADDR="h", MASTER_PORT="1")
    assert prepare_once(cfg) == "found"
    env(RANK="2", LOCAL_RANK="0")
    assert prepare_once(cfg) == "found"
    assert prepare_once(replace(cfg, prepare_per_node=True)) is prepared  # local rank 0 of its node


def test_job_id_from_the_launcher():
    assert job_id({}) is None
    assert job_id({"MASTER_ADDR": "n0", "MASTER_PORT": "29500"}) == "n0:29500"
    assert job_id({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}) \
        == "slurm:77.0/0"
    assert job_id({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}) == "slurm:77/1"  # a requeued job
    assert job_id({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2", "SLURM_JOB_ID": "77"}) \
        == "torchrun:abc/2"


def test_status_key_covers_what_defines_the_data(tmp_path):
    cfg = data_cfg(tmp_path)
    key = status_key(cfg)
    for same in (dict(num_workers=4), dict(num_proc=3), dict(prepare_per_node=True), dict(prepare_timeout_s=5.0),
                 dict(seq_len=2048), dict(cache_dir="elsewhere")):
        assert status_key(replace(cfg, **same)) == key, same
    for other in (dict(source="shakespeare"), dict(val_fraction=0.1), dict(mix={"recall": 0.1}),
                  dict(tokenizer=TokenizerConfig(kind="bpe", vocab_size=512))):
        assert status_key(replace(cfg, **other)) != key, other


# --- the preparer ---------------------------------------------------------------------------------------------------

def test_preparer_keeps_its_status_fresh_then_marks_it_done(env, fast, monkeypatch, tmp_path):
    cfg = data_cfg(tmp_path)
    path = handoff.status_path(cfg)
    seen = []

    def prepare_data(c, progress=True):
        for _ in range(8):
            seen.append(handoff.read_status(path))
            time.sleep(0.05)
        return SimpleNamespace(directory=tmp_path / "tokens" / "k")

    monkeypatch.setattr(pipeline, "prepare_data", prepare_data)
    env(RANK="0", LOCAL_RANK="0", TORCHELASTIC_RUN_ID="run")
    prepare_once(cfg)
    assert {s["state"] for s in seen} == {"running"} and seen[0]["job"] == "torchrun:run/0"
    assert seen[0]["pid"] == os.getpid()
    assert len({s["updated"] for s in seen}) >= 3, "the heartbeat rewrites the status while preparing"
    final = handoff.read_status(path)
    assert final["state"] == "done" and final["directory"] == str(tmp_path / "tokens" / "k")
    assert not list(path.parent.glob(".*.tmp")), "status files are written atomically, no temporary left"


def test_preparer_records_its_failure(env, fast, monkeypatch, tmp_path):
    cfg = data_cfg(tmp_path)

    def prepare_data(c, progress=True):
        raise ConfigError("unknown corpus 'kvj'")

    monkeypatch.setattr(pipeline, "prepare_data", prepare_data)
    env(MASTER_ADDR="n0", MASTER_PORT="29500")  # the parent of Lightning's launcher on a node of a larger job
    with pytest.raises(ConfigError, match="kvj"):
        prepare_once(cfg)
    final = handoff.read_status(handoff.status_path(cfg))
    assert final["state"] == "failed" and final["error"] == "unknown corpus 'kvj'" and final["job"] == "n0:29500"


# --- the waiting processes ------------------------------------------------------------------------------------------

def test_waiter_stops_with_the_preparers_error(env, fast, monkeypatch, tmp_path):
    cfg = data_cfg(tmp_path, prepare_timeout_s=2.0)
    env(RANK="1", LOCAL_RANK="1", MASTER_ADDR="n0", MASTER_PORT="29500")
    fake_find(monkeypatch)
    no_prepare(monkeypatch)
    status(cfg, "n0:29500", "failed", error="unknown corpus 'kvj'")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"rank 0 \(host node0, pid 4242\) failed to prepare the data .*kvj"):
        waited(cfg)
    assert time.monotonic() - started < 1


def test_waiter_ignores_failures_of_other_launches(env, fast, monkeypatch, tmp_path):
    """Another job's failure, or this job id's from before this process started (an earlier launch), is not this
    launch's: the waiter keeps waiting (here until its timeout)."""
    cfg = data_cfg(tmp_path, prepare_timeout_s=0.5)
    env(RANK="1", LOCAL_RANK="1", MASTER_ADDR="n0", MASTER_PORT="29500")
    fake_find(monkeypatch)
    no_prepare(monkeypatch)
    for job, updated in (("n0:29501", None), ("n0:29500", time.time() - 24 * 3600)):
        status(cfg, job, "failed", updated=updated, error="unknown corpus 'kvj'")
        with pytest.raises(ConfigError) as error:
            waited(cfg)
        assert "kvj" not in str(error.value) and "prepare_timeout_s" in str(error.value)


def test_waiter_times_out_on_a_stale_heartbeat(env, fast, monkeypatch, tmp_path, capsys):
    cfg = data_cfg(tmp_path, prepare_timeout_s=1.0)
    env(RANK="1", LOCAL_RANK="1", MASTER_ADDR="n0", MASTER_PORT="29500")
    fake_find(monkeypatch)
    no_prepare(monkeypatch)
    status(cfg, "n0:29500", "running", updated=time.time() - 3600)  # a preparer that died an hour ago
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        waited(cfg)
    assert 1.0 <= time.monotonic() - started < 3.0
    message = str(error.value)
    assert "host node0, pid 4242" in message and "no sign of life" in message
    assert "data.prepare_per_node=true" in message and "data.prepare_timeout_s (now 1)" in message
    err = capsys.readouterr().err
    assert err.count("rank 1: waiting for rank 0 (host node0, pid 4242) to prepare the data in") == 1


def test_waiter_times_out_when_no_status_ever_appears(env, fast, monkeypatch, tmp_path, capsys):
    cfg = data_cfg(tmp_path, prepare_timeout_s=1.0, prepare_per_node=True)
    env(SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_JOB_ID="9")
    fake_find(monkeypatch)
    no_prepare(monkeypatch)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="never wrote its status file") as error:
        waited(cfg)
    assert 1.0 <= time.monotonic() - started < 3.0
    assert "local rank 0 of this node" in str(error.value)
    assert "rank 3: waiting for local rank 0 of this node (no status in" in capsys.readouterr().err


def test_a_fresh_heartbeat_keeps_the_waiter_waiting(env, fast, monkeypatch, tmp_path, capsys):
    """The preparer takes 3 timeouts' time but beats all along; then its status says done and the data is found."""
    cfg = data_cfg(tmp_path, prepare_timeout_s=0.5)
    env(RANK="1", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="run")
    monkeypatch.setattr(handoff, "REPORT_EVERY_S", 0.6)
    no_prepare(monkeypatch)
    found = SimpleNamespace(directory=tmp_path / "cache" / "tokens" / "k")
    done = threading.Event()

    def preparer():
        for step in range(15):
            status(cfg, "torchrun:run/0", "running", progress=f"tokenizing train: {step * 7}%")
            time.sleep(0.1)
        status(cfg, "torchrun:run/0", "done", directory=str(found.directory))
        done.set()

    monkeypatch.setattr(pipeline, "find_prepared", lambda c: found if done.is_set() else None)
    thread = threading.Thread(target=preparer)
    thread.start()
    try:
        assert waited(cfg) is found
    finally:
        thread.join()
    err = capsys.readouterr().err
    assert err.count("rank 1: waiting for rank 0 (host node0, pid 4242)") == 1
    assert "rank 1: still waiting for rank 0 after" in err and "tokenizing train:" in err
    assert f"rank 1: the data is ready in {found.directory}" in err


def test_waiter_returns_the_data_once_it_is_there(env, fast, monkeypatch, tmp_path):
    cfg = data_cfg(tmp_path, prepare_timeout_s=5.0)
    env(LOCAL_RANK="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1234")  # a Lightning child
    no_prepare(monkeypatch)
    status(cfg, "127.0.0.1:1234", "done", directory="somewhere")
    found = SimpleNamespace(directory="somewhere")
    calls = fake_find(monkeypatch, found, misses=2)
    assert waited(cfg) is found
    assert len(calls) == 3


# --- a real job -----------------------------------------------------------------------------------------------------

RANK_SCRIPT = '''
import os, sys, time
from pathlib import Path


def run(logs: Path, argv: list[str]) -> int:
    rank = os.environ["RANK"]
    (logs / f"rank{rank}.pid").write_text(str(os.getpid()))
    log = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from satlab.data import prepare

    polled = logs / "polled"
    prepare_data, find_prepared = prepare.prepare_data, prepare.find_prepared

    def counted_prepare(cfg, progress=True):
        print("TEST: this process prepares", flush=True)
        deadline = time.monotonic() + 15
        while not polled.exists() and time.monotonic() < deadline:  # until rank 1 waits for this one
            time.sleep(0.05)
        return prepare_data(cfg, progress)

    def polling_find(cfg):  # tells rank 0 once this rank found no data although rank 0's status was there
        found = find_prepared(cfg)
        if found is None and any(Path(cfg.cache_dir, "prepare").glob("*.json")):
            polled.touch()
        return found

    prepare.prepare_data, prepare.find_prepared = counted_prepare, polling_find
    from satlab.cli.main import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
'''

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64",
    "data.source=kjv", "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4",
    "train.global_batch_tokens=512", "train.max_tokens=1024", "train.val_every_tokens=100000",
    "train.val_tokens=512", "train.log_every_n_steps=1", "train.accelerator=cpu", "optim.warmup_fraction=0",
    "data.num_proc=1", "tracking.enabled=false",
]


@pytest.mark.slow  # make test-full (~25 s); the rank decisions above are the fast part
@pytest.mark.process
def test_two_rank_torchrun_job_prepares_once(tmp_path):
    """torchrun starts both ranks at once; rank 0 prepares (holding on until rank 1 has looked for the data in
    vain while rank 0's status was there, so that rank 1 surely waits), rank 1 waits, and both train on the one token
    folder."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    logs = tmp_path / "logs"
    logs.mkdir()
    cache = tmp_path / "cache"
    args = ["train", "--no-progress", *TINY, "name=handoff", f"data.cache_dir={cache}",
            f"train.out_dir={tmp_path / 'runs'}", "train.devices=2", "train.strategy=ddp"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node=2", str(script), str(logs), *args],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # torchrun's session, then each worker's: torchrun starts every worker in a session of its own
        for pid in [proc.pid] + [int(p.read_text()) for p in logs.glob("rank*.pid")]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the 2-rank job did not finish in 120 s:\n{out[-3000:]}")
    wall = time.monotonic() - started
    ranks = [(logs / f"rank{r}.log").read_text() for r in (0, 1)]
    assert proc.returncode == 0, out[-2000:] + "\n".join(log[-3000:] for log in ranks)
    print(f"2-rank torchrun job: {wall:.1f} s")

    assert [log.count("TEST: this process prepares") for log in ranks] == [1, 0]
    assert [log.count("waiting for rank 0 (host") for log in ranks] == [0, 1]
    folders = [p for p in (cache / "tokens").iterdir() if not p.name.startswith(".")]
    assert len(folders) == 1, folders
    assert f"rank 0: the data is ready in {folders[0]}" in ranks[0]
    assert f"rank 1: the data is ready in {folders[0]}" in ranks[1]
    assert (tmp_path / "runs" / "handoff" / "checkpoints" / "last.ckpt").exists()
    final = handoff.read_status(next((cache / handoff.STATUS_DIR).glob("*.json")))
    assert final["state"] == "done" and final["job"].startswith("torchrun:")
