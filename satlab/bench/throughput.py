"""A fair side-by-side training benchmark: one process, architectures interleaved (A B C A B C ...), warm-up and
compile time excluded from throughput and reported apart, memory and MFU per architecture.

Memory: on CUDA, ``max_memory_allocated`` over each architecture's own steps. On a CPU there is no allocator
statistic, and RSS mixes all the models of the process, so the bench counts what a step must hold: the tensors
autograd saves for backward (deduplicated by storage) plus parameters, gradients and the two Adam moments.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from satlab.models import build_model, count_params, flops_per_token
from satlab.training.parallel import compile_blocks
from satlab.training.perf import device_peak_flops


@dataclass
class BenchResult:
    arch: str
    params: int
    tokens_per_step: int
    step_times: list[float] = field(repr=False)
    compile_seconds: float
    peak_mem_gb: float
    flops_per_token: float
    peak_flops: float | None

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_times)

    @property
    def spread(self) -> float:
        """Interquartile range of the step time, relative to the median."""
        q = statistics.quantiles(self.step_times, n=4) if len(self.step_times) > 1 else [self.median_step] * 3
        return (q[2] - q[0]) / self.median_step

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_step / self.median_step

    @property
    def tflops(self) -> float:
        return self.tokens_per_sec * self.flops_per_token / 1e12

    @property
    def mfu(self) -> float | None:
        return self.tflops * 1e12 / self.peak_flops if self.peak_flops else None

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(median_step=self.median_step, spread=self.spread, tokens_per_sec=self.tokens_per_sec,
                    tflops=self.tflops, mfu=self.mfu)
        return data


class _Runner:
    """One architecture's model, optimizer and fixed batch, stepped on demand."""

    def __init__(self, arch: str, size: str, batch: int, seq_len: int, device: torch.device, dtype: torch.dtype,
                 compile: bool, seed: int, overrides: dict):
        torch.manual_seed(seed)
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.model = build_model(dict(arch=arch, size=size, **overrides)).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=device.type == "cuda" or None)
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.model.cfg.vocab_size, (batch, seq_len + 1), generator=generator)
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.compile_seconds = 0.0
        if compile:
            compile_blocks(self.model)

    def step(self) -> float:
        """One training step; returns its wall time (device-synchronised)."""
        _sync(self.device)
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(self.x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.y.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - start

    def memory_gb(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step()
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        return _cpu_step_memory(self) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_step_memory(runner: _Runner) -> int:
    """Bytes saved for backward by one forward pass, plus parameters, gradients and Adam's two moments."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = runner.model(runner.x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), runner.y.flatten())
    loss.backward()
    runner.optimizer.zero_grad(set_to_none=True)
    state_bytes = 4 * sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return sum(seen.values()) + state_bytes


def run_bench(archs: Sequence[str], size: str = "tiny", batch: int = 8, seq_len: int = 256, rounds: int = 10,
              warmup: int = 3, device: str = "auto", precision: str = "32-true", compile: bool = False,
              seed: int = 0, overrides: dict | None = None) -> list[BenchResult]:
    """Interleaved training-step benchmark of ``archs`` at one size and batch."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    runners = [_Runner(a, size, batch, seq_len, dev, dtype, compile, seed, overrides or {}) for a in archs]
    for runner in runners:  # warm-up (and compilation) of each model, timed apart
        start = time.perf_counter()
        for _ in range(warmup):
            runner.step()
        runner.compile_seconds = time.perf_counter() - start if compile else 0.0
    times: dict[str, list[float]] = {r.arch: [] for r in runners}
    for _ in range(rounds):
        for runner in runners:
            times[runner.arch].append(runner.step())
    peak, _ = device_peak_flops(dev, precision)
    return [
        BenchResult(
            arch=r.arch, params=count_params(r.model), tokens_per_step=batch * seq_len, step_times=times[r.arch],
            compile_seconds=r.compile_seconds, peak_mem_gb=r.memory_gb(),
            flops_per_token=flops_per_token(r.model, seq_len), peak_flops=peak,
        )
        for r in runners
    ]
