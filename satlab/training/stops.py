"""How a run's stops keep its record true: the logged step after a resume, and the per-command time limit.

Every stop (SIGTERM, a kill, the time limit, no space, an extended budget, a moved folder) is continued by the same
command into the same MLflow run, with exactly the points of a run never stopped; see docs/checkpoints.md.
"""

from __future__ import annotations

import os
import signal
import time

import lightning as L

from satlab.config.errors import EXIT_REQUEUE, RunStopped


class TimeLimitReached(RunStopped):
    """``train.max_time_minutes`` of training passed in this command before the token budget was reached: the state
    is saved and the same command continues the run (exit code ``EXIT_REQUEUE``). The run's MLflow record ends
    KILLED (not FINISHED, and without the end-of-run validation of a finished run), as on SIGTERM."""

    exit_code = EXIT_REQUEUE


class TimeLimit(L.Callback):
    """``train.max_time_minutes``, counted per command, so a job requeued with the same limit gets further each time.
    Past the limit, rank 0 sends itself SIGTERM after the step it is in: the run then stops exactly as a pre-empted
    one (the step's validation and checkpoint done, ``last.ckpt`` written, every rank stopped by Lightning), and
    ``train`` reports it as :class:`TimeLimitReached`. Lightning's own ``max_time`` is not used: it counts the time
    of earlier attempts (kept in the checkpoint), so a resumed run would stop at once, and it stops through
    ``should_stop``, which runs a validation and the end-of-run evaluation at that step, points a run never
    stopped does not have."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.started: float | None = None
        self.reached = False

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.minutes is None or self.started is None or self.reached or not trainer.is_global_zero:
            return
        if time.monotonic() - self.started >= self.minutes * 60 and trainer.global_step < trainer.max_steps:
            self.reached = True
            os.kill(os.getpid(), signal.SIGTERM)


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
