"""`satlab train experiment=<name> key=value ...`: train one experiment (resumes it with train.resume=auto)."""

from __future__ import annotations

import argparse
import sys

from rich.table import Table

from satlab.config.derived import derive_schedule
from satlab.config.display import print_config
from satlab.config.errors import EXIT_REQUEUE
from satlab.config.loader import load_experiment
from satlab.console import console as make_console
from satlab.training.machine import resolve_precision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="experiment=<preset name or YAML path> (default: default), then any config overrides, "
                             "e.g. model.arch=transformer optim.lr=1e-3 train.max_tokens=5e5")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config before training")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, sizes, FLOPs, derived steps and a time estimate; no training")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (for logs and CI)")


def split_experiment(overrides: list[str]) -> tuple[str, list[str]]:
    """The `experiment=` argument (default 'default') and the remaining overrides."""
    experiment, rest = "default", []
    for item in overrides:
        if item.startswith("experiment="):
            experiment = item.split("=", 1)[1]
        else:
            rest.append(item)
    return experiment, rest


def run(args: argparse.Namespace) -> int:
    experiment, overrides = split_experiment(args.overrides)
    cfg = load_experiment(experiment, overrides)
    if args.print_config or args.dry_run:
        from satlab.data.vocabulary import model_vocabulary

        cfg = resolve_precision(cfg)  # what this machine would train in (train() resolves it the same way)
        print_config(model_vocabulary(cfg).sized(cfg))  # the model.vocab_size the run's config.yaml will have
    if args.dry_run:
        print_plan(cfg)
        return 0
    from satlab.training.sigterm import ignore_sigterm_from_now, install_sigterm_watch

    sigterm = install_sigterm_watch()  # from here on a SIGTERM is never fatal (satlab/training/sigterm.py)
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from satlab.evaluation.callback import EvaluationCallback
    from satlab.training.run import train

    evaluation = EvaluationCallback(cfg, progress=not args.no_progress)
    try:
        train(cfg, preset=experiment, progress=not args.no_progress, callbacks=[evaluation])
    except SIGTERMException:  # pre-emption or a time limit: CheckpointOnSigterm saved the state
        print(f"satlab train: stopped by SIGTERM with its state checkpointed; the same command continues it "
              f"(exit code {EXIT_REQUEUE}: requeue me)", file=sys.stderr)
        return EXIT_REQUEUE
    ignore_sigterm_from_now(sigterm, "satlab train")  # the interpreter's exit (seconds of C-level teardown after
    # the summary, where no Python handler runs) is not killed by a late SIGTERM
    if evaluation.last_results:
        print_evaluation(evaluation.last_results)
    return 0


def print_evaluation(metrics: dict[str, float]) -> None:
    """The end-of-run evaluation: suite averages, each task's primary metrics, and the gate summary."""
    from satlab.evaluation.callback import EVAL_SECONDS
    from satlab.evaluation.gates import METRIC_PREFIX as GATES
    from satlab.evaluation.suite import METRIC_PREFIX as TASKS

    gate_summary = [f"{GATES}/{name}" for name in ("mean", "sparsity", "saturated_frac", "dead_head_frac")]
    table = Table(title="evaluation at the end of the run", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key in sorted(metrics):
        if (key.startswith(f"{TASKS}/") and key.count("/") <= 2 or key in gate_summary) and "seconds" not in key:
            table.add_row(key, f"{metrics[key]:.4f}")
    from satlab.evaluation.tasks import FAMILIES

    console = make_console()
    console.print(table)
    times = [f"{name.removeprefix('satlab_')} {metrics[f'{TASKS}/{name}/seconds']:.1f} s" for name in FAMILIES
             if f"{TASKS}/{name}/seconds" in metrics]
    if EVAL_SECONDS in metrics:
        console.print(f"evaluation time: {metrics[EVAL_SECONDS]:.1f} s"
                      + (f" (model time per task: {', '.join(times)})" if times else ""))


def plan(cfg) -> dict[str, object]:
    """What a run of ``cfg`` would train, derived as the run derives it (:func:`model_vocabulary`, the schedule)
    without training a tokenizer, preparing data or building real weights: ``params``, ``non_embedding_params``,
    ``flops_per_token`` (the run's MLflow ``model.*`` params), ``vocab_size`` (None: not known before a hub
    tokenizer is fetched), ``vocab_origin``, ``model_vocab_size`` (what the sizes use) and ``schedule``."""
    from satlab.data.vocabulary import model_vocabulary
    from satlab.studies.ladder import model_sizes

    vocabulary = model_vocabulary(cfg)
    size, cfg = model_sizes(cfg)
    return {"params": size.params, "non_embedding_params": size.non_embedding_params,
            "flops_per_token": size.flops_per_token, "vocab_size": vocabulary.size, "vocab_origin": vocabulary.origin,
            "model_vocab_size": cfg.model.vocab_size,
            "schedule": derive_schedule(cfg, world_size=cfg.train.devices * cfg.train.num_nodes)}


def estimated_seconds(cfg, flops_per_token: float) -> tuple[float, str]:
    """The time a run of ``cfg`` takes here at half the peak FLOP/s: a GPU's from the dense table when the run would
    train on one and this machine has one, else this CPU's measured fp32 matmul peak (a CPU run reaches about half
    of it); and where the estimate is for, in words. ``satlab ablate --dry-run`` sums it over a look's cells."""
    import torch

    from satlab.training.perf import device_peak_flops, measure_cpu_matmul_peak

    if cfg.train.accelerator != "cpu" and torch.cuda.is_available():
        peak, label = device_peak_flops(torch.device("cuda"), cfg.train.precision)
        if peak:
            return cfg.train.max_tokens * flops_per_token / (0.5 * peak), f"on this GPU (at 50 % of its {label} peak)"
    return cfg.train.max_tokens * flops_per_token / (0.5 * measure_cpu_matmul_peak()), \
        "on this CPU (at 50 % of its fp32 peak)"


def print_plan(cfg) -> None:
    """Sizes, FLOPs, the derived schedule and a time estimate, without building real weights."""
    planned = plan(cfg)
    flops = planned["flops_per_token"]
    seconds, where = estimated_seconds(cfg, flops)
    vocab = planned["vocab_size"]
    table = Table(title=f"plan for '{cfg.name}'", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in [
        ("vocabulary", f"{vocab:,} from {planned['vocab_origin']}" if vocab is not None
         else f"{planned['vocab_origin']} ({planned['model_vocab_size']:,})"),
        ("parameters", f"{planned['params']:,} ({planned['non_embedding_params']:,} non-embedding)"),
        ("FLOPs per token", f"{flops / 1e6:,.2f} M"),
        ("tokens", f"{cfg.train.max_tokens:,}"),
        *[(f"derived {k}", f"{v:,}" if isinstance(v, int) else str(v))
          for k, v in planned["schedule"].as_dict().items()],
        ("estimated time", f"{seconds / 60:.1f} min {where}"),
    ]:
        table.add_row(name, value)
    make_console().print(table)
