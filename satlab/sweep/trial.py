"""One trial in its own process: ``SATLAB_SWEEP_STORAGE=<url> python -m satlab.sweep.trial --trial-id N ...``.

The driver samples the parameters and owns the trial's state; this process builds the config from them, trains
with :class:`~satlab.sweep.callbacks.TrialCallback`, and writes what happened into the trial's user attributes
(``objective_value`` or ``reason``). The exit code tells the driver how it ended (0 complete, 3 pruned, 4 failed
with a recorded reason, 5 the worker died); any other code, or a signal, is a crash the driver describes itself.
A process of its own per trial means a crash, an out-of-memory kill or a leaked CUDA context ends one trial only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import torch

from satlab.config.schema import ExperimentConfig
from satlab.sweep.callbacks import TrialCallback, TrialStopped
from satlab.sweep.loader import spec_from_dict
from satlab.sweep.spec import SweepSpec, override_items
from satlab.sweep.study import (
    EXIT_COMPLETE,
    EXIT_FAILED,
    EXIT_PRUNED,
    EXIT_WORKER_LOST,
    PID,
    REASON,
    STORAGE_ENV,
    VALUE,
    load_study,
)
from satlab.training.run import train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m satlab.sweep.trial", description=__doc__.splitlines()[0])
    parser.add_argument("--trial-id", type=int, required=True, help="Optuna's trial id (not its number)")
    parser.add_argument("--spec-json", required=True, help="the resolved sweep spec, as SweepSpec.to_json() wrote it")
    parser.add_argument("--parent-run-id", required=True, help="the study's MLflow parent run")
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--experiment", required=True, help="the MLflow experiment of the parent run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--worker-pid", type=int, default=None, help="exit when this process (the worker) dies")
    return parser.parse_args(argv)


def trial_config(spec: SweepSpec, params: dict[str, Any], number: int, parent_run_id: str, tracking_uri: str,
                 experiment: str) -> ExperimentConfig:
    """The validated config of trial ``number``: the base experiment, the spec's fixed overrides, the sampled
    parameters, then where it runs; its MLflow run is tagged as a child of the parent run (tags go in through
    ``dataclasses.replace``: dotted tag keys cannot be written as overrides)."""
    cfg = spec.base_config([
        *override_items(params),
        f"name={spec.name}-t{number:04d}",
        f"train.out_dir={spec.study_dir().resolve() / 'runs'}",
        "train.resume=never",
        *override_items({"tracking.uri": tracking_uri, "tracking.experiment": experiment}),
    ])
    tags = {**cfg.tracking.tags, "mlflow.parentRunId": parent_run_id, "optuna.trial_number": str(number),
            "optuna.study": spec.name}
    return replace(cfg, tracking=replace(cfg.tracking, tags=tags))


def watch_worker(pid: int, on_lost) -> None:
    """Exit when the worker that launched this trial is gone (killed with SIGKILL, its host preempted...): the trial
    would otherwise train on, unreported. Its RUNNING trial is then failed by heartbeat and retried."""

    def alive() -> bool:
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat")
            return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")
        except ProcessLookupError:
            return False
        except (OSError, IndexError):
            return True

    def watch() -> None:
        while alive():
            time.sleep(1.0)
        on_lost()
        os._exit(EXIT_WORKER_LOST)

    threading.Thread(target=watch, name="satlab-worker-watch", daemon=True).start()


def is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or "out of memory" in text \
        or "can't allocate memory" in text


def objective_value(metric: str, final_val_loss: float | None, last_metrics: dict[str, float]) -> float | None:
    """The final value of the objective metric: ``val/loss`` from the final validation, any other metric from the
    last validation's logged scalars."""
    if metric == "val/loss" and final_val_loss is not None:
        return final_val_loss
    return last_metrics.get(metric)


def run_trial(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = spec_from_dict(json.loads(args.spec_json), "sweep spec")
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    study = load_study(spec, os.environ[STORAGE_ENV])
    trial = optuna.Trial(study, args.trial_id)

    def record(reason: str) -> None:
        if rank_zero:
            trial.set_user_attr(REASON, reason[:500])

    if args.worker_pid:
        watch_worker(args.worker_pid, lambda: record("worker_lost"))
    if rank_zero:
        trial.set_user_attr(PID, os.getpid())
    callback = TrialCallback(trial if rank_zero else None, spec.saturation, spec.objective.metric)
    try:
        cfg = trial_config(spec, trial.params, trial.number, args.parent_run_id, args.tracking_uri, args.experiment)
        result = train(cfg, preset=f"sweep:{spec.name}", progress=False, callbacks=[callback])
    except TrialStopped as stop:
        print(f"trial {trial.number} stopped: {stop}", flush=True)
        record(stop.reason)
        return EXIT_PRUNED if stop.pruned else EXIT_FAILED
    except Exception as error:
        traceback.print_exc()
        record("oom" if is_oom(error) else f"error: {type(error).__name__}: {error}")
        return EXIT_FAILED
    value = objective_value(spec.objective.metric, result.final_val_loss, callback.last_metrics)
    if value is None:
        record(f"metric '{spec.objective.metric}' was never logged; logged: {', '.join(sorted(callback.last_metrics))}")
        return EXIT_FAILED
    if not math.isfinite(value):
        record("nan")
        return EXIT_PRUNED
    if rank_zero:
        trial.set_user_attr(VALUE, value)
    return EXIT_COMPLETE


def main(argv: list[str] | None = None) -> int:
    return run_trial(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
