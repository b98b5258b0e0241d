"""The Optuna side of a sweep: the storage, sampler, pruner and study a spec describes, and how a trial samples its
config. The driver and every trial process build these from the same resolved spec, so a trial process prunes with
exactly the driver's pruner."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial

from satlab.config.errors import ConfigError
from satlab.sweep.spec import Param, SweepSpec, TrialSettings, active_params

# Trial user attributes (what `optuna-dashboard` shows next to each trial).
REASON = "reason"  # why a trial was pruned or failed: pruned, gate_saturation, nan, oom, timeout, ...
ARCH = "arch"  # the trial's model.arch, so the dashboard's trial table shows it
VALUE = "objective_value"  # the objective a trial process computed (the driver returns it to Optuna)
SATURATION = "saturated_frac"  # the last val/gates/saturated_frac measured (absent for models without gates)
TOKENS = "tokens_seen"  # tokens seen at the last validation
RUN_ID = "mlflow_run_id"
PID = "pid"
LOG = "log_file"
RETRY_OF = "retry_of"
# Exit codes of a trial process (anything else, or a signal, is a crash the driver describes from the log).
EXIT_COMPLETE, EXIT_PRUNED, EXIT_FAILED, EXIT_WORKER_LOST = 0, 3, 4, 5
CONSTRAINT = "gate_saturation"
STORAGE_ENV = "SATLAB_SWEEP_STORAGE"  # how a trial process gets the storage URL (not argv: it may hold a password)
# Study user attributes.
PARENT_RUN = "mlflow_parent_run_id"
TRACKING_URI = "mlflow_tracking_uri"
# Attributes that describe one attempt: a retried trial inherits the stale one's user attrs and must not keep these.
ATTEMPT_ATTRS = (REASON, VALUE, SATURATION, TOKENS, RUN_ID, PID, LOG)


def open_storage(url: str, settings: TrialSettings | None = None,
                 stale_callback: Callable[[optuna.Study, FrozenTrial], None] | None = None,
                 create_tables: bool = True) -> RDBStorage:
    """An RDB storage (sqlite file, PostgreSQL, MySQL). With ``settings`` it records heartbeats, so a trial whose
    worker died is failed after ``grace_seconds`` and handed to ``stale_callback`` (which retries it).

    Journal storages are not accepted: Optuna implements heartbeats for RDB storages only, and without them a
    killed worker's trial would stay RUNNING for ever.
    """
    if "://" not in url:
        raise ConfigError(f"storage '{url}' is not a database URL; use sqlite:///<abs path>/optuna.db on one host or "
                          "postgresql://user:password@host/db across hosts (journal files lack heartbeats)")
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 120}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    heartbeat: dict[str, Any] = {}
    if settings is not None:
        heartbeat = dict(heartbeat_interval=settings.heartbeat_seconds, grace_period=settings.grace_seconds,
                         heartbeat_stale_trial_callback=stale_callback)
    attempts = 3 if url.startswith("sqlite") else 1  # two processes creating one new sqlite file race: try again
    for attempt in range(1, attempts + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                storage = RDBStorage(url, engine_kwargs=engine_kwargs, skip_table_creation=not create_tables,
                                     **heartbeat)
            break
        except ImportError as e:
            raise ConfigError(f"storage '{safe_url(url)}' needs a database driver that is not installed ({e}); "
                              "for PostgreSQL: pip install psycopg2-binary") from None
        except Exception as e:  # SQLAlchemy's OperationalError and friends: unreachable server, bad credentials
            if attempt == attempts:
                raise ConfigError(f"cannot open the storage '{safe_url(url)}': {type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}") from None
            time.sleep(attempt)
    if url.startswith("sqlite"):
        serialize_sqlite(storage.engine)
    return storage


def serialize_sqlite(engine: sqlalchemy.engine.Engine) -> None:
    """SQLite ignores ``SELECT ... FOR UPDATE``, so two workers could both pop the same WAITING trial (an enqueued
    point or a retry) and run it twice. Beginning every transaction with ``BEGIN IMMEDIATE`` (SQLAlchemy's recipe
    for pysqlite) takes the write lock up front and makes Optuna's read-check-write atomic across threads and
    processes; transactions are short, so waiting for the lock costs little."""

    @sqlalchemy.event.listens_for(engine, "connect")
    def no_implicit_begin(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sqlalchemy.event.listens_for(engine, "begin")
    def begin_immediate(connection: sqlalchemy.engine.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners existed must not be reused


def safe_url(url: str) -> str:
    """The URL with any password masked (for logs, MLflow params and messages)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: nothing to hide that we could parse
        return url


