"""What keeps a run alive across crashes and pre-emption: atomic checkpoint writes, a resume that skips a corrupt
checkpoint, a checkpoint on SIGTERM, and the lock that keeps two processes out of one run."""

from __future__ import annotations

import fcntl
import os
import re
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from satlab.config.errors import ConfigError
from satlab.training.checkpoint import KEY

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/.lock`` for as long as a process trains the run, so a second ``satlab
    train`` of the same name is refused instead of writing into the same checkpoints and MLflow run. The lock file
    holds the owner's PID for the message; the operating system drops the lock when the process dies, so a
    SIGKILL never leaves a run locked."""

    def __init__(self, run_dir: Path, name: str):
        self.path, self.name, self.fd = run_dir / LOCK_FILE, name, None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"run '{self.name}' is being trained by another process (PID {holder}), which holds {self.path}; "
                "wait for it to finish or stop it (its checkpoints let it resume later), or train under another "
                "name (name=...)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc_info) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


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


class CheckpointAfterValidation(ModelCheckpoint):
    """Lightning's step checkpoints, written after the validation of their step (Lightning's own deferral to
    ``on_validation_end``). Lightning logs a step's training metrics after its callbacks' ``on_train_batch_end``,
    so a checkpoint written there would precede them, and a run killed just after it would resume past points it
    never logged. The schedule puts every checkpoint on a validation step (``ckpt_every_steps`` is a multiple of
    ``val_every_steps``), so every checkpoint follows everything its step logs."""

    def __init__(self, val_every_steps: int, **kwargs):
        super().__init__(**kwargs)
        self.val_every_steps = val_every_steps

    @property
    def state_key(self) -> str:
        """One key whatever the interval (Lightning's includes it): a resume that extends ``train.max_tokens``, which
        can move the checkpoint interval, restores this callback's state instead of warning and dropping it."""
        return type(self).__name__

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        due = self._every_n_train_steps >= 1 and step % self._every_n_train_steps == 0
        if due and step % self.val_every_steps == 0 and not self._should_skip_saving_checkpoint(trainer):
            self._defer_save_until_validation = True
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _step_of(path: Path) -> int:
    match = re.search(r"step(\d+)", path.name)
    return int(match.group(1)) if match else -1


def readable(path: Path) -> tuple[int | None, str | None]:
    """(the checkpoint's global step, None) for a complete satlab checkpoint, else (None, why not)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # truncated or corrupt files raise many different errors
        return None, f"{type(error).__name__}: {error}"
    if "state_dict" not in state or KEY not in state:
        return None, "it lacks the model state or satlab's config/tokenizer entry"
    return int(state.get("global_step", 0)), None


def find_resume_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The readable checkpoint of the highest step (``last.ckpt`` on a tie): usually ``last.ckpt``, but a kill while
    it was being rewritten leaves the older one, and then the step checkpoint just written is newer, and the run's
    MLflow record already reaches it. A corrupt one is renamed to ``*.corrupt`` (kept, never reused) with a
    message saying so."""
    candidates = [checkpoint_dir / "last.ckpt"] + sorted(checkpoint_dir.glob("step*.ckpt"), key=_step_of,
                                                         reverse=True)
    best: tuple[int, Path] | None = None
    for path in candidates:
        if not path.exists():
            continue
        step, problem = readable(path)
        if problem is None:
            if best is None or step > best[0]:
                best = (step, path)
            continue
        path.rename(path.with_name(path.name + ".corrupt"))
        print(f"satlab: checkpoint {path} is unreadable ({problem}); kept as {path.name}.corrupt, "
              "resuming from another one", file=sys.stderr)
    return None if best is None else best[1]


class CheckpointOnSigterm(L.Callback):
    """Lightning stops at the end of the current batch on SIGTERM (pre-emption, `scancel`); this writes
    ``last.ckpt`` first, so `resume=auto` continues from there."""

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint_dir = checkpoint_dir

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            path = self.checkpoint_dir / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)
            print(f"satlab: SIGTERM received; checkpoint written to {path} at step {trainer.global_step}",
                  file=sys.stderr)
