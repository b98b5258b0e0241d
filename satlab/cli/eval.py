"""`satlab eval ckpt=<checkpoint or run dir> tasks=... [limit=N] [device=cpu]`: evaluate a checkpoint with lm-eval,
print the results, log them into the checkpoint's MLflow run (when its run directory holds a run.json) and
optionally write them as JSON.

The checkpoint may be one file or a sharded directory (train.strategy fsdp or model_parallel): a sharded one is
read whole in this one process, without a process group, whatever number of processes wrote it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from satlab.cli.devices import device_problem
from satlab.config.errors import ConfigError, did_you_mean
from satlab.evaluation.tasks import chance_level, split_task_names

RUN_INFO = "run.json"

SETTINGS = {
    "ckpt": "checkpoint file or run directory (required), e.g. runs/default",
    "tasks": "satlab_offline (default), paper_zero_shot, paper_retrieval or a comma list of task names",
    "limit": "items per task (offline: how many are generated; hub tasks: lm-eval's limit)",
    "device": "cpu (default), cuda, cuda:1, ...",
    "batch_size": "sequences per forward pass (default 32)",
    "seed": "seed of the generated offline items (default 0)",
    "threads": "torch CPU threads (default: one per core; 1 is much faster for tiny models on a busy machine)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("settings", nargs="*", metavar="key=value",
                        help="; ".join(f"{key}: {text}" for key, text in SETTINGS.items()))
    parser.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    parser.add_argument("--no-mlflow", action="store_true",
                        help="do not log into the checkpoint's MLflow run (by default the results go there when "
                             "the run directory holds a run.json)")


def parse_settings(items: list[str]) -> dict[str, str]:
    """``key=value`` items as a dict; every malformed or unknown item is reported at once."""
    settings, problems = {}, []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"'{item}' is not key=value; valid keys: {', '.join(SETTINGS)}")
        elif key not in SETTINGS:
            problems.append(f"unknown setting '{key}'{did_you_mean(key, SETTINGS)}; valid: {', '.join(SETTINGS)}")
        else:
            settings[key] = value
    if "ckpt" not in settings:
        problems.append("ckpt=<checkpoint file or run directory> is required, e.g. satlab eval ckpt=runs/default")
    if problems:
        raise ConfigError(problems)
    return settings


def run(args: argparse.Namespace) -> int:
    settings = parse_settings(args.settings)
    tasks = [t.strip() for t in settings.get("tasks", "satlab_offline").split(",") if t.strip()]
    split_task_names(tasks)  # unknown satlab names fail before the checkpoint is loaded
    numbers = {key: _positive_int(key, settings[key]) for key in ("limit", "batch_size", "threads") if key in settings}
    seed = _positive_int("seed", settings.get("seed", "0"), minimum=0)
    device = settings.get("device", "cpu")
    if problem := device_problem(device, "device", words=("cpu",)):
        raise ConfigError(problem)

    import datasets
    import torch

    from satlab.evaluation.suite import eval_corpus, metric_keys, run_tasks
    from satlab.training.checkpoint import load_checkpoint

    datasets.disable_progress_bars()
    if "threads" in numbers:
        torch.set_num_threads(numbers["threads"])
    loaded = load_checkpoint(settings["ckpt"], device)
    data = loaded.cfg.data
    results = run_tasks(loaded.model, loaded.tokenizer, tasks, numbers.get("limit"), data.cache_dir, seed,
                        eval_corpus(data.source), data.val_fraction, numbers.get("batch_size"))
    print_results(results, f"{loaded.path} (step {loaded.step})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if not args.no_mlflow:
        run_id = log_to_run(loaded.path, metric_keys(results), loaded.step,
                            loaded.step * loaded.cfg.train.global_batch_tokens)
        if run_id:
            print(f"logged {len(metric_keys(results))} metrics into MLflow run {run_id} at step {loaded.step}")
    return 0


def print_results(results: dict[str, dict[str, float]], title: str) -> None:
    table = Table(title=f"evaluation of {title}")
    for column in ("task", "metric", "value", "chance"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, metrics in results.items():
        chance = chance_level(task)
        for metric, value in metrics.items():
            shown = "" if chance is None or not metric.startswith("acc") else f"{chance:.2f}"
            table.add_row(task, metric, f"{value:.4f}" if abs(value) < 1e6 else f"{value:.3e}", shown)
    Console().print(table)


def log_to_run(ckpt_path: Path, metrics: dict[str, float], step: int, tokens_seen: int | None = None) -> str | None:
    """Logs ``metrics`` at ``step`` into the MLflow run named by the run.json of the checkpoint's run directory, with
    the step's ``tokens_seen`` point when the run has none there (so they plot against tokens like the run's own);
    returns that run's id, or None when there is no run.json."""
    info_path = next((d / RUN_INFO for d in (ckpt_path.parent, ckpt_path.parent.parent) if (d / RUN_INFO).is_file()),
                     None)
    if info_path is None:
        return None
    import mlflow
    from mlflow.entities import Metric

    from satlab.training.mlflow_logger import TOKENS_SEEN

    info = json.loads(info_path.read_text(encoding="utf-8"))
    client, run_id, now = mlflow.MlflowClient(info["tracking_uri"]), info["mlflow_run_id"], int(time.time() * 1000)
    points = [Metric(key, value, now, step) for key, value in metrics.items()]
    if tokens_seen is not None and step not in {m.step for m in client.get_metric_history(run_id, TOKENS_SEEN)}:
        points.append(Metric(TOKENS_SEEN, float(tokens_seen), now, step))
    client.log_batch(run_id, metrics=points)
    return run_id


def _positive_int(key: str, value: str, minimum: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"{key}={value} is not valid; it takes a whole number >= {minimum}.")
    return number
