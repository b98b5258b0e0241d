"""`satlab report <ablation or parent run id>`: (re)write an ablation's report from its MLflow runs."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

import mlflow
import yaml
from mlflow.exceptions import MlflowException

from satlab.config.errors import ConfigError
from satlab.console import console as make_console
from satlab.studies import attrs as A
from satlab.studies.ablation_report import write_report
from satlab.studies.loader import load_ablation, spec_from_dict
from satlab.studies.plans import GridPlan
from satlab.studies.runs import find_parent_run, usable_run
from satlab.studies.spec import AblationSpec
from satlab.training.tracking import resolve_tracking

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def run(args: argparse.Namespace) -> int:
    spec, client, parent_run_id = open_ablation(args.target, args.tracking_uri)
    write_report(spec, client, parent_run_id, Path(args.out) if args.out else None, console=make_console())
    return 0


def open_ablation(target: str, tracking_uri: str | None = None) -> tuple[AblationSpec, mlflow.MlflowClient, str]:
    """(the spec the parent run was made with, a client of its store, the parent run id) for an ablation name, a
    spec file or a parent run id."""
    if RUN_ID.match(target):
        client = mlflow.MlflowClient(tracking_uri or resolve_tracking(None, None)[0])
        return stored_spec(client, target), client, target
    spec = load_ablation(target)
    study = GridPlan(spec).recorded_study()
    recorded = study.user_attrs if study is not None else {}
    uri = tracking_uri or recorded.get(A.TRACKING_URI) or resolve_tracking(spec.base_config().tracking.uri, None)[0]
    client = mlflow.MlflowClient(uri)
    parent = usable_run(client, recorded.get(A.PARENT_RUN)) if recorded.get(A.TRACKING_URI) == uri else None
    parent = parent or find_parent_run(client, spec) or find_parent_run(client, spec, same_settings=False)
    if parent is None:
        raise ConfigError(f"no runs of ablation '{spec.name}' in {uri} (experiment '{spec.experiment_name}'); "
                          f"run it first: satlab ablate {target}")
    return stored_spec(client, parent.info.run_id), client, parent.info.run_id


def stored_spec(client: mlflow.MlflowClient, run_id: str) -> AblationSpec:
    """The spec saved on the parent run (the one actually run, command-line items included)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file: no progress bar
    try:
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(client.download_artifacts(run_id, AblationSpec.spec_artifact, tmp)).read_text()
    except (MlflowException, OSError) as e:
        raise ConfigError(f"run {run_id} in {client.tracking_uri} is not an ablation's parent run (no "
                          f"{AblationSpec.spec_artifact}: {' '.join(str(e).split())[:200]})") from None
    return spec_from_dict(AblationSpec, yaml.safe_load(text), f"{AblationSpec.spec_artifact} of run {run_id}")
