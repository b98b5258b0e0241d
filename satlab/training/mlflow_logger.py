"""An MLflow logger that a resumed run continues without repeating a point, and whose status follows the run.

A run killed after logging step 17 and resumed from its checkpoint at step 15 logs steps 15 to 17 again; Lightning's
``MLFlowLogger`` would record them twice. Reopened on an existing run, this logger counts the (metric, step) points
that run already holds from the resume step on and skips that many of the same again: a resumed run reproduces the
same points in the same order (deterministic data order, RNG states in the checkpoint), so each is recorded exactly
as often as in a run never killed. Lightning's ``epoch``, added to every call, is not recorded: a run
budgeted in tokens has one epoch. No point is missed
either, because checkpoints are written only after everything of their step is logged
(:class:`~satlab.training.resilience.CheckpointAfterValidation`).

Writes go through :class:`~satlab.training.tracking_buffer.BufferedClient`, so an outage of the store costs no
record: what could not be sent waits in the run folder and is sent, in order, once the store answers.

Every step at which anything is logged gets one ``tokens_seen`` point (:data:`TOKENS_SEEN`), whoever logs it
(training, validation, the evaluation callback, the throughput callback): MLflow plots a metric against another by
joining their points on the step, so a metric is plottable against tokens seen only at steps where ``tokens_seen``
has a point, and only one (two points at one step would shift the pairs). Runs of different batch sizes, or from
different experiments, line up on that axis.

The run's MLflow status is set by :meth:`close`, not by Lightning's ``finalize``, which runs after every
``trainer.validate`` and would mark a run FINISHED by the validation before training starts. A run continued in
another process (a resume, or a restart from step 0 of a run killed before its first checkpoint) is
:meth:`reopen`-ed: RUNNING again, with the tags of the new attempt (its folder, command, revision).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

from satlab.training.tracking import record_end
from satlab.training.tracking_buffer import BufferedClient

TOKENS_SEEN = "tokens_seen"
"""The metric every step that logs anything carries: the training tokens seen when the step's values were measured."""

CLOSE_WAIT_SECONDS = 120.0
"""How long the end of a run waits for a store that is down to take what was kept during the outage."""


class ResumableMLFlowLogger(MLFlowLogger):
    def __init__(self, *args, run_dir: Path, store: str, resume_step: int | None = None,
                 tokens_seen: Callable[[], int] | None = None, **kwargs):
        """``tokens_seen``: the run's training tokens so far (read at each step's first log call)."""
        super().__init__(*args, **kwargs)
        self.tokens_seen = tokens_seen
        self._tokens_step = -1  # the last step given its tokens_seen point (steps are logged in increasing order)
        self._mlflow_client = self.buffer = BufferedClient(self._mlflow_client, run_dir, store)
        self.resume_step = resume_step
        self.continues = kwargs.get("run_id") is not None  # an existing MLflow run, reopened by this attempt
        self._recorded: Counter[tuple[str, int]] | None = None

    def _already_recorded(self) -> Counter[tuple[str, int]]:
        """How many points per (key, step) the reopened run holds from the step before the resume step on (read
        once). A validation at step S logs at S - 1 (Lightning's logging step lags the global step there), so a run
        resumed from the checkpoint of its last step S that validates again (its final validation: the run had
        finished, or was stopped in its end-of-run evaluation) logs at S - 1 what the record holds already."""
        if self._recorded is None:
            self._recorded = Counter()
            self.buffer.flush(force=True)  # what an earlier process kept during an outage counts as recorded
            if self.resume_step is not None:
                client, run_id = self.experiment, self.run_id
                for key in client.get_run(run_id).data.metrics:
                    self._recorded.update((key, m.step) for m in client.get_metric_history(run_id, key)
                                          if m.step >= self.resume_step - 1)
        return self._recorded

    def has_recorded(self, key: str, step: int) -> bool:
        """Whether the run holds a point of ``key`` at ``step`` that an earlier attempt logged (rank 0 only)."""
        return self._already_recorded()[(key, step)] > 0

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        recorded = self._already_recorded()
        metrics = self._with_tokens(metrics, step or 0)
        fresh = {}
        for key, value in metrics.items():
            if key == "epoch":  # Lightning adds it to every log call; a token-budgeted run has one epoch
                continue
            if recorded[(key, step or 0)] > 0:
                recorded[(key, step or 0)] -= 1
            else:
                fresh[key] = value
        if fresh:
            super().log_metrics(fresh, step)

    def _with_tokens(self, metrics: Mapping[str, float], step: int) -> Mapping[str, float]:
        """``metrics`` with the step's ``tokens_seen`` point if it has none yet, without one if it has."""
        if self.tokens_seen is None:
            return metrics
        metrics = {k: v for k, v in metrics.items() if k != TOKENS_SEEN}
        if step > self._tokens_step:
            self._tokens_step = step
            metrics[TOKENS_SEEN] = float(self.tokens_seen())
        return metrics

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Lightning's end-of-stage hook: nothing here (see :meth:`close`)."""

    @rank_zero_only
    def reopen(self) -> None:
        """Marks the existing run this logger continues RUNNING and sets this attempt's tags on it (Lightning sets
        tags only on a run it creates): ``run_dir`` follows a run folder moved to another ``train.out_dir``."""
        self.experiment.update_run(self.run_id, status="RUNNING")
        for key, value in (self.tags or {}).items():
            self.experiment.set_tag(self.run_id, key, value)

    @rank_zero_only
    def close(self, status: str, reason: str, step: int | None = None) -> None:
        """End the MLflow run as FINISHED, FAILED or KILLED with ``reason`` (:func:`record_end`), once what an outage
        kept back is sent (or, if the store stays down, say where it is kept)."""
        record_end(self.experiment, self.run_id, status, reason, step)
        if not self.buffer.wait_for_store(CLOSE_WAIT_SECONDS):
            print(f"satlab: the tracking store is still down; this run's last records are kept in "
                  f"{self.buffer.spool} and are sent when the run is started again (same command, resume=auto)",
                  file=sys.stderr)
