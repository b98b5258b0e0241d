"""Figures of the gate analysis and of the static mixing weights, so dynamic (SATFormer) and static (ResFormer,
DenseFormer, hyper-connections, MUDDFormer) access to earlier layers can be compared side by side.

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``, rendered by Agg on save): no pyplot,
so no global figure registry to leak into and nothing to close; a figure is freed when it is no longer referenced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import nn

from satlab.evaluation.gates import GateReport
from satlab.models.architecture import MixingWeight

ANNOTATE_MAX_CELLS = 256


def _text(ax: Axes, row: int, col: int, label: str, shade: tuple[float, ...]) -> None:
    """A cell label in black or white, whichever reads better on the cell's colour."""
    color = "black" if np.mean(shade[:3]) > 0.5 else "white"
    ax.text(col, row, label, ha="center", va="center", fontsize=7, color=color)


def _norm(values: np.ndarray, signed: bool) -> Normalize:
    """Colour scale of ``values``: symmetric around 0 when signed, never of zero width."""
    if signed:
        vmax = float(np.abs(values).max()) or 1.0
        return Normalize(-vmax, vmax)
    low, high = float(values.min()), float(values.max())
    return Normalize(low, high if high > low else low + 1.0)


def plot_gate_heatmap(report: GateReport) -> Figure:
    """Mean gate per gated layer × KV head, annotated with mean and sparsity; dead heads framed red, other
    saturated heads framed orange and labelled with their bound."""
    mean = report.mean
    signed = bool(mean.min() < 0)
    cmap = colormaps["RdBu_r" if signed else "viridis"]
    norm = _norm(mean, signed)
    fig = Figure(figsize=(2.0 + 1.1 * report.heads, 1.4 + 0.55 * len(report.layers)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(mean, cmap=cmap, norm=norm, aspect="auto")
    fig.colorbar(image, ax=ax, label="mean gate")
    for (r, c), v in np.ndenumerate(mean):
        bound = report.saturated_at[r][c]
        label = f"{v:.2f}\n{report.sparsity[r, c]:.0%} zero" + ("" if bound is None else f"\nsat@{bound:g}")
        _text(ax, r, c, label, cmap(norm(v)))
        if report.dead[r, c] or bound is not None:
            color = "red" if report.dead[r, c] else "orange"
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=2.5))
    ax.set_xticks(range(report.heads), [str(h) for h in range(report.heads)] if report.heads > 1 else ["all"])
    ax.set_yticks(range(len(report.layers)), [str(layer) for layer in report.layers])
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(f"{report.label} gates ({report.gate_fn}, {report.granularity}, {report.n_tokens} tokens)", fontsize=9)
    handles = [Patch(fill=False, edgecolor="red", label="dead"), Patch(fill=False, edgecolor="orange",
                                                                       label="saturated")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    return fig


def plot_gate_categories(report: GateReport) -> Figure:
    """One panel per category, stacked: grouped bars of the mean gate per category value, one bar per gated
    layer, and a black tick for the mean over all gated layers; tick labels give the token counts. Stacked at a
    fixed width (900 px at the logged 120 dpi) so that MLflow's artifact viewer shows it whole at any depth and
    sequence length; side by side it grew past 1,500 px."""
    tables = report.categories
    fig = Figure(figsize=(7.5, 0.8 + 2.6 * len(tables)), layout="constrained")
    axes = fig.subplots(len(tables), 1, sharey=True, squeeze=False)[:, 0]
    cmap = colormaps["viridis"]
    n_layers = len(report.layers)
    bar = 0.8 / n_layers
    for ax, (name, table) in zip(axes, tables.items(), strict=True):
        x = np.arange(len(table.values))
        for row, layer in enumerate(report.layers):
            ax.bar(x - 0.4 + bar * (row + 0.5), table.layer_means[:, row], bar, color=cmap(row / max(n_layers - 1, 1)),
                   label=f"layer {layer}")
        ax.scatter(x, table.means, marker="_", s=400, color="black", zorder=3, label="all layers")
        ax.set_xticks(x, [f"{v}\nn={n}" for v, n in zip(table.values, table.counts, strict=True)], fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.axhline(0, color="grey", linewidth=0.5)
    axes[0].set_ylabel("mean gate")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, frameon=False, ncols=1 + len(labels) // 14)
    fig.suptitle(f"{report.label}: gate by token category ({report.gate_fn}, {report.granularity})", fontsize=10)
    return fig


def _plot_vectors(ax: Axes, vectors: dict[str, MixingWeight]) -> None:
    """1-D weights per layer (ResFormer λ: layers 1..L-1) as lines on shared axes."""
    for name, weight in vectors.items():
        values = weight.values.numpy()
        ax.plot(np.arange(weight.first_row, weight.first_row + len(values)), values, marker="o", label=name)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(next(iter(vectors.values())).row_label)
    ax.set_ylabel("weight")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.legend(fontsize=8)


def _plot_matrix(fig: Figure, ax: Axes, name: str, weight: MixingWeight) -> None:
    values = weight.values.numpy()
    rows, cols = values.shape
    missing = np.zeros_like(values, dtype=bool) if weight.missing is None else weight.missing.numpy()
    matrix = np.ma.masked_array(values, missing)
    cmap = colormaps["RdBu_r"].with_extremes(bad="0.8")
    norm = _norm(np.ma.compressed(matrix), signed=True)
    image = ax.imshow(matrix, cmap=cmap, norm=norm, aspect="auto")
    fig.colorbar(image, ax=ax)
    if rows * cols <= ANNOTATE_MAX_CELLS:
        for r, c in zip(*np.nonzero(~missing), strict=True):
            _text(ax, r, c, f"{matrix[r, c]:.2f}", cmap(norm(matrix[r, c])))
    ax.set_yticks(range(rows), weight.row_ticks or [str(weight.first_row + r) for r in range(rows)], fontsize=7)
    ax.set_xticks(range(cols), [str(c) for c in range(cols)], fontsize=7)
    ax.set_xlabel(weight.col_label, fontsize=8)
    ax.set_ylabel(weight.row_label, fontsize=8)
    ax.set_title(name, fontsize=9)


def plot_static_weights(model: nn.Module) -> dict[str, Figure]:
    """One figure per family of ``model.mixing_weights()`` (``resformer``, ``denseformer``, ...): 1-D weights as
    lines per layer, 2-D ones as annotated heatmaps, with the axes their architecture declares. Empty for a
    Transformer or SATFormer."""
    families: dict[str, dict[str, MixingWeight]] = {}
    for key, weight in model.mixing_weights().items():
        family, _, name = key.partition("/")
        families.setdefault(family, {})[name] = replace(weight, values=weight.values.detach().float().cpu())
    figures = {}
    for family, weights in families.items():
        vectors = {k: w for k, w in weights.items() if w.values.ndim == 1}
        matrices = {k: w for k, w in weights.items() if w.values.ndim == 2}
        panels = (1 if vectors else 0) + len(matrices)
        fig = Figure(figsize=(0.5 + 4.2 * panels, 3.8), layout="constrained")
        axes = list(fig.subplots(1, panels, squeeze=False)[0])
        if vectors:
            _plot_vectors(axes.pop(0), vectors)
        for ax, (name, weight) in zip(axes, matrices.items(), strict=True):
            _plot_matrix(fig, ax, name, weight)
        fig.suptitle(f"{family}: static mixing weights", fontsize=10)
        figures[family] = fig
    return figures


def value_access(model: nn.Module, report: GateReport | None = None) -> dict[int, float] | None:
    """Per layer, the coefficient on V_1 in V'_n: the mean gate (from ``report``), or the static weight the
    architecture declares as its V_1 coefficient (ResFormer's λ1, 0.5 when fixed); None otherwise."""
    architecture = getattr(model, "architecture", None)
    if report is not None:
        if architecture is not None and architecture.gate_target != "V_1":
            return None
        return {layer: float(report.mean[row].mean()) for row, layer in enumerate(report.layers)}
    for weight in model.mixing_weights().values():
        if weight.v1_coefficient:
            return {weight.first_row + n: float(v) for n, v in enumerate(weight.values.tolist())}
    return None


def plot_value_access(curves: Mapping[str, Mapping[int, float]]) -> Figure:
    """Value access per layer for several models on one axes, e.g. ``{"satformer": value_access(sat, report),
    "resformer": value_access(res)}``: dynamic (mean gate) against static (λ1) access to V_1."""
    fig = Figure(figsize=(5.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for name, curve in curves.items():
        layers = sorted(curve)
        ax.plot(layers, [curve[n] for n in layers], marker="o", label=name)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("layer")
    ax.set_ylabel("weight on V_1 (mean gate or λ1)")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_title("Value access per layer", fontsize=10)
    if curves:
        ax.legend(fontsize=8)
    return fig


def plot_layer_means(layers: list[int], history: list[tuple[int, list[float]]], label: str) -> Figure:
    """The mean gate of every gated layer against the training step, one line per layer (coloured by depth), in
    one chart: how access to V_1 develops, layer by layer."""
    fig = Figure(figsize=(7.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    steps = [step for step, _ in history]
    values = np.array([means for _, means in history])
    for column, layer in enumerate(layers):
        ax.plot(steps, values[:, column], marker="o" if len(steps) < 12 else None, markersize=3,
                color=cmap(column / max(len(layers) - 1, 1)), label=f"layer {layer}")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean gate")
    ax.set_title(f"{label}: mean gate per layer", fontsize=10)
    fig.legend(loc="outside right upper", fontsize=7, frameon=False, ncols=1 + len(layers) // 14)
    return fig


def plot_saturation(layers: list[int], history: list[dict], label: str, rule: str = "") -> Figure:
    """The share of saturated heads of every gated layer (rows) at every analysis (columns, by training step), from
    the saturation history (``{"step", "saturated": [gated layer][head]}`` per analysis): when saturation sets in,
    and where. Annotated while the grid is small."""
    steps = [entry["step"] for entry in history]
    values = np.array([np.asarray(entry["saturated"], dtype=float).mean(axis=1) for entry in history]).T
    values = values.reshape(len(layers), len(steps))
    fig = Figure(figsize=(min(7.5, 2.5 + 0.5 * len(steps)), 1.4 + 0.4 * len(layers)), layout="constrained")
    ax = fig.add_subplot()
    cmap = colormaps["Reds"]
    norm = Normalize(0.0, 1.0)
    image = ax.imshow(values, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="saturated heads")
    if values.size <= ANNOTATE_MAX_CELLS:
        for (r, c), v in np.ndenumerate(values):
            _text(ax, r, c, f"{v:.0%}", cmap(norm(v)))
    ticks = list(range(0, len(steps), max(1, -(-len(steps) // 12))))
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("training step (one column per analysis)")
    ax.set_ylabel("layer")
    ax.set_title(f"{label}: saturated heads per layer" + (f" (rule: {rule})" if rule else ""), fontsize=10)
    return fig


def gate_figures(report: GateReport | None, model: nn.Module) -> dict[str, Figure]:
    """Every figure for one model, keyed by artifact path: ``heatmap``, ``categories`` and ``value_access`` when
    available, and ``mixing/<family>`` for its static mixing weights."""
    figures = {}
    if report is not None:
        figures["heatmap"] = plot_gate_heatmap(report)
        figures["categories"] = plot_gate_categories(report)
    curve = value_access(model, report)
    if curve:
        figures["value_access"] = plot_value_access({getattr(model.cfg, "arch", "model"): curve})
    figures.update({f"mixing/{name}": fig for name, fig in plot_static_weights(model).items()})
    return figures


def save_figures(figures: Mapping[str, Figure], directory: str | Path, dpi: int = 120) -> list[Path]:
    """Write each figure to ``<directory>/<name>.png`` (names may contain ``/``); returns the paths."""
    paths = []
    for name, fig in figures.items():
        path = Path(directory) / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths

