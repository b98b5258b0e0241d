"""What keeps a run alive across crashes and pre-emption: atomic checkpoint writes (files and sharded directories),
a resume that skips a corrupt or incomplete checkpoint, a checkpoint on SIGTERM, and the lock that keeps two
processes out of one run.

Every write goes to a hidden sibling (``.<name>.tmp-<pid>``) that is renamed into place when complete; a checkpoint
that is replaced or removed is first renamed aside (``.<name>.old-<pid>``, ``.<name>.removed-<pid>``). Resume never
reads a hidden name, so a kill at any moment leaves only complete checkpoints under their own names, plus hidden
leftovers that :func:`remove_partial_checkpoints` clears once the run holds its lock. See docs/checkpoints.md."""

from __future__ import annotations

import errno
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

from satlab.config.errors import EXIT_NO_SPACE, ConfigError, RunStopped
from satlab.training.checkpoint import KEY, read_checkpoint_meta
from satlab.training.checkpoint_scan import cannot_read, load_checkpoint_file
from satlab.training.sigterm import SigtermWatch

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
    SIGKILL never leaves a run locked. The lock is taken before anything of the run is read or checked; when that
    fails (a bad input), the folders it created for the lock file are removed again, so nothing is left behind."""

    def __init__(self, run_dir: Path, name: str):
        self.path, self.name, self.fd = run_dir / LOCK_FILE, name, None
        self.created: list[Path] = []  # the folders __enter__ made, innermost first

    def __enter__(self) -> RunLock:
        folder = self.path.parent
        while not folder.exists():
            self.created.append(folder)
            folder = folder.parent
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

    def __exit__(self, exc_type, *exc_info) -> None:
        if self.fd is None:
            return
        if exc_type is not None and self.created and not any(p.name != LOCK_FILE for p in self.path.parent.iterdir()):
            self.path.unlink()  # before the unlock, so no other process takes a lock on this file in between
            for folder in self.created:
                if not any(folder.iterdir()):
                    folder.rmdir()
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


class NoSpaceForCheckpoint(RunStopped):
    """A checkpoint does not fit on its disk. The previous checkpoints are intact (a write goes to a temporary file
    first); the CLI exits with ``EXIT_NO_SPACE`` so a job script can hold the job until space is freed."""

    exit_code = EXIT_NO_SPACE

    def __init__(self, folder: Path, needed: int):
        super().__init__(f"no space left on {folder}: the checkpoint needs ~{_size(needed)} and "
                         f"{_size(free_space(folder))} are "
                         "free. The previous checkpoints are intact; free space there (or set train.out_dir to "
                         f"another disk) and run the same command to continue (exit code {EXIT_NO_SPACE})")


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def checkpoint_bytes(state: Any) -> int:
    """What ``state`` needs on disk, nearly: the bytes of its tensors (a sharded tensor's local shard, which is what
    this process writes), plus a margin for the pickled rest and the archive's alignment."""
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            total += local.numel() * local.element_size() + 64
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return int(total * 1.01) + (64 << 10)


def free_space(folder: Path) -> int:
    """Free bytes on the disk of ``folder``, or of its nearest existing parent (a save makes the folder)."""
    return shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists())).free


def ensure_space(folder: Path, needed: int) -> None:
    """Raises :class:`NoSpaceForCheckpoint` before a write of ``needed`` bytes into ``folder`` that cannot fit."""
    if free_space(folder) < needed:
        raise NoSpaceForCheckpoint(folder, needed)


