"""The end-of-sweep report in ``<study dir>/report/``, also logged on the MLflow parent run and printed: the trial
table (``trials.csv``, ``trials.md``), ``best.yaml`` (and ``best-<arch>.yaml`` when ``model.arch`` is searched) as
ready-to-run experiments, and PNG plots (matplotlib): the searched learning rate against the objective per
architecture coloured by gate saturation, and Optuna's optimisation history and parameter importances.

"Best" is the best feasible completed trial (:mod:`satlab.studies.best`; any completed trial when none is feasible):
feasible as Optuna records it, gates not saturated beyond the guard's threshold when the guard is a constraint. A low
loss with pinned gates is not the learning rate to recommend; Optuna's ``study.best_trial`` and the dashboard that
``satlab sweep --dashboard`` serves pick the same trial.

On the parent run, per architecture (the group), in the section the ablation parent runs use for their groups
(``variants/<group>/...``, :mod:`satlab.studies.parent_results`; it sorts after the trials' ``train/`` and ``val/``
in MLflow's charts): ``variants/<arch>/best_<objective>`` (``best_val_loss``), the best trial's value of each searched
numeric parameter (``best_lr``), ``n_complete`` / ``n_pruned`` / ``n_failed`` and ``n_infeasible`` (completed but
infeasible) as metrics at step = trials finished in the study; the best trial's number and parameters as tags
(``variants/<arch>/best_trial``, ``variants/<arch>/best/optim.lr``; tags, not params: MLflow refuses to change a param
when a re-run finds a better trial), and ``sweep.best_trial``, ``sweep.best_arch`` overall.

With an observing saturation guard (``saturation.action: observe``; or when any trial recorded one) the trial table
has a ``would_prune_at`` column beside the objective (tokens seen when the guard would have pruned the trial), the
summary names the trials it would have pruned with their objective (and says so of a best trial), the plot rings
them in red, and the parent run gets ``variants/<arch>/n_would_prune``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
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
from satlab.config.resolve import user_path
from satlab.config.specs import nest
from satlab.evaluation.gates import SATURATION_METRIC
from satlab.studies.attrs import ARCH, REASON, RETRY_OF, RUN_ID, SATURATION, TOKENS, WOULD_PRUNE_AT, WOULD_PRUNE_REASON
from satlab.studies.best import best_trial, is_feasible
from satlab.studies.parent_results import GROUP_SECTION, record_results
from satlab.studies.spec import SweepSpec, format_value

STALE_REASON = "worker_lost"
STATE_STYLE = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red"}
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
BEST_TAG = "sweep.best_"  # sweep.best_trial, sweep.best_arch


def trial_rows(study: optuna.Study, spec: SweepSpec, base_arch: str) -> list[dict[str, Any]]:
    """One dict per trial: its outcome, architecture, parameters, objective, last reported value, tokens, saturated
    gate fraction, minutes, retry origin and MLflow run id; ``would_prune_at`` after the objective when the guard
    observes (:func:`observing`)."""
    trials = study.get_trials(deepcopy=False)
    observed = observing(trials, spec)
    names = [n for n in spec.space if n != "model.arch"]
    names += sorted({n for t in trials for n in t.params} - set(names) - {"model.arch"})
    rows = []
    for t in trials:
        steps = sorted(t.intermediate_values.items())
        rows.append({"trial": t.number, "state": t.state.name, "reason": reason_of(t, spec),
                     "arch": arch_of(t, base_arch), **{name: t.params.get(name) for name in names},
                     spec.objective.metric: t.value if t.state == TrialState.COMPLETE else None,
                     **({"would_prune_at": would_prune_at(t)} if observed else {}),
                     "last_reported": steps[-1][1] if steps else None,
                     "tokens_seen": t.user_attrs.get(TOKENS) or (steps[-1][0] if steps else None),
                     "saturated_frac": t.user_attrs.get(SATURATION),
                     "minutes": round(t.duration.total_seconds() / 60, 2) if t.duration else None,
                     "retry_of": t.user_attrs.get(RETRY_OF), "mlflow_run_id": t.user_attrs.get(RUN_ID)})
    return rows


def would_prune_at(trial: FrozenTrial) -> int | None:
    """Tokens seen when an observing saturation guard would have pruned ``trial``; None when it would not have."""
    return trial.user_attrs.get(WOULD_PRUNE_AT)


def observing(trials: Iterable[FrozenTrial], spec: SweepSpec) -> bool:
    """Whether the report shows the observing guard's would-be prunes: the spec's guard observes, or a trial has
    one (the spec may have changed since)."""
    return spec.saturation.action == "observe" or any(would_prune_at(t) is not None for t in trials)


def reason_of(trial: FrozenTrial, spec: SweepSpec) -> str:
    """The recorded reason; a failed trial without one was failed by heartbeat (its worker died with it); a
    completed trial has one when it is infeasible."""
    recorded = trial.user_attrs.get(REASON)
    if trial.state == TrialState.FAIL:
        return recorded or STALE_REASON
    if trial.state == TrialState.PRUNED:
        return recorded or "pruned"
    return "" if trial.state != TrialState.COMPLETE or is_feasible(trial) else infeasible_reason(trial, spec)


def infeasible_reason(trial: FrozenTrial, spec: SweepSpec) -> str:
    saturation, threshold = trial.user_attrs.get(SATURATION), spec.saturation.threshold
    if saturation is None or threshold is None:
        return "infeasible"
    return f"infeasible: {saturation:.0%} of gates saturated > {threshold:.0%}"


def arch_of(trial: FrozenTrial, base_arch: str) -> str:
    return str(trial.params.get("model.arch", trial.user_attrs.get(ARCH, base_arch)))


def by_arch(trials: Iterable[FrozenTrial], base_arch: str) -> dict[str, list[FrozenTrial]]:
    """The finished trials of each architecture (a running one may not have suggested ``model.arch`` yet)."""
    groups: dict[str, list[FrozenTrial]] = {}
    for trial in trials:
        if trial.state in FINISHED:
            groups.setdefault(arch_of(trial, base_arch), []).append(trial)
    return groups


def best_trials(study: optuna.Study, spec: SweepSpec, base_arch: str) -> dict[str, FrozenTrial]:
    """``{"": best overall, arch: best of that architecture, ...}``, the architectures best first (see the module
    docstring); ``[""]`` is Optuna's ``study.best_trial`` whenever a completed trial is feasible."""
    trials = study.get_trials(deepcopy=False)
    direction = spec.objective.direction
    groups = {arch: best_trial(group, direction) for arch, group in by_arch(trials, base_arch).items()}
    sign = 1.0 if direction == "minimize" else -1.0
    ranked = sorted(((a, t) for a, t in groups.items() if t is not None),
                    key=lambda item: (not is_feasible(item[1]), sign * item[1].value, item[1].number))
    overall = best_trial(trials, direction)
    return ({"": overall} if overall is not None else {}) | dict(ranked)


