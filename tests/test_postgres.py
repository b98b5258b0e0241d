"""Studies and MLflow on a real PostgreSQL server, as a team runs them across hosts: a throwaway server (initdb +
pg_ctl on a free port in a temp folder, as the postgres user when the tests run as root), then (a) a micro ablation
run by two driver processes from two working directories, as two hosts would, one of them SIGKILLed mid-cell,
every run logging to an MLflow server whose backend store is that PostgreSQL, and (b) a sweep shared by two
drivers. Every process is started on a free port and stopped by PID."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import mlflow
import optuna
import pytest
import yaml

from satlab.config.errors import ConfigError
from satlab.studies.attrs import CELL, LOG, PID, REASON, RETRY_OF, WORKER
from satlab.studies.engine import run_study
from satlab.studies.loader import load_ablation
from satlab.studies.plans import GridPlan
from satlab.studies.runs import CELL_TAG, PARENT_TAG
from satlab.studies.storage import open_storage

pytestmark = pytest.mark.process

MICRO = {
    "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.mlp_hidden": 64,
    "data.source": "kjv", "data.tokenizer.kind": "byte", "data.seq_len": 64,
    "train.micro_batch_size": 4, "train.global_batch_tokens": 256, "train.max_tokens": 2048,
    "train.val_every_tokens": 1024, "train.val_tokens": 256, "train.accelerator": "cpu", "eval.at_end": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))[-1:]), None)


@pytest.fixture(scope="module")
def postgres():
    """``postgresql://satlab@127.0.0.1:<port>/<db>`` for any db name (created on first use), on a fresh server."""
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian: apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="satlab-pg-"))  # not under pytest's folder: the postgres user cannot enter it
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run([*as_user, initdb, "-D", str(root / "data"), "-U", "satlab", "--auth=trust"], check=True,
                   capture_output=True)
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200"
    subprocess.run([*as_user, pg_ctl, "-D", str(root / "data"), "-o", options, "-l", str(root / "log"), "-w",
                    "start"], check=True, capture_output=True)
    pid = int((root / "data" / "postmaster.pid").read_text().split()[0])
    import psycopg

    made: set[str] = set()

    def url(db: str) -> str:
        if db not in made:
            with psycopg.connect(host="127.0.0.1", port=port, user="satlab", dbname="postgres",
                                 autocommit=True) as connection:
                connection.execute(f"CREATE DATABASE {db}")
            made.add(db)
        return f"postgresql://satlab@127.0.0.1:{port}/{db}"

    yield url
    os.kill(pid, signal.SIGQUIT)  # immediate shutdown of the postmaster and its backends
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    shutil.rmtree(root, ignore_errors=True)


def write_spec(folder: Path, name: str, tracking: str) -> Path:
    """A grid of two cells, one per host; run folders, data caches and reports relative to each driver's working
    directory (a host's disk), the MLflow store shared. One thread per cell so every host computes the same numbers."""
    spec = {"name": name, "base": "default", "axes": {"model.arch": ["transformer", "satformer"], "train.seed": [0]},
            "overrides": {**MICRO, "tracking.uri": tracking}, "trial": {"heartbeat_seconds": 1, "grace_seconds": 4,
                                                                         "threads": 1}}
    path = folder / f"{name}.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def make_store(folder: Path) -> str:
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    mlflow.MlflowClient(uri).search_experiments()  # created once, before the drivers race to create it
    return uri


