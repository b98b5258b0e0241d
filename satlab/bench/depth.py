"""How the architectures' costs grow with depth at a fixed width: the paired bench at each depth, the overheads over
the Transformer, and one plot of the tokens/s ratios against depth.

A depth-mixing term that is O(L²) in total (DenseFormer's and MUDDFormer's weighted sums over all earlier layers)
against a backbone that is O(L) gives a time overhead over the Transformer that grows ∝ L: about 2x per doubling of
depth. A per-layer cost (hyper-connections' stream mixing) gives a constant overhead: about 1x per doubling.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from satlab.bench.throughput import BenchResult, run_bench


def depth_sweep(archs: Sequence[str], depths: Sequence[int], **bench_args) -> dict[int, list[BenchResult]]:
    """:func:`run_bench` of ``archs`` at each depth (``n_layers``), everything else as the size preset says."""
    overrides = bench_args.pop("overrides", None) or {}
    return {depth: run_bench(archs, overrides={**overrides, "n_layers": depth}, **bench_args) for depth in depths}


def overheads(sweep: dict[int, list[BenchResult]]) -> dict[str, dict]:
    """Per architecture and depth: time overhead (reference tokens/s over its own, minus 1), memory overhead, and the
    growth of the time overhead per doubling of depth (a least-squares slope of log overhead against log2 depth)."""
    import numpy as np

    table: dict[str, dict] = {}
    for depth, results in sorted(sweep.items()):
        base = next(r for r in results if r.ratio is None)
        for r in results:
            if r.ratio is None:
                continue
            row = table.setdefault(r.arch, {"time": {}, "memory": {}})
            row["time"][depth] = 1 / r.ratio.mean - 1
            row["memory"][depth] = r.peak_mem_gb / base.peak_mem_gb - 1
    for row in table.values():
        depths = sorted(row["time"])
        values = np.array([row["time"][d] for d in depths])
        row["growth_per_doubling"] = (float(2 ** np.polyfit(np.log2(depths), np.log2(values), 1)[0])
                                      if len(depths) > 1 and (values > 0).all() else None)
    return table


def plot_depth_sweep(sweep: dict[int, list[BenchResult]], path: Path, title: str) -> Path:
    """Tokens/s ratio to the reference against depth, one line per architecture, with the 95 % intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from satlab.config.archs import label

    depths = sorted(sweep)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    archs = [r.arch for r in sweep[depths[0]] if r.ratio is not None]
    for arch in archs:
        ratios = [next(r.ratio for r in sweep[d] if r.arch == arch) for d in depths]
        means = [q.mean for q in ratios]
        ax.errorbar(depths, means, yerr=[[m - q.low for m, q in zip(means, ratios, strict=True)],
                                         [q.high - m for m, q in zip(means, ratios, strict=True)]],
                    marker="o", capsize=3, label=label(arch))
    reference = next(r.arch for r in sweep[depths[0]] if r.ratio is None)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("layers")
    ax.set_ylabel(f"tokens/s relative to {label(reference)}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
