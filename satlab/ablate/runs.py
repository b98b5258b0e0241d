"""The ablation's MLflow runs: one parent run per ablation, one child run per cell.

A cell's child run is made by ``satlab train`` (Lightning's MLflow logger) and tagged ``mlflow.parentRunId`` and
``satlab.ablation.cell`` (the cell key) through the cell's config; the parent carries the spec (params and an
``ablation.yaml`` artifact) and, once written, the report. A FINISHED child with a cell's key is that cell's record:
it is what resuming skips and what the report reads.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable

import mlflow
import yaml
from mlflow.entities import Param, Run
from mlflow.exceptions import MlflowException

from satlab.ablate.spec import AblationSpec, format_value
from satlab.training.tracking import experiment_id, git_revision

ABLATION_TAG = "satlab.ablation"
ROLE_TAG = "satlab.ablation.role"
CELL_TAG = "satlab.ablation.cell"
GROUP_TAG = "satlab.ablation.group"
PARENT_TAG = "mlflow.parentRunId"
FINGERPRINT_TAG = "satlab.ablation.fingerprint"
SPEC_ARTIFACT = "ablation.yaml"


def usable_run(client: mlflow.MlflowClient, run_id: str | None) -> Run | None:
    """The run, unless it does not exist or was deleted."""
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def fingerprint(spec: AblationSpec) -> str:
    """What the cells share besides their axis values (base, fixed overrides, seed axis). A parent run is reused only
    with the same fingerprint: finished cells of a different budget or setting are never taken for this one's."""
    text = json.dumps({"base": spec.base, "overrides": spec.overrides, "seed_key": spec.seed_key}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def find_parent_run(client: mlflow.MlflowClient, spec: AblationSpec, same_settings: bool = True) -> Run | None:
    """The newest active parent run of this ablation in its experiment (with the same fingerprint by default)."""
    experiment = client.get_experiment_by_name(spec.experiment_name)
    if experiment is None:
        return None
    query = f"tags.`{ABLATION_TAG}` = '{spec.name}' and tags.`{ROLE_TAG}` = 'parent'"
    if same_settings:
        query += f" and tags.`{FINGERPRINT_TAG}` = '{fingerprint(spec)}'"
    runs = client.search_runs([experiment.experiment_id], query, order_by=["attributes.start_time DESC"],
                              max_results=1)
    return runs[0] if runs else None


def ensure_parent_run(client: mlflow.MlflowClient, spec: AblationSpec, known_run_id: str | None,
                      artifact_location: str | None) -> str:
    """The ablation's parent run: the one the state file names (or the newest one found by tag) if it has the same
    fingerprint, set RUNNING again; else a new one carrying the spec as params. Either way the spec as run
    (``ablation.yaml``) is saved on it, for ``satlab report <run id>``."""
    run = usable_run(client, known_run_id)
    if run is None or run.data.tags.get(FINGERPRINT_TAG) != fingerprint(spec):
        run = find_parent_run(client, spec)
    if run is not None:
        run_id = run.info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        run_id = create_parent_run(client, spec, artifact_location)
    client.log_text(run_id, yaml.safe_dump(spec.to_dict(), sort_keys=False), SPEC_ARTIFACT)
    return run_id


def create_parent_run(client: mlflow.MlflowClient, spec: AblationSpec, artifact_location: str | None) -> str:
    rev, dirty = git_revision()
    tags = {ABLATION_TAG: spec.name, ROLE_TAG: "parent", FINGERPRINT_TAG: fingerprint(spec), "git_revision": rev,
            "git_dirty": str(dirty).lower(), "command": " ".join(sys.argv)}
    if spec.description:
        tags["mlflow.note.content"] = spec.description
    run = client.create_run(experiment_id(client, spec.experiment_name, artifact_location),
                            run_name=f"ablation-{spec.name}", tags=tags)
    params = {"base": spec.base, "seed_key": spec.seed_key, "cells": len(spec.cells()),
              **{f"axis.{k}": ", ".join(format_value(v) for v in values) for k, values in spec.axes.items()},
              **{f"fixed.{k}": format_value(v) for k, v in spec.overrides.items()},
              **{f"baseline.{k}": format_value(v) for k, v in spec.baseline_values().items()}}
    client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    return run.info.run_id


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
        token = page.token
        if not token:
            return runs


def finished_cells(client: mlflow.MlflowClient, parent_run_id: str) -> dict[str, str]:
    """Cell key -> run id of its newest FINISHED child run."""
    parent = client.get_run(parent_run_id)
    return {run.data.tags[CELL_TAG]: run.info.run_id for run in child_runs(client, parent)
            if CELL_TAG in run.data.tags}


def close_runs(client: mlflow.MlflowClient, run_ids: Iterable[str], status: str) -> None:
    """End runs left RUNNING (their process was killed) with ``status``."""
    for run_id in run_ids:
        run = usable_run(client, run_id)
        if run is not None and run.info.status == "RUNNING":
            client.set_terminated(run_id, status)
