"""MLflow tracking: where runs go, provenance tags, and a check that the tracking store answers before a run starts.

MLflow >= 3.13 refuses a plain-folder store, so the default is a sqlite database ``mlruns/mlflow.db`` with
artifacts in ``mlruns/artifacts`` under the project (or ``$MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import satlab
from satlab.config.archs import ARCH_SPECS
from satlab.config.display import Param, flatten
from satlab.config.errors import ConfigError
from satlab.config.schema import ExperimentConfig
from satlab.config.stores import sqlite_file
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
    if (db := sqlite_file(uri)) is not None:
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
    if (db := sqlite_file(uri)) is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    return uri


CHECK_SECONDS = 10.0
"""How long a tracking store may take to answer the check before a run: MLflow's own clients retry for minutes."""
DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")
"""The SQLAlchemy databases MLflow can use as a tracking store (with an optional ``+driver``)."""


def store_problem(uri: str, timeout: float = CHECK_SECONDS) -> str | None:
    """None when the tracking store at ``uri`` can be used now, else why not. Checked before anything is written:
    a sqlite file (its folder must exist unless it is satlab's default store, and an existing file must be a
    database), an http(s) server (its health endpoint), a database server (a connection); any other scheme is
    refused. Each check gives up after ``timeout`` seconds."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme == "sqlite":
        db = sqlite_file(uri)
        return sqlite_problem(db) if db is not None else "a sqlite store is written sqlite:///<path to the .db file>"
    if scheme in ("http", "https"):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout).close()
        except (urllib.error.URLError, OSError) as error:
            return str(getattr(error, "reason", error))
        return None
    if scheme in DATABASE_SCHEMES:
        return database_problem(uri, timeout)
    return (f"its scheme '{scheme}://' is not one satlab can check; use sqlite:///<abs path>/mlflow.db, an http(s) "
            f"tracking server or a database URL ({', '.join(s + '://' for s in DATABASE_SCHEMES)})")


def store_folder_problem(db: Path) -> str | None:
    """None when the folder of a database file exists or can be made as one new folder in an existing one (as
    ``mlruns/`` is); a path whose parents are missing too is more likely a typo than a wish for a folder tree."""
    if db.parent.is_dir() or db.parent.parent.is_dir():
        return None
    return f"its folder {db.parent} does not exist, nor does {db.parent.parent} (create it first: mkdir -p {db.parent})"


def sqlite_problem(db: Path) -> str | None:
    if problem := store_folder_problem(db):
        return problem
    if db.is_dir():
        return f"{db} is a folder, not a database file"
    if db.exists():
        import sqlite3

        try:
            # Read-write, never creating: a process killed inside a write transaction leaves a hot journal, which
            # the next connection must roll back; a read-only one fails on it ("attempt to write a readonly
            # database") and the store would be refused for good.
            with sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=CHECK_SECONDS) as connection:
                connection.execute("PRAGMA schema_version").fetchone()
        except sqlite3.Error as error:
            return f"{db} is not a usable sqlite database ({error})"
    return None


def database_problem(uri: str, timeout: float) -> str | None:
    """Connects once, in a thread given ``timeout`` seconds: drivers take a connect timeout, but a DNS lookup or a
    half-open connection can outlast it."""
    import threading

    import sqlalchemy

    outcome: list[str | None] = []

    def connect() -> None:
        try:
            engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": max(1, int(timeout))})
            engine.connect().close()
            engine.dispose()
            outcome.append(None)
        except ImportError as error:
            outcome.append(f"its database driver is not installed ({error}); for PostgreSQL: pip install psycopg")
        except Exception as error:  # noqa: BLE001 - SQLAlchemy wraps each driver's errors differently
            outcome.append(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}")

    thread = threading.Thread(target=connect, name="satlab-store-check", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:.0f} s"


def artifact_problem(artifact_dir: str | None) -> str | None:
    """None when the artifact folder can be written (or is not set), else why not."""
    if not artifact_dir:
        return None
    path = Path(artifact_dir).resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"tracking.artifact_dir {path} cannot be written ({existing} is not a writable folder)"
    return None


def ensure_reachable(uri: str, fallback_local: bool, artifact_dir: str | None = None) -> str:
    """The URI to use: ``uri`` when its store answers; the local sqlite store if it does not and fallback is on.
    Raises ConfigError (exit 2, nothing written) otherwise, naming the store tried and why it failed."""
    if problem := artifact_problem(artifact_dir):
        raise ConfigError(problem + "; give a folder you can write to, or leave it unset (the store's default)")
    problem = store_problem(uri)
    if problem is None:
        return uri
    shown = safe_uri(uri)
    if fallback_local and uri != default_tracking_uri():
        local = default_tracking_uri()
        print(f"satlab: MLflow tracking store {shown} is unusable ({problem}); logging to the local store {local}",
              file=sys.stderr)
        return local
    raise ConfigError(
        f"the MLflow tracking store {shown} cannot be used: {problem}. Start or fix it (make ui serves the local "
        "store), or fix tracking.uri / MLFLOW_TRACKING_URI, or set tracking.fallback_local=true to log to "
        "mlruns/mlflow.db; nothing was written"
    )


def safe_uri(uri: str) -> str:
    """``uri`` without a password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", uri)


EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""MLflow 3's UI opens an experiment without this tag on its GenAI overview; with it, on the runs table."""


def usable_run(client: mlflow.MlflowClient, run_id: str | None) -> mlflow.entities.Run | None:
    """The MLflow run ``run_id``; None when there is none, or it does not exist or was deleted."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


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
    unused = tuple(f"model.{a.name}." for a in ARCH_SPECS.values()
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


END_TAG = "end_reason"
"""How the run's latest attempt ended (``FINISHED: ...``, ``KILLED at step 20: SIGTERMException``, ...): replaced at
every end, so a run that finishes after a pre-emption says it finished."""
END_HISTORY_TAG = "end_history"
"""Every end of the run, one line each, oldest first (the last 5,000 characters): the pre-emptions, failures and
time limits a finished run went through."""


def record_end(client: mlflow.MlflowClient, run_id: str, status: str, reason: str, step: int | None = None) -> None:
    """Ends the run as ``status`` (FINISHED, FAILED or KILLED) with ``reason``: :data:`END_TAG` is replaced and the
    line appended to :data:`END_HISTORY_TAG`. When the store cannot be read (an outage; the writes wait in the run
    folder), the history is left as it is rather than overwritten."""
    line = f"{status}{'' if step is None else f' at step {step}'}: {reason}"[:2000]
    readable = True
    try:
        before = client.get_run(run_id).data.tags.get(END_HISTORY_TAG)
    except Exception:  # noqa: BLE001 - any failure to read: the history is left alone
        readable, before = False, None
    if readable:
        client.set_tag(run_id, END_HISTORY_TAG, "\n".join([*(before or "").splitlines(), line])[-5000:])
    client.set_tag(run_id, END_TAG, line)
    client.set_terminated(run_id, status)
