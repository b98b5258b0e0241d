"""What keeps a run alive across crashes and pre-emption: atomic checkpoint writes, a resume that skips a corrupt
checkpoint, and a checkpoint on SIGTERM."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from satlab.training.checkpoint import KEY


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same folder and renames it into place, so a kill during
    the write leaves the previous checkpoint intact; loads with ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = True) -> dict:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


def _step_of(path: Path) -> int:
    match = re.search(r"step(\d+)", path.name)
    return int(match.group(1)) if match else -1


def readable(path: Path) -> str | None:
    """None when ``path`` is a complete satlab checkpoint, else why not."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # truncated or corrupt files raise many different errors
        return f"{type(error).__name__}: {error}"
    if "state_dict" not in state or KEY not in state:
        return "it lacks the model state or satlab's config/tokenizer entry"
    return None


def find_resume_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest readable checkpoint: ``last.ckpt``, else the step checkpoints newest first. A corrupt one is
    renamed to ``*.corrupt`` (kept, never reused) with a message saying which one is used instead."""
    candidates = [checkpoint_dir / "last.ckpt"] + sorted(checkpoint_dir.glob("step*.ckpt"), key=_step_of,
                                                         reverse=True)
    for path in candidates:
        if not path.exists():
            continue
        problem = readable(path)
        if problem is None:
            return path
        path.rename(path.with_name(path.name + ".corrupt"))
        print(f"satlab: checkpoint {path} is unreadable ({problem}); kept as {path.name}.corrupt, "
              "resuming from the previous one", file=sys.stderr)
    return None


class CheckpointOnSigterm(L.Callback):
    """Lightning stops at the end of the current batch on SIGTERM (pre-emption, `scancel`); this writes
    ``last.ckpt`` first, so `resume=auto` continues from there."""

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint_dir = checkpoint_dir

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            path = self.checkpoint_dir / "last.ckpt"
            trainer.save_checkpoint(path)
            print(f"satlab: SIGTERM received; checkpoint written to {path} at step {trainer.global_step}",
                  file=sys.stderr)
