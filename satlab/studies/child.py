"""One trial in its own process: ``SATLAB_STUDY_STORAGE=<url> python -m satlab.studies.child experiment=<file>``
(under ``torchrun`` for a multi-GPU trial), where the file is the trial's resolved experiment, whose tags name the
study and the trial. It trains like ``satlab train``, writes the outcome into the trial's user attributes and tells
the driver how it ended by its exit code (:mod:`satlab.studies.attrs`). A process per trial means a crash, an
out-of-memory kill or a leaked CUDA context ends one trial only. SIGTERM (the driver stopping, a pre-emption) is
handled as ``satlab train`` handles it (:mod:`satlab.training.sigterm`): it stops the training with a checkpoint
(exit ``EXIT_INTERRUPTED``) and never kills the process outside it, so a trial whose run had just finished still
reports its value instead of leaving a finished cell to be taken again.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable

import optuna
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from satlab.config.loader import load_experiment
from satlab.config.schema import ExperimentConfig
from satlab.evaluation.callback import EvaluationCallback
from satlab.studies import attrs as A
from satlab.studies.callbacks import TrialCallback, TrialStopped
from satlab.studies.loader import KINDS, spec_from_dict
from satlab.studies.plans import make_pruner
from satlab.studies.runs import STUDY_TAG, TRIAL_TAG
from satlab.studies.spec import StudySpec, SweepSpec
from satlab.studies.storage import open_storage, trial_id
from satlab.training.launch import pid_alive
from satlab.training.run import train
from satlab.training.sigterm import SigtermWatch, ignore_sigterm_from_now, install_sigterm_watch


def watch_driver(pid: int, on_lost) -> None:
    """Exit when the driver is gone (SIGKILL, a pre-empted host...): the trial would otherwise train on, unreported.
    Polling the pid also covers the ranks under torchrun, whose parent is torchrun."""

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(1.0)
        try:
            on_lost()
        finally:
            os._exit(A.EXIT_WORKER_LOST)

    threading.Thread(target=watch, name="satlab-driver-watch", daemon=True).start()


def is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or "out of memory" in text \
        or "can't allocate memory" in text


def cpu_seconds() -> float:
    """User and system CPU time of this process and its finished children (data-loader workers): what a trial cost on
    a shared machine, where its wall time also counts the time it waited for a core."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_trial(experiment: str) -> int:
    sigterm = install_sigterm_watch()  # first: a SIGTERM while the study loads stops the fit at its first batch
    cfg = load_experiment(experiment)
    storage = open_storage(os.environ[A.STORAGE_ENV], create_tables=False)
    name = cfg.tracking.tags[STUDY_TAG]
    study = optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler(),
                              pruner=optuna.pruners.NopPruner())  # the trial reports; it samples nothing
    info = study.user_attrs
    spec = spec_from_dict(KINDS[info[A.KIND]], info[A.SPEC], f"the spec stored on study {name}")
    search = isinstance(spec, SweepSpec)
    if search:
        study.pruner = make_pruner(spec)
    trial = optuna.Trial(study, trial_id(storage, name, int(cfg.tracking.tags[TRIAL_TAG])))
    rank_zero = int(os.environ.get("RANK", "0")) == 0

    def record(reason: str) -> None:
        if rank_zero:
            trial.set_user_attr(A.REASON, reason[:500])

    if os.environ.get(A.DRIVER_ENV):
        watch_driver(int(os.environ[A.DRIVER_ENV]), lambda: record("worker_lost"))
    if rank_zero:
        trial.set_user_attr(A.PID, os.getpid())
    try:
        return train_trial(cfg, spec, trial, rank_zero, record, sigterm)
    finally:
        if rank_zero:
            trial.set_user_attr(A.CPU_SECONDS, round(cpu_seconds(), 1))


def train_trial(cfg: ExperimentConfig, spec: StudySpec, trial: optuna.Trial, rank_zero: bool,
                record: Callable[[str], None], sigterm: SigtermWatch) -> int:
    """Train the trial's experiment and return the exit code that tells the driver how it ended."""
    search = isinstance(spec, SweepSpec)
    metric = spec.objective.metric if search else "val/loss"
    guard = spec.saturation  # an ablation's only observes (AblationSpec.problems)
    # runs first: its gate statistics are logged, and guard the trial; a trial's log gets no progress bars
    evaluation = EvaluationCallback(cfg, progress=False)
    callback = TrialCallback(trial if rank_zero else None, guard, evaluation, metric)
    try:
        result = train(cfg, preset=f"{spec.kind}:{spec.name}", progress=False, callbacks=[evaluation, callback])
    except SIGTERMException:  # the checkpoint is written (CheckpointOnSigterm); the cell resumes from it
        print(f"trial {trial.number} stopped by SIGTERM with its state checkpointed", flush=True)
        return A.EXIT_INTERRUPTED
    except TrialStopped as stop:
        print(f"trial {trial.number} stopped: {stop}", flush=True)
        record(stop.reason)
        return A.EXIT_PRUNED if stop.pruned else A.EXIT_FAILED
    except Exception as error:
        traceback.print_exc()
        record("oom" if is_oom(error) else f"error: {type(error).__name__}: {error}")
        return A.EXIT_FAILED
    ignore_sigterm_from_now(sigterm, f"trial {trial.number}")
    value = result.final_val_loss if metric == "val/loss" and result.final_val_loss is not None \
        else callback.last_metrics.get(metric)
    if value is None:
        record(f"metric '{metric}' was never logged; logged: {', '.join(sorted(callback.last_metrics))}")
        return A.EXIT_FAILED
    if not math.isfinite(value):
        record("nan")
        return A.EXIT_PRUNED
    if rank_zero:
        trial.set_user_attr(A.VALUE, value)
    return A.EXIT_COMPLETE


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].startswith("experiment="):
        print("usage: python -m satlab.studies.child experiment=<resolved trial file>", file=sys.stderr)
        return 2
    return run_trial(args[0].removeprefix("experiment="))


if __name__ == "__main__":
    sys.exit(main())