def passed_over(trials: Iterable[FrozenTrial], best: FrozenTrial, direction: str) -> list[FrozenTrial]:
    """The completed trials with a better value than ``best``: infeasible ones, which the best trial skips."""
    sign = 1.0 if direction == "minimize" else -1.0
    return [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
            and sign * t.value < sign * best.value]  # type: ignore[operator]


def best_config_text(spec: SweepSpec, trial: FrozenTrial, name: str) -> str:
    """An experiment YAML: ``base:`` the sweep's base experiment, then its fixed overrides and the trial's params."""
    base = spec.base
    if (path := user_path(base)) is not None:
        base = str(path.resolve())  # a path base must still resolve wherever this file is moved
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
    if client is not None and (figure := saturation_figure(study, spec, client)) is not None:
        files["saturation_curves.png"] = out / "saturation_curves.png"
        figure.savefig(files["saturation_curves.png"], dpi=120)
        plt.close(figure)
    if client is not None and parent_run_id is not None:
        try:
            client.log_artifacts(parent_run_id, str(out), "report")
            metrics, tags = parent_results(study, spec, base_arch)
            finished = sum(t.state in FINISHED for t in study.get_trials(deepcopy=False))
            record_results(client, parent_run_id, metrics, tags, step=finished)
        except MlflowException as e:
            print(f"satlab sweep: could not log the report on the parent run {parent_run_id}: {e}")
    print_summary(rows, best, spec, notes, out, console or Console(), study.get_trials(deepcopy=False), base_arch)
    return files


