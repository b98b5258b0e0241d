"""Lightning's overhead: the same model and batch stepped by a bare PyTorch loop and by satlab's LightningModule
under a Trainer (same optimizer groups, schedule and gradient clipping), as a ratio of median step times."""

from __future__ import annotations

import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from satlab.config.derived import derive_schedule
from satlab.config.loader import load_experiment
from satlab.training.module import LMModule, lr_factor, parameter_groups


class _StepTimer(L.Callback):
    def __init__(self, warmup: int):
        self.warmup, self.times = warmup, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


def lightning_overhead(arch: str = "satformer", size: str = "tiny", batch: int = 8, seq_len: int = 256,
                       steps: int = 10, warmup: int = 3, seed: int = 0) -> dict[str, float]:
    """Median step seconds of both loops on the CPU and their ratio (Lightning / bare)."""
    cfg = load_experiment("default", [f"model.arch={arch}", f"model.size={size}", f"data.seq_len={seq_len}",
                                      f"train.micro_batch_size={batch}", f"train.global_batch_tokens={batch * seq_len}",
                                      f"train.max_tokens={batch * seq_len * (steps + warmup)}"])
    schedule = derive_schedule(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    sample = (tokens[:, :-1], tokens[:, 1:])

    torch.manual_seed(seed)
    module = LMModule(cfg, schedule)
    bare_times = _bare_loop(module, sample, cfg, schedule, steps, warmup)

    torch.manual_seed(seed)
    module = LMModule(cfg, schedule)
    timer = _StepTimer(warmup)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + warmup, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=cfg.optim.grad_clip, callbacks=[timer], limit_val_batches=0)
    trainer.fit(module, train_dataloaders=DataLoader([sample] * (steps + warmup), batch_size=None))
    bare, lightning = statistics.median(bare_times), statistics.median(timer.times)
    return {"bare_step_s": bare, "lightning_step_s": lightning, "ratio": lightning / bare}


def _bare_loop(module: LMModule, sample, cfg, schedule, steps: int, warmup: int) -> list[float]:
    optim = cfg.optim
    optimizer = torch.optim.AdamW(parameter_groups(module.model, optim.weight_decay, optim.decay_all, optim.lr,
                                                   optim.gate_lr_multiplier), betas=tuple(optim.betas), eps=optim.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, schedule.warmup_steps, schedule.max_steps, optim.min_lr_ratio))
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        loss = module.loss(*sample)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.model.parameters(), optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
