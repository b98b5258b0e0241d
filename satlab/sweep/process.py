"""The command of a trial process: ``python -m satlab.sweep.trial``, under ``torchrun`` for a multi-GPU trial. Its
environment, its timeout and what its exit says are :mod:`satlab.training.launch`'s."""

from __future__ import annotations

import sys


def trial_command(trial_args: list[str], devices: int, accelerator: str) -> list[str]:
    """``python -m satlab.sweep.trial ...``, under ``torchrun`` when the trial trains on several GPUs."""
    module = ["-m", "satlab.sweep.trial", *trial_args]
    if devices > 1 and accelerator != "cpu":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", *module]
    return [sys.executable, *module]