@contextlib.contextmanager
def mlflow_server(backend: str, artifacts: Path) -> Iterator[str]:
    """``http://127.0.0.1:<port>``: an MLflow server whose backend store is ``backend`` (PostgreSQL here), as a team
    shares one across hosts; stopped by its process group."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
                               "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                mlflow.MlflowClient(uri).search_experiments()
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(1)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "satlab.cli.main", *command], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-6000:]
    return out


def hosts(root: Path, count: int = 2) -> list[Path]:
    folders = [root / f"host{i}" for i in range(count)]
    for folder in folders:
        folder.mkdir()
    return folders


def cell_losses(uri: str, spec_path: Path, only_runs: bool = True) -> dict[str, float]:
    """Cell key -> final val/loss, checking there is one FINISHED run per cell (and, with ``only_runs``, no other
    run: no cell was started twice), all under one parent run."""
    spec = load_ablation(spec_path)
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`{CELL_TAG}` != ''")
    assert len({r.data.tags[PARENT_TAG] for r in runs}) == 1  # one parent run across the hosts
    assert all(r.info.status == "FINISHED" for r in runs) or not only_runs
    runs = [r for r in runs if r.info.status == "FINISHED"]
    keys = [r.data.tags[CELL_TAG] for r in runs]
    assert sorted(keys) == sorted(c.key for c in spec.cells()), keys
    return {r.data.tags[CELL_TAG]: r.data.metrics["val/loss"] for r in runs}


def study_of(url: str, spec_path: Path) -> optuna.Study:
    study_name = GridPlan(load_ablation(spec_path)).study_name()
    return optuna.load_study(study_name=study_name, storage=open_storage(url, create_tables=False))


def launched_trials(url: str, spec_path: Path) -> dict[str, list[optuna.trial.FrozenTrial]]:
    plan = GridPlan(load_ablation(spec_path))
    trials = plan.trials_by_cell(study_of(url, spec_path)).items()
    return {key: [t for t in cell_trials if t.user_attrs.get(LOG)] for key, cell_trials in trials}


@pytest.mark.slow  # ~160 s; the fast suite shares a sweep between two drivers here, and retries a lost trial
def test_two_hosts_share_an_ablation_grid_one_killed_mid_cell_and_match_one_host(postgres, tmp_path, capsys,
                                                                                 monkeypatch):
    """Two drivers from two working directories share a grid on PostgreSQL; the first is SIGKILLed while it trains
    a cell. The other finishes its own cell, then the dead host's (once its heartbeat is stale): every cell ends
    with one FINISHED run, each trial launched once but the lost one (retried once), and the losses are those of
    one host running the grid alone. Every run logs to an MLflow server whose backend store is the same PostgreSQL
    server."""
    with mlflow_server(postgres("mlflow"), tmp_path / "artifacts") as store:
        two_hosts, one_host, cells = run_two_hosts_then_one(postgres("grid"), store, tmp_path, monkeypatch)
    with capsys.disabled():
        print(f"\nmicro ablation, {cells} cells: two drivers on PostgreSQL, one killed, {two_hosts:.0f} s; "
              f"one driver {one_host:.0f} s")


def run_two_hosts_then_one(url: str, store: str, tmp_path: Path, monkeypatch) -> tuple[float, float, int]:
    shared = write_spec(tmp_path, "shared", store)
    started = time.monotonic()
    drivers = [start(["ablate", str(shared), "--storage", url, "--no-report"], cwd) for cwd in hosts(tmp_path)]
    victim, survivor = drivers
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # a cell of the first driver training
        try:
            trials = [t for ts in launched_trials(url, shared).values() for t in ts]
        except (ConfigError, KeyError):  # the drivers have not made the tables or the study yet
            trials = []
        if any(t.state.name == "RUNNING" and t.user_attrs.get(PID)
               and t.user_attrs.get(WORKER, "").endswith(f":{victim.pid}") for t in trials):
            break
        time.sleep(0.3)
    else:
        pytest.fail("no cell of the first driver started")
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    finish(survivor)
    two_hosts = time.monotonic() - started
    by_cell = launched_trials(url, shared)
    trials = [t for ts in by_cell.values() for t in ts]
    lost = [t for t in trials if t.state.name == "FAIL"]
    assert [t.user_attrs.get(REASON) for t in lost] == ["worker_lost"]
    retry = [t for t in trials if t.user_attrs.get(RETRY_OF) == lost[0].number]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE" and retry[0].params == lost[0].params
    assert len({t.user_attrs[WORKER] for t in trials}) == 2  # both hosts ran cells
    others = [ts for ts in by_cell.values() if lost[0].number not in {t.number for t in ts}]
    assert others and all(len(ts) == 1 and ts[0].state.name == "COMPLETE" for ts in others)  # launched once
    lost_cell = next(key for key, ts in by_cell.items() if lost[0].number in {t.number for t in ts})
    queued = Counter(t.user_attrs.get(CELL) for t in study_of(url, shared).trials)
    assert queued == {key: 2 if key == lost_cell else 1 for key in by_cell}  # set up at once, yet queued once

    alone = write_spec(tmp_path, "alone", store)
    monkeypatch.chdir(tmp_path)  # the third host's disk
    started = time.monotonic()
    assert not run_study(load_ablation(alone), workers=1, report=False).failed
    one_host = time.monotonic() - started
    reference = cell_losses(store, alone)
    assert cell_losses(store, shared, only_runs=False) == pytest.approx(reference, rel=1e-6)
    client = mlflow.MlflowClient(store)  # a run through the server: its history and its artifacts
    run = client.search_runs([client.get_experiment_by_name(load_ablation(alone).experiment_name).experiment_id],
                             f"tags.`{CELL_TAG}` != ''", max_results=1)[0]
    assert len(client.get_metric_history(run.info.run_id, "val/loss")) > 1
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    return two_hosts, one_host, len(reference)


def test_two_drivers_share_a_sweep(postgres, tmp_path):
    store = make_store(tmp_path)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "pg-sweep", "base": "default",
        "overrides": {**MICRO, "model.arch": "transformer", "tracking.uri": store},
        "space": {"optim.lr": {"low": 1e-3, "high": 1e-2, "log": True}}, "n_trials": 1, "pruner": {"name": "none"},
        "trial": {"threads": 1}}))
    url = postgres("sweep")
    for driver in [start(["sweep", str(path), "--storage", url], cwd) for cwd in hosts(tmp_path)]:
        finish(driver)
    study = optuna.load_study(study_name="pg-sweep", storage=open_storage(url, create_tables=False))
    assert [t.number for t in study.trials] == [0, 1]  # n_trials from each driver, numbered in one sequence
    assert {t.state.name for t in study.trials} == {"COMPLETE"}
    assert len({t.user_attrs[WORKER] for t in study.trials}) == 2
    parent = study.user_attrs["mlflow_parent_run_id"]
    runs = mlflow.MlflowClient(store).search_runs(
        [mlflow.MlflowClient(store).get_run(parent).info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'")
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in runs) == [0, 1]
