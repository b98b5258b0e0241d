"""Which recorded ablation ``satlab report`` means: a parent run id, a spec (a name under the ablations folder or a
file, :mod:`satlab.config.resolve`), or the name of an ablation that ran from a spec file elsewhere
(``satlab ablate path/to/x.yml``, then ``satlab report x``), found by its record: the Optuna study in its default
folder (the study names its parent run and MLflow store), else a parent run of that name in the MLflow store.
Either way the report is written from the spec saved on the parent run, the one that ran, except for its analysis
settings (the ``lr_transfer:`` block, a ladder's ``fit:``), which a spec file of the same study may change after the run
(:func:`with_analysis_of`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path

import mlflow
import optuna
import yaml
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from satlab.config.errors import ConfigError
from satlab.config.resolve import find, folder, unknown
from satlab.config.stores import missing_sqlite_file
from satlab.studies import attrs as A
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import load_ablation, spec_from_dict
from satlab.studies.plans import GridPlan
from satlab.studies.runs import ABLATION_TAG, ROLE_TAG, find_parent_run, usable_run
from satlab.studies.storage import open_storage
from satlab.training.tracking import resolve_tracking

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def open_ablation(target: str, tracking_uri: str | None = None) -> tuple[AblationSpec, mlflow.MlflowClient, str]:
    """(the spec the parent run was made with, a client of its store, the parent run id) for an ablation name, a
    spec file or a parent run id."""
    if RUN_ID.match(target):
        client = mlflow.MlflowClient(tracking_uri or resolve_tracking(None, None)[0])
        return stored_spec(client, target), client, target
    if find("ablation", target) is None:  # a name no spec file has
        return recorded_ablation(target, tracking_uri)
    spec = load_ablation(target)
    study = GridPlan(spec).recorded_study()
    recorded = study.user_attrs if study is not None else {}
    uri = tracking_uri or recorded.get(A.TRACKING_URI) or resolve_tracking(spec.base_config().tracking.uri, None)[0]
    never_ran = ConfigError(f"no runs of ablation '{spec.name}' in {uri} (experiment '{spec.experiment_name}'); "
                            f"run it first: satlab ablate {target}")
    if missing_sqlite_file(uri):
        raise never_ran  # opening a client would create an empty store: a lookup writes nothing
    client = mlflow.MlflowClient(uri)
    parent = usable_run(client, recorded.get(A.PARENT_RUN)) if recorded.get(A.TRACKING_URI) == uri else None
    parent = parent or find_parent_run(client, spec) or find_parent_run(client, spec, same_settings=False)
    if parent is None:
        raise never_ran
    return with_analysis_of(stored_spec(client, parent.info.run_id), spec), client, parent.info.run_id


def with_analysis_of(stored: AblationSpec, current: AblationSpec) -> AblationSpec:
    """The spec that ran, with the analysis settings of ``current`` (the spec file now: its ``lr_transfer:`` block
    and its ladder's ``fit:``) when both are the same study (same fingerprint): how the report fits what ran is the
    report's, not the runs'. Another study's file changes nothing."""
    if stored.fingerprint() != current.fingerprint():
        return stored
    merged = dataclasses.replace(stored, lr_transfer=current.lr_transfer)
    if stored.ladder.enabled and current.ladder.enabled:
        merged = dataclasses.replace(merged, ladder=dataclasses.replace(stored.ladder, fit=current.ladder.fit))
        if problems := merged.ladder.backtest_seed_problems():
            raise ConfigError([f"{p} (the ladder as it ran; the spec file's ladder.seeds differ: run the ladder to "
                               "add the seeds, or judge seeds it ran)" for p in problems])
    return merged


def recorded_ablation(name: str, tracking_uri: str | None = None) -> tuple[AblationSpec, mlflow.MlflowClient, str]:
    """:func:`open_ablation` of a name without a spec file: the newest study of that name in the ablation's default
    folder that names a parent run (in ``tracking_uri`` when given, else in the store it records), else the newest
    parent run of that name in ``tracking_uri`` (default: ``$MLFLOW_TRACKING_URI`` or satlab's store). Neither is
    a :class:`ConfigError` that lists the ablation specs and says where it looked."""
    db = (AblationSpec.out_of(name) / "optuna.db").resolve()
    for uri, run_id in _studies_parents(name, db):
        client = mlflow.MlflowClient(tracking_uri or uri)
        if usable_run(client, run_id) is not None:
            return stored_spec(client, run_id), client, run_id
    uri = tracking_uri or resolve_tracking(None, None)[0]
    client = mlflow.MlflowClient(uri)
    if (parent := named_parent_run(client, name)) is not None:
        return stored_spec(client, parent.info.run_id), client, parent.info.run_id
    raise ConfigError(f"{unknown('ablation', name, folder('ablation'))}; nor has an ablation of that name run from a "
                      f"spec file elsewhere: no study of it with a parent run in {db}, no parent run tagged "
                      f"{ABLATION_TAG}={name} in {uri} (give the spec's path, its parent run id, or --tracking-uri)")


def _studies_parents(name: str, db: Path) -> list[tuple[str, str]]:
    """(MLflow store, parent run id) of each ablation study named ``name`` in ``db``, newest first."""
    if not db.is_file():
        return []
    storage = open_storage(f"sqlite:///{db}", create_tables=False)
    studies = [s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)
               if s.study_name.startswith(f"{name}.") and s.user_attrs.get(A.KIND) == AblationSpec.kind
               and s.user_attrs.get(A.PARENT_RUN) and s.user_attrs.get(A.TRACKING_URI)]
    studies.sort(key=lambda s: s.datetime_start or datetime.min, reverse=True)
    return [(s.user_attrs[A.TRACKING_URI], s.user_attrs[A.PARENT_RUN]) for s in studies]


def named_parent_run(client: mlflow.MlflowClient, name: str) -> Run | None:
    """The newest active parent run of an ablation named ``name`` in any experiment of the store."""
    experiments: list[str] = []
    token = None
    while True:
        page = client.search_experiments(page_token=token)
        experiments.extend(e.experiment_id for e in page)
        if not (token := page.token):
            break
    if not experiments:
        return None
    query = f"tags.`{ABLATION_TAG}` = '{name}' and tags.`{ROLE_TAG}` = 'parent'"
    runs = client.search_runs(experiments, query, order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


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
