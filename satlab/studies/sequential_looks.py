"""A sequential ablation's looks on its records: the plan fixed with the study, each look's rows appended, the verdict
tags, and the cells the next look runs (the decisions are :mod:`satlab.studies.sequential_schedule`'s, pure).

- **The plan** (:meth:`satlab.config.sequential.SequentialPlan.fixed`, with its comparisons and seeds) is the study's
  user attr ``sequential_plan`` from the first setup on, and the parent run's ``sequential.*`` params from just
  before the first look is recorded. Once a look is recorded a changed plan is refused (exit 2, nothing written):
  its error rate holds only for the plan fixed before the data were seen.
- **The looks**: one row per look record (:func:`satlab.studies.sequential_schedule.look_rows`), in the study's user
  attr ``sequential_looks`` and on the parent run as ``sequential/looks.json`` and ``sequential/looks.csv``. Rows
  are only ever appended. Every look is replayed from the finished cells' values each time (so two drivers on one
  storage compute the same look, and a restarted one the same decisions); a recorded row that the cells no longer
  give is reported and the records are left as they were (:class:`LookState`).
- **Tags** ``verdict.sequential.<a>_vs_<b>`` on the parent run: a_better, b_better, equivalent, undecided or open.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import optuna
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from rich.console import Console

from satlab.config.errors import ConfigError, shown
from satlab.studies import attrs as A
from satlab.studies import sequential_schedule as S
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.results import cell_runs, final_values

LOOKS_JSON = "sequential/looks.json"
LOOKS_CSV = "sequential/looks.csv"
REPLAY_TAG = "sequential.replay"


def fixed_plan(spec: AblationSpec, design: S.Design) -> dict[str, str]:
    """What must not change once a look is recorded: the plan's fields, its comparisons (per family) and the seeds
    its looks run, in order."""
    families = [f"{f.name or 'study'}: " + "; ".join(f"{a} vs {b}" for a, b in f.comparisons) for f in design.families]
    return spec.sequential.fixed() | {"sequential.comparisons_made": " | ".join(families)[:6000],
                                      "sequential.seeds": "[" + ", ".join(design.seeds[:spec.sequential.schedule[-1]])
                                                          + "]"}


def recorded_plan(study: optuna.Study | None, client: mlflow.MlflowClient, parent_id: str | None) -> dict | None:
    """The plan the study fixed, else the one on the parent run (a study made anew: its storage lost, the grid
    grown)."""
    if study is not None and A.SEQUENTIAL_PLAN in study.user_attrs:
        return dict(study.user_attrs[A.SEQUENTIAL_PLAN])
    params = _parent_params(client, parent_id)
    return {k: v for k, v in params.items() if k.startswith("sequential.")} or None


def recorded_looks(study: optuna.Study | None, client: mlflow.MlflowClient, parent_id: str | None) -> list[dict]:
    """The rows recorded so far: the study's, else the parent run's table."""
    if study is not None and A.SEQUENTIAL_LOOKS in study.user_attrs:
        return list(study.user_attrs[A.SEQUENTIAL_LOOKS])
    if parent_id is None:
        return []
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file: no bar
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(parent_id, LOOKS_JSON, tmp)).read_text())
    except (MlflowException, OSError, ValueError):
        return []


def _parent_params(client: mlflow.MlflowClient, parent_id: str | None) -> dict[str, str]:
    try:
        return dict(client.get_run(parent_id).data.params) if parent_id else {}
    except MlflowException:
        return {}


def check_plan(spec: AblationSpec, study: optuna.Study | None, client: mlflow.MlflowClient,
               parent_id: str | None) -> None:
    """Refuse (exit 2) a plan that differs from the one fixed when a look has been recorded; reads only."""
    stored = recorded_plan(study, client, parent_id)
    if stored is None or not recorded_looks(study, client, parent_id):
        return
    now = fixed_plan(spec, S.design(spec))
    changed = [f"{k.removeprefix('sequential.')} {stored.get(k, 'unset')} -> {now.get(k, 'unset')}"
               for k in sorted(stored.keys() | now.keys()) if stored.get(k) != now.get(k)]
    if changed:
        raise ConfigError(
            f"ablation '{spec.name}': its sequential plan was fixed before the first look (the study's "
            f"'{A.SEQUENTIAL_PLAN}' and the parent run's sequential.* params), and looks have been recorded since; "
            f"this spec changes it ({'; '.join(changed)}). A plan changed after seeing results no longer holds the "
            f"error rate it states, so the study keeps its plan: run the spec as it was, or start a new study with "
            f"this plan by giving it another name (name=...; its cells run anew)")


def store_plan(spec: AblationSpec, study: optuna.Study) -> None:
    """The plan on the study, before any look: replaced while no look is recorded (:func:`check_plan` refuses a
    change after one)."""
    plan = fixed_plan(spec, S.design(spec))
    if study.user_attrs.get(A.SEQUENTIAL_PLAN) != plan:
        study.set_user_attr(A.SEQUENTIAL_PLAN, plan)


@dataclass
class LookState:
    """One replay of the plan: the schedule, the cells it wants run by now, and what changed on the records."""

    design: S.Design
    schedule: S.Schedule
    wanted: set[str]
    new: list[dict[str, Any]] = field(default_factory=list)
    changed: list[tuple[dict, dict]] = field(default_factory=list)
    missing: list[dict[str, Any]] = field(default_factory=list)

    @property
    def problem(self) -> str | None:
        """Why the scheduler stops: recorded looks that the finished cells no longer give."""
        if not self.changed:
            return None
        first = self.changed[0]
        return (f"sequential: {len(self.changed)} recorded look row(s) no longer match what the finished cells give "
                f"(a cell's run deleted and run again, or changed), e.g. {first[0]['pair']} look {first[0]['look']}: "
                f"{S.differences(first)}; the recorded looks are kept as they were and no further look is queued. "
                f"Restore the runs, or start a new study (name=...)")


def look(spec: AblationSpec, study: optuna.Study, client: mlflow.MlflowClient, parent_id: str,
         console: Console | None = None) -> LookState:
    """Replay the plan on the finished cells, record the looks not recorded yet (rows, tags) and say which cells it
    wants by now. A finished cell whose run did not log the plan's measure is refused (exit 2)."""
    design = S.design(spec)
    runs = cell_runs(client, parent_id)
    values, lacking = final_values({k: r for k, r in runs.items() if k in {c.key for c in spec.cells()}},
                                   spec.sequential.measure)
    if lacking:
        cell, logged = next(iter(lacking.items()))
        raise ConfigError(f"sequential.measure {shown(spec.sequential.measure)}: the finished run of cell '{cell}' "
                          f"({runs[cell].info.run_id}) never logged it; it logged {', '.join(logged) or 'nothing'}. "
                          f"Give sequential.measure one of these (no look has been recorded with this measure)")
    schedule = S.decide(design, S.observations(design, spec.cells(), values))
    wanted = {c.key for c in S.wanted_cells(spec, design, schedule.seeds)}
    recorded = recorded_looks(study, client, parent_id)
    replay = S.replay(recorded, S.look_rows(schedule))
    state = LookState(design, schedule, wanted, replay.new, replay.changed, replay.missing)
    if state.problem:
        client.set_tag(parent_id, REPLAY_TAG, state.problem[:5000])
        if console is not None:
            console.print(f"[bold red]{state.problem}[/]", soft_wrap=True)
        return state
    if replay.missing and console is not None:
        console.print(f"[yellow]sequential: {len(replay.missing)} recorded look row(s) are not reached by the "
                      f"finished cells now (a cell's run is gone); its cells run again and the rows must come out "
                      f"as recorded[/]", soft_wrap=True)
    if replay.new:
        append_rows(study, client, parent_id, spec, design, recorded, replay.new)
        if console is not None:
            for row in replay.new:
                console.print(f"look {row['look']} ({row['seeds']} seeds) {row['pair']}: t {row['t']:.3g}, critical "
                              f"{row['critical']:.3g}: [bold]{row['decision']}[/]", soft_wrap=True)
    tags = S.verdict_tags(design, schedule)
    current = client.get_run(parent_id).data.tags
    for key, value in tags.items():
        if current.get(key) != value:
            client.set_tag(parent_id, key, value)
    return state


