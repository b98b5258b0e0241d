"""The machine a bench ran on, measured next to its ratios.

At small widths the architectures that add passes over the hidden states (dense depth loops, gates, extra norms)
are bound by memory bandwidth, and a shared host's bandwidth changes from run to run with its neighbours
(docs/results/2026-12-02-bench-tiny.md gives a case). The bench therefore records what the host was (CPU, caches,
threads, fp32 matmul rate, memory copy bandwidth before and after the rounds), so two bench files can be told apart
by their machines, not only their code.
"""

from __future__ import annotations

import time

import torch

from satlab.training.machine import cpu_caches, cpu_model
from satlab.training.perf import measure_cpu_matmul_peak


def measure_memory_bandwidth(megabytes: int = 256, seconds: float = 0.3) -> float:
    """Bytes per second read plus written by copying a tensor larger than a core's caches, with torch's threads."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        target.copy_(source)
        count += 1
    return 2 * source.nbytes * count / (time.perf_counter() - start)


def describe_host(device: torch.device) -> dict:
    """What the bench's device was: on a GPU its name and memory, on a CPU its model, caches, threads, measured
    fp32 matmul rate and memory bandwidth (``memory_gbps``: a list, one entry per :func:`remeasure`)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": props.name, "memory_gb": props.total_memory / 1e9, "torch": torch.__version__}
    return {"device": cpu_model(), "caches": cpu_caches(), "threads": torch.get_num_threads(),
            "matmul_gflops": measure_cpu_matmul_peak() / 1e9, "memory_gbps": [measure_memory_bandwidth() / 1e9],
            "torch": torch.__version__}


def remeasure(host: dict) -> dict:
    """Add a second bandwidth measurement (after the rounds) to a CPU host's description."""
    if "memory_gbps" in host:
        host["memory_gbps"].append(measure_memory_bandwidth() / 1e9)
    return host


def host_line(host: dict) -> str:
    """One line for the bench's printout."""
    if "memory_gbps" not in host:
        return f"host: {host['device']}, {host['memory_gb']:.0f} GB, torch {host['torch']}"
    caches = ", ".join(f"{level} {size}" for level, size in host["caches"].items() if level != "L1")
    bandwidth = " -> ".join(f"{gbps:.1f}" for gbps in host["memory_gbps"])
    return (f"host: {host['device']}, {host['threads']} threads{', ' + caches if caches else ''}; fp32 matmul "
            f"{host['matmul_gflops']:.0f} GFLOP/s, memory copy {bandwidth} GB/s (before -> after the rounds)")
