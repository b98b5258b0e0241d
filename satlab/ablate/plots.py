"""The report's figures: validation loss against tokens seen, overlaid per group (mean over seeds with its range),
and the groups' gate heatmaps side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from satlab.ablate.results import GroupResult  # noqa: E402


def loss_curves(groups: Sequence[GroupResult], labels: dict[str, str], path: Path, title: str) -> Path | None:
    """One line per group: the mean val/loss over its seeds at the token counts they share, shaded from the lowest
    to the highest seed. None when no run logged a curve."""
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
    axes.set_xlabel("tokens seen")
    axes.set_ylabel("validation loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


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