def make_sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    """TPE (multivariate, grouped for the per-architecture parameters, constant liar for parallel workers) or
    random search. TPE treats a trial whose ``gate_saturation`` constraint (:func:`record_constraint`) is positive
    as infeasible and samples away from it."""
    if spec.sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=spec.sampler.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=spec.sampler.seed, n_startup_trials=spec.sampler.n_startup_trials,
                                          multivariate=True, group=True, constant_liar=True)


def record_constraint(trial: optuna.Trial, spec: SweepSpec, saturation: float | None) -> None:
    """The saturation guard as an Optuna constraint (Optuna 5's ``Trial.set_constraint``, which replaced the
    sampler's ``constraints_func``): saturated fraction minus threshold, feasible when <= 0; no gates is feasible."""
    guard = spec.saturation
    if guard.threshold is not None and guard.constraint:
        trial.set_constraint(CONSTRAINT, float(saturation or 0.0) - guard.threshold)


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    """Steps are tokens seen, so warm-up and Hyperband's resources are token counts. When ``model.arch`` is searched
    the median pruner compares each trial with trials of its own architecture (Hyperband's brackets stay
    study-wide)."""
    p = spec.pruner
    if p.name == "median":
        median = optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=p.warmup_tokens)
        return SameArchitecturePruner(median) if "model.arch" in spec.space else median
    if p.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_tokens or 1, max_resource="auto",
                                              reduction_factor=p.reduction_factor)
    return optuna.pruners.NopPruner()


class SameArchitecturePruner(optuna.pruners.BasePruner):
    """``inner`` judging a trial against the trials of the same ``model.arch`` only: architectures differ in loss at
    every token count, so a study-wide median would prune the weaker architecture's best learning rates."""

    def __init__(self, inner: optuna.pruners.BasePruner):
        self.inner = inner

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.inner.prune(_SameArchitecture(study, trial.params.get("model.arch")), trial)


class _SameArchitecture:
    """A view of a study whose trials are those of one architecture (all a percentile pruner reads)."""

    def __init__(self, study: optuna.Study, arch: Any):
        self._study, self._arch = study, arch

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[FrozenTrial]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states)
                if t.params.get("model.arch") == self._arch]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


def create_study(spec: SweepSpec, storage: RDBStorage) -> optuna.Study:
    """Create the study or join the existing one of the same name (another host, or a re-run that resumes)."""
    study = optuna.create_study(study_name=spec.name, storage=storage, sampler=make_sampler(spec),
                                pruner=make_pruner(spec), direction=spec.objective.direction, load_if_exists=True)
    if study.direction.name.lower() != spec.objective.direction:
        raise ConfigError(f"study '{spec.name}' in this storage was created to {study.direction.name.lower()}, but the "
                          f"spec says {spec.objective.direction}; use another name or storage")
    study.set_metric_names([spec.objective.metric])  # the dashboard's axis says "val/loss", not "Objective 0"
    for point in spec.enqueue:
        study.enqueue_trial(point, skip_if_exists=True)
    return study


def load_study(spec: SweepSpec, url: str) -> optuna.Study:
    """The study as a trial process sees it: no heartbeats of its own (its worker beats for it), the spec's pruner."""
    return optuna.load_study(study_name=spec.name, storage=open_storage(url, create_tables=False),
                             sampler=optuna.samplers.RandomSampler(), pruner=make_pruner(spec))


def suggest(trial: optuna.Trial, spec: SweepSpec, base_arch: str) -> dict[str, Any]:
    """Sample the trial's config keys: ``model.arch`` first, then the parameters that apply to that architecture."""
    params: dict[str, Any] = {}
    if "model.arch" in spec.space:
        params["model.arch"] = suggest_one(trial, "model.arch", spec.space["model.arch"])
    arch = params.get("model.arch", base_arch)
    for name in active_params(spec, arch):
        if name != "model.arch":
            params[name] = suggest_one(trial, name, spec.space[name])
    return params


def suggest_one(trial: optuna.Trial, name: str, p: Param) -> Any:
    if p.type == "categorical":
        return trial.suggest_categorical(name, p.choices)
    if p.type == "int":
        return trial.suggest_int(name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
    return trial.suggest_float(name, float(p.low), float(p.high), step=p.step, log=p.log)
