"""The end-of-sweep report in ``<study dir>/report/``, also logged on the MLflow parent run and printed: the trial
table (``trials.csv``, ``trials.md``), ``best.yaml`` (and ``best-<arch>.yaml`` when ``model.arch`` is searched) as
ready-to-run experiments, and PNG plots (matplotlib): the searched learning rate against the objective per
architecture coloured by gate saturation, and Optuna's optimisation history and parameter importances.

"Best" is the best completed trial whose gates are not saturated beyond the guard's threshold (any completed trial
when none qualifies): a low loss with pinned gates is not the learning rate to recommend.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import mlflow
import optuna
import pandas as pd
import yaml
from matplotlib.ticker import NullFormatter
from mlflow.exceptions import MlflowException
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, TrialState
from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances
from rich.console import Console
from rich.table import Table

from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.config.specs import nest
from satlab.studies.attrs import REASON, RETRY_OF, RUN_ID, SATURATION, TOKENS
from satlab.studies.spec import SweepSpec

STALE_REASON = "worker_lost"
STATE_STYLE = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red"}


def trial_rows(study: optuna.Study, spec: SweepSpec, base_arch: str) -> list[dict[str, Any]]:
    """One dict per trial: its outcome, architecture, parameters, objective, last reported value, tokens, saturated
    gate fraction, minutes, retry origin and MLflow run id."""
    trials = study.get_trials(deepcopy=False)
    names = [n for n in spec.space if n != "model.arch"]
    names += sorted({n for t in trials for n in t.params} - set(names) - {"model.arch"})
    rows = []
    for t in trials:
        steps = sorted(t.intermediate_values.items())
        rows.append({"trial": t.number, "state": t.state.name, "reason": reason_of(t),
                     "arch": t.params.get("model.arch", base_arch), **{name: t.params.get(name) for name in names},
                     spec.objective.metric: t.value if t.state == TrialState.COMPLETE else None,
                     "last_reported": steps[-1][1] if steps else None,
                     "tokens_seen": t.user_attrs.get(TOKENS) or (steps[-1][0] if steps else None),
                     "saturated_frac": t.user_attrs.get(SATURATION),
                     "minutes": round(t.duration.total_seconds() / 60, 2) if t.duration else None,
                     "retry_of": t.user_attrs.get(RETRY_OF), "mlflow_run_id": t.user_attrs.get(RUN_ID)})
    return rows


def reason_of(trial: FrozenTrial) -> str:
    """The recorded reason; a failed trial without one was failed by heartbeat (its worker died with it)."""
    recorded = trial.user_attrs.get(REASON)
    if trial.state == TrialState.FAIL:
        return recorded or STALE_REASON
    return (recorded or "pruned") if trial.state == TrialState.PRUNED else ""


def best_trials(study: optuna.Study, spec: SweepSpec, base_arch: str) -> dict[str, FrozenTrial]:
    """``{"": best overall, arch: best of that architecture}`` among completed trials (see the module docstring)."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    threshold = spec.saturation.threshold
    feasible = [t for t in complete
                if threshold is None or (t.user_attrs.get(SATURATION) or 0.0) <= threshold] or complete
    sign = 1.0 if spec.objective.direction == "minimize" else -1.0
    best: dict[str, FrozenTrial] = {}
    for trial in sorted(feasible, key=lambda t: sign * t.value):
        best.setdefault("", trial)
        best.setdefault(trial.params.get("model.arch", base_arch), trial)
    return best


def best_config_text(spec: SweepSpec, trial: FrozenTrial, name: str) -> str:
    """An experiment YAML: ``base:`` the sweep's base experiment, then its fixed overrides and the trial's params."""
    base = spec.base
    if Path(base).suffix in (".yaml", ".yml") or Path(base).is_file():
        base = str(Path(base).resolve())  # a path base must still resolve wherever this file is moved
    body = {"base": base, "name": name, "description": f"best trial ({trial.number}) of sweep {spec.name}",
            **nest({**spec.overrides, **trial.params})}
    return (f"# Trial {trial.number} of sweep '{spec.name}': {spec.objective.metric} {trial.value:.4f}.\n"
            f"# Train it: satlab train experiment=<this file>\n" + yaml.safe_dump(body, sort_keys=False))


