"""The sweep's plots, as PNG (matplotlib; no plotly here): the learning rate against the objective per architecture
coloured by gate saturation, and Optuna's optimisation history and parameter importances."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import optuna
from matplotlib.ticker import NullFormatter
from optuna.exceptions import ExperimentalWarning
from optuna.trial import TrialState
from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

from satlab.studies.spec import SweepSpec


def write_plots(study: optuna.Study, spec: SweepSpec, rows: list[dict[str, Any]],
                out: Path) -> tuple[dict[str, Path], list[str]]:
    """Write the plots that the trials so far allow; returns (files by name, notes on the ones skipped)."""
    files: dict[str, Path] = {}
    notes: list[str] = []
    x = "optim.lr" if "optim.lr" in spec.space else next(
        (n for n, p in spec.space.items() if p.type in ("float", "int")), None)
    if x is None:
        notes.append("no numeric parameter to plot the objective against")
    elif path := plot_param_vs_objective(rows, spec, x, out / "lr_vs_loss.png"):
        files[path.name] = path
    else:
        notes.append(f"{x} vs {spec.objective.metric}: no trial reported a value yet")
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    plots = [("optimization_history.png", plot_optimization_history, bool(complete),
              "optimisation history: no completed trial yet")]
    varying = [n for n in spec.space if len({repr(t.params.get(n)) for t in complete}) > 1]
    plots.append(("param_importances.png", plot_param_importances, len(complete) >= 2 and bool(varying),
                  "parameter importances need >= 2 completed trials whose parameters differ"))
    for name, plot, possible, why_not in plots:
        if not possible:
            notes.append(why_not)
            continue
        try:
            with warnings.catch_warnings(), plt.rc_context():  # Optuna's plots switch the global style to ggplot
                warnings.simplefilter("ignore", ExperimentalWarning)
                axes = plot(study)
        except (ValueError, RuntimeError) as e:
            notes.append(f"{name}: {e}")
            continue
        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        files[name] = out / name
    return files, notes


def plot_param_vs_objective(rows: list[dict[str, Any]], spec: SweepSpec, param: str, path: Path) -> Path | None:
    """One panel per architecture: ``param`` (log axis for log ranges) against the objective of completed trials
    (dots) and the last reported value of pruned ones (crosses), coloured by saturated gate fraction (grey: the
    architecture has no gates)."""
    metric = spec.objective.metric
    points = [r for r in rows if r.get(param) is not None
              and (r[metric] is not None or (r["state"] == "PRUNED" and r["last_reported"] is not None))]
    if not points:
        return None
    archs = sorted({r["arch"] for r in points})
    figure, axes = plt.subplots(1, len(archs), figsize=(4.5 * len(archs) + 1, 4), sharex=True, sharey=True,
                                squeeze=False)
    colormap = plt.get_cmap("viridis")
    for ax, arch in zip(axes[0], archs, strict=True):
        for state, marker in (("COMPLETE", "o"), ("PRUNED", "x")):
            chosen = [r for r in points if r["arch"] == arch and r["state"] == state]
            if not chosen:
                continue
            ys = [r[metric] if state == "COMPLETE" else r["last_reported"] for r in chosen]
            colors = ["0.6" if r["saturated_frac"] is None else colormap(float(r["saturated_frac"])) for r in chosen]
            ax.scatter([r[param] for r in chosen], ys, c=colors, marker=marker, s=45,
                       label="complete" if state == "COMPLETE" else "pruned (last value)")
        if spec.space[param].log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(arch)
        ax.set_xlabel(param)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(metric)
    mappable = plt.cm.ScalarMappable(norm=plt.Normalize(0, 1), cmap=colormap)
    figure.colorbar(mappable, ax=axes[0].tolist(), label="val/gates/saturated_frac (grey: no gates)")
    figure.suptitle(f"sweep {spec.name}: {param} vs {metric}")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path
