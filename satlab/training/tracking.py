"""MLflow tracking: where runs go, provenance tags, and a fail-fast check of the tracking server.

MLflow >= 3.13 refuses a plain-folder store, so the default is a sqlite database ``mlruns/mlflow.db`` with
artifacts in ``mlruns/artifacts`` under the project (or ``$MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import satlab
from satlab.config.display import Param, flatten
from satlab.config.errors import ConfigError
from satlab.config.schema import ExperimentConfig
from satlab.training.machine import cpu_model

if TYPE_CHECKING:
    import mlflow

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STORE = PROJECT_ROOT / "mlruns"


def default_tracking_uri() -> str:
    return f"sqlite:///{DEFAULT_STORE / 'mlflow.db'}"


def resolve_tracking(uri: str | None, artifact_dir: str | None) -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments) from the config, the environment and the default."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        artifacts = Path(artifact_dir) if artifact_dir else db.parent / "artifacts"
        return uri, artifacts.resolve().as_uri()
    if "://" not in uri:
        raise ConfigError(
            f"tracking.uri '{uri}' is a plain folder, which MLflow >= 3.13 refuses as a tracking store; "
            f"use 'sqlite:///{Path(uri).resolve()}/mlflow.db' or a server URL such as http://127.0.0.1:5000"
        )
    return uri, Path(artifact_dir).resolve().as_uri() if artifact_dir else None


def open_store(uri: str) -> str:
    """``uri``, with the folder of a sqlite store created: done only once a run is about to be recorded, so that a
    run refused for bad input leaves no store behind."""
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return uri


def check_server(uri: str, timeout: float = 5.0) -> str | None:
    """None when an http(s) tracking server answers (or the store is local); otherwise why it does not."""
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout).close()
    except (urllib.error.URLError, OSError) as error:
        return str(getattr(error, "reason", error))
    return None


def ensure_reachable(uri: str, fallback_local: bool) -> str:
    """The URI to use: ``uri`` when reachable; the local sqlite store if the server is down and fallback is on."""
    problem = check_server(uri)
    if problem is None:
        return uri
    if fallback_local:
        local = default_tracking_uri()
        print(f"satlab: MLflow server {uri} is unreachable ({problem}); logging to the local store {local}",
              file=sys.stderr)
        return local
    raise ConfigError(
        f"the MLflow tracking server {uri} is unreachable ({problem}); start it (make ui serves the local store), "
        "fix tracking.uri / MLFLOW_TRACKING_URI, or set tracking.fallback_local=true to log to mlruns/mlflow.db"
    )


EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""MLflow 3's UI opens an experiment without this tag on its GenAI overview; with it, on the runs table."""


def mark_model_training(client: mlflow.MlflowClient, experiment_id: str) -> None:
    client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)


def experiment_id(client: mlflow.MlflowClient, name: str, artifact_location: str | None) -> str:
    """The id of the MLflow experiment ``name``, created (with ``artifact_location``) if it does not exist yet."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        created = client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:  # another process or host created it between the two calls
        return client.get_experiment_by_name(name).experiment_id
    mark_model_training(client, created)
    return created


def run_params(cfg: ExperimentConfig) -> dict[str, Param]:
    """The config as MLflow params, less the options of the architectures this run does not use (a run page
    would otherwise list every registered architecture's settings)."""
    from satlab.models import ARCHITECTURES

    unused = tuple(f"model.{a.name}." for a in ARCHITECTURES.values()
                   if a.options is not None and a.name != cfg.model.arch)
    return {k: v for k, v in flatten(cfg).items() if not k.startswith(unused)}


def git_revision() -> tuple[str, bool]:
    """(commit hash or 'unknown', whether the work tree has uncommitted changes)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip() != ""
        return rev, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def provenance_tags(arch: str, preset: str) -> dict[str, str]:
    import lightning
    import torch

    rev, dirty = git_revision()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_model()
    return {
        "arch": arch,
        "preset": preset,
        "git_revision": rev,
        "git_dirty": str(dirty).lower(),
        "satlab_version": satlab.__version__,
        "torch_version": torch.__version__,
        "lightning_version": lightning.__version__,
        "python_version": platform.python_version(),
        "device": device,
        "device_count": str(max(torch.cuda.device_count(), 1)),
        "command": " ".join(sys.argv),
    }
