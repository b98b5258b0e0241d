"""`satlab ablate <spec> [key=value ...]`: run (or resume) an ablation's grid of cells, then write its report."""

from __future__ import annotations

import argparse

from rich.table import Table

from satlab.config.errors import EXIT_REQUEUE, ConfigError
from satlab.console import console as make_console
from satlab.studies.loader import load_ablation
from satlab.studies.spec import AblationSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC",
                        help="an ablation under experiments/ablations/ (arch_tiny, granularity, gate_fn, arch_small, "
                             "...) or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="spec fields (axes.train.seed=[0,1], baseline.model.arch=resformer, out_dir=...) or "
                             "config overrides for every cell (train.max_tokens=1e5)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="cells run in parallel on this host (default 1); the CPU threads are shared out, and on "
                             "a GPU host each worker gets its own train.devices GPUs")
    parser.add_argument("--storage", metavar="URL",
                        help="Optuna storage of the grid (default sqlite:///<out_dir>/optuna.db); the same "
                             "postgresql://user:password@host/db on several hosts makes them share the cells")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the grid and what the study records of each cell; run nothing")
    parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    spec = load_ablation(args.spec, args.overrides)
    if args.dry_run:
        print_grid(spec, args.storage)
        return 0
    from satlab.studies.engine import run_study

    console = make_console()
    result = run_study(spec, workers=args.workers, storage=args.storage, console=console, report=not args.no_report)
    console.print(f"ablation [cyan]{spec.name}[/]: {len(result.skipped)} cells finished before, "
                  f"{len(result.finished)} now, {len(result.failed)} failed"
                  + (", interrupted (the same command resumes)" if result.interrupted else ""), soft_wrap=True)
    for key, reason in result.failed.items():
        console.print(f"  [red]failed[/] {key}: {reason}", soft_wrap=True)
    return EXIT_REQUEUE if result.interrupted else 1 if result.failed else 0


def print_grid(spec: AblationSpec, storage: str | None = None) -> None:
    """The cells in run order, with the status the study records (MLflow is not opened)."""
    from satlab.studies.plans import GridPlan

    plan = GridPlan(spec)
    status = plan.cell_status(plan.recorded_study(storage))
    table = Table(title=f"ablation '{spec.name}': {len(spec.cells())} cells, base {spec.base}")
    for column in ("#", "cell", "group", "status"):
        table.add_column(column)
    for i, cell in enumerate(spec.run_order(), 1):
        table.add_row(str(i), cell.slug, cell.group, status[cell.key])
    make_console().print(table)
