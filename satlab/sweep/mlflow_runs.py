"""The sweep's MLflow runs: one parent run per study, one child run per trial.

Each trial's child run is made by Lightning's MLflow logger inside the trial process (tagged ``mlflow.parentRunId``,
``optuna.trial_number``, ``optuna.study``); the driver closes it with the trial's outcome, and makes a failed one for
a trial that died before training began, so every trial has a child run.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import mlflow
import optuna
import yaml
from mlflow.entities import Param as MlflowParam
from mlflow.exceptions import MlflowException
from optuna.trial import FrozenTrial

from satlab.config.schema import ExperimentConfig
from satlab.sweep.spec import SweepSpec
from satlab.sweep.study import LOG, PARENT_RUN, REASON, RUN_ID, TRACKING_URI, safe_url
from satlab.training.tracking import ensure_reachable, experiment_id, git_revision, open_store, resolve_tracking

RUN_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def tracking_target(cfg: ExperimentConfig) -> tuple[str, str | None]:
    """(tracking URI, artifact location for a new experiment) of the base experiment, checked reachable."""
    uri, artifacts = resolve_tracking(cfg.tracking.uri, cfg.tracking.artifact_dir)
    return open_store(ensure_reachable(uri, cfg.tracking.fallback_local)), artifacts


def _reopen(client: mlflow.MlflowClient, run_id: str) -> bool:
    """Mark the recorded parent run RUNNING again; False when it is gone (deleted, or the store was replaced)."""
    try:
        client.update_run(run_id, status="RUNNING")
    except MlflowException:
        return False
    return True


def ensure_parent_run(client: mlflow.MlflowClient, study: optuna.Study, spec: SweepSpec, tracking_uri: str,
                      artifact_location: str | None, storage_url: str) -> str:
    """The study's parent run: the one recorded on the study (a re-run resumes it), else a new one with the spec as
    params and a ``sweep.yaml`` artifact, recorded on the study for the next run and for other hosts."""
    run_id = study.user_attrs.get(PARENT_RUN)
    if run_id and study.user_attrs.get(TRACKING_URI) == tracking_uri and _reopen(client, run_id):
        return run_id
    rev, dirty = git_revision()
    tags = {"optuna.study": spec.name, "satlab.sweep": "parent", "git_revision": rev, "git_dirty": str(dirty).lower(),
            "command": " ".join(sys.argv)}
    run = client.create_run(experiment_id(client, spec.experiment or f"sweep-{spec.name}", artifact_location),
                            run_name=f"sweep-{spec.name}", tags=tags)
    run_id = run.info.run_id
    params = parent_params(spec, storage_url)
    client.log_batch(run_id, params=[MlflowParam(k, str(v)[:6000]) for k, v in params.items()])
    shown = dataclasses.replace(spec, storage=safe_url(storage_url))
    client.log_text(run_id, yaml.safe_dump(dataclasses.asdict(shown), sort_keys=False), "sweep.yaml")
    study.set_user_attr(PARENT_RUN, run_id)
    study.set_user_attr(TRACKING_URI, tracking_uri)
    return run_id


def parent_params(spec: SweepSpec, storage_url: str) -> dict[str, Any]:
    """The spec flattened for the parent run: search space, fixed overrides, objective, sampler, pruner, guard."""

    def describe(section: Any) -> str:
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(section).items() if v is not None)

    params: dict[str, Any] = {"study": spec.name, "base": spec.base, "objective": spec.objective.metric,
                              "direction": spec.objective.direction, "n_trials": spec.n_trials,
                              "sampler": describe(spec.sampler), "pruner": describe(spec.pruner),
                              "saturation": describe(spec.saturation), "trial": describe(spec.trial),
                              "storage": safe_url(storage_url)}
    params.update({f"space.{name}": describe(p) for name, p in spec.space.items()})
    params.update({f"fixed.{key}": value for key, value in spec.overrides.items()})
    return params


def close_child_run(client: mlflow.MlflowClient, run_id: str, state: str, reason: str | None,
                    log_file: Path | None = None) -> None:
    """Tag the trial's run with its Optuna state and reason, attach the trial log, and set the matching status
    (COMPLETE -> FINISHED, PRUNED -> KILLED, FAIL -> FAILED)."""
    client.set_tag(run_id, "optuna.state", state)
    if reason:
        client.set_tag(run_id, "sweep.reason", reason[:5000])
    if state != "COMPLETE":  # MLflow has no "pruned" status: the runs table's stop_reason column says it
        client.set_tag(run_id, "stop_reason", f"{state.lower()}: {reason or 'no reason recorded'}"[:5000])
    if log_file is not None and log_file.exists():
        client.log_artifact(run_id, str(log_file), "sweep")
    status = RUN_STATUS.get(state, "FAILED")
    if client.get_run(run_id).info.status != status:
        client.set_terminated(run_id, status)


def record_trial_without_run(client: mlflow.MlflowClient, parent_run_id: str, study_name: str,
                             trial: FrozenTrial) -> str:
    """A child run for a trial that ended before its process opened one (killed while importing, bad config...)."""
    parent = client.get_run(parent_run_id)
    tags = {"mlflow.parentRunId": parent_run_id, "optuna.trial_number": str(trial.number), "optuna.study": study_name}
    run = client.create_run(parent.info.experiment_id, run_name=f"{study_name}-t{trial.number:04d}", tags=tags)
    if trial.params:
        client.log_batch(run.info.run_id, params=[MlflowParam(k, str(v)) for k, v in trial.params.items()])
    return run.info.run_id


def close_trial(client: mlflow.MlflowClient, parent_run_id: str, study_name: str, trial: FrozenTrial,
                default_reason: str | None = None) -> str:
    """Close the child run of a finished trial (making one if needed); returns its id."""
    run_id = trial.user_attrs.get(RUN_ID) or record_trial_without_run(client, parent_run_id, study_name, trial)
    log = trial.user_attrs.get(LOG)
    close_child_run(client, run_id, trial.state.name, trial.user_attrs.get(REASON) or default_reason,
                    Path(log) if log else None)
    return run_id
