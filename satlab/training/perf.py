"""Throughput, MFU and memory, computed by satlab.

Lightning's ``ThroughputMonitor`` knows no H200 and uses sparse peaks, so MFU here uses a dense bf16 peak table
(or, on a CPU, a matmul peak measured in the same process) and the analytic FLOPs per token.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
import time

import lightning as L
import torch

# Dense (no 2:4 sparsity) peak FLOP/s per device for bf16/fp16 tensor-core math, and fp32 (tf32 off) where known.
DENSE_PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s or None if unknown, a label saying where the number came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(DENSE_PEAK_BF16, key=len, reverse=True):
            if key.lower() in name.lower():
                peak = DENSE_PEAK_BF16[key]
                return (peak if "16" in precision else peak / 2), f"{key} dense table"  # fp32 runs on TF32 at half rate
        return None, f"unknown device '{name}': no MFU"
    return measure_cpu_matmul_peak(), "cpu fp32 matmul measured"


def keep_freed_memory() -> bool:
    """Keep freed memory in the process rather than hand it back to the OS; True when the C library took it.

    glibc returns large freed blocks at once (munmap, or trimming the heap), and the next training step faults every
    page of them in again, zero-filled by the kernel: about 37,000 page faults (150 MB) per tiny step on the 2-core
    CPU here, 15-25 % of the step's time and most of the bench's run-to-run noise, and more for the architectures
    whose allocations happen to fall that way. No mmap for large blocks and no trimming is what jemalloc and tcmalloc
    (which the PyTorch CPU tuning guides recommend) do by default; the process keeps its peak, as CUDA's caching
    allocator does. A no-op off glibc (``mallopt`` is glibc's)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return all(libc.mallopt(option, value) == 1 for option, value in
                   ((m_mmap_max, 0), (m_trim_threshold, 2**31 - 1)))
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False


_CPU_PEAK: float | None = None


def measure_cpu_matmul_peak(size: int = 1024, seconds: float = 0.5) -> float:
    """fp32 matmul FLOP/s of this CPU with torch's current thread count (measured once per process)."""
    global _CPU_PEAK
    if _CPU_PEAK is None:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, b)
            count += 1
        _CPU_PEAK = 2 * size**3 * count / (time.perf_counter() - start)
    return _CPU_PEAK


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


class ThroughputCallback(L.Callback):
    """Logs system/tokens_per_sec, system/mfu, system/peak_mem_gb, system/data_wait_frac and, with more than one
    device, system/tokens_per_sec_per_device; the peak FLOP/s the MFU divides by is the run's tag
    ``peak_tflops_used_for_mfu``.

    Rates are averaged over the optimizer steps since the last log, with the first ``warmup_steps`` steps (compile,
    allocator warm-up) left out; time spent in validation is not counted.
    """

    def __init__(self, flops_per_token: float, tokens_per_step: int, warmup_steps: int = 2):
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.warmup_steps = warmup_steps
        self.peak: float | None = None
        self.peak_label = ""
        self._reset()
        self.total_train_time = 0.0
        self.total_train_tokens = 0
        self._last_end: float | None = None
        self._seen_step = -1

    def _reset(self) -> None:
        self.window_time = 0.0
        self.window_wait = 0.0
        self.window_steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.peak, self.peak_label = device_peak_flops(pl_module.device, trainer.precision)
        self.world_size = trainer.world_size
        self._seen_step = trainer.global_step
        logger = trainer.logger
        if self.peak and trainer.is_global_zero and getattr(logger, "run_id", None):  # a tag: a resumed run may
            logger.experiment.set_tag(logger.run_id, "peak_tflops_used_for_mfu",    # be on another device
                                      f"{self.peak / 1e12:.4g} ({self.peak_label})")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self.window_wait += now - self._last_end
            self.window_time += now - self._last_end
        self._batch_start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.window_time += now - self._batch_start
        self._last_end = now
        if trainer.global_step != self._seen_step:  # an optimizer step finished with this micro-batch
            self._seen_step = trainer.global_step
            self.window_steps += 1
            if trainer.global_step <= self.warmup_steps:
                self._reset()
                return
            if trainer.global_step % max(1, trainer.log_every_n_steps) == 0 or self.window_steps >= 50:
                self._log(pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last_end = None  # validation time is not training time

    def _log(self, pl_module) -> None:
        if self.window_time <= 0 or self.window_steps == 0:
            return
        tokens = self.window_steps * self.tokens_per_step
        rate = tokens / self.window_time
        self.total_train_time += self.window_time
        self.total_train_tokens += tokens
        metrics = {
            "system/tokens_per_sec": rate,
            "system/peak_mem_gb": peak_memory_gb(pl_module.device),
            "system/data_wait_frac": self.window_wait / self.window_time,
        }
        if self.world_size > 1:  # on one device it would repeat tokens_per_sec
            metrics["system/tokens_per_sec_per_device"] = rate / self.world_size
        if self.peak:  # the peak it divides by is a constant: a tag (on_train_start), not a series
            metrics["system/mfu"] = rate / self.world_size * self.flops_per_token / self.peak
        pl_module.log_dict(metrics, prog_bar=False)
        pl_module.log("tok/s", rate, prog_bar=True, logger=False)
        self._reset()

    @property
    def mean_tokens_per_sec(self) -> float | None:
        return self.total_train_tokens / self.total_train_time if self.total_train_time else None
