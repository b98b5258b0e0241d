"""A study's MLflow runs: one parent run per study (the spec and the report), one child run per trial.

A child run is made by ``satlab train`` in the trial process, tagged through its config; the driver closes it with
the trial's outcome (or makes a failed one for a trial that died before training began). A FINISHED child with a
cell's key is that cell's record.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.entities import Param, Run
from optuna.trial import FrozenTrial

from satlab.studies import attrs as A
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.best import is_feasible
from satlab.studies.spec import StudySpec, SweepSpec, format_value
from satlab.studies.storage import safe_url
from satlab.training.tracking import END_TAG, experiment_id, git_revision, usable_run

PARENT_TAG = "mlflow.parentRunId"
STUDY_TAG = "optuna.study"
TRIAL_TAG = "optuna.trial_number"
ROLE_TAG = "satlab.study.role"
ABLATION_TAG = "satlab.ablation"
CELL_TAG = "satlab.ablation.cell"
GROUP_TAG = "satlab.ablation.group"
FINGERPRINT_TAG = "satlab.ablation.fingerprint"
REASON_TAG = "sweep.reason"
CPU_METRIC = "trial/cpu_seconds"  # the trial processes' CPU time (user + system), summed over a cell's attempts
WOULD_PRUNE_TAG = "guard.would_prune_at"  # an observing saturation guard's would-be prune: tokens seen, and why
WOULD_PRUNE_REASON_TAG = "guard.would_prune_reason"
FEASIBLE_TAG = "feasible"  # a finished or pruned trial's run: "true" when it met its constraints (satlab.studies.best)
STOPPED_TAG = "trial.stopped"  # why a trial stopped before its budget (nan, pruned, gate_saturation): its run FAILED
RUN_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
INTERRUPTED = "interrupted"
"""The reason of a trial stopped by Ctrl-C or SIGTERM to the study: its cell runs again, in the same MLflow run."""


def create_parent_run(client: mlflow.MlflowClient, spec: StudySpec, artifact_location: str | None) -> str:
    """Tagged so that ``satlab report`` finds it again."""
    rev, dirty = git_revision()
    tags = {STUDY_TAG: spec.name, ROLE_TAG: "parent", "satlab.study.kind": spec.kind, "git_revision": rev,
            "git_dirty": str(dirty).lower(), "command": " ".join(sys.argv)}
    if isinstance(spec, AblationSpec):
        tags.update({ABLATION_TAG: spec.name, FINGERPRINT_TAG: spec.fingerprint()})
    if spec.description:
        tags["mlflow.note.content"] = spec.description
    run = client.create_run(experiment_id(client, spec.experiment_name, artifact_location),
                            run_name=f"{spec.kind}-{spec.name}", tags=tags)
    client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in parent_params(spec).items()])
    return run.info.run_id


def parent_params(spec: StudySpec) -> dict[str, Any]:
    def describe(section: Any) -> str:
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(section).items() if v is not None)

    params: dict[str, Any] = {"base": spec.base, **{f"fixed.{k}": format_value(v) for k, v in spec.overrides.items()},
                              "trial": describe(spec.trial), "storage": safe_url(spec.storage_url())}
    if isinstance(spec, SweepSpec):
        params.update({"study": spec.name, "objective": spec.objective.metric, "direction": spec.objective.direction,
                       "n_trials": spec.n_trials, "sampler": describe(spec.sampler), "pruner": describe(spec.pruner),
                       "saturation": describe(spec.saturation),
                       **{f"space.{name}": describe(p) for name, p in spec.space.items()}})
    elif isinstance(spec, AblationSpec):
        params.update({"seed_key": spec.seed_key, "cells": len(spec.cells()),
                       **{f"axis.{k}": ", ".join(map(format_value, v)) for k, v in spec.axes.items()},
                       **{f"baseline.{k}": format_value(v) for k, v in spec.baseline_values().items()}})
    return params


def save_spec(client: mlflow.MlflowClient, run_id: str, spec: StudySpec) -> None:
    """The spec as run: command-line items included, password masked."""
    shown = dataclasses.replace(spec, storage=safe_url(spec.storage_url()))
    client.log_text(run_id, yaml.safe_dump(shown.to_dict(), sort_keys=False), spec.spec_artifact)


def find_parent_run(client: mlflow.MlflowClient, spec: AblationSpec, same_settings: bool = True) -> Run | None:
    """The newest active parent run of this ablation (with the same fingerprint by default)."""
    experiment = client.get_experiment_by_name(spec.experiment_name)
    if experiment is None:
        return None
    query = f"tags.`{ABLATION_TAG}` = '{spec.name}' and tags.`{ROLE_TAG}` = 'parent'"
    if same_settings:
        query += f" and tags.`{FINGERPRINT_TAG}` = '{spec.fingerprint()}'"
    runs = client.search_runs([experiment.experiment_id], query, order_by=["attributes.start_time DESC"],
                              max_results=1)
    return runs[0] if runs else None


def child_runs(client: mlflow.MlflowClient, parent: Run, finished_only: bool = True) -> list[Run]:
    """The parent's active child runs (FINISHED ones only by default), oldest first."""
    query = f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    if finished_only:
        query += " and attributes.status = 'FINISHED'"
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs([parent.info.experiment_id], query, order_by=["attributes.start_time ASC"],
                                  max_results=1000, page_token=token)
        runs.extend(page)
        if not (token := page.token):
            return runs


