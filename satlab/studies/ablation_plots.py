"""The ablation report's figures: a validation metric against tokens seen per group (mean over seeds with its
range), a metric against a difficulty axis per architecture, and gate heatmaps side by side."""

from __future__ import annotations

import math
import textwrap
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
    """The learning curves (:func:`draw_curves`) in one plot. None when no run logged a curve past its start."""
    figure, axes = plt.subplots(figsize=(8, 5))
    if not draw_curves(axes, groups, labels):
        plt.close(figure)
        return None
    axes.xaxis.set_major_formatter(EngFormatter())
    return save_figure(figure, path, title, axes, "tokens seen (the untrained validation at 0 left out)", ylabel)


def draw_curves(axes: plt.Axes, groups: Sequence[GroupResult], labels: dict[str, str]) -> bool:
    """One line per group at the token counts its seeds share, shaded from the lowest to the highest seed, from the
    first validation after training began; whether any group had one. The validation before training (at 0 tokens)
    is left out: it is about the same for every cell (a loss near log(vocabulary)), compares nothing, and on the
    same scale would squash the differences the plot is for; the matched-token table leaves it out too. The y-range
    is then matplotlib's own fit of everything drawn, so no curve leaves the frame (a range cut below the first
    point would clip the start of the curves)."""
    drawn = False
    for i, group in enumerate(g for g in groups if any(c.curve for c in g.cells)):
        tokens, rows = group.shared_curve()
        trained = [j for j, t in enumerate(tokens) if t > 0]
        if not trained:
            continue
        x, values = [tokens[j] for j in trained], np.array(rows)[:, trained]
        color = plt.get_cmap("tab10")(i % 10)
        axes.plot(x, values.mean(axis=0), color=color, marker="o", markersize=3,
                  label=f"{labels[group.label]} (n={len(rows)})")
        if len(rows) > 1:
            axes.fill_between(x, values.min(axis=0), values.max(axis=0), color=color, alpha=0.15, linewidth=0)
        drawn = True
    return drawn


def metric_vs_axis(groups: Sequence[GroupResult], axis: str, line_key: str, metric: str, names: dict[str, str],
                   path: Path, title: str) -> Path | None:
    """One line per value of ``line_key`` (the architecture): the mean ± std of ``metric`` over seeds at each value
    of ``axis`` (the difficulty), in grid order. None when no group has the metric."""
    points = list(dict.fromkeys(g.values[axis] for g in groups))
    figure, axes = plt.subplots(figsize=(8, 5))
    for line in dict.fromkeys(g.values[line_key] for g in groups):
        found = {i: g.samples(metric) for g in groups for i, p in enumerate(points)
                 if g.values[line_key] == line and g.values[axis] == p and g.samples(metric)}
        if found:
            axes.errorbar(list(found), [np.mean(s) for s in found.values()], marker="o", capsize=3,
                          yerr=[np.std(s, ddof=1) if len(s) > 1 else 0.0 for s in found.values()],
                          label=names.get(line, str(line)))
    if not axes.lines:
        plt.close(figure)
        return None
    axes.set_xticks(range(len(points)), [str(p) for p in points])
    return save_figure(figure, path, title, axes, axis, metric.replace("_", " "))


def tile_images(items: Sequence[tuple[str, Path]], path: Path, title: str, columns: int = 3) -> Path | None:
    """The images side by side (``columns`` per row), each under its label. None when there are none."""
    if not items:
        return None
    columns = min(columns, len(items))
    rows = math.ceil(len(items) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.5 * rows), squeeze=False)
    for ax in grid.flat:
        ax.axis("off")
    for ax, (label, image) in zip(grid.flat, items, strict=False):
        ax.imshow(plt.imread(image))
        ax.set_title(label, fontsize=10)
    return save_figure(figure, path, title, dpi=110)


def save_figure(figure: plt.Figure, path: Path, title: str, axes: plt.Axes | None = None, xlabel: str = "",
          ylabel: str = "", dpi: int = 120) -> Path:
    """Title the figure (and label, grid and legend a line plot's ``axes``), write it to ``path`` and close it. A
    title wider than the figure is wrapped (matplotlib would cut it at both edges)."""
    title = textwrap.fill(title, width=max(40, int(figure.get_figwidth() * 11)))
    if axes is None:
        figure.suptitle(title)
    else:
        axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path
