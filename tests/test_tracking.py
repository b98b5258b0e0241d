"""What a user sees in MLflow: runs of one preset family side by side in one experiment, each tagged with its
architecture and described, RUNNING while it trains (seen from another process) and FINISHED after."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import mlflow
import pytest

from satlab.config.loader import load_experiment
from satlab.config.resolve import experiment_family

SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
         "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_tokens=256",
         "train.max_tokens=51200", "train.val_every_tokens=12800", "train.val_tokens=256", "train.log_every_n_steps=5",
         "eval.at_end=false"]


def test_experiment_family_of_a_preset():
    assert experiment_family("tiny/satformer") == "tiny"
    assert experiment_family("paper/small/transformer") == "paper-small"
    assert experiment_family("default") == "default" and experiment_family("recall/mqar") == "recall"
    assert experiment_family("custom") is None and experiment_family("/somewhere/else.yaml") is None


@pytest.mark.slow  # make test-full (~35 s)
@pytest.mark.process
def test_two_tiny_runs_share_one_experiment_with_arch_tags_and_are_running_while_they_train(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    (tmp_path / "mlruns").mkdir()
    client = mlflow.MlflowClient(uri)
    client.search_experiments()  # the store exists before two processes open it (they would race to create it)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {arch: subprocess.Popen(
        [sys.executable, "-m", "satlab.cli.main", "train", f"experiment=tiny/{arch}", "--no-progress", *SMALL,
         f"tracking.uri={uri}", f"train.out_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in ("transformer", "satformer")}
    running: set[str] = set()
    deadline = time.time() + 240
    while len(running) < 2 and time.time() < deadline and all(p.poll() is None for p in procs.values()):
        for run in client.search_runs([e.experiment_id for e in client.search_experiments()]):
            if run.info.status == "RUNNING" and "train/loss" in run.data.metrics:
                running.add(run.data.tags["arch"])
        time.sleep(0.1)
    for proc in procs.values():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "litlogger" not in out + err and "GPU available" not in out + err, err[-3000:]
        assert "satlab run 'tiny-" in out  # the summary table
    assert running == {"transformer", "satformer"}, "each run was RUNNING, with metrics, while it trained"
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 2 and len({r.info.experiment_id for r in runs}) == 1
    experiment = client.get_experiment(runs[0].info.experiment_id)
    assert experiment.name == "tiny" and experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    for run in runs:
        arch = run.data.tags["arch"]
        assert run.info.status == "FINISHED" and run.info.end_time
        assert run.data.tags["mlflow.note.content"] == load_experiment(f"tiny/{arch}").description
    log = (tmp_path / "runs" / "tiny-satformer" / "train.log").read_text()
    assert "GPU available" in log  # Lightning's notices went to the run's log file


_X86 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R)   Processor
cache size\t: 266240 KB

processor\t: 1
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
"""
_ARM = """processor\t: 0
BogoMIPS\t: 50.00
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


def test_a_run_is_tagged_with_the_cpus_name_and_model_number_wherever_proc_cpuinfo_says_them(tmp_path, monkeypatch):
    import platform

    import torch

    from satlab.training import machine
    from satlab.training.tracking import provenance_tags

    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(machine, "_CPUINFO", cpuinfo)
    cpuinfo.write_text(_X86)
    assert machine.cpu_model() == "Intel(R) Xeon(R) Processor (family 6, model 207)"  # the first core's, tabs gone
    if not torch.cuda.is_available():  # the tag on every run: the CPU, not platform.processor()'s empty string
        assert provenance_tags("satformer", "default")["device"] == "Intel(R) Xeon(R) Processor (family 6, model 207)"
    cpuinfo.write_text(_ARM)  # no model name nor family: the machine's architecture, no empty brackets
    assert machine.cpu_model() == (platform.processor() or platform.machine())
    cpuinfo.unlink()
    assert machine.cpu_model() == (platform.processor() or platform.machine())


@pytest.mark.process
def test_a_store_left_mid_transaction_by_a_killed_process_is_usable_by_the_next_run(tmp_path):
    """A run SIGKILLed while MLflow writes to its sqlite store leaves a hot journal; the next process's store check
    must roll it back (as any writer does) rather than refuse the store as read-only."""
    from satlab.training.tracking import sqlite_problem

    db = tmp_path / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()
    writer = ("import os, signal, sqlite3, sys\n"
              "connection = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "connection.execute('PRAGMA cache_size=2')  # so the transaction spills pages: the journal is hot\n"
              "connection.execute('BEGIN IMMEDIATE')\n"
              "for k in range(2000):\n"
              "    connection.execute('INSERT INTO experiment_tags VALUES (?, ?, ?)', (f'k{k}', 'v' * 500, '0'))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", writer, str(db)]).returncode == -9
    assert (tmp_path / "mlflow.db-journal").exists()  # hot: its writer died inside the transaction
    assert sqlite_problem(db) is None
    assert not (tmp_path / "mlflow.db-journal").exists()
    assert "k0" not in mlflow.MlflowClient(f"sqlite:///{db}").get_experiment("0").tags
