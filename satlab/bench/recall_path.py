"""The synthetic-recall training path against a plain PyTorch loop: where a recall step's time goes.

Three loops train the same shape (MQAR batches from :mod:`satlab.data.mqar`, head at the answer positions only,
AdamW): a minimal attention model written here in plain PyTorch (the yardstick), satlab's zoo model in the same
bare loop, and satlab's full path (``LMModule`` + ``LMDataModule`` under a Lightning ``Trainer``, as ``satlab
train`` runs it, without logging or checkpoints). The bare loops time each phase (batch generation, forward,
backward, optimizer), so the table says where the time goes, not only how much there is.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from satlab.config.derived import derive_schedule
from satlab.config.loader import load_experiment
from satlab.data.mqar import IGNORE_INDEX, MQARBatches, MQARTask
from satlab.data.vocabulary import model_vocabulary
from satlab.training.datamodule import LMDataModule
from satlab.training.module import LMModule

PHASES = ("data", "forward", "backward", "optimizer")


class PlainAttentionLM(nn.Module):
    """Embedding, ``layers`` pre-norm causal single-head attention blocks with RoPE-free learned positions, final
    norm, tied head at the selected positions: the smallest model that does the task, with no satlab code."""

    def __init__(self, vocab: int, d: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq_len, d))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))
        self.final = nn.LayerNorm(d)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: Tensor, select: Tensor) -> Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for norm, qkv, out in zip(self.norms, self.qkv, self.out, strict=True):
            q, k, v = qkv(norm(x)).unsqueeze(1).chunk(3, dim=-1)
            x = x + out(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return F.linear(self.final(x[select]), self.embed.weight)


def _timed_loop(model: nn.Module, forward, batches: MQARBatches, steps: int, warmup: int, lr: float) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    for step in range(steps + warmup):
        t0 = time.perf_counter()
        x, y = batches.micro_batch(step)
        t1 = time.perf_counter()
        scored = y != IGNORE_INDEX
        loss = F.cross_entropy(forward(model, x, scored), y[scored])
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if step >= warmup:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phases[phase].append(seconds)
    medians = {p: statistics.median(v) for p, v in phases.items()}
    steps_total = [sum(parts) for parts in zip(*phases.values(), strict=True)]
    return {"step_s": statistics.median(steps_total), **{f"{p}_s": s for p, s in medians.items()}}


class _StepTimer(L.Callback):
    """Wall time from one optimizer step's end to the next (batch fetch and logging included)."""

    def __init__(self, warmup: int):
        self.warmup, self.times, self._last = warmup, [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None and batch_idx > self.warmup:
            self.times.append(now - self._last)
        self._last = now


def recall_path_bench(experiment: str = "recall/mqar", batch: int = 512, seq_len: int = 64, steps: int = 10,
                      warmup: int = 3, arch: str = "transformer") -> dict:
    """Median step seconds (and phases) of the three loops, and satlab's ratios to the plain one."""
    tokens = batch * seq_len
    cfg = load_experiment(experiment, [f"model.arch={arch}", f"data.seq_len={seq_len}",
                                       f"train.micro_batch_size={batch}", f"train.global_batch_tokens={tokens}",
                                       f"train.max_tokens={tokens * (steps + warmup + 1)}", "tracking.enabled=false"])
    task = MQARTask(replace(cfg.data.mqar, eval_sequences=batch), seq_len)
    batches = MQARBatches(task, batch, seed=0)
    lr = cfg.optim.lr

    torch.manual_seed(0)
    plain = PlainAttentionLM(task.vocab_size, 64, cfg.model.n_layers or 2, seq_len)
    result = {"batch": batch, "seq_len": seq_len, "arch": arch,
              "plain": _timed_loop(plain, lambda m, x, s: m(x, s), batches, steps, warmup, lr)}

    cfg = model_vocabulary(cfg).sized(cfg)  # the recall task's token ids, as a run derives them
    schedule = derive_schedule(cfg)
    torch.manual_seed(0)
    module = LMModule(cfg, schedule)
    result["zoo_bare"] = _timed_loop(module.model, lambda m, x, s: m(x, select=s).logits, batches, steps, warmup, lr)

    torch.manual_seed(0)
    module = LMModule(cfg, schedule)
    data = LMDataModule(replace(cfg, data=replace(cfg.data, mqar=replace(cfg.data.mqar, eval_sequences=batch))))
    data.set_schedule(schedule)
    timer = _StepTimer(warmup)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + warmup + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=cfg.optim.grad_clip, callbacks=[timer], limit_val_batches=0,
                        num_sanity_val_steps=0, log_every_n_steps=cfg.train.log_every_n_steps)
    trainer.fit(module, datamodule=data)
    result["satlab_trainer"] = {"step_s": statistics.median(timer.times)}
    plain_step = result["plain"]["step_s"]
    result["ratio_zoo_bare"] = result["zoo_bare"]["step_s"] / plain_step
    result["ratio_satlab_trainer"] = result["satlab_trainer"]["step_s"] / plain_step
    return result