def write_report(study: optuna.Study, spec: SweepSpec, base_arch: str, client: mlflow.MlflowClient | None = None,
                 parent_run_id: str | None = None, console: Console | None = None) -> dict[str, Path]:
    """Write the report files, log them on the parent run, print the summary; returns the files by name."""
    out = spec.out_path() / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = trial_rows(study, spec, base_arch)
    table = pd.DataFrame(rows, dtype=object)  # None stays None (shown as —), not NaN
    table.to_csv(out / "trials.csv", index=False)
    (out / "trials.md").write_text((table.map(_cell).to_markdown(index=False) if rows else "(no trials)") + "\n")
    files = {"trials.csv": out / "trials.csv", "trials.md": out / "trials.md"}
    best = best_trials(study, spec, base_arch)
    for arch, trial in best.items():
        if arch and "model.arch" not in spec.space:
            continue
        path = out / f"best-{arch}.yaml" if arch else out / "best.yaml"
        path.write_text(best_config_text(spec, trial, f"{spec.name}-{path.stem}"))
        try:
            load_experiment(path)
        except ConfigError as e:  # would be a bug here; say so rather than ship a broken preset
            path.write_text(f"# This config does not load: {e}\n" + path.read_text())
        files[path.name] = path
    plots, notes = write_plots(study, spec, rows, out)
    files.update(plots)
    if client is not None and parent_run_id is not None:
        try:
            client.log_artifacts(parent_run_id, str(out), "report")
            for arch, trial in best.items():
                client.log_metric(parent_run_id, f"best/{arch + '/' if arch else ''}{spec.objective.metric}",
                                  trial.value)
            if "" in best:
                client.set_tag(parent_run_id, "best_trial", str(best[""].number))
        except MlflowException as e:
            print(f"satlab sweep: could not log the report on the parent run {parent_run_id}: {e}")
    print_summary(rows, best, spec, notes, out, console or Console())
    return files


def print_summary(rows: list[dict[str, Any]], best: dict[str, FrozenTrial], spec: SweepSpec, notes: list[str],
                  out: Path, console: Console) -> None:
    """The trial table (short column names, cells fold rather than truncate) and the best trials. A log file or pipe
    gets 160 columns rather than rich's 80."""
    if not console.is_terminal and console.width < 160:
        console.width = 160
    columns = [c for c in rows[0] if c not in ("mlflow_run_id", "retry_of")] if rows else []
    short = {"saturated_frac": "sat", "tokens_seen": "tokens", "last_reported": "last", "minutes": "min"}
    table = Table(title=f"sweep '{spec.name}': {len(rows)} trials")
    for column in columns:
        name = short.get(column, column if column == spec.objective.metric else column.rsplit(".", 1)[-1])
        table.add_column(name, justify="left" if column in ("state", "reason", "arch") else "right", overflow="fold")
    for row in rows:
        cells = [_cell(row[c]).lower() if c == "state" else _cell(row[c]) for c in columns]
        table.add_row(*cells, style=STATE_STYLE.get(row["state"]))
    console.print(table)
    for arch, trial in best.items():
        params = ", ".join(f"{k}={_cell(v)}" for k, v in trial.params.items() if k != "model.arch")
        console.print(f"best{f' {arch}' if arch else ''}: trial {trial.number}, {spec.objective.metric} "
                      f"{trial.value:.4f} ({params})", soft_wrap=True)
    for note in notes:
        console.print(f"[dim]{note}[/]", soft_wrap=True)
    console.print(f"report: {out}", soft_wrap=True)


def write_plots(study: optuna.Study, spec: SweepSpec, rows: list[dict[str, Any]],
                out: Path) -> tuple[dict[str, Path], list[str]]:
    """The plots that the trials so far allow; returns (files by name, notes on the ones skipped)."""
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
    varying = [n for n in spec.space if len({repr(t.params.get(n)) for t in complete}) > 1]
    for name, plot, possible, why_not in (
            ("optimization_history.png", plot_optimization_history, bool(complete),
             "optimisation history: no completed trial yet"),
            ("param_importances.png", plot_param_importances, len(complete) >= 2 and bool(varying),
             "parameter importances need >= 2 completed trials whose parameters differ")):
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
    """One panel per architecture: ``param`` against the objective of completed trials (dots) and the last reported
    value of pruned ones (crosses), coloured by saturated gate fraction (grey: the architecture has no gates)."""
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
        for state, marker, label in (("COMPLETE", "o", "complete"), ("PRUNED", "x", "pruned (last value)")):
            if chosen := [r for r in points if r["arch"] == arch and r["state"] == state]:
                ax.scatter([r[param] for r in chosen], [r[metric] if state == "COMPLETE" else r["last_reported"]
                                                        for r in chosen], marker=marker, s=45, label=label,
                           c=["0.6" if r["saturated_frac"] is None else colormap(float(r["saturated_frac"]))
                              for r in chosen])
        if spec.space[param].log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=arch, xlabel=param)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(metric)
    mappable = plt.cm.ScalarMappable(norm=plt.Normalize(0, 1), cmap=colormap)
    figure.colorbar(mappable, ax=axes[0].tolist(), label="val/gates/saturated_frac (grey: no gates)")
    figure.suptitle(f"sweep {spec.name}: {param} vs {metric}")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return ("nan" if math.isnan(value) else f"{value:.4g}") if isinstance(value, float) else str(value)
