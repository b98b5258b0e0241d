"""The end-of-sweep report, written under ``<study dir>/report/`` and logged on the MLflow parent run:
``trials.csv`` and ``trials.md`` (one row per trial), ``best.yaml`` (and ``best-<arch>.yaml`` per architecture when
``model.arch`` is searched) as ready-to-run experiments (``satlab train experiment=<file>``), and the plots of
:mod:`satlab.studies.sweep_plots`. The same table and the best trials are printed with rich.

"Best" is the best completed trial whose gates are not saturated beyond the guard's threshold (any completed trial
when none qualifies): a trial that reached a low loss with pinned gates is not the learning rate to recommend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlflow
import optuna
import pandas as pd
import yaml
from mlflow.exceptions import MlflowException
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.table import Table

from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.config.specs import nest
from satlab.studies.attrs import REASON, RETRY_OF, RUN_ID, SATURATION, TOKENS
from satlab.studies.spec import SweepSpec
from satlab.studies.sweep_plots import write_plots

STALE_REASON = "worker_lost"


def trial_rows(study: optuna.Study, spec: SweepSpec, base_arch: str) -> list[dict[str, Any]]:
    """One dict per trial: number, state, reason, architecture, parameters, objective, last reported value, tokens,
    saturated gate fraction, minutes, retry origin and MLflow run id."""
    trials = study.get_trials(deepcopy=False)
    names = [n for n in spec.space if n != "model.arch"]
    names += sorted({n for t in trials for n in t.params} - set(names) - {"model.arch"})
    rows = []
    for t in trials:
        steps = sorted(t.intermediate_values.items())
        rows.append({
            "trial": t.number,
            "state": t.state.name,
            "reason": reason_of(t),
            "arch": t.params.get("model.arch", base_arch),
            **{name: t.params.get(name) for name in names},
            spec.objective.metric: t.value if t.state == TrialState.COMPLETE else None,
            "last_reported": steps[-1][1] if steps else None,
            "tokens_seen": t.user_attrs.get(TOKENS) or (steps[-1][0] if steps else None),
            "saturated_frac": t.user_attrs.get(SATURATION),
            "minutes": round(t.duration.total_seconds() / 60, 2) if t.duration else None,
            "retry_of": t.user_attrs.get(RETRY_OF),
            "mlflow_run_id": t.user_attrs.get(RUN_ID),
        })
    return rows


def reason_of(trial: FrozenTrial) -> str:
    """The recorded reason; a failed trial without one was failed by heartbeat (its worker died with it)."""
    recorded = trial.user_attrs.get(REASON)
    if trial.state == TrialState.FAIL:
        return recorded or STALE_REASON
    if trial.state == TrialState.PRUNED:
        return recorded or "pruned"
    return ""


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
    header = (f"# Trial {trial.number} of sweep '{spec.name}': {spec.objective.metric} {trial.value:.4f}.\n"
              f"# Train it: satlab train experiment=<this file>\n")
    body = {"base": base, "name": name,
            "description": f"best trial ({trial.number}) of sweep {spec.name}",
            **nest({**spec.overrides, **trial.params})}
    return header + yaml.safe_dump(body, sort_keys=False)


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
        label = f"best-{arch}" if arch else "best"
        if arch and "model.arch" not in spec.space:
            continue
        path = out / f"{label}.yaml"
        path.write_text(best_config_text(spec, trial, f"{spec.name}-{label}"))
        try:
            load_experiment(path)
        except ConfigError as e:  # would be a bug here; say so rather than ship a broken preset
            path.write_text(f"# This config does not load: {e}\n" + path.read_text())
        files[path.name] = path
    plots, notes = write_plots(study, spec, rows, out)
    files.update(plots)
    if client is not None and parent_run_id is not None:
        _log_on_parent(client, parent_run_id, out, best, spec)
    print_summary(rows, best, spec, notes, files, console or Console())
    return files


def print_summary(rows: list[dict[str, Any]], best: dict[str, FrozenTrial], spec: SweepSpec, notes: list[str],
                  files: dict[str, Path], console: Console) -> None:
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
    style = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red"}
    for row in rows:
        cells = [_cell(row[c]).lower() if c == "state" else _cell(row[c]) for c in columns]
        table.add_row(*cells, style=style.get(row["state"]))
    console.print(table)
    for arch, trial in best.items():
        params = ", ".join(f"{k}={_cell(v)}" for k, v in trial.params.items() if k != "model.arch")
        console.print(f"best{f' {arch}' if arch else ''}: trial {trial.number}, {spec.objective.metric} "
                      f"{trial.value:.4f} ({params})", soft_wrap=True)
    for note in notes:
        console.print(f"[dim]{note}[/]", soft_wrap=True)
    if files:
        console.print(f"report: {next(iter(files.values())).parent}", soft_wrap=True)


def _log_on_parent(client: mlflow.MlflowClient, run_id: str, folder: Path, best: dict[str, FrozenTrial],
                   spec: SweepSpec) -> None:
    try:
        client.log_artifacts(run_id, str(folder), "report")
        if "" in best:
            client.log_metric(run_id, f"best/{spec.objective.metric}", best[""].value)
            client.set_tag(run_id, "best_trial", str(best[""].number))
        for arch, trial in best.items():
            if arch:
                client.log_metric(run_id, f"best/{arch}/{spec.objective.metric}", trial.value)
    except MlflowException as e:
        print(f"satlab sweep: could not log the report on the parent run {run_id}: {e}")


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)
