"""The LightningModule that trains any zoo model as a language model."""

from __future__ import annotations

import ast
import math
import random

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics

from satlab.config.derived import Schedule
from satlab.config.schema import ExperimentConfig
from satlab.data.mqar import IGNORE_INDEX
from satlab.models import build_model
from satlab.models.parametrization import parameter_table
from satlab.training.checkpoint import KEY as CHECKPOINT_KEY
from satlab.training.checkpoint import satlab_entry
from satlab.training.parallel import checkpoint_blocks, compile_blocks, shard_model


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine from 1 down to ``min_ratio`` at ``max_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


RECALL_THRESHOLDS = (0.9, 0.99)
"""Held-out recall accuracies whose first crossing a recall run records (``recall/steps_to_<t>``)."""


class LMModule(L.LightningModule):
    """Next-token cross-entropy on a zoo model, AdamW with warmup + cosine, validation loss and perplexity.

    On a synthetic recall task only the answer positions have targets: the LM head runs there alone
    (``select``), validation also logs the held-out accuracy ``recall/acc``, the first step at which it reaches
    each of :data:`RECALL_THRESHOLDS` (``recall/steps_to_<t>``, ``recall/sequences_to_<t>``), and the run stops
    at ``data.mqar.stop_at_acc`` (a resumed run that had stopped stays stopped). The first step at the bind
    threshold (:attr:`bind_threshold`) is kept too; :meth:`bind_record` is what the run logs once at its end.
    """

    def __init__(self, cfg: ExperimentConfig, schedule: Schedule, tokenizer=None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.schedule = schedule
        self.model = build_model(cfg.model)
        self.val_loss = torchmetrics.MeanMetric()
        self.tokens_seen = 0
        self._configured = False
        self._step_losses: list[torch.Tensor] = []
        self.skipped_steps = 0
        self.stop_reason: str | None = None
        self._grad_norm: torch.Tensor | None = None
        self.answers_only = cfg.data.synthetic_task is not None
        self.val_correct = torchmetrics.SumMetric()
        self.recall_reached: dict[str, int] = {}  # threshold -> the first step whose validation reached it
        self.reached_stop_acc = False
        self.bound_at: int | None = None  # the first step whose validation reached bind_threshold
        self.validated_at: int | None = None  # the step of the last validation inside fit

    def configure_model(self) -> None:
        """Per-block compile, activation checkpointing, then FSDP2 sharding under the model-parallel strategy (see
        ``parallel.py``)."""
        if self._configured:
            return
        self._configured = True
        train = self.cfg.train
        if train.activation_checkpointing and train.strategy != "fsdp":  # Lightning's FSDP wraps the blocks itself
            checkpoint_blocks(self.model)
        if train.compile:  # after the checkpoint wrappers, so that compile traces the recomputed regions too
            compile_blocks(self.model, whole_loop=train.strategy not in ("fsdp", "model_parallel"))
        if train.strategy == "model_parallel":
            shard_model(self.model, self.device_mesh["data_parallel"], train.precision)

    def forward(self, idx: torch.Tensor):
        return self.model(idx)

    def scored_logits(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, targets) flattened to the scored positions: every position of text, the answers of a recall
        task (the head computed there only)."""
        if self.answers_only:
            scored = targets != IGNORE_INDEX
            return self.model(idx, select=scored).logits, targets[scored]
        return self.model(idx).logits.flatten(0, 1), targets.flatten()

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, labels = self.scored_logits(idx, targets)
        return F.cross_entropy(logits.float(), labels)

    def on_train_start(self) -> None:
        self.tokens_seen = self.global_step * self.schedule.tokens_per_step
        if self.reached_stop_acc:  # resumed after stopping at data.mqar.stop_at_acc: nothing left to train
            self.trainer.should_stop = True

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = self.loss(idx, targets)
        self.tokens_seen += idx.numel() * self.trainer.world_size
        self._step_losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Logs the loss of the whole global batch (mean over micro-batches and ranks), the gradient norm before
        clipping, and the learning rate."""
        step_loss = torch.stack(self._step_losses).mean()
        self._step_losses.clear()
        self.log("train/loss", step_loss, prog_bar=True, sync_dist=True)  # tokens_seen: the logger adds it
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # a DTensor under FSDP2, as clipping wants it
        total = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self._grad_norm = None
        if not (torch.isfinite(step_loss) and torch.isfinite(total)):
            self._skip_step(step_loss, total)
        else:
            self._grad_norm = norm
            self.log("train/grad_norm", total)
        if self.skipped_steps:  # a series only for a run that skipped steps: a flat zero is clutter
            self.log("train/skipped_steps", float(self.skipped_steps))
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by norm with the norm already computed for logging: one pass over the gradients instead of two.
        Lightning's FSDP strategy keeps flat gradient shards whose norm only its own clipping reduces across ranks,
        so that strategy (and clipping by value) goes through Lightning."""
        if (gradient_clip_val and gradient_clip_algorithm in (None, "norm") and self._grad_norm is not None
                and self.cfg.train.strategy != "fsdp"):
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), gradient_clip_val, self._grad_norm)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _skip_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Drop this step's gradients (AdamW leaves parameters without a gradient untouched) and count it; past
        ``train.max_skipped_steps`` the run stops with :attr:`stop_reason` set."""
        for p in self.model.parameters():
            p.grad = None
        self.skipped_steps += 1
        limit = self.cfg.train.max_skipped_steps
        print(f"satlab: step {self.global_step} skipped: loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g} "
              f"({self.skipped_steps} skipped so far, limit {limit})")
        if self.skipped_steps > limit:
            self.stop_reason = (f"{self.skipped_steps} steps had a non-finite loss or gradient norm (limit "
                                f"train.max_skipped_steps={limit}); the model diverged — lower optim.lr, raise "
                                "optim.warmup_fraction or check the data")
            self.trainer.should_stop = True

    def validation_step(self, batch, batch_idx: int) -> None:
        idx, targets = batch
        logits, labels = self.scored_logits(idx, targets)
        self.val_loss.update(F.cross_entropy(logits.float(), labels), weight=labels.numel())
        if self.answers_only:
            self.val_correct.update((logits.argmax(-1) == labels).sum())

    def on_validation_epoch_end(self) -> None:
        count = self.val_loss.weight.clone()
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # global already (torchmetrics sums every rank's batches): no sync_dist, and no advice (training/chatter.py)
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss))
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.validated_at = self.global_step
        if self.answers_only:
            self._log_recall(float(self.val_correct.compute() / count))
            self.val_correct.reset()

    @property
    def bind_threshold(self) -> float:
        """The accuracy at which the run counts as bound (:attr:`satlab.config.schema.MQARConfig.bind_threshold`)."""
        return self.cfg.data.mqar.bind_threshold

    def bind_record(self) -> dict[str, float]:
        """The run's time-to-bind, for its end: ``recall/steps_to_bind``, the first step whose held-out accuracy
        reached :attr:`bind_threshold`, or the current (last) step when none did, i.e. censored at the budget (the
        restricted time-to-bind, defined for every run, so two runs' values can be subtracted), and
        ``recall/bound`` (1.0 reached, 0.0 censored). Empty for a text run."""
        if not self.answers_only:
            return {}
        bound = self.bound_at is not None
        return {"recall/steps_to_bind": float(self.bound_at if bound else self.global_step),
                "recall/bound": 1.0 if bound else 0.0}

    def _log_recall(self, accuracy: float) -> None:
        self.log("recall/acc", accuracy, prog_bar=True)
        if accuracy >= self.bind_threshold and self.bound_at is None:
            self.bound_at = self.global_step
        for threshold in RECALL_THRESHOLDS:
            key = f"{threshold:g}"
            if accuracy >= threshold and key not in self.recall_reached:
                self.recall_reached[key] = self.global_step
        stop_at = self.cfg.data.mqar.stop_at_acc
        if stop_at is not None and accuracy >= stop_at and self.trainer.state.fn == "fit":
            self.reached_stop_acc = True
            self.trainer.should_stop = True
        for key, first in self.recall_reached.items():  # logged at every validation, so the last value is the answer
            self.log(f"recall/steps_to_{key}", float(first))
            self.log(f"recall/sequences_to_{key}", float(first * self.schedule.tokens_per_step / self.cfg.data.seq_len))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.tokenizer is not None:
            checkpoint[CHECKPOINT_KEY] = satlab_entry(self.cfg, self.tokenizer)
        checkpoint["satlab_train_state"] = {"skipped_steps": self.skipped_steps, "rng": rng_state(),
                                            "recall_reached": dict(self.recall_reached),
                                            "reached_stop_acc": self.reached_stop_acc, "bound_at": self.bound_at}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("satlab_train_state", {})
        self.skipped_steps = state.get("skipped_steps", 0)
        self.recall_reached = dict(state.get("recall_reached", {}))
        self.reached_stop_acc = bool(state.get("reached_stop_acc", False))
        self.bound_at = state.get("bound_at", self.recall_reached.get(f"{self.bind_threshold:g}"))  # older: by 0.99
        if "rng" in state:
            set_rng_state(state["rng"])

    def configure_optimizers(self):
        optim = self.cfg.optim
        groups = parameter_groups(self.model, optim, self.cfg.model)
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                      fused=self.device.type == "cuda" or None)
        s = self.schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, s.warmup_steps, s.max_steps, optim.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def parameter_groups(model, optim_cfg, model_cfg=None) -> list[dict]:
    """AdamW groups with their own ``lr``, ``weight_decay`` and ``eps``, from ``optim_cfg`` (an
    :class:`~satlab.config.schema.OptimConfig`) and the parametrisation of ``model_cfg`` (default ``model.cfg``).

    Weight decay applies to matrices only (not norms, gains, biases or the variants' static mixing weights) unless
    ``optim.decay_all``. Each parameter's learning rate, decay and epsilon are ``optim.lr``, ``optim.weight_decay``
    and ``optim.eps`` times what its class derives (:func:`~satlab.models.parametrization.parameter_table`: all 1
    under ``sp``); the parameters of modules in the ``gate`` learning-rate group (SATFormer's gates) get
    ``optim.gate_lr_multiplier`` on top, an override of the derived rate. Under ``sp`` these are the groups (order and
    numbers) of runs from before the parametrisations, so their checkpoints' optimizer states load unchanged."""
    table = parameter_table(model, model.cfg if model_cfg is None else model_cfg)
    no_decay = model.no_weight_decay()
    lr_groups = model.lr_groups()
    buckets: dict[tuple, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        rule = table[name]
        is_gate = lr_groups.get(name) == "gate"
        decay = optim_cfg.decay_all or (param.ndim >= 2 and name not in no_decay)
        buckets.setdefault((decay, is_gate, rule.lr_mult, rule.wd_mult, rule.eps_mult), []).append(param)
    return [
        {"params": params, "weight_decay": optim_cfg.weight_decay * wd_mult if decay else 0.0,
         "lr": optim_cfg.lr * lr_mult * (optim_cfg.gate_lr_multiplier if is_gate else 1.0),
         "eps": optim_cfg.eps * eps_mult}
        for (decay, is_gate, lr_mult, wd_mult, eps_mult), params in sorted(buckets.items())
    ]


def rng_state() -> dict:
    """torch, CUDA, numpy and Python RNG states as tensors and plain data (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": repr(random.getstate()),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(ast.literal_eval(state["python"]))
