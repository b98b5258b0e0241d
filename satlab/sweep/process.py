"""How a trial process is started and stopped: the command (``torchrun`` for a multi-GPU trial), its environment
(CPU threads and GPUs of its worker slot), and what its exit says when it left no reason of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from satlab.config.schema import TrainConfig


def trial_command(trial_args: list[str], devices: int, accelerator: str) -> list[str]:
    """``python -m satlab.sweep.trial ...``, under ``torchrun`` when the trial trains on several GPUs."""
    module = ["-m", "satlab.sweep.trial", *trial_args]
    if devices > 1 and accelerator != "cpu":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", *module]
    return [sys.executable, *module]


def trial_env(slot: int, workers: int, threads: int, train: TrainConfig,
              environ: dict[str, str] | None = None) -> dict[str, str]:
    """The trial's environment: ``threads`` CPU threads, and with several workers on a GPU host its own
    ``train.devices`` GPUs (worker slot k gets the k-th group of the visible devices)."""
    env = dict(os.environ if environ is None else environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if workers > 1 and train.accelerator != "cpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(workers * train.devices)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[slot * train.devices:(slot + 1) * train.devices])
    return env


def describe_exit(returncode: int, log_file: Path) -> str:
    """Why a trial process that left no reason ended: the signal that killed it, or its exit code and last line."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()] \
        if log_file.exists() else []
    return f"crashed (exit code {returncode})" + (f": {lines[-1].strip()[:300]}" if lines else "")


def stop_process(proc: subprocess.Popen, grace: float = 30.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
