"""`satlab ablate <spec> [key=value ...]`: run (or resume) an ablation's grid of cells, then write its report."""

from __future__ import annotations

import argparse

from rich.table import Table

from satlab.config.errors import EXIT_REQUEUE, ConfigError
from satlab.console import console as make_console
from satlab.studies.loader import load_ablation
from satlab.studies.plans import GridPlan
from satlab.studies.spec import AblationSpec


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
    plan = GridPlan(spec)
    status = plan.cell_status(plan.recorded_study(storage))
    table = Table(title=f"ablation '{spec.name}': {len(spec.cells())} cells, base {spec.base}")
    for column in ("#", "cell", "group", "status"):
        table.add_column(column)
    for i, cell in enumerate(spec.run_order(), 1):
        table.add_row(str(i), cell.slug, cell.group, status[cell.key])
    make_console().print(table)
