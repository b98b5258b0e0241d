"""A study's workers: threads that each run one trial at a time as a process of its own (:mod:`satlab.studies.child`)
in a slot with its share of the CPU threads and devices, read its outcome from the exit code and the attributes it
wrote, and close its MLflow run; and the retry of trials whose driver died."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlflow
import optuna
import yaml
from mlflow.exceptions import MlflowException
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console

from satlab.config.loader import load_experiment, safe_run_name
from satlab.config.schema import ExperimentConfig
from satlab.config.specs import nest
from satlab.studies import attrs as A
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.plans import GridPlan, Plan, Point, SearchPlan
from satlab.studies.runs import (
    INTERRUPTED,
    PARENT_TAG,
    STUDY_TAG,
    TRIAL_TAG,
    close_trial_run,
    end_run,
    read_run_id,
    usable_run,
)
from satlab.studies.spec import StudySpec, SweepSpec
from satlab.studies.storage import trial_id
from satlab.training.launch import ProcessGroup, describe_exit, pid_alive, worker_env


class TrialFailed(Exception):
    """A trial ended without a value; its reason is on the trial. Caught by ``study.optimize``: the study goes on."""


def fail_dead_local_trials(study: optuna.Study, storage: BaseStorage, retry: StaleTrialRetry) -> None:
    """Fail and retry the RUNNING trials of a dead driver on this host now, rather than after the heartbeat's grace
    period (trials of other hosts are left to their heartbeats). The reason goes on the trial through ``storage``,
    the study's: Optuna has no call for an attribute of a trial that another process runs."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get(A.WORKER, "")).rpartition(":")
        if worker_host == host and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            try:
                storage.set_trial_user_attr(trial_id(storage, study.study_name, trial.number), A.REASON,
                                            "worker_lost")
                failed = study.tell(trial.number, state=TrialState.FAIL)
            except (UpdateFinishedTrialError, ValueError):  # its heartbeat check, here or on another host, came first
                continue
            retry(study, failed)


def trial_now(study: optuna.Study, number: int) -> FrozenTrial:
    """Trial ``number`` as the storage has it now (its trial process writes attributes; a running trial is not
    cached)."""
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