def parent_results(study: optuna.Study, spec: SweepSpec, base_arch: str) -> tuple[dict[str, float], dict[str, str]]:
    """The study's results for the parent run: (metrics, tags) named as in the module docstring."""
    trials = study.get_trials(deepcopy=False)
    numeric = [n for n, p in spec.space.items() if p.type in ("float", "int")]
    leaves = [n.rsplit(".", 1)[-1] for n in numeric]
    param_keys = {n: f"best_{leaf if leaves.count(leaf) == 1 else n.replace('.', '_')}"
                  for n, leaf in zip(numeric, leaves, strict=True)}  # optim.lr: best_lr, unless two are "lr"
    objective_key = f"best_{spec.objective.metric.replace('/', '_')}"
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    observed = observing(trials, spec)
    for arch, group in by_arch(trials, base_arch).items():
        prefix = f"{GROUP_SECTION}/{arch}/"
        complete = [t for t in group if t.state == TrialState.COMPLETE]
        metrics.update({f"{prefix}n_complete": len(complete),
                        f"{prefix}n_pruned": sum(t.state == TrialState.PRUNED for t in group),
                        f"{prefix}n_failed": sum(t.state == TrialState.FAIL for t in group),
                        f"{prefix}n_infeasible": sum(not is_feasible(t) for t in complete)})
        if observed:
            metrics[f"{prefix}n_would_prune"] = sum(would_prune_at(t) is not None for t in group)
        best = best_trial(group, spec.objective.direction)
        if best is None:
            continue
        metrics[prefix + objective_key] = float(best.value)  # type: ignore[arg-type]
        metrics.update({prefix + key: float(best.params[n]) for n, key in param_keys.items() if n in best.params})
        tags.update({f"{prefix}best_trial": str(best.number), f"{prefix}best_feasible": str(is_feasible(best)).lower(),
                     **{f"{prefix}best/{k}": format_value(v) for k, v in best.params.items() if k != "model.arch"}})
    if (overall := best_trial(trials, spec.objective.direction)) is not None:
        tags.update({f"{BEST_TAG}trial": str(overall.number), f"{BEST_TAG}arch": arch_of(overall, base_arch)})
    return metrics, tags


def print_summary(rows: list[dict[str, Any]], best: dict[str, FrozenTrial], spec: SweepSpec, notes: list[str],
                  out: Path, console: Console, trials: list[FrozenTrial] | None = None, base_arch: str = "") -> None:
    """The trial table (short column names, cells fold rather than truncate) and the best trials, with the better
    valued infeasible trials each passed over (of ``trials``). A log file or pipe gets 160 columns rather than rich's
    80."""
    if not console.is_terminal and console.width < 160:
        console.width = 160
    columns = [c for c in rows[0] if c not in ("mlflow_run_id", "retry_of")] if rows else []
    short = {"saturated_frac": "sat", "tokens_seen": "tokens", "last_reported": "last", "minutes": "min",
             "would_prune_at": "would prune at"}
    table = Table(title=f"sweep '{spec.name}': {len(rows)} trials")
    for column in columns:
        name = short.get(column, column if column == spec.objective.metric else column.rsplit(".", 1)[-1])
        table.add_column(name, justify="left" if column in ("state", "reason", "arch") else "right", overflow="fold")
    for row in rows:
        cells = [_cell(row[c]).lower() if c == "state" else _cell(row[c]) for c in columns]
        table.add_row(*cells, style=STATE_STYLE.get(row["state"]))
    console.print(table)
    groups = by_arch(trials or [], base_arch)
    explained: set[int] = set()
    for arch, trial in best.items():
        params = ", ".join(f"{k}={_cell(v)}" for k, v in trial.params.items() if k != "model.arch")
        feasible = "" if is_feasible(trial) else \
            f" — {infeasible_reason(trial, spec)}; no completed{f' {arch}' if arch else ''} trial is feasible"
        if (tokens := would_prune_at(trial)) is not None:
            feasible += f" — the saturation guard would have pruned it at {tokens:,} tokens"
        console.print(f"best{f' {arch}' if arch else ''}: trial {trial.number}, {spec.objective.metric} "
                      f"{trial.value:.4f} ({params}){feasible}", soft_wrap=True)
        for other in passed_over(groups.get(arch, []) if arch else trials or [], trial, spec.objective.direction):
            if other.number not in explained:
                explained.add(other.number)
                console.print(f"  trial {other.number} ({arch_of(other, base_arch)}) has a better "
                              f"{spec.objective.metric}, {other.value:.4f}, but is {infeasible_reason(other, spec)}",
                              soft_wrap=True)
    print_would_prune(trials or [], spec, console, base_arch)
    for note in notes:
        console.print(f"[dim]{note}[/]", soft_wrap=True)
    console.print(f"report: {out}", soft_wrap=True)


