"""Running a sweep: :func:`run_sweep` is ``satlab sweep`` (and ``make sweep``).

Optuna is driven directly: ``study.optimize`` with ``n_jobs=workers`` threads, each sampling a trial, running it as a
subprocess (``python -m satlab.sweep.trial``, or ``torchrun`` for a multi-GPU config) and returning its outcome; the
thread keeps the trial's heartbeat while the subprocess trains. The same command on another host with the same
storage joins the study; a re-run resumes it (``load_if_exists``) and its MLflow parent run.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlflow
import optuna
from mlflow.exceptions import MlflowException
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial
from rich.console import Console

from satlab.config.schema import ExperimentConfig
from satlab.data import prepare_data
from satlab.sweep.mlflow_runs import close_trial, ensure_parent_run, tracking_target
from satlab.sweep.process import trial_command
from satlab.sweep.report import write_report
from satlab.sweep.spec import SweepSpec
from satlab.sweep.study import (
    ARCH,
    ATTEMPT_ATTRS,
    EXIT_COMPLETE,
    EXIT_PRUNED,
    LOG,
    REASON,
    RETRY_OF,
    SATURATION,
    STORAGE_ENV,
    TOKENS,
    VALUE,
    create_study,
    open_storage,
    record_constraint,
    safe_url,
    suggest,
)
from satlab.training.launch import ProcessGroup, describe_exit, worker_env

WORKER_LOST = "worker_lost"


class TrialFailed(Exception):
    """A trial ended without a value; its reason is on the trial. Caught by ``study.optimize``: the study goes on."""


@dataclass
class SweepResult:
    study_name: str
    storage: str
    tracking_uri: str
    experiment: str
    parent_run_id: str
    states: dict[str, int]
    report: dict[str, Path]
    interrupted: bool


def resolve_spec(spec: SweepSpec, base: ExperimentConfig, storage: str | None = None) -> SweepSpec:
    """Fill the defaults that depend on the base config and the command line, so every process sees one spec."""
    return replace(spec, storage=storage or spec.storage_url(), experiment=spec.experiment or f"sweep-{spec.name}",
                   out_dir=str(spec.study_dir().resolve()),
                   pruner=replace(spec.pruner, min_tokens=spec.pruner.min_tokens or base.train.val_every_tokens))


def run_sweep(spec: SweepSpec, workers: int = 1, n_trials: int | None = None, storage: str | None = None,
              console: Console | None = None) -> SweepResult:
    """Run ``n_trials`` (default ``spec.n_trials``) more trials of the study with ``workers`` in parallel, then
    write the report onto the parent run. The base config's data, the storage and the MLflow store are prepared
    here, before any trial process opens them (two processes creating one sqlite database race)."""
    console = console or Console()
    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeats, retries, constraints: experimental
    base = spec.base_config()
    spec = resolve_spec(spec, base, storage)
    spec.study_dir().mkdir(parents=True, exist_ok=True)
    if not base.data.synthetic_task:  # once, here: the trials find it cached instead of racing to build it
        prepare_data(base.data, progress=False)
    stale = StaleTrialRetry(None, spec.trial.max_retry)
    study = create_study(spec, open_storage(spec.storage, spec.trial, stale))  # a bad storage fails before MLflow
    tracking_uri, artifacts = tracking_target(base)
    client = stale.client = mlflow.MlflowClient(tracking_uri)
    stale.parent_run_id = parent_run_id = ensure_parent_run(client, study, spec, tracking_uri, artifacts, spec.storage)
    launcher = TrialLauncher(spec, base, parent_run_id, tracking_uri, workers, client, console)
    count = spec.n_trials if n_trials is None else n_trials
    console.print(f"[bold]sweep[/] [cyan]{spec.name}[/]: {count} trials, {workers} worker(s), "
                  f"{launcher.threads} thread(s) each; storage {safe_url(spec.storage)}; MLflow {tracking_uri}, "
                  f"experiment '{spec.experiment}', parent run {parent_run_id}", soft_wrap=True)
    interrupted = False
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, launcher.interrupt) if in_main_thread else None
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # each trial gets one line of ours instead
    try:
        optuna.storages.fail_stale_trials(study)  # a worker that died since the last run: retry its trial first
        if count > 0:
            study.optimize(launcher, n_trials=count, n_jobs=workers, catch=(TrialFailed,),
                           callbacks=[launcher.on_trial_end])
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted[/]: the same command resumes the study")
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
            if trial.user_attrs.get(REASON) == "interrupted":  # Optuna ran no callback for these
                close_trial(client, parent_run_id, spec.name, trial)
    except BaseException:
        client.set_terminated(parent_run_id, "FAILED")
        raise
    finally:
        optuna.logging.set_verbosity(verbosity)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    report = write_report(study, spec, base.model.arch, client, parent_run_id, console)
    client.set_terminated(parent_run_id, "KILLED" if interrupted else "FINISHED")
    states: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        states[trial.state.name] = states.get(trial.state.name, 0) + 1
    return SweepResult(spec.name, spec.storage, tracking_uri, spec.experiment, parent_run_id, states, report,
                       interrupted)


class StaleTrialRetry(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a trial whose worker stopped beating (it comes back as a WAITING trial with the same
    parameters), after closing the dead trial's MLflow run as FAILED with reason ``worker_lost``."""

    def __init__(self, client: mlflow.MlflowClient | None, max_retry: int):
        super().__init__(max_retry=max_retry)
        self.client = client
        self.parent_run_id: str | None = None

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.parent_run_id is not None:
            try:
                close_trial(self.client, self.parent_run_id, study.study_name, trial, WORKER_LOST)
            except MlflowException as e:
                print(f"satlab sweep: could not close the MLflow run of stale trial {trial.number}: {e}",
                      file=sys.stderr)
        super().__call__(study, trial)


