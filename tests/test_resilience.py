"""Nothing a user ran is lost: a run killed with SIGKILL resumes to exactly the losses of an uninterrupted one,
SIGTERM writes a checkpoint first, a corrupt checkpoint is skipped, and a diverging run stops itself cleanly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch

from satlab.config.errors import EXIT_REQUEUE, ConfigError
from satlab.config.loader import load_experiment
from satlab.training.resilience import RunLock
from satlab.training.run import TrainingStopped, train

STEPS = 80
BASE = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=128",
    "data.source=kjv", "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=16",
    "train.global_batch_tokens=1024", f"train.max_tokens={STEPS * 1024}", "train.val_every_tokens=10240",
    "train.val_tokens=1024", "train.ckpt_every_tokens=10240", "train.log_every_n_steps=1",
    "train.deterministic=true", "train.accelerator=cpu", "train.keep_last_k=3",
]


def args_for(tmp_path, name: str, *extra: str) -> list[str]:
    return [*BASE, f"name={name}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'runs'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}", *extra]


def run_named(client: mlflow.MlflowClient, name: str):
    """The MLflow run of the training run ``name`` (runs of the default preset share the experiment 'default')."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.`mlflow.runName` = '{name}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def start(tmp_path, name: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "satlab.cli.main", "train", "--no-progress",
                             *args_for(tmp_path, name, *extra)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def losses_by_step(tmp_path, name: str) -> tuple[dict[int, float], str]:
    """The last logged train/loss of every step (a resumed run logs the steps after its checkpoint again)."""
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = run_named(client, name)
    latest: dict[int, tuple[int, float]] = defaultdict(lambda: (-1, 0.0))
    for m in client.get_metric_history(run.info.run_id, "train/loss"):
        if m.timestamp >= latest[m.step][0]:
            latest[m.step] = (m.timestamp, m.value)
    return {step: value for step, (_, value) in latest.items()}, run.info.status


def metric_histories(tmp_path, name: str) -> tuple[dict[str, list[tuple[int, float]]], str]:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = run_named(client, name)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}, run.info.status


def stop_in_a_checkpoint_write(proc: subprocess.Popen, checkpoints, deadline: float) -> None:
    """Freeze ``proc`` (SIGSTOP) at a moment its checkpoint write is under way: the write's hidden ``.tmp-`` file
    still exists once the process is seen stopped, so a kill sent now lands in the middle of that write. A write
    that finished before the stop is let go (SIGCONT) and the next one is tried."""
    while True:
        assert proc.poll() is None and time.time() < deadline, "no checkpoint write was caught under way"
        if list(checkpoints.glob(".*.tmp-*")):
            proc.send_signal(signal.SIGSTOP)
            while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.0005)
            if list(checkpoints.glob(".*.tmp-*")):
                return
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.0005)