def print_would_prune(trials: list[FrozenTrial], spec: SweepSpec, console: Console, base_arch: str) -> None:
    """With an observing guard: each trial it would have pruned, when and why, beside its outcome and objective."""
    if not observing(trials, spec):
        return
    flagged = [t for t in trials if would_prune_at(t) is not None]
    finished = sum(t.state in FINISHED for t in trials)
    console.print(f"saturation guard (observing, not pruning): would have pruned {len(flagged)} of {finished} "
                  f"finished trials", soft_wrap=True)
    for t in flagged:
        outcome = f"{spec.objective.metric} {t.value:.4f}" if t.state == TrialState.COMPLETE and t.value is not None \
            else t.state.name.lower()
        console.print(f"  trial {t.number} ({arch_of(t, base_arch)}): at {would_prune_at(t):,} tokens, {outcome}; "
                      f"{t.user_attrs.get(WOULD_PRUNE_REASON) or 'gate_saturation'}", soft_wrap=True)


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
    value of pruned ones (crosses), coloured by saturated gate fraction (grey: the architecture has no gates); the
    trials an observing saturation guard would have pruned ringed in red."""
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
        if flagged := [r for r in points if r["arch"] == arch and r.get("would_prune_at") is not None]:
            ax.scatter([r[param] for r in flagged], [r[metric] if r["state"] == "COMPLETE" else r["last_reported"]
                                                     for r in flagged], marker="o", s=160, facecolors="none",
                       edgecolors="red", linewidths=1.5, label="guard would prune")
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


def saturation_curves(trial: FrozenTrial, client: mlflow.MlflowClient) -> list[tuple[float, float]]:
    """(tokens seen, ``val/gates/saturated_frac``) at each validation of the trial's MLflow run; [] without one.
    The gate analysis logs at the steps done (``trainer.global_step``; Lightning's ``val/loss`` is at the index of the
    step before), so the one after training repeats the last one inside it; step 0 is the check before training."""
    run_id = trial.user_attrs.get(RUN_ID)
    if not run_id:
        return []
    try:
        params = client.get_run(run_id).data.params
        history = client.get_metric_history(run_id, SATURATION_METRIC)
    except MlflowException:  # the run was deleted, or the store moved: the curve is left out
        return []
    per_step = float(params.get("derived.tokens_per_step") or 0)
    return sorted({m.step * per_step: m.value for m in history if m.step > 0}.items())


def saturation_figure(study: optuna.Study, spec: SweepSpec, client: mlflow.MlflowClient) -> plt.Figure | None:
    """Each trial's objective (top) and saturated gate fraction (bottom) against tokens seen, in one colour per
    trial, with the guard's threshold; a cross where the guard pruned the trial, a red ring where an observing guard
    would have. None when no trial logged a saturation curve (no gated architecture)."""
    curves = {t.number: (t, saturation_curves(t, client)) for t in study.get_trials(deepcopy=False)}
    curves = {n: (t, c) for n, (t, c) in curves.items() if c}
    if not curves:
        return None
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, layout="constrained")
    colours = plt.get_cmap("tab20")
    for i, (number, (trial, curve)) in enumerate(sorted(curves.items())):
        colour = colours(i % 20)
        losses = sorted(trial.intermediate_values.items())
        top.plot([t for t, _ in losses], [v for _, v in losses], color=colour, marker=".", label=f"trial {number}")
        bottom.plot([t for t, _ in curve], [v for _, v in curve], color=colour, marker=".")
        if trial.user_attrs.get(REASON) == "gate_saturation":
            bottom.scatter([curve[-1][0]], [curve[-1][1]], marker="x", s=80, color=colour)
        if (tokens := would_prune_at(trial)) is not None:
            value = min(curve, key=lambda point: abs(point[0] - tokens))[1]
            bottom.scatter([tokens], [value], s=160, facecolors="none", edgecolors="red", linewidths=1.5)
    if spec.saturation.threshold is not None:
        bottom.axhline(spec.saturation.threshold, color="red", linestyle="--", linewidth=1,
                       label=f"guard threshold ({spec.saturation.action}, patience {spec.saturation.patience})")
        bottom.legend(fontsize=8)
    top.set(ylabel=spec.objective.metric, title=f"sweep {spec.name}: each trial's loss and gate saturation")
    bottom.set(xlabel="tokens seen", ylabel="saturated gate fraction", ylim=(-0.05, 1.05))
    top.legend(fontsize=7, ncol=max(1, len(curves) // 10))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return figure


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return ("nan" if math.isnan(value) else f"{value:.4g}") if isinstance(value, float) else str(value)