def out_of_space(error: BaseException | None) -> bool:
    """Whether a failed write failed for lack of space: ENOSPC or EDQUOT from the OS, or torch's archive writer,
    which reports a short write as "unexpected pos" (sharded saves gather every rank's error into one message)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in ("No space left on device", "Disk quota exceeded", "unexpected pos")):
            return True
        error = error.__cause__ or error.__context__
    return False


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same folder and renames it into place, so a kill during
    the write leaves the previous checkpoint intact; loads with ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        needed = checkpoint_bytes(checkpoint)
        ensure_space(path.parent, needed)
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as error:
            if out_of_space(error):
                tmp.unlink(missing_ok=True)
                raise NoSpaceForCheckpoint(path.parent, needed) from error
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = True) -> dict:
        """Scanned first, as every satlab read of a checkpoint (:func:`load_checkpoint_file`): a file that is not a
        satlab checkpoint is refused with satlab's message, and nothing in it is unpickled."""
        try:
            return load_checkpoint_file(Path(path), map_location or "cpu")
        except Exception as error:  # torch's own errors too: satlab's message, without advice to load unsafely
            raise ConfigError(cannot_read(path, error)) from None

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
        needed = checkpoint_bytes(checkpoint)  # this rank's shards: every rank checks its own disk, and all stop
        fits = free_space(path.parent) >= needed
        if not (self.reduce_boolean_decision(fits, all=True) if self.world_size > 1 else fits):
            raise NoSpaceForCheckpoint(path.parent, needed)
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        except Exception as error:  # torch.distributed.checkpoint raises every rank's errors on every rank
            if out_of_space(error):
                raise NoSpaceForCheckpoint(path.parent, needed) from error
            raise
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

    def _should_remove_checkpoint(self, trainer, previous: str, current: str) -> bool:
        """Lightning never deletes the checkpoint a run resumed from (it may be another run's); a satlab run resumes
        only from its own folder, where that one is just its oldest step checkpoint, and keeping it would leave
        ``keep_last_k + 1``."""
        return previous != current and Path(self.dirpath).absolute() in Path(previous).absolute().parents

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
    of :func:`move_into_place` left that name empty: the state just before the replace. Call it holding the run's
    lock, like the rest of the resume choice: in a run that trains, a name is empty for the instant between the
    renames."""
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


def keep_newest_steps(checkpoint_dir: Path, keep: int, resume_from: Path | None = None) -> list[str]:
    """Deletes the step checkpoints beyond the newest ``keep`` (``train.keep_last_k``). Lightning deletes the
    oldest only after writing the newest, and remembers only those it wrote, so a kill between the two (or a
    smaller ``keep_last_k`` on resume) leaves one it never deletes. Call it on rank 0 while holding the run's
    lock, after the resume checkpoint is chosen: ``resume_from`` is never deleted. Returns the names deleted."""
    if not checkpoint_dir.is_dir():
        return []
    removed = []
    for path in sorted(checkpoint_dir.glob("step*.ckpt"), key=_step_of, reverse=True)[keep:]:
        if path != resume_from:
            gone = _aside(path, REMOVED)
            os.rename(path, gone)
            _delete(gone)
            removed.append(path.name)
    if removed:
        print(f"satlab: train.keep_last_k={keep}: removed older step checkpoints {', '.join(removed)} from "
              f"{checkpoint_dir}", file=sys.stderr)
    return removed


class CheckpointOnSigterm(L.Callback):
    """Lightning stops at the end of the current batch on SIGTERM (pre-emption, `scancel`); this writes
    ``last.ckpt`` first, so `resume=auto` continues from there (the time limit stops a run the same way).

    With several ranks every rank must stop at the same batch. Lightning's own SIGTERM handler broadcasts from
    inside the handler, that is in the middle of whatever collective the rank is in, and then each rank stops on
    its own flag at its own batch boundary: under srun, where every rank gets the signal at a slightly different
    moment, the ranks end up waiting on each other for good. Here the handler only notes the signal; at the end of
    every training batch the ranks agree (any rank signalled stops them all) and raise Lightning's flag together.

    A SIGTERM that came before the fit began (``watch``, :mod:`satlab.training.sigterm`) stops it at the end of the
    first batch the same way."""

    def __init__(self, checkpoint_dir: Path, watch: SigtermWatch | None = None):
        self.checkpoint_dir = checkpoint_dir
        self.watch = watch
        self.requested = False

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        connector = getattr(trainer, "_signal_connector", None)  # registers its handlers after this hook
        lightning_notifier = getattr(connector, "_sigterm_notifier_fn", None)
        if lightning_notifier is None:  # a Lightning without these private names: its own handling, unchanged
            return

        def notify(signum, frame) -> None:
            if trainer.world_size == 1:
                lightning_notifier(signum, frame)
                return
            launcher = trainer.strategy.launcher
            if not self.requested and launcher is not None:
                launcher.kill(signum)  # the processes Lightning started itself, as its handler does
            self.requested = True

        connector._sigterm_notifier_fn = notify

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if self.watch is not None and self.watch.received:
            self.requested = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        requested = self.requested
        if trainer.world_size > 1:
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if requested:
            trainer._signal_connector.received_sigterm = True

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            path = self.checkpoint_dir / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)
            print(f"satlab: SIGTERM received; checkpoint written to {path} at step {trainer.global_step}",
                      file=sys.stderr)

