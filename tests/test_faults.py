"""Tracking stores that fail: one that cannot be used is refused within seconds, before anything is written (exit 2);
one that goes away during a run costs no training and no record (the run keeps what it could not send in its folder
and sends it when the store is back)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch

from satlab.cli.main import main
from satlab.config.loader import load_experiment
from satlab.evaluation.callback import EvaluationCallback
from satlab.training import tracking_buffer
from satlab.training.run import train

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
         "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_tokens=256",
         "train.max_tokens=51200", "train.val_every_tokens=12800", "train.val_tokens=256", "train.log_every_n_steps=5",
         "eval.at_end=false", "eval.every_tokens=25600", "eval.tasks=[]", "train.accelerator=cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unused_port() -> int:
    """A port nothing listens on (bound, then released: the connection is refused)."""
    return free_port()


UNUSABLE = [
    ("PostgreSQL server down", lambda tmp: f"postgresql://nobody@127.0.0.1:{unused_port()}/x", ["postgresql://nobody"]),
    ("PostgreSQL password hidden", lambda tmp: f"postgresql://me:secret@127.0.0.1:{unused_port()}/x", ["me:***@"]),
    ("MySQL without its driver", lambda tmp: "mysql://me@127.0.0.1:1/x", ["mysql://me@127.0.0.1:1/x"]),
    ("https server down", lambda tmp: f"https://127.0.0.1:{unused_port()}", ["https://127.0.0.1"]),
    ("unknown scheme", lambda tmp: "ftp://example.org/mlruns", ["'ftp://'", "sqlite:///", "postgresql://"]),
    ("sqlite in folders that do not exist", lambda tmp: f"sqlite:///{tmp}/no/such/dir/mlflow.db",
     ["no/such/dir", "mkdir -p"]),
    ("sqlite file that is not a database", lambda tmp: f"sqlite:///{Path(__file__).resolve()}",
     ["not a usable sqlite database"]),
    ("sqlite path that is a folder", lambda tmp: f"sqlite:///{tmp}", ["is a folder"]),
]


@pytest.mark.parametrize("case", UNUSABLE, ids=[c[0] for c in UNUSABLE])
def test_an_unusable_tracking_store_is_refused_within_seconds_with_nothing_written(case, tmp_path, capsys):
    _, make_uri, fragments = case
    started = time.monotonic()
    code = main(["train", "data.source=kjv", "data.tokenizer.kind=byte", f"train.out_dir={tmp_path / 'runs'}",
                 f"data.cache_dir={tmp_path / 'cache'}", f"tracking.uri={make_uri(tmp_path)}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert time.monotonic() - started < 15, "the check must not wait for MLflow's retries"
    assert "cannot be used" in err and all(f in err for f in fragments), err
    assert "secret" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("command", ["sweep lr_tiny", "ablate arch_tiny"])
def test_a_study_checks_its_tracking_store_before_it_opens_its_storage(command, tmp_path, capsys):
    kind, spec = command.split()
    prefix = "overrides." if kind == "sweep" else ""
    started = time.monotonic()
    code = main([kind, spec, f"out_dir={tmp_path / 'studies'}", f"{prefix}data.cache_dir={tmp_path / 'cache'}",
                 f"{prefix}tracking.uri=postgresql://nobody@127.0.0.1:{unused_port()}/x"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be used" in err and time.monotonic() - started < 15, err
    assert not list(tmp_path.iterdir())  # no study folder, no Optuna database, no data cache


def test_an_artifact_folder_that_cannot_be_written_is_refused(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["train", "data.source=kjv", f"train.out_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'c'}",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
                 f"tracking.artifact_dir={blocker / 'artifacts'}"])
    err = capsys.readouterr().err
    assert code == 2 and "artifact_dir" in err and "not a writable folder" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()


class Server:
    """``mlflow server`` on a free port, in a process group of its own (uvicorn's workers go with it)."""

    def __init__(self, root: Path):
        self.port, self.root, self.proc = free_port(), root, None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                mlflow.MlflowClient(self.uri).search_experiments()
                return
            except Exception:
                assert self.proc.poll() is None, "mlflow server exited"
                time.sleep(0.5)
        raise TimeoutError("mlflow server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)


class Outage(L.Callback):
    """Stops the server after step ``down`` and starts it again after step ``up``, while the run trains."""

    def __init__(self, server: Server, down: int, up: int):
        self.server, self.down, self.up = server, down, up

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.down:
            self.server.stop()
        elif trainer.global_step == self.up:
            self.server.start()


def histories(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = mlflow.MlflowClient(uri)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics}


@pytest.mark.slow  # make test-full (~70 s)
@pytest.mark.process
def test_a_server_stopped_and_restarted_mid_run_loses_no_point(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tracking_buffer, "RETRY_SECONDS", 0.5)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    common = [*SMALL, f"data.cache_dir={tmp_path / 'cache'}", "train.max_tokens=25600", "train.val_every_tokens=6400",
              "eval.every_tokens=12800"]  # 100 steps, validated every 25, gates analysed at 50 (in the outage) and 100

    reference_cfg = load_experiment("default", [*common, "name=steady", f"train.out_dir={tmp_path / 'a'}",
                                                f"tracking.uri=sqlite:///{tmp_path / 'steady' / 'mlflow.db'}"])
    steady = train(reference_cfg, progress=False, callbacks=[EvaluationCallback(reference_cfg, progress=False)])

    server = Server(tmp_path / "server")
    server.start()
    try:
        cfg = load_experiment("default", [*common, "name=outage", f"train.out_dir={tmp_path / 'b'}",
                                          f"tracking.uri={server.uri}"])
        capsys.readouterr()
        result = train(cfg, progress=False, callbacks=[EvaluationCallback(cfg, progress=False),
                                                       Outage(server, down=20, up=70)])
        err = capsys.readouterr().err
        assert "does not answer" in err and "answers again" in err, err
        assert not (result.run_dir / tracking_buffer.SPOOL).exists()  # everything kept was sent

        expected = histories(steady.tracking_uri, steady.mlflow_run_id)
        got = histories(server.uri, result.mlflow_run_id)
        assert sorted(got) == sorted(expected)
        for key in expected:  # point for point: the same steps, and the same values but for timings
            assert [s for s, _ in got[key]] == [s for s, _ in expected[key]], key
            if not key.startswith("system/"):
                assert [v for _, v in got[key]] == pytest.approx([v for _, v in expected[key]], rel=1e-6), key
        assert any(20 < step < 70 for step, _ in got["train/loss"])  # points from inside the outage are there
        client = mlflow.MlflowClient(server.uri)
        assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
        during = {Path(a.path).name for a in client.list_artifacts(result.mlflow_run_id, "gates/step_50")}
        assert "gates.json" in during and any(n.endswith(".png") for n in during), during  # kept, then sent
    finally:
        server.stop()


# --- disks and leftovers ---------------------------------------------------------------------------------------

def checkpoint_args(tmp_path, name: str, *extra: str) -> list[str]:
    return ["train", "--no-progress", *SMALL, f"name={name}", "tracking.enabled=false", "train.keep_last_k=2",
            "train.ckpt_every_tokens=12800", f"data.cache_dir={tmp_path / 'cache'}", *extra]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size at ``tmp_path/disk`` (root can mount one: CI runs as root), resizable."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = []

    def mount(size: int) -> Path:
        options = f"{'remount,' if mounted else ''}size={size}"
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'}; needs root)")
        mounted.append(size)
        return folder

    yield mount
    if mounted:  # lazily: a failed test's traceback may still hold a memory-mapped checkpoint there
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


WIDER = ["model.d_model=128", "model.mlp_hidden=512"]  # checkpoints of ~5 MB, so the margin is small beside them


def disk_size_for(checkpoints: float, overrides: Sequence[str] = (*SMALL, *WIDER)) -> int:
    """A disk that holds ``checkpoints`` of the model of ``overrides`` (default: the WIDER one), with the vocabulary
    its data give it: its weights and two Adam moments, plus the margin."""
    from satlab.config.loader import load_experiment as load
    from satlab.data.vocabulary import model_vocabulary
    from satlab.models import build_model, count_params
    from satlab.training.resilience import checkpoint_bytes

    cfg = load("default", list(overrides))
    cfg = model_vocabulary(cfg).sized(cfg)
    params = count_params(build_model(cfg.model, device="meta"))
    return int(checkpoints * checkpoint_bytes({"three copies": [torch.empty(params, device="meta")] * 3}))


@pytest.mark.parametrize("precheck", [pytest.param(True, marks=pytest.mark.slow), False],  # one in the fast suite
                         ids=["checked before the write", "write fails midway"])
@pytest.mark.process
def test_a_full_disk_stops_the_run_with_its_own_message_and_code_and_keeps_the_last_checkpoint(
        precheck, tmp_path, small_disk, monkeypatch, capsys):
    from satlab.config.errors import EXIT_NO_SPACE
    from satlab.training import resilience

    if not precheck:  # as if something else filled the disk between the check and the write
        monkeypatch.setattr(resilience, "ensure_space", lambda folder, needed: None)
    writes = []
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (writes.append(Path(f).name), save(obj, f, *a, **k)))
    disk = small_disk(disk_size_for(1.6))  # the first step checkpoint fits, its last.ckpt copy does not
    args = checkpoint_args(tmp_path, "full", f"train.out_dir={disk}", *WIDER)
    code = main(args)
    err = capsys.readouterr().err
    assert code == EXIT_NO_SPACE, err[-3000:]
    assert f"no space left on {disk / 'full' / 'checkpoints'}" in err and "needs ~" in err, err[-3000:]
    assert "Traceback" not in err and "unexpected pos" not in err
    folder = disk / "full" / "checkpoints"
    kept = sorted(folder.glob("*.ckpt"))
    assert kept and all(resilience.readable(p)[1] is None for p in kept), kept  # the ones before are intact
    assert not list(folder.glob(".*"))  # and no partial write is left
    assert len([w for w in writes if ".ckpt" in w]) == len(kept) + (0 if precheck else 1)  # checked: not even begun

    small_disk(disk_size_for(6))  # space freed: the same command continues from the kept checkpoint
    assert main(args) == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["last.ckpt", "step0000150.ckpt", "step0000200.ckpt"]


def test_leftovers_of_killed_writes_are_removed_when_the_run_starts_again(tmp_path, capsys):
    args = checkpoint_args(tmp_path, "leftovers", f"train.out_dir={tmp_path / 'runs'}", "train.max_tokens=25600")
    assert main(args) == 0
    folder = tmp_path / "runs" / "leftovers" / "checkpoints"
    planted = [folder / ".last.ckpt.tmp-999999", folder / ".step0000100.ckpt.removed-999999"]
    for path in planted:
        path.write_bytes(os.urandom(1 << 20))  # a write cut off by a kill: gigabytes at the paper's sizes
    assert main([*args[:-1], "train.max_tokens=38400"]) == 0
    assert not any(p.exists() for p in planted)
    assert "removed what interrupted checkpoint writes left" in capsys.readouterr().err


@pytest.mark.parametrize("leftover", ["planted", "resumed from a step checkpoint"])
def test_keep_last_k_holds_across_a_resume(leftover, tmp_path, capsys):
    args = checkpoint_args(tmp_path, "keep", f"train.out_dir={tmp_path / 'runs'}", "train.max_tokens=25600")
    assert main(args) == 0
    folder = tmp_path / "runs" / "keep" / "checkpoints"
    assert sorted(p.name for p in folder.glob("step*.ckpt")) == ["step0000050.ckpt", "step0000100.ckpt"]
    if leftover == "planted":  # a kill between Lightning's write of a step checkpoint and its delete of the oldest
        (folder / "step0000030.ckpt").write_bytes((folder / "step0000050.ckpt").read_bytes())
    else:  # a kill while last.ckpt was rewritten: the run resumes from its newest step checkpoint, which Lightning
        (folder / "last.ckpt").unlink()  # would never delete
    assert main([*args[:-1], "train.max_tokens=51200"]) == 0
    assert sorted(p.name for p in folder.glob("step*.ckpt")) == ["step0000150.ckpt", "step0000200.ckpt"]
    if leftover == "planted":
        assert "keep_last_k=2: removed older step checkpoints step0000030.ckpt" in capsys.readouterr().err