def append_rows(study: optuna.Study, client: mlflow.MlflowClient, parent_id: str, spec: AblationSpec,
                design: S.Design, recorded: list[dict], new: list[dict]) -> None:
    """The plan's params on the parent run before its first look, then the rows: the study's attr and the parent
    run's table, the recorded rows unchanged and the new ones after them."""
    params = _parent_params(client, parent_id)
    missing = [Param(k, v) for k, v in fixed_plan(spec, design).items() if k not in params]
    if missing:
        client.log_batch(parent_id, params=missing)
    rows = [*recorded, *new]
    study.set_user_attr(A.SEQUENTIAL_LOOKS, rows)
    client.log_text(parent_id, json.dumps(rows, indent=1), LOOKS_JSON)
    client.log_text(parent_id, rows_csv(rows), LOOKS_CSV)


CSV_FIRST = ("pair", "look", "seeds", "decision", "t", "critical", "mean", "rci")
"""The looks table's first columns: a viewer that shows a few columns at a time (MLflow's artifact preview) shows
which comparison, at which look, what was decided and why; the rest (family, boundaries, alpha...) follow."""


def rows_csv(rows: list[dict]) -> str:
    found = list(dict.fromkeys(k for row in rows for k in row))
    columns = [k for k in CSV_FIRST if k in found] + [k for k in found if k not in CSV_FIRST]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    return out.getvalue()


def planned(spec: AblationSpec, study: optuna.Study | None) -> tuple[list[dict], S.Schedule, dict[str, str]]:
    """For ``satlab ablate --dry-run``, reading only: the rows the study recorded, the plan replayed on the finished
    cells (MLflow as the study names it; none without a study) and the finished cells (key -> run id)."""
    design = S.design(spec)
    runs: dict = {}
    if study is not None and study.user_attrs.get(A.PARENT_RUN) and study.user_attrs.get(A.TRACKING_URI):
        try:
            runs = cell_runs(mlflow.MlflowClient(study.user_attrs[A.TRACKING_URI]), study.user_attrs[A.PARENT_RUN])
        except MlflowException:
            runs = {}
    values, _ = final_values(runs, spec.sequential.measure)
    schedule = S.decide(design, S.observations(design, spec.cells(), values))
    rows = list(study.user_attrs.get(A.SEQUENTIAL_LOOKS, [])) if study is not None else []
    return rows, schedule, {k: r.info.run_id for k, r in runs.items()}
