"""What keeps a run alive across crashes and pre-emption: atomic checkpoint writes (files and sharded directories),
a resume that skips a corrupt or incomplete checkpoint, a checkpoint on SIGTERM, and the lock that keeps two
processes out of one run.

Every write goes to a hidden sibling (``.<name>.tmp-<pid>``) that is renamed into place when complete; a checkpoint
that is replaced or removed is first renamed aside (``.<name>.old-<pid>``, ``.<name>.removed-<pid>``). Resume never
reads a hidden name, so a kill at any moment leaves only complete checkpoints under their own names, plus hidden
leftovers that :func:`remove_partial_checkpoints` clears once the run holds its lock. See docs/checkpoints.md."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from satlab.config.errors import ConfigError
from satlab.training.checkpoint import KEY, read_checkpoint_meta

LOCK_FILE = ".lock"
WRITING, REPLACED, REMOVED = ".tmp-", ".old-", ".removed-"
"""Marks of the hidden siblings: ``.<name>.tmp-<pid>`` being written, ``.<name>.old-<pid>`` the checkpoint it
replaces (between the two renames of :func:`move_into_place`), ``.<name>.removed-<pid>`` one being deleted."""


def _aside(path: Path, mark: str) -> Path:
    return path.with_name(f".{path.name}{mark}{os.getpid()}")


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def move_into_place(tmp: Path, path: Path) -> None:
    """Renames the finished checkpoint ``tmp`` to ``path``, replacing whatever is there (a file or a directory).
    A directory cannot be renamed over a non-empty one, so the old checkpoint is renamed aside first and deleted
    after; a kill between the two renames leaves no ``path`` but a complete ``.<name>.old-<pid>``, which
    :func:`find_resume_checkpoint` renames back."""
    old = None
    if path.exists() or path.is_symlink():
        old = _aside(path, REPLACED)
        if old.exists():  # a leftover of an earlier process that had this PID
            _delete(old)
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        _delete(old)


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

    def remove_checkpoint(self, path) -> None:
        """Renamed aside first, so a kill during the (for a sharded directory, many-file) delete leaves nothing
        half-deleted under a checkpoint's name. Lightning's ModelCheckpoint calls this (through the strategy, on
        rank 0) for checkpoints beyond ``train.keep_last_k``."""
        path = Path(path)
        if path.exists() or path.is_symlink():
            gone = _aside(path, REMOVED)
            os.rename(path, gone)
            _delete(gone)


class AtomicShardedSave:
    """Mixin for the strategies that write sharded checkpoints (Lightning's ModelParallelStrategy and FSDPStrategy):
    every rank writes into ``.<name>.tmp-<pid of rank 0>``, then rank 0 renames it into place once all ranks are
    done, so a checkpoint directory under its own name is always complete.

    Why the strategy's ``save_checkpoint`` and not a CheckpointIO plugin, as for files: for a sharded save these
    strategies bypass the CheckpointIO (they refuse ``storage_options`` for that reason) and call
    ``torch.distributed.checkpoint`` and ``torch.save(meta.pt)`` themselves; ``save_checkpoint`` is the one method
    that every sharded write goes through (ModelCheckpoint, ``trainer.save_checkpoint`` in run.py and on SIGTERM),
    it runs on every rank, and the strategy has the collectives (broadcast, barrier) that the rename needs."""

    writes_sharded: bool  # each strategy's own setting (a property below)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if not self.writes_sharded:  # one gathered file, through AtomicCheckpointIO
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        path = Path(filepath)
        path, tmp = self.broadcast((path, path.with_name(f".{path.name}{WRITING}{os.getpid()}")))  # rank 0's
        if self.is_global_zero and tmp.exists():
            _delete(tmp)
        self.barrier("satlab_sharded_checkpoint_start")
        super().save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        # torch.distributed.checkpoint's coordinator writes the index only after every rank reported its shards
        # written, and Lightning writes meta.pt after that; the barrier makes "all ranks are done" explicit.
        self.barrier("satlab_sharded_checkpoint_written")
        if self.is_global_zero:
            move_into_place(tmp, path)
        self.barrier("satlab_sharded_checkpoint_in_place")


class AtomicModelParallelStrategy(AtomicShardedSave, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2) with atomic sharded checkpoint directories."""

    @property
    def writes_sharded(self) -> bool:
        return self._save_distributed_checkpoint


class AtomicFSDPStrategy(AtomicShardedSave, FSDPStrategy):
    """Lightning's FSDPStrategy with atomic sharded checkpoint directories (``state_dict_type="sharded"``)."""

    @property
    def writes_sharded(self) -> bool:
        return self._state_dict_type == "sharded"


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
    """(the checkpoint's global step, None) for a complete satlab checkpoint, a file or a sharded directory, else
    (None, why not)."""
    try:
        state = read_checkpoint_meta(path)
    except Exception as error:  # truncated or corrupt files raise many different errors
        return None, f"{type(error).__name__}: {error}"
    if KEY not in state:
        return None, "it lacks satlab's config/tokenizer entry"
    return int(state.get("global_step", 0)), None


def _restore_replaced(checkpoint_dir: Path) -> None:
    """Renames a replaced checkpoint (``.<name>.old-<pid>``) back to its name when a kill between the two renames
    of :func:`move_into_place` left that name empty: the state just before the replace. (This runs before the run
    lock is taken, like the rest of the resume choice; a second process that got here while the first one trains
    is refused by the lock right after, and the first one's names are empty only for the instant between the
    renames.)"""
    for old in sorted(checkpoint_dir.glob(f".*{REPLACED}*"), key=lambda p: p.stat().st_mtime, reverse=True):
        target = checkpoint_dir / old.name[1:old.name.rindex(REPLACED)]
        if not (target.exists() or target.is_symlink()):
            old.rename(target)
            print(f"satlab: the replace of checkpoint {target} was cut off; restored the previous one",
                  file=sys.stderr)


def find_resume_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The readable checkpoint of the highest step (``last.ckpt`` on a tie): usually ``last.ckpt``, but a kill while
    it was being rewritten leaves the older one, and then the step checkpoint just written is newer, and the run's
    MLflow record already reaches it. Checkpoints are files or sharded directories; hidden names (writes or
    deletes in progress or cut off) are never read. A corrupt file is renamed to ``*.corrupt`` (kept, never reused)
    with a message saying so; a directory is never renamed: one that is incomplete or unreadable (only a writer
    other than satlab's atomic one leaves it so) is skipped with a message."""
    if checkpoint_dir.is_dir():
        _restore_replaced(checkpoint_dir)
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
        if path.is_dir():
            print(f"satlab: sharded checkpoint {path} is not usable ({problem}); skipped and left as it is",
                  file=sys.stderr)
            continue
        path.rename(path.with_name(path.name + ".corrupt"))
        print(f"satlab: checkpoint {path} is unreadable ({problem}); kept as {path.name}.corrupt, "
              "resuming from another one", file=sys.stderr)
    return None if best is None else best[1]


def remove_partial_checkpoints(checkpoint_dir: Path) -> list[str]:
    """Deletes what killed writes and deletes left behind: ``.<name>.tmp-*`` (a write that never finished),
    ``.<name>.removed-*`` (a delete that never finished) and ``.<name>.old-*`` whose name holds a newer checkpoint.
    Call it on rank 0 only while holding the run's lock: the lock is what makes every such sibling a leftover
    rather than another process's write in progress. Returns the names deleted."""
    removed = []
    for path in sorted(checkpoint_dir.glob(".*")) if checkpoint_dir.is_dir() else []:
        name = path.name
        replaced = REPLACED in name and (checkpoint_dir / name[1:name.rindex(REPLACED)]).exists()
        if WRITING in name or REMOVED in name or replaced:
            _delete(path)
            removed.append(name)
    if removed:
        print(f"satlab: removed what interrupted checkpoint writes left in {checkpoint_dir}: {', '.join(removed)}",
              file=sys.stderr)
    return removed


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
