"""How a run's stops keep its record true: the logged step after a resume, and the per-command time limit.

Every stop (SIGTERM, a kill, the time limit, no space, an extended budget, a moved folder) is continued by the same
command into the same MLflow run, with exactly the points of a run never stopped; see docs/checkpoints.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L

from satlab.config.errors import EXIT_REQUEUE, RunStopped


class TimeLimitReached(RunStopped):
    """``train.max_time_minutes`` of training passed in this command before the token budget was reached: the state
    is saved and the same command continues the run (exit code ``EXIT_REQUEUE``). The run's MLflow record ends
    KILLED (not FINISHED, and without the end-of-run validation of a finished run), as on SIGTERM."""

    exit_code = EXIT_REQUEUE


class TimeLimit(L.Callback):
    """``train.max_time_minutes``, counted per command, so a job requeued with the same limit gets further each time.
    Checked before each training batch: past the limit, :class:`TimeLimitReached` is raised there, the state being
    that of the step just done, as on SIGTERM between steps (:class:`CheckpointOnSigterm` writes ``last.ckpt``).
    Lightning's own ``max_time`` is not used: it counts the time of earlier attempts (kept in the checkpoint), so a
    resumed run would stop at once, and it stops through ``should_stop``, which runs a validation at that step that
    a run never stopped does not have."""

    def __init__(self, minutes: float | None, name: str, checkpoint: Path):
        self.minutes, self.name, self.checkpoint = minutes, name, checkpoint
        self.started: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.started = time.monotonic()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if self.minutes is None or self.started is None:
            return
        over = trainer.strategy.broadcast(time.monotonic() - self.started >= self.minutes * 60)  # rank 0 decides
        if over and trainer.global_step < trainer.max_steps:
            raise TimeLimitReached(f"run '{self.name}' reached train.max_time_minutes={self.minutes:g} at step "
                                   f"{trainer.global_step} of {trainer.max_steps}; its state is saved in "
                                   f"{self.checkpoint}: run the same command to continue (exit code {EXIT_REQUEUE})")


class AlignLoggingStep(L.Callback):
    """Keeps the step Lightning logs at equal to the global step, whichever checkpoint a run resumed from.

    Lightning logs at ``fit_loop.epoch_loop._batches_that_stepped``, which at the start of every training batch of a
    run never stopped equals ``global_step``. A checkpoint written after a validation step's loop iteration is done
    (``last.ckpt`` at the end of a run, or on SIGTERM once that step's validation and checkpoint are through) restores
    as Lightning's ``RESTARTED_ON_LAST``: its first loop iteration (``_TrainingEpochLoop.advance``) sees the
    validation of that step due again, sets ``_skip_next_val`` and returns without a batch, but ``on_advance_end``
    still adds one to ``_batches_that_stepped`` for the batch that never ran. Everything the resumed run logs would
    land one step late (train/loss missing at the resume step and doubled at the end; val/loss at 30 instead of 29).
    A checkpoint written before a batch began (the time limit) restores with no restart stage, and
    ``_TrainingEpochLoop.reset`` adds one for a checkpoint it takes to be written inside validation. The step
    checkpoints, written inside validation, come out right. Rather than tell these apart, this callback restores the
    invariant before each batch's hooks and logging."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        if loop._batches_that_stepped != trainer.global_step:
            loop._batches_that_stepped = trainer.global_step
