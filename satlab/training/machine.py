"""What machine this is, in words: the CPU's name and caches (a run's provenance tag, the bench's host line), and
what it computes fast: the precision ``train.precision: auto`` means here."""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from satlab.config.schema import ExperimentConfig

_CPUINFO = Path("/proc/cpuinfo")
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (with its model number: one name covers several generations)."""
    try:
        lines = _CPUINFO.read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for key, _, value in (line.partition(":") for line in lines if ":" in line):
        fields.setdefault(key.strip(), value.strip())  # the first core's
    name = " ".join(fields.get("model name", platform.processor() or platform.machine()).split())
    numbers = ", ".join(f"{label} {fields[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
                        if key in fields)
    return f"{name} ({numbers})" if numbers else name


def cpu_caches() -> dict[str, str]:
    """Data and unified cache sizes of core 0 by level, e.g. {"L2": "2048K", "L3": "266240K"} (empty off Linux)."""
    caches = {}
    for index in sorted(_CACHES.glob("index*")):
        try:
            if (index / "type").read_text().strip() != "Instruction":
                caches[f"L{(index / 'level').read_text().strip()}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return caches


GPU_ACCELERATORS = ("auto", "gpu", "cuda")
"""``train.accelerator`` values that train on a CUDA GPU when torch sees one."""


def auto_precision(accelerator: str = "auto") -> str:
    """What ``train.precision: auto`` means here for ``train.accelerator``: ``bf16-mixed`` on a CUDA GPU with bf16
    arithmetic (compute capability 8.0 or later: A100, H100, H200, RTX 30xx and later), ``32-true`` anywhere else:
    on a CPU without bf16 instructions, or a GPU that would only emulate it, bf16 runs many times slower than fp32.
    Imports torch, and on a GPU initializes CUDA in this process."""
    if accelerator not in GPU_ACCELERATORS:
        return "32-true"
    import torch

    if not torch.cuda.is_available():
        return "32-true"
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.3 has no including_emulation and counts only native support
        native = torch.cuda.is_bf16_supported()
    return "bf16-mixed" if native else "32-true"


def resolve_precision(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with ``train.precision: auto`` replaced by what it means on this machine (:func:`auto_precision`);
    any other precision is kept as it is."""
    if cfg.train.precision != "auto":
        return cfg
    train = dataclasses.replace(cfg.train, precision=auto_precision(cfg.train.accelerator))
    return dataclasses.replace(cfg, train=train)
