"""The report's figures: a validation metric against tokens seen, overlaid per group (mean over seeds with its
range), a metric against a difficulty axis per architecture, and the groups' gate heatmaps side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from satlab.studies.results import GroupResult  # noqa: E402


def loss_curves(groups: Sequence[GroupResult], labels: dict[str, str], path: Path, title: str,
                ylabel: str = "validation loss") -> Path | None:
    """One line per group: the mean of its curve metric (val/loss) over its seeds at the token counts they share,
    shaded from the lowest to the highest seed. None when no run logged a curve."""
    figure, axes = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab10")
    tops = []
    for i, group in enumerate(g for g in groups if any(c.curve for c in g.cells)):
        curves = [dict(c.curve) for c in group.cells if c.curve]
        tokens = sorted(set.intersection(*(set(c) for c in curves)))
        if not tokens:
            continue
        values = np.array([[c[t] for t in tokens] for c in curves])
        mean = values.mean(axis=0)
        color = colors(i % 10)
        axes.plot(tokens, mean, color=color, marker="o", markersize=3, label=f"{labels[group.label]} (n={len(curves)})")
        if len(curves) > 1:
            axes.fill_between(tokens, values.min(axis=0), values.max(axis=0), color=color, alpha=0.15, linewidth=0)
        tops.append(values[:, 1:].max() if values.shape[1] > 1 else values.max())
    if not tops:
        plt.close(figure)
        return None
    low, _ = axes.get_ylim()
    axes.set_ylim(low, max(tops) + 0.05 * (max(tops) - low))  # the untrained first point would squash the rest
    axes.xaxis.set_major_formatter(EngFormatter())
    return _save_lines(figure, axes, path, "tokens seen", ylabel, title)


def _save_lines(figure, axes, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Label, grid and legend a line plot, write it to ``path`` and close it."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def metric_vs_axis(groups: Sequence[GroupResult], axis: str, line_key: str, metric: str, names: dict[str, str],
                   path: Path, title: str) -> Path | None:
    """One line per value of ``line_key`` (the architecture): the mean of ``metric`` over seeds at each value of
    ``axis`` (the difficulty), in grid order, with ± one std. None when no group has the metric."""
    points = [v for v in dict.fromkeys(g.values[axis] for g in groups)]
    figure, axes = plt.subplots(figsize=(8, 5))
    drawn = False
    for line in dict.fromkeys(g.values[line_key] for g in groups):
        xs, means, stds = [], [], []
        for i, point in enumerate(points):
            group = next((g for g in groups if g.values[line_key] == line and g.values[axis] == point), None)
            samples = [] if group is None else group.samples(metric)
            if samples:
                xs.append(i)
                means.append(float(np.mean(samples)))
                stds.append(float(np.std(samples, ddof=1)) if len(samples) > 1 else 0.0)
        if xs:
            axes.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=names.get(line, str(line)))
            drawn = True
    if not drawn:
        plt.close(figure)
        return None
    axes.set_xticks(range(len(points)), [str(p) for p in points])
    return _save_lines(figure, axes, path, axis, metric.replace("_", " "), title)


def tile_images(items: Sequence[tuple[str, Path]], path: Path, title: str, columns: int = 3) -> Path | None:
    """The images side by side (``columns`` per row), each under its label. None when there are none."""
    if not items:
        return None
    columns = min(columns, len(items))
    rows = math.ceil(len(items) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.5 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (label, image) in zip(axes.flat, items, strict=False):
        ax.imshow(plt.imread(image))
        ax.set_title(label, fontsize=10)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
