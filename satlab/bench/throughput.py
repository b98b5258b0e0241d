"""A fair side-by-side training benchmark: one process, each architecture stepped right after the reference in every
round (paired ratios with confidence intervals), warm-up and compile time excluded from throughput and reported
apart, memory and MFU per architecture.

Memory: on CUDA, ``max_memory_allocated`` over each architecture's own steps. On a CPU there is no allocator
statistic, and RSS mixes all the models of the process, so the bench takes the peak of one step's live tensors from
torch's ``MemTracker`` (parameters, gradients, optimizer state, activations and temporaries; tensors recomputed in
backward count only while they are alive, which a count of saved tensors would miss).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats

from satlab.config.schema import OptimConfig
from satlab.models import build_model, count_params, flops_per_token
from satlab.training.module import parameter_groups
from satlab.training.parallel import compile_blocks
from satlab.training.perf import device_peak_flops, keep_freed_memory


@dataclass
class PairedRatio:
    """An architecture's tokens/s over the reference's from rounds in which the two ran back to back (reference step,
    then its step): the geometric mean of the per-round ratios and its 95 % t-interval. Pairing cancels the drift
    of a machine's speed between rounds, which unpaired medians (spread 7-22 % per step here) cannot resolve."""

    reference: str
    ratios: list[float] = field(repr=False)

    def _log_stats(self) -> tuple[float, float]:
        logs = np.log(self.ratios)
        if len(logs) < 2:
            return float(logs.mean()), float("inf")
        return float(logs.mean()), float(stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs)))

    @property
    def mean(self) -> float:
        return float(np.exp(self._log_stats()[0]))

    @property
    def low(self) -> float:
        mean, half = self._log_stats()
        return float(np.exp(mean - half))

    @property
    def high(self) -> float:
        mean, half = self._log_stats()
        return float(np.exp(mean + half))

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the ratio (0.01: ± 1 %)."""
        return (self.high - self.low) / 2 / self.mean

    def as_dict(self) -> dict:
        return {"reference": self.reference, "rounds": len(self.ratios), "mean": self.mean, "low": self.low,
                "high": self.high, "half_width": self.half_width}


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
    ratio: PairedRatio | None = None  # tokens/s against the reference (None for the reference itself)
    graphs: int | None = None  # with compile: the graphs dynamo made for it (0: it reused another's)

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
        data["ratio"] = self.ratio.as_dict() if self.ratio is not None else None
        data.update(median_step=self.median_step, spread=self.spread, tokens_per_sec=self.tokens_per_sec,
                    tflops=self.tflops, mfu=self.mfu)
        return data


class _Runner:
    """One architecture's model, optimizer and fixed batch, stepped on demand."""

    def __init__(self, arch: str, size: str, batch: int, seq_len: int, device: torch.device, dtype: torch.dtype,
                 compile: bool, seed: int, overrides: dict, label: str | None = None):
        torch.manual_seed(seed)
        self.arch = label or arch
        self.device = device
        self.dtype = dtype
        self.model = build_model(dict(arch=arch, size=size, **overrides)).to(device)
        # the training's own AdamW groups (per-group lr, decay and eps: one group under sp, a few under mup/completep)
        groups = parameter_groups(self.model, OptimConfig(lr=1e-4))
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda" or None)
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.model.cfg.vocab_size, (batch, seq_len + 1), generator=generator)
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.compile_seconds = 0.0
        self.graphs: int | None = None
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
    """Peak bytes of live tensors over one training step."""
    # A private module, but torch's own tool for this (the public profiler gives per-op allocations, not a peak).
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(runner.model, runner.optimizer)
    # MemTracker is a dispatch mode, which compiled graphs cannot run under: a compiled model's step is measured
    # eagerly (the same code; inductor's fusions would only lower the peak).
    with tracker, torch.compiler.set_stance("force_eager"):
        runner.step()
    return int(tracker.get_tracker_snapshot("peak")[runner.device]["Total"])


def compiled_graphs() -> int:
    """The graphs dynamo has made in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def bench_device(device: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; otherwise the device named."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def run_bench(archs: Sequence[str], size: str = "tiny", batch: int = 8, seq_len: int = 256, rounds: int = 10,
              warmup: int = 3, device: str = "auto", precision: str = "32-true", compile: bool = False,
              seed: int = 0, overrides: dict | None = None, ci_target: float | None = None,
              max_rounds: int | None = None, compare: tuple[str, Sequence] | None = None) -> list[BenchResult]:
    """Interleaved training-step benchmark of ``archs`` at one size and batch. Each round steps the reference (the
    Transformer if present, else the first) and then each other architecture, in pairs; after ``rounds`` rounds it
    goes on while some ratio's 95 % interval is wider than ± ``ci_target``, up to ``max_rounds``.

    ``compare`` = (model field, values): each architecture is built once per value instead (labelled ``arch
    field:value``, a name MLflow takes in its metric names), and each is paired with the same architecture at the
    first value: the runtime cost of a model option, such as ``("parametrization", ["sp", "completep"])``."""
    keep_freed_memory()
    dev = bench_device(device)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    field_name, values = compare or (None, [None])
    runners = [_Runner(a, size, batch, seq_len, dev, dtype, compile, seed,
                       {**(overrides or {}), **({field_name: v} if field_name else {})},
                       f"{a} {field_name}:{v}" if field_name else None) for a in archs for v in values]
    for runner in runners:  # warm-up (and compilation) of each model, timed apart
        start, graphs = time.perf_counter(), compiled_graphs()
        for _ in range(warmup):
            runner.step()
        if compile:
            runner.compile_seconds, runner.graphs = time.perf_counter() - start, compiled_graphs() - graphs
    if field_name:  # each architecture against itself at the first value
        reference_of = {r: runners[i - i % len(values)] for i, r in enumerate(runners)}
    else:
        first = next((r for r in runners if r.arch == "transformer"), runners[0])
        reference_of = {r: first for r in runners}
    others = [r for r in runners if reference_of[r] is not r]
    times: dict[str, list[float]] = {r.arch: [] for r in runners}
    ratios = {r.arch: PairedRatio(reference_of[r].arch, []) for r in others}
    done = 0
    while done < rounds or (ci_target is not None and done < (max_rounds or rounds)
                            and any(r.half_width > ci_target for r in ratios.values())):
        for runner in others or runners[:1]:
            reference = reference_of[runner]
            reference_time = reference.step()
            times[reference.arch].append(reference_time)
            if runner is not reference:
                times[runner.arch].append(runner.step())
                ratios[runner.arch].ratios.append(reference_time / times[runner.arch][-1])
        done += 1
    peak, _ = device_peak_flops(dev, precision)
    return [
        BenchResult(
            arch=r.arch, params=count_params(r.model), tokens_per_step=batch * seq_len, step_times=times[r.arch],
            compile_seconds=r.compile_seconds, peak_mem_gb=r.memory_gb(),
            flops_per_token=flops_per_token(r.model, seq_len), peak_flops=peak, ratio=ratios.get(r.arch),
            graphs=r.graphs,
        )
        for r in runners
    ]