class StaleTrialRetry(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry of a trial whose worker stopped beating, after closing its MLflow run as FAILED."""

    def __init__(self, max_retry: int):
        super().__init__(max_retry=max_retry)
        self.client: mlflow.MlflowClient | None = None
        self.parent_run_id: str | None = None

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.client is not None and self.parent_run_id is not None:
            try:
                close_trial_run(self.client, self.parent_run_id, study.study_name, trial,
                                trial.user_attrs.get(A.RUN_ID), trial.user_attrs.get(A.REASON) or "worker_lost", None)
            except MlflowException as e:
                print(f"satlab: could not close the MLflow run of stale trial {trial.number}: {e}")
        super().__call__(study, trial)


class TrialRunner:
    """Optuna's objective: one trial process per call, in a worker slot (CPU threads, GPUs) of its own."""

    def __init__(self, spec: StudySpec, plan: Plan, study: optuna.Study, storage: BaseStorage,
                 client: mlflow.MlflowClient, parent_id: str, tracking_uri: str, workers: int, console: Console):
        self.spec, self.plan, self.study, self.client, self.parent_id = spec, plan, study, client, parent_id
        self.storage = storage
        self.tracking_uri, self.workers, self.console = tracking_uri, workers, console
        self.threads = spec.trial.threads or max(1, (os.cpu_count() or 1) // workers)
        self.slots: queue.Queue[int] = queue.Queue()
        for slot in range(workers):
            self.slots.put(slot)
        self.logs = Path(spec.out_dir) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs, self.stopping, self.lock = ProcessGroup(), threading.Event(), threading.Lock()
        self.launched = 0
        self.starting = 0  # workers told to run that have not popped their trial yet
        self.local = threading.local()
        self.finished: list[str] = []
        self.failures: dict[str, str] = {}

    def run_all(self, retry: StaleTrialRetry) -> bool:
        """Run trials until the plan is done; True when interrupted (Ctrl-C or SIGTERM stop the running trials)."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self.interrupt) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # each trial gets lines of ours instead
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="satlab-worker")
        try:
            futures = [pool.submit(self.worker_loop, retry) for _ in range(self.workers)]
            for future in futures:
                while not future.done():
                    time.sleep(0.2)
                future.result()
        except KeyboardInterrupt:
            self.stopping.set()
            self.console.print("[yellow]interrupted[/]: stopping the running trials; the same command resumes")
            self.procs.stop()
            return True
        finally:
            pool.shutdown(wait=True)
            optuna.logging.set_verbosity(verbosity)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self.stopping.is_set()

    def interrupt(self, signum: int, frame: Any) -> None:
        """The first SIGINT or SIGTERM stops the running trials; a second one (make passes its own SIGTERM on, a
        second Ctrl-C) is ignored rather than raised inside that stop, which ends within each trial's grace period
        and leaves every trial resumable."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.procs.terminate()
        raise KeyboardInterrupt

    def worker_loop(self, retry: StaleTrialRetry) -> None:
        while not self.stopping.is_set():
            # before Optuna's heartbeat check (here, and when optimize() starts a trial), which fails a stale trial
            # without a reason: a dead driver on this host is seen at once, and its trial failed as worker_lost
            fail_dead_local_trials(self.study, self.storage, retry)
            with self.lock:  # counted so that two workers here do not both go for the last queued cell
                action = self.plan.next_action(self.study, self.launched, self.starting)
                self.launched += action == "run"
                self.starting += action == "run"
            if action == "done":
                return
            if action == "wait":
                optuna.storages.fail_stale_trials(self.study)
                time.sleep(self.spec.trial.heartbeat_seconds)
                continue
            self.local.starting = True
            try:
                self.study.optimize(self, n_trials=1, catch=(TrialFailed,), callbacks=[self.on_trial_end])
            finally:
                self.popped()

    def popped(self) -> None:
        """This worker's trial has left the queue (or optimize ended before it began)."""
        if getattr(self.local, "starting", False):
            self.local.starting = False
            with self.lock:
                self.starting -= 1

    def __call__(self, trial: optuna.Trial) -> float:
        self.popped()
        retry_of = RetryHeartbeatStaleTrialCallback.retried_trial_number(trial_now(self.study, trial.number))
        if retry_of is not None:  # a retried trial inherits the stale one's user attrs: start this attempt clean
            for key in A.ATTEMPT_ATTRS:
                trial.set_user_attr(key, None)
            trial.set_user_attr(A.RETRY_OF, retry_of)
        if isinstance(self.plan, GridPlan) and self.plan.cell_key(trial) is None:
            trial.set_user_attr(A.IGNORED, "no cell left")  # another host popped the last queued cell first
            raise optuna.TrialPruned("no cell left: another worker took the last one")
        params = self.plan.suggest(trial)
        if isinstance(self.plan, GridPlan) and self.plan.is_duplicate(self.study, trial, params):
            trial.set_user_attr(A.IGNORED, "duplicate")
            raise optuna.TrialPruned("duplicate: another worker has this cell")
        point = self.plan.point(trial, params)
        log_file = self.logs / f"{point.slug}.log"
        trial.set_user_attr(A.WORKER, f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr(A.LOG, str(log_file))
        path, cfg = self.write_trial_file(trial, params, point)
        trial.set_user_attr(A.ARCH, cfg.model.arch)
        run_dir = Path(cfg.train.out_dir) / cfg.name
        resumed = point.resume == "auto" and prepare_run_dir(self.client, run_dir)
        retry = f" (retry of trial {retry_of})" if retry_of is not None else ""
        self.console.print(f"trial {trial.number:>3} {'resumed' if resumed else 'started'}{retry}: "
                           f"{format_params(params)}  [dim]{log_file}[/]", soft_wrap=True)
        slot = self.slots.get()
        try:
            returncode, timed_out = self.execute(path, cfg, slot, log_file)
        finally:
            self.slots.put(slot)
        values = trial_now(self.study, trial.number).user_attrs  # the trial process wrote them
        if values.get(A.RUN_ID) is None and (run_id := read_run_id(run_dir)) is not None:
            trial.set_user_attr(A.RUN_ID, run_id)  # opened before the trial's callback could record it
        if isinstance(self.plan, SearchPlan) and returncode in (A.EXIT_COMPLETE, A.EXIT_PRUNED):
            self.plan.record_constraint(trial, values.get(A.SATURATION))
        if returncode == A.EXIT_COMPLETE and values.get(A.VALUE) is not None:
            return float(values[A.VALUE])
        if returncode == A.EXIT_PRUNED and not self.stopping.is_set():
            raise optuna.TrialPruned(values.get(A.REASON) or "pruned")
        if self.stopping.is_set():
            reason = INTERRUPTED
        elif timed_out:
            reason = f"timeout after {self.spec.timeout_minutes:g} min"
        else:
            reason = values.get(A.REASON) or describe_exit(returncode, log_file)
        trial.set_user_attr(A.REASON, reason)
        raise TrialFailed(reason)

    def write_trial_file(self, trial: optuna.Trial, params: dict[str, Any],
                         point: Point) -> tuple[Path, ExperimentConfig]:
        """The trial's experiment YAML, validated. Tags go in through the file: dotted tag keys such as
        ``mlflow.parentRunId`` cannot be written as overrides."""
        spec = self.spec
        base = spec.base_config()
        tags = {**base.tracking.tags, PARENT_TAG: self.parent_id, STUDY_TAG: self.study.study_name,
                TRIAL_TAG: str(trial.number), **point.tags}
        flat: dict[str, Any] = {k: v for k, v in spec.overrides.items() if not k.startswith("tracking.tags")}
        if spec.saturation.threshold is not None:  # the guard judges the run's gate analysis: on its windows
            flat = {"eval.gate_windows": spec.saturation.windows, **flat}
        if isinstance(spec, SweepSpec):  # no end-of-run suite unless asked for
            flat = {"eval.at_end": False, **flat}
            out_dir = Path(spec.out_dir) / "runs"
        else:
            out_dir = (Path(base.train.out_dir) / "ablations" / spec.name).resolve()
        flat.update({**params, "name": safe_run_name(f"{spec.name}-{point.slug}"), "tracking.run_name": point.label,
                     "description": f"ablation {spec.name}: {point.key}" if isinstance(spec, AblationSpec) else
                     f"sweep {spec.name}, trial {trial.number}: {format_params(params)}",
                     "train.out_dir": str(out_dir), "train.resume": point.resume,
                     "tracking.uri": self.tracking_uri, "tracking.experiment": spec.experiment_name})
        data = {"base": str(spec.base_path()), **nest(flat)}
        data["tracking"]["tags"] = tags
        path = Path(spec.out_dir) / "trials" / f"{point.slug}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {spec.kind} '{spec.name}', trial {trial.number}: {point.key}. Written by satlab.\n"
                        f"# Rerun it by hand with: satlab train experiment={path}\n"
                        + yaml.safe_dump(data, sort_keys=False))
        return path, load_experiment(path)

    def execute(self, path: Path, cfg: ExperimentConfig, slot: int, log_file: Path) -> tuple[int, bool]:
        """The storage URL goes through the environment, so a database password does not show in the process list."""
        env = worker_env(slot, self.workers, self.threads, cfg.train)
        env.update({A.STORAGE_ENV: self.spec.storage, A.DRIVER_ENV: str(os.getpid())})
        timeout = self.spec.timeout_minutes * 60 if self.spec.timeout_minutes else None
        return self.procs.run(trial_command(path, cfg.train.devices, cfg.train.accelerator), env, log_file, timeout,
                              append=True)

    def on_trial_end(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.user_attrs.get(A.IGNORED):
            return
        point = self.plan.point(trial, trial.params)  # type: ignore[arg-type]
        reason = trial.user_attrs.get(A.REASON) if trial.state.name != "COMPLETE" else None
        log = trial.user_attrs.get(A.LOG)
        try:
            close_trial_run(self.client, self.parent_id, self.spec.name, trial, trial.user_attrs.get(A.RUN_ID), reason,
                            Path(log) if log else None)
        except MlflowException as e:
            self.console.print(f"[yellow]could not close the MLflow run of trial {trial.number}: {e}[/]")
        # An interrupted trial is neither finished nor failed: the next run of the command resumes it.
        if reason != INTERRUPTED:
            if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
                self.finished.append(point.key)
            else:
                self.failures[point.key] = reason or "no reason recorded"
        minutes = trial.duration.total_seconds() / 60 if trial.duration else 0.0
        cpu = trial.user_attrs.get(A.CPU_SECONDS)
        style = {"COMPLETE": "green", "PRUNED": "yellow"}.get(trial.state.name, "red")
        tokens = trial.user_attrs.get(A.TOKENS)
        outcome = f"val/loss {trial.value:.4f}" if isinstance(self.plan, GridPlan) and trial.value is not None else \
            f"{self.spec.objective.metric} {trial.value:.4f}" if trial.state.name == "COMPLETE" else \
            f"at {tokens:,} tokens" if trial.state.name == "PRUNED" and tokens is not None else ""
        self.console.print(f"trial {trial.number:>3} [{style}]{trial.state.name.lower()}[/] {outcome}"
                           f"{f' ({reason})' if reason else ''} after {minutes:.1f} min"
                           f"{f' ({cpu / 60:.1f} CPU-min)' if cpu is not None else ''}: {format_params(trial.params)}",
                           soft_wrap=True)


def trial_command(path: Path, devices: int, accelerator: str) -> list[str]:
    module = ["-m", "satlab.studies.child", f"experiment={path}"]
    if devices > 1 and accelerator != "cpu":
        module = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", *module]
    return [sys.executable, *module]


def prepare_run_dir(client: mlflow.MlflowClient, run_dir: Path) -> bool:
    """True when the trial continues an earlier attempt: its folder names an unfinished MLflow run, which the
    training reopens (from its checkpoint, or from step 0 when it was stopped before the first one), so a cell
    interrupted and run again has one child run. Otherwise an earlier attempt's leftovers are removed and a RUNNING
    run they name is closed as KILLED, so the trial starts clean."""
    if not run_dir.exists():
        return False
    run_id = read_run_id(run_dir)
    run = usable_run(client, run_id)
    if run is not None and run.info.status != "FINISHED":
        return True
    end_run(client, run_id, "KILLED")
    shutil.rmtree(run_dir)
    return False


def format_params(params: dict[str, Any]) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k, v in params.items())

