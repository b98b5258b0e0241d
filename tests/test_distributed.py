"""Multi-process training on the CPU (gloo), each run in its own subprocess with a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import mlflow
import pytest

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64",
    "data.source=kjv", "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4",
    "train.global_batch_tokens=512", "train.max_tokens=1024", "train.val_every_tokens=100000",
    "train.val_tokens=512", "train.log_every_n_steps=1", "train.accelerator=cpu", "optim.warmup_fraction=0",
]

ALARMS = ("sync_dist", "returned a view tensor")
"""Lightning's advice to log with ``sync_dist`` (satlab's epoch-level values are already global) and FSDP2's warning
that a sharded block returned a view (none does: tests/test_models.py checks every variant)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_losses(tmp_path, name: str, *extra: str) -> list[float]:
    db = tmp_path / "mlruns" / "mlflow.db"
    args = [*TINY, f"name={name}", f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'runs'}",
            f"tracking.uri=sqlite:///{db}", *extra]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "satlab.cli.main", "train", "--no-progress", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for advice in ALARMS:  # library advice that does not apply to satlab's runs, on every multi-process run
        assert advice not in proc.stderr, proc.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("default").experiment_id],  # the preset's experiment
                              f"tags.`mlflow.runName` = '{name}'")
    assert len(runs) == 1, "exactly one MLflow run per training run, whatever the number of processes"
    history = sorted(client.get_metric_history(runs[0].info.run_id, "train/loss"), key=lambda m: m.step)
    return [m.value for m in history]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def single_process_losses(workdir):
    return train_losses(workdir, "single", "train.devices=1")


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("model_parallel", marks=pytest.mark.slow)])
@pytest.mark.process
def test_two_cpu_processes_match_one_process_with_the_same_global_batch(workdir, single_process_losses, strategy):
    """DDP, and FSDP2 sharding through the model-parallel strategy, both on gloo."""
    losses = train_losses(workdir, strategy, "train.devices=2", f"train.strategy={strategy}")
    assert len(single_process_losses) == len(losses) == 2
    assert losses == pytest.approx(single_process_losses, abs=1e-5)


def test_fsdp_strategy_wraps_blocks_and_checkpoints_sharded():
    """Lightning's FSDPStrategy refuses a CPU, so its configuration is checked here and the GPU check runs it."""
    from satlab.config.loader import load_experiment
    from satlab.models.layers import Block
    from satlab.training.parallel import make_strategy

    cfg = load_experiment("default", ["train.strategy=fsdp", "train.activation_checkpointing=true"])
    strategy = make_strategy(cfg)
    assert strategy._state_dict_type == "sharded"
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._activation_checkpointing_kwargs
