"""Lightning's overhead: satlab's LightningModule stepped by a Trainer and by a bare PyTorch loop doing the same work
(the module's own loss, optimizer and schedule, the gradient norm it logs, the same clipping, the same batches from
the same DataLoader), in alternating blocks, as a paired ratio of step times.

A step is timed from one batch's start to the next one's in both loops, so fetching the batch, the scheduler step
and Lightning's logging are inside it. Each block starts a fresh optimizer (a new ``fit`` calls
``configure_optimizers``), and its first ``warmup`` steps are left out in both loops.
"""

from __future__ import annotations

import statistics
import time
import warnings
from itertools import pairwise

import lightning as L
import torch
from torch.utils.data import DataLoader

from satlab.bench.throughput import PairedRatio
from satlab.config.derived import derive_schedule
from satlab.config.loader import load_experiment
from satlab.training.module import LMModule
from satlab.training.perf import keep_freed_memory


class _StepTimer(L.Callback):
    """Seconds between consecutive batch starts (the last step ends at the end of the epoch)."""

    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())


def lightning_overhead(arch: str = "satformer", size: str = "tiny", batch: int = 8, seq_len: int = 256,
                       steps: int = 6, warmup: int = 2, rounds: int = 5, seed: int = 0, ci_target: float | None = None,
                       max_rounds: int | None = None) -> dict[str, float]:
    """Median step seconds of both loops on the CPU, and their paired ratio (Lightning / bare) with its 95 % CI;
    after ``rounds`` rounds it goes on while the interval is wider than ± ``ci_target``, up to ``max_rounds``."""
    keep_freed_memory()
    cfg = load_experiment("default", [f"model.arch={arch}", f"model.size={size}", f"data.seq_len={seq_len}",
                                      f"train.micro_batch_size={batch}", f"train.global_batch_tokens={batch * seq_len}",
                                      f"train.max_tokens={batch * seq_len * steps * max(rounds, max_rounds or 0)}"])
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    loader = DataLoader([(tokens[:, :-1], tokens[:, 1:])] * steps, batch_size=None)
    torch.manual_seed(seed)
    module = LMModule(cfg, derive_schedule(cfg))
    ratio, bare_medians, lightning_medians = PairedRatio("bare", []), [], []
    while len(ratio.ratios) < rounds or (ci_target is not None and len(ratio.ratios) < (max_rounds or rounds)
                                         and ratio.half_width > ci_target):
        bare = statistics.median(_bare_steps(module, loader, cfg.optim.grad_clip)[warmup:])
        timer = _StepTimer()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            gradient_clip_val=cfg.optim.grad_clip, callbacks=[timer],
                            log_every_n_steps=cfg.train.log_every_n_steps)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*val_dataloader.*")  # no validation here, on purpose
            trainer.fit(module, train_dataloaders=loader)
        lightning = statistics.median([b - a for a, b in pairwise(timer.starts)][warmup:])
        bare_medians.append(bare)
        lightning_medians.append(lightning)
        ratio.ratios.append(lightning / bare)
    return {"bare_step_s": statistics.median(bare_medians), "lightning_step_s": statistics.median(lightning_medians),
            "ratio": ratio.mean, "low": ratio.low, "high": ratio.high, "half_width": ratio.half_width,
            "rounds": len(ratio.ratios)}


def _bare_steps(module: LMModule, loader: DataLoader, grad_clip: float) -> list[float]:
    """One pass over ``loader`` doing what the Trainer does with the module; the seconds of each step."""
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    params = list(module.model.parameters())
    starts = []
    for idx, targets in loader:
        starts.append(time.perf_counter())
        loss = module.loss(idx, targets)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type=2.0)
        if bool(torch.isfinite(loss.detach()) and torch.isfinite(norm)):  # the module's skip check syncs likewise
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    starts.append(time.perf_counter())
    return [b - a for a, b in pairwise(starts)]