def finished_cells(client: mlflow.MlflowClient, parent_run_id: str) -> dict[str, str]:
    """Cell key -> run id of its newest FINISHED child run."""
    parent = client.get_run(parent_run_id)
    return {run.data.tags[CELL_TAG]: run.info.run_id for run in child_runs(client, parent)
            if CELL_TAG in run.data.tags}


def end_run(client: mlflow.MlflowClient, run_id: str | None, status: str) -> None:
    run = usable_run(client, run_id)
    if run is not None and run.info.status == "RUNNING":
        client.set_terminated(run.info.run_id, status)


def close_trial_run(client: mlflow.MlflowClient, parent_run_id: str, study_name: str, trial: FrozenTrial,
                    run_id: str | None, reason: str | None, log_file: Path | None) -> str | None:
    """Tag the trial's run (made here if the trial died before opening one) with its Optuna state, reason and
    feasibility, attach the trial log, and end it with the matching status. An interrupted trial's run ends KILLED,
    and none is made for one that had not opened its run yet: the next attempt of the cell records it (no FAILED run
    beside it)."""
    state = trial.state.name
    if usable_run(client, run_id) is None:
        if reason == INTERRUPTED:
            return None
        parent = client.get_run(parent_run_id)
        tags = {PARENT_TAG: parent_run_id, TRIAL_TAG: str(trial.number), STUDY_TAG: study_name}
        run_id = client.create_run(parent.info.experiment_id, run_name=f"{study_name}-t{trial.number:04d}",
                                   tags=tags).info.run_id
        client.log_batch(run_id, params=[Param(k, format_value(v)) for k, v in trial.params.items()])
    client.set_tag(run_id, "optuna.state", state)
    if state in ("COMPLETE", "PRUNED"):  # judged on its gates (a failed trial has no verdict): the sweep view's filter
        client.set_tag(run_id, FEASIBLE_TAG, str(is_feasible(trial)).lower())
    if reason:
        client.set_tag(run_id, REASON_TAG, reason[:5000])
    elif REASON_TAG in client.get_run(run_id).data.tags:  # an earlier attempt's, such as "interrupted"
        client.delete_tag(run_id, REASON_TAG)
    if state != "COMPLETE":  # MLflow has no "pruned" status: the runs table's end_reason column says it; the
        # training's own end (if it got that far) is already in the run's end_history
        client.set_tag(run_id, END_TAG, f"{state.lower()}: {reason or 'no reason recorded'}"[:5000])
    if log_file is not None and log_file.exists():
        client.log_artifact(run_id, str(log_file), "trial")
    cpu = trial.user_attrs.get(A.CPU_SECONDS)
    if cpu is not None:  # summed over the attempts of a cell interrupted and resumed (each adds its own)
        earlier = client.get_run(run_id).data.metrics.get(CPU_METRIC, 0.0)
        client.log_metric(run_id, CPU_METRIC, earlier + float(cpu))
    status = "KILLED" if reason == INTERRUPTED else RUN_STATUS.get(state, "FAILED")
    if client.get_run(run_id).info.status != status:
        client.set_terminated(run_id, status)
    return run_id


def read_run_id(run_dir: Path) -> str | None:
    info = run_dir / "run.json"
    try:
        return json.loads(info.read_text()).get("mlflow_run_id") if info.exists() else None
    except (OSError, ValueError):
        return None