class TrialLauncher:
    """Optuna's objective: one trial subprocess per call, in a worker slot (CPU threads, GPUs) of its own."""

    def __init__(self, spec: SweepSpec, base: ExperimentConfig, parent_run_id: str, tracking_uri: str, workers: int,
                 client: mlflow.MlflowClient, console: Console):
        self.spec, self.base, self.parent_run_id, self.tracking_uri = spec, base, parent_run_id, tracking_uri
        self.workers, self.client, self.console = workers, client, console
        self.threads = spec.trial.threads or max(1, (os.cpu_count() or 1) // workers)
        self.slots: queue.Queue[int] = queue.Queue()
        for slot in range(workers):
            self.slots.put(slot)
        self.logs = spec.study_dir() / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessGroup()
        self.stopping = threading.Event()

    def __call__(self, trial: optuna.Trial) -> float:
        retry_of = RetryHeartbeatStaleTrialCallback.retried_trial_number(trial.storage.get_trial(trial._trial_id))
        if retry_of is not None:  # a retried trial inherits the stale one's user attrs: start this attempt clean
            for key in ATTEMPT_ATTRS:
                trial.set_user_attr(key, None)
            trial.set_user_attr(RETRY_OF, retry_of)
        params = suggest(trial, self.spec, self.base.model.arch)
        trial.set_user_attr(ARCH, params.get("model.arch", self.base.model.arch))
        log_file = self.logs / f"trial-{trial.number:04d}.log"
        trial.set_user_attr(LOG, str(log_file))
        retry = f" (retry of trial {retry_of})" if retry_of is not None else ""
        self.console.print(f"trial {trial.number:>3} started{retry}: {format_params(params)}  [dim]{log_file}[/]",
                           soft_wrap=True)
        slot = self.slots.get()
        try:
            returncode, timed_out = self._run(trial, slot, log_file)
        finally:
            self.slots.put(slot)
        attrs = trial.storage.get_trial(trial._trial_id).user_attrs  # fresh: the trial process wrote them
        if returncode in (EXIT_COMPLETE, EXIT_PRUNED):
            record_constraint(trial, self.spec, attrs.get(SATURATION))
        if returncode == EXIT_COMPLETE and attrs.get(VALUE) is not None:
            return float(attrs[VALUE])
        if returncode == EXIT_PRUNED and not self.stopping.is_set():
            raise optuna.TrialPruned(attrs.get(REASON) or "pruned")
        if timed_out:
            reason = f"timeout after {self.spec.trial.timeout_minutes:g} min"
        elif self.stopping.is_set():
            reason = "interrupted"
        else:
            reason = attrs.get(REASON) or describe_exit(returncode, log_file)
        trial.set_user_attr(REASON, reason)
        raise TrialFailed(reason)

    def _run(self, trial: optuna.Trial, slot: int, log_file: Path) -> tuple[int, bool]:
        """Run the trial process to its end (or its timeout); the storage URL goes through the environment, so a
        database password does not show in the process list."""
        args = ["--trial-id", str(trial._trial_id), "--spec-json", replace(self.spec, storage=None).to_json(),
                "--parent-run-id", self.parent_run_id, "--tracking-uri", self.tracking_uri,
                "--experiment", self.spec.experiment, "--threads", str(self.threads), "--worker-pid", str(os.getpid())]
        command = trial_command(args, self.base.train.devices, self.base.train.accelerator)
        env = worker_env(slot, self.workers, self.threads, self.base.train)
        env[STORAGE_ENV] = self.spec.storage
        timeout = self.spec.trial.timeout_minutes * 60 if self.spec.trial.timeout_minutes else None
        try:
            return self.procs.run(command, env, log_file, timeout)
        except KeyboardInterrupt:
            trial.set_user_attr(REASON, "interrupted")
            raise

    def interrupt(self, signum: int, frame: Any) -> None:
        """SIGINT: stop every running trial process (their trials fail with reason ``interrupted``), then raise
        KeyboardInterrupt in the main thread so that no new trial starts."""
        self.stopping.set()
        self.procs.terminate()
        raise KeyboardInterrupt

    def on_trial_end(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """After Optuna recorded the outcome: close the trial's MLflow run and print one line."""
        try:
            close_trial(self.client, self.parent_run_id, study.study_name, trial)
        except MlflowException as e:
            self.console.print(f"[yellow]could not close the MLflow run of trial {trial.number}: {e}[/]")
        minutes = trial.duration.total_seconds() / 60 if trial.duration else 0.0
        style = {"COMPLETE": "green", "PRUNED": "yellow"}.get(trial.state.name, "red")
        tokens = trial.user_attrs.get(TOKENS)
        if trial.state.name == "COMPLETE":
            outcome = f"{self.spec.objective.metric} {trial.value:.4f}"
        elif trial.state.name == "PRUNED" and tokens is not None:
            outcome = f"at {tokens:,} tokens"
        else:
            outcome = ""
        reason = trial.user_attrs.get(REASON) if trial.state.name != "COMPLETE" else None
        self.console.print(f"trial {trial.number:>3} [{style}]{trial.state.name.lower()}[/] {outcome}"
                           f"{f' ({reason})' if reason else ''} after {minutes:.1f} min: {format_params(trial.params)}",
                           soft_wrap=True)


def format_params(params: dict[str, Any]) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k, v in params.items())