@pytest.mark.process
def test_a_run_stopped_three_ways_resumes_to_the_mlflow_history_of_an_uninterrupted_run(tmp_path):
    """One run, stopped three times in three ways once training is under way, then finished by the same command.

    1. SIGTERM, as a scheduler pre-empts: a checkpoint, exit code ``EXIT_REQUEUE``, the MLflow run KILLED. Meanwhile
       a second process of the same name is refused by the run's lock (exit 2, naming the holder's PID); after the
       holder is gone the lock is free, as every later attempt shows.
    2. SIGKILL in the middle of a checkpoint write: the half-written file stays behind, and the resume ignores it.
    3. SIGKILL at a random moment.

    After the resumes each metric has exactly the points of a run that was never stopped (timings aside, which
    differ by nature): every step's train/loss among them, so a resumed run trains each step after its checkpoint
    again, to the same loss."""
    often = ["train.ckpt_every_tokens=2048", "train.val_every_tokens=2048", "train.keep_last_k=2"]
    (tmp_path / "mlruns").mkdir()
    mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").search_experiments()  # made before two
    calm_run = start(tmp_path, "calm", *often)  # processes use it; the uninterrupted reference, trained meanwhile
    checkpoints = tmp_path / "runs" / "stopped" / "checkpoints"
    for attempt in ("sigterm", "kill in a write", "kill"):
        proc = start(tmp_path, "stopped", *often)
        deadline = time.time() + 240
        before = {p.name for p in checkpoints.glob("step*.ckpt")} if checkpoints.exists() else set()
        while True:  # wait for training to be under way in this attempt: a new checkpoint
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "no checkpoint appeared"
            if checkpoints.exists() and {p.name for p in checkpoints.glob("step*.ckpt")} - before:
                break
            time.sleep(0.01)
        if attempt == "sigterm":
            proc.send_signal(signal.SIGSTOP)  # paused, holding the lock, so that it does not finish meanwhile
            second = start(tmp_path, "stopped", *often)
            _, err = second.communicate(timeout=120)
            assert second.returncode == 2 and f"PID {proc.pid}" in err and "another name" in err, err
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
            _, err = proc.communicate(timeout=120)
            assert "SIGTERM received; checkpoint written" in err
            assert proc.returncode == EXIT_REQUEUE, err[-3000:]  # "checkpointed, requeue me" for a job script
            assert metric_histories(tmp_path, "stopped")[1] == "KILLED"
            continue
        if attempt == "kill in a write":  # the half-written file stays behind
            stop_in_a_checkpoint_write(proc, checkpoints, deadline)
        else:
            time.sleep(random.Random(0).uniform(0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if attempt == "kill in a write":
            assert list(checkpoints.glob(".*.tmp-*")), "the kill did not land in a checkpoint write"
    finish(start(tmp_path, "stopped", *often))
    finish(calm_run)
    assert not list(checkpoints.glob(".*.tmp-*")), "a resumed run leaves killed writes behind"
    calm, _ = metric_histories(tmp_path, "calm")
    resumed, status = metric_histories(tmp_path, "stopped")
    assert status == "FINISHED" and set(resumed) == set(calm)
    assert len(calm["train/loss"]) == STEPS and len(calm["val/loss"]) > 2
    differ = {}
    for key in calm:
        same = [s for s, _ in resumed[key]] == [s for s, _ in calm[key]] if key.startswith("system/") else \
            resumed[key] == calm[key]
        if not same:
            differ[key] = (sorted(set(resumed[key]) ^ set(calm[key]))[:6], len(resumed[key]), len(calm[key]))
    assert not differ, differ


def test_a_corrupt_last_checkpoint_is_kept_aside_and_the_previous_one_is_used(tmp_path):
    cfg = load_experiment("default", args_for(tmp_path, "corrupt", "train.max_tokens=30720"))
    first = train(cfg, progress=False)
    last = first.run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    resumed = train(load_experiment("default", args_for(tmp_path, "corrupt", "train.max_tokens=40960")),
                    progress=False)
    assert (first.run_dir / "checkpoints" / "last.ckpt.corrupt").exists()
    assert resumed.mlflow_run_id == first.mlflow_run_id and resumed.tokens == 40960


def test_a_run_refused_by_the_lock_leaves_the_holders_checkpoints_untouched(tmp_path):
    """The resume choice renames unreadable checkpoints; it must wait for the lock, or a second run reads a
    checkpoint the holder is deleting in its rotation and renames (or fails to rename) it."""
    cfg = load_experiment("default", args_for(tmp_path, "held"))
    checkpoints = Path(cfg.train.out_dir) / "held" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step0000010.ckpt").write_bytes(b"half written by nobody: unreadable")
    with RunLock(checkpoints.parent, "held"), pytest.raises(ConfigError, match=f"PID {os.getpid()}"):
        train(cfg, progress=False)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step0000010.ckpt"]


def test_a_run_that_fails_its_checks_leaves_no_folder_behind(tmp_path):
    cfg = load_experiment("default", args_for(tmp_path, "unreachable", "tracking.uri=http://127.0.0.1:9",
                                              "tracking.fallback_local=false"))
    with pytest.raises(ConfigError):
        train(cfg, progress=False)
    assert not (tmp_path / "runs").exists()


class Diverge(L.Callback):
    """Makes the weights infinite before step ``step``, as a blown-up run would (no learning rate a user could mean
    gets there in a few steps of this model: RMSNorm keeps the activations finite)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.embed.weight.fill_(float("inf"))


@pytest.mark.filterwarnings("ignore:Encountered `nan` values:UserWarning")  # the divergence this test makes
def test_a_diverging_run_skips_non_finite_steps_then_stops_with_a_checkpoint(tmp_path):
    cfg = load_experiment("default", args_for(tmp_path, "diverge", "train.max_skipped_steps=2"))
    with pytest.raises(TrainingStopped, match="max_skipped_steps=2"):
        train(cfg, progress=False, callbacks=[Diverge(3)])
    assert (tmp_path / "runs" / "diverge" / "checkpoints" / "last.ckpt").exists()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = run_named(client, "diverge")
    assert run.info.status == "FAILED" and run.data.metrics["train/skipped_steps"] == 3
    assert "diverged" in run.data.tags["end_reason"] and run.data.tags["end_reason"].startswith("FAILED at step")
