"""The LightningModule that trains any zoo model as a language model."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics

from satlab.config.derived import Schedule
from satlab.config.schema import ExperimentConfig
from satlab.models import build_model
from satlab.training.checkpoint import KEY as CHECKPOINT_KEY
from satlab.training.checkpoint import satlab_entry
from satlab.training.parallel import compile_blocks, shard_model


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine from 1 down to ``min_ratio`` at ``max_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LMModule(L.LightningModule):
    """Next-token cross-entropy on a zoo model, AdamW with warmup + cosine, validation loss and perplexity."""

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

    def configure_model(self) -> None:
        """Per-block compile, then FSDP2 sharding under the model-parallel strategy (see ``parallel.py``)."""
        if self._configured:
            return
        self._configured = True
        if self.cfg.train.compile:
            compile_blocks(self.model)
        if self.cfg.train.strategy == "model_parallel":
            shard_model(self.model, self.device_mesh["data_parallel"], self.cfg.train.precision,
                        self.cfg.train.activation_checkpointing)

    def forward(self, idx: torch.Tensor):
        return self.model(idx)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def on_train_start(self) -> None:
        self.tokens_seen = self.global_step * self.schedule.tokens_per_step

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
        self.log("train/loss", step_loss, prog_bar=True, sync_dist=True)
        self.log("tokens_seen", float(self.tokens_seen))
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(total, "full_tensor"):  # FSDP2 shards gradients as DTensors
            total = total.full_tensor()
        self.log("train/grad_norm", total)
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def validation_step(self, batch, batch_idx: int) -> None:
        idx, targets = batch
        self.val_loss.update(self.loss(idx, targets), weight=targets.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.tokenizer is not None:
            checkpoint[CHECKPOINT_KEY] = satlab_entry(self.cfg, self.tokenizer)

    def configure_optimizers(self):
        optim = self.cfg.optim
        groups = parameter_groups(self.model, optim.weight_decay, optim.decay_all, optim.lr, optim.gate_lr_multiplier)
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                      fused=self.device.type == "cuda" or None)
        s = self.schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, s.warmup_steps, s.max_steps, optim.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def parameter_groups(model, weight_decay: float, decay_all: bool, lr: float, gate_lr_multiplier: float):
    """AdamW groups: decay matrices only (not norms, gains, biases or the variants' static mixing weights) unless
    ``decay_all``; SATFormer gate parameters get ``gate_lr_multiplier`` × lr."""
    no_decay = model.no_weight_decay()
    buckets: dict[tuple[bool, bool], list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_gate = ".value_path." in name
        decay = decay_all or (param.ndim >= 2 and name not in no_decay)
        buckets.setdefault((decay, is_gate), []).append(param)
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0,
         "lr": lr * (gate_lr_multiplier if is_gate else 1.0)}
        for (decay, is_gate), params in sorted(buckets.items())
    ]
