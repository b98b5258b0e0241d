"""The Lightning callback that ties one training run to its Optuna trial. optuna-integration's pruning callback
reports once per epoch; satlab validates inside one long epoch, so this one reports after every validation, at
``tokens_seen``. Under DDP every rank computes the gate statistics (a forward pass is collective under FSDP), rank 0
decides, and the decision is broadcast so that all ranks stop together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import lightning as L
import optuna
import torch
from lightning.pytorch.trainer.states import TrainerFn

from satlab.evaluation.callback import EvaluationCallback
from satlab.evaluation.gates import SATURATION_METRIC
from satlab.studies.attrs import RUN_ID, SATURATION, TOKENS, WOULD_PRUNE_AT, WOULD_PRUNE_REASON
from satlab.studies.runs import STOPPED_TAG, WOULD_PRUNE_REASON_TAG, WOULD_PRUNE_TAG
from satlab.studies.spec import SaturationGuard


class TrialStopped(Exception):
    """Ends a trial early (``train()`` passes it through after closing its MLflow run); ``pruned`` tells PRUNED (the
    trial says something about its region) from FAIL (it says nothing, e.g. out of memory)."""

    def __init__(self, reason: str, pruned: bool = True, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.pruned = pruned


class TrialCallback(L.Callback):
    """Stops the run when the pruner says so (``pruned``), when the saturation guard trips (``gate_saturation``) or
    a loss is NaN/Inf (``nan``). ``last_metrics``: the latest validation's scalars. ``trial``: None off rank 0.

    An observing guard (``guard.action == "observe"``) stops nothing: the first time it would have pruned, rank 0
    records ``would_prune`` (tokens seen, reason) as the trial's user attributes and as tags of the trial's MLflow
    run, and the trial trains on."""

    def __init__(self, trial: optuna.Trial | None, guard: SaturationGuard, gates: EvaluationCallback,
                 metric: str = "val/loss"):
        self.trial, self.guard, self.gates, self.metric = trial, guard, gates, metric
        self.last_metrics: dict[str, float] = {}
        self._streak = 0
        self._run_recorded = False
        self.would_prune: tuple[int, str] | None = None  # (tokens seen, reason) of an observing guard's first trip
        self._would_prune_tagged = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.trial is not None and not self._run_recorded and trainer.logger is not None:
            self.trial.set_user_attr(RUN_ID, trainer.logger.run_id)
            self._run_recorded = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        """Stop at the first non-finite training loss or skipped step, not at the next validation: that learning
        rate has diverged (a long run may ride out a few such steps; a sweep should not recommend them). The loss
        check is single-process only: ranks could see it at different micro-batches."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if trainer.world_size == 1 and isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            self._stop(trainer, "nan", True, f"training loss {loss.item()} at {pl_module.tokens_seen:,} tokens")
        if getattr(pl_module, "skipped_steps", 0):
            self._stop(trainer, "nan", True, f"a step with a non-finite loss or gradient was skipped at "
                                             f"{pl_module.tokens_seen:,} tokens")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last_metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()
                                  if isinstance(v, torch.Tensor) and v.numel() == 1})
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return  # the validations before and after fit() are not steps of the trial
        saturation = self.gates.last_gate_scalars.get(SATURATION_METRIC)  # this validation's, on fixed windows
        decision = self._decide(int(pl_module.tokens_seen), saturation) if trainer.is_global_zero else None
        if self.would_prune is not None and not self._would_prune_tagged:
            self._tag_would_prune(trainer)
        decision = trainer.strategy.broadcast(decision, src=0)
        if decision is not None:
            self._stop(trainer, *decision)

    def _stop(self, trainer: L.Trainer, reason: str, pruned: bool, detail: str) -> None:
        """Raise :class:`TrialStopped`, with the reason as a tag of the trial's MLflow run (which ends FAILED): a
        report read from MLflow tells a diverged or pruned trial from a crashed one."""
        logger = getattr(trainer, "logger", None)
        if trainer.is_global_zero and getattr(logger, "run_id", None):
            logger.experiment.set_tag(logger.run_id, STOPPED_TAG, f"{reason}: {detail}"[:5000])
        raise TrialStopped(reason, pruned, detail)

    def _decide(self, tokens: int, saturation: float | None) -> tuple[str, bool, str] | None:
        """(reason, pruned, detail) when the trial should stop now. Rank 0 only."""
        value = self.last_metrics.get(self.metric)
        if value is not None and not math.isfinite(value):
            return "nan", True, f"{self.metric} = {value} at {tokens:,} tokens"
        if self.trial is None:
            return None
        self.trial.set_user_attr(TOKENS, tokens)
        if value is not None:
            self.trial.report(value, step=tokens)
        if saturation is not None:
            self.trial.set_user_attr(SATURATION, saturation)
            above = self.guard.threshold is not None and saturation > self.guard.threshold
            self._streak = self._streak + 1 if above else 0
            if self._streak >= self.guard.patience:
                detail = (f"{saturation:.0%} of gates saturated for {self._streak} validations "
                          f"(threshold {self.guard.threshold:.0%})")
                if self.guard.action != "observe":
                    return "gate_saturation", True, detail
                if self.would_prune is None:  # the first time only: when the guard would have stopped the trial
                    self.would_prune = (tokens, f"gate_saturation: {detail} at {tokens:,} tokens")
                    self.trial.set_user_attr(WOULD_PRUNE_AT, tokens)
                    self.trial.set_user_attr(WOULD_PRUNE_REASON, self.would_prune[1])
        if value is not None and self.trial.should_prune():
            return "pruned", True, f"{self.metric} = {value:.4f} at {tokens:,} tokens"
        return None

    def _tag_would_prune(self, trainer: L.Trainer) -> None:
        """The observing guard's would-be prune as tags of the trial's MLflow run, beside its loss curves."""
        self._would_prune_tagged = True
        logger = getattr(trainer, "logger", None)
        if self.would_prune is not None and getattr(logger, "run_id", None):
            tokens, reason = self.would_prune
            logger.experiment.set_tag(logger.run_id, WOULD_PRUNE_TAG, str(tokens))
            logger.experiment.set_tag(logger.run_id, WOULD_PRUNE_REASON_TAG, reason[:5000])
