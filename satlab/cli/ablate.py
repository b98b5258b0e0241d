"""`satlab ablate <spec> [key=value ...]`: run (or resume) an ablation's grid of cells, then write its report."""

from __future__ import annotations

import argparse
import math

from rich.table import Table

from satlab.cli.numbers import number_list
from satlab.config.errors import EXIT_REQUEUE, ConfigError, shown
from satlab.console import console as make_console
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import load_ablation
from satlab.studies.spec import format_value

SIGMA = 0.0975
"""Paired std of final validation loss, SATFormer vs ResFormer on Shakespeare in arch_tiny (+0.110 nats, paired p
0.19 at 3 seeds, so 0.110 sqrt(3) / t_{2, 0.905}; its stated minimum detectable difference, 0.32, agrees)."""


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
    mode = parser.add_mutually_exclusive_group()  # each runs nothing but itself: two at once is refused (exit 2)
    mode.add_argument("--dry-run", action="store_true",
                      help="print the grid and what the study records of each cell; run nothing")
    parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    mode.add_argument("--simulate", type=int, metavar="N",
                      help="run nothing: check the spec's sequential plan on N simulated null studies per rule "
                           "(its family-wise error against the naive re-test at 0.05) and its power and seeds "
                           "against a fixed-n test (docs/studies.md)")
    mode.add_argument("--simulate-transfer", type=int, metavar="N",
                      help="run nothing: how often the LR-transfer verdict passes, on N simulated studies per "
                           "series, scenario and seed count, drawn from this finished study's curves and seed noise "
                           "and judged by the report's own analysis (docs/lr-transfer.md)")
    parser.add_argument("--seeds-per-point", default="3,6,12,24", metavar="LIST",
                        help="--simulate-transfer: the seeds per learning rate and shape to simulate (default "
                             "3,6,12,24)")
    parser.add_argument("--drifts", default="0.5,0.75,1", metavar="LIST",
                        help="--simulate-transfer: true drifts of the optimum, octaves per 8x of width or depth "
                             "(default 0.5,0.75,1)")
    parser.add_argument("--sigma", type=float, default=SIGMA,
                        help=f"--simulate: std of a paired difference, the measure's units (default {SIGMA}: "
                             "SATFormer vs ResFormer in arch_tiny, docs/results/2026-12-01-arch-tiny.md)")
    parser.add_argument("--differences", metavar="FILE",
                        help="--simulate: real observed paired differences (numbers, one per line) for sign-flip "
                             "null studies")


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    spec = load_ablation(args.spec, args.overrides)
    if args.simulate is not None:
        return simulate(spec, args.simulate, args.sigma, read_differences(args.differences))
    if args.simulate_transfer is not None:
        return simulate_transfer(spec, args.spec, args.simulate_transfer, args.seeds_per_point, args.drifts)
    if args.dry_run:
        if problems := spec.sequential.seed_problems(spec.axes, spec.seed_key):
            raise ConfigError(problems)
        print_grid(spec, args.storage)
        if spec.sequential.enabled:
            print_sequential(spec, args.storage)
        return 0
    return run_grid(spec, args.workers, args.storage, not args.no_report)


def run_grid(spec: AblationSpec, workers: int, storage: str | None, report: bool) -> int:
    """Run (or resume) the grid's cells through the study engine, then say what happened; the exit code."""
    from satlab.studies.engine import run_study

    console = make_console()
    result = run_study(spec, workers=workers, storage=storage, console=console, report=report)
    console.print(f"ablation [cyan]{spec.name}[/]: {len(result.skipped)} cells finished before, "
                  f"{len(result.finished)} now, {len(result.failed)} failed"
                  + (", interrupted (the same command resumes)" if result.interrupted else ""), soft_wrap=True)
    for key, reason in result.failed.items():
        console.print(f"  [red]failed[/] {key}: {reason}", soft_wrap=True)
    return EXIT_REQUEUE if result.interrupted else 1 if result.failed else 0


def grid_status(spec: AblationSpec, storage: str | None = None) -> dict[str, str]:
    """Each cell's status as the study records it (MLflow is not opened); a grid that grew and has not run since
    shows the cells its earlier grid finished, which the run adopts."""
    from satlab.studies.plans import GridPlan

    plan = GridPlan(spec)
    study = plan.recorded_study(storage)
    status = plan.cell_status(study)
    if study is None:
        status |= dict.fromkeys(plan.finished_in_earlier_grids(storage), "finished (an earlier grid)")
    return status


def print_grid(spec: AblationSpec, storage: str | None = None, status: dict[str, str] | None = None) -> None:
    """The cells in run order, with their :func:`grid_status`."""
    status = status or grid_status(spec, storage)
    table = Table(title=f"ablation '{spec.name}': {len(spec.cells())} cells, base {spec.base}")
    for column in ("#", "cell", "group", "status"):
        table.add_column(column)
    for i, cell in enumerate(spec.run_order(), 1):
        table.add_row(str(i), cell.slug, cell.group, status[cell.key])
    make_console().print(table)


def print_sequential(spec: AblationSpec, storage: str | None = None) -> None:
    """The plan with its boundaries per look, the looks the study recorded, and the cells the next look runs with
    the time they take (``satlab train --dry-run``'s estimate); reads the study and its MLflow runs, makes nothing."""
    from satlab.cli.train import estimated_seconds, plan
    from satlab.studies import sequential_schedule as S
    from satlab.studies.plans import GridPlan
    from satlab.studies.sequential import boundaries
    from satlab.studies.sequential_looks import planned
    from satlab.studies.sequential_report import look_table

    p, console = spec.sequential, make_console()
    design = S.design(spec)
    console.print(f"sequential plan: {p.measure} ({p.better} is better), alpha {p.alpha:g} ({p.sides}-sided), "
                  f"{p.spending} spending, looks {list(p.schedule)} (n_max {p.schedule[-1]}), comparisons "
                  f"{p.comparisons}{f' of {p.compare} per setting' if p.compare else ''}, sharing {p.sharing}, "
                  f"family {p.family}", soft_wrap=True)
    for family in design.families:
        share = p.alpha / p.sides / len(family.comparisons)
        bounds = boundaries(p.schedule, share, p.spending, p.sides, floor=True)
        table = Table(title=f"family {family.name or 'study'}: {len(family.comparisons)} comparison(s), "
                            f"{share:.4g} a side each to start ({p.sharing} passes a decided one's on)")
        for column in ("look", "seeds", "z boundary", "nominal (one-sided)", "t critical", "alpha spent"):
            table.add_column(column, justify="right")
        for k, n in enumerate(p.schedule):
            table.add_row(str(k + 1), str(n), f"{bounds.z[k]:.3f}", f"{bounds.nominal[k]:.3g}",
                          f"{bounds.critical(k):.3f}", f"{bounds.spent[k]:.3g}")
        console.print(table)
        if dead := [n for n, z in zip(p.schedule, bounds.z, strict=True) if math.isinf(z)]:
            first = next((n for n, z in zip(p.schedule, bounds.z, strict=True) if not math.isinf(z)), None)
            console.print(f"[yellow]the looks at {', '.join(map(str, dead))} seeds cannot stop a comparison at its "
                          "starting alpha (their nominal level is below 2^-n, the smallest sign-flip p of n seeds): "
                          + (f"no comparison of this family can be decided before {first} seeds[/]" if first else
                             f"no comparison of this family can be decided at all (2^-{p.schedule[-1]} > "
                             f"{share:.3g}); the looks need at least {math.ceil(-math.log2(share))} seeds[/]"),
                          soft_wrap=True)
        for a, b in family.comparisons:
            console.print(f"  {S.arm_label(design, a)} vs {S.arm_label(design, b)}", soft_wrap=True)
    grid = GridPlan(spec)
    rows, schedule, finished = planned(spec, grid.recorded_study(storage))
    if rows:
        done = look_table(rows)
        table = Table(title="looks recorded")
        for column in done[0]:
            table.add_column(column)
        for row in done[1:]:
            table.add_row(*row)
        console.print(table)
    else:
        console.print("no look recorded yet")
    if schedule.decided:
        console.print("every comparison is decided: nothing more to run")
        return
    todo = [c for c in S.wanted_cells(spec, design, schedule.seeds) if c.key not in finished]
    seconds, where, estimates = 0.0, "", {}
    for cell in todo:
        if cell.group not in estimates:
            cfg = spec.base_config(cell.overrides())
            estimates[cell.group] = estimated_seconds(cfg, plan(cfg)["flops_per_token"])
        seconds, where = seconds + estimates[cell.group][0], estimates[cell.group][1]
    waiting = {f or "study": k for f, k in schedule.waiting_for.items() if k}
    cost = f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
    console.print(f"next: look {', '.join(f'{k} ({f})' for f, k in waiting.items())}: {len(todo)} cell(s) to run, "
                  f"about {cost} of compute {where} in all (one worker)", soft_wrap=True)
    for cell in todo:
        console.print(f"  {cell.key}", soft_wrap=True)


def read_differences(path: str | None) -> list[float] | None:
    if path is None:
        return None
    try:
        values = [float(line) for line in open(path, encoding="utf-8").read().split()]  # noqa: SIM115
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--differences {shown(path)}: {e}; give a text file of numbers, one per line") from None
    if len(values) < 2 or not any(values):
        raise ConfigError(f"--differences {shown(path)}: at least two numbers, not all zero, got {len(values)}")
    return values


def simulate(spec: AblationSpec, studies: int, sigma: float, observed: list[float] | None) -> int:
    """The plan's family-wise error on null studies (normal; sign-flips of ``observed``) against the naive rule, then
    power and seeds against a fixed-n test at n_max, as tables."""
    from satlab.studies.sequential_sim import null_studies, power_table

    plan = spec.sequential
    problems = [] if plan.enabled else [f"ablation '{spec.name}' has no sequential plan: add one, e.g. sequential: "
                                        "{looks: [3, 5, 8, 12, 20]} (docs/studies.md)"]
    if studies < 100:
        problems.append(f"--simulate must be at least 100 studies, got {studies}")
    if not sigma > 0:
        problems.append(f"--sigma must be a positive number (the std of a paired difference), got {sigma}")
    if problems:
        raise ConfigError(problems)
    groups = list(dict.fromkeys(c.group for c in spec.cells()))
    baseline = " ".join(f"{k}={v}" for k, v in ((k, format_value(v)) for k, v in spec.baseline_values().items()))
    console = make_console()
    null = null_studies(plan, groups, baseline or groups[0], studies, sigma, observed)
    table = Table(title=f"'{spec.name}': family-wise error of {len(groups)} arms ({plan.comparisons}, "
                        f"{plan.sharing}), alpha {plan.alpha:g}, looks {list(plan.schedule)}, {studies:,} null studies")
    for column in ("rule", "family-wise error ± MCSE", "bound (alpha + 2 MCSE)", "mean seeds per arm"):
        table.add_column(column)
    for name, est in null.items():
        table.add_row(name, est.text(), f"{plan.alpha + 2 * est.mcse:.4f}", f"{est.seeds:.2f}")
    console.print(table)
    power = Table(title=f"one comparison, sigma {sigma:g}: plan ({plan.spending}) vs a fixed test at n_max")
    for column in ("true difference", "plan: power", "plan: mean seeds", "fixed n_max: power", "seeds"):
        power.add_column(column)
    for row in power_table(plan, sigma, studies):
        power.add_row(f"{row.factor:g} MDD = {row.difference:.3g}", row.sequential.text(),
                      f"{row.sequential.seeds:.2f}", row.fixed.text(), str(plan.schedule[-1]))
    console.print(power)
    return 1 if any(e.rate > plan.alpha + 2 * e.mcse for k, e in null.items() if k.startswith("plan")) else 0


def simulate_transfer(spec: AblationSpec, target: str, replicates: int, seeds_text: str, drifts_text: str) -> int:
    """The LR-transfer verdict's pass rate per series, scenario and seed count (satlab.studies.lr_transfer_sim),
    on simulated studies drawn from the finished study ``target`` (as it ran, with the spec file's analysis
    settings, as `satlab report` reads it); one table per series."""
    from satlab.studies.lookup import open_ablation
    from satlab.studies.lr_transfer_sim import pass_rate, scenario_names, truths
    from satlab.studies.results import collect, measures_for

    problems = [] if spec.lr_transfer.enabled else [
        f"ablation '{spec.name}' has no lr_transfer: block, so there is no transfer verdict to simulate: give it "
        "one (lr_key, width_keys, depth_keys, base; docs/lr-transfer.md)"]
    if replicates < 2:
        problems.append(f"--simulate-transfer must be at least 2 simulated studies, got {replicates}")
    seeds = number_list("--seeds-per-point", seeds_text, problems, example="3,6,12,24", low=2, high=1000)
    drifts = number_list("--drifts", drifts_text, problems, example="0.5,0.75,1", kind=float, low=-4, high=4)
    if problems:
        raise ConfigError(problems)
    spec, client, parent_run_id = open_ablation(target)
    series = truths(spec, collect(spec, client, parent_run_id, measures_for(spec)))
    if not series:
        raise ConfigError(f"ablation '{spec.name}' has no series with a base-shape optimum among its finished runs "
                          "to take the truth from: finish the base shape's learning rates first")
    console, plan = make_console(), spec.lr_transfer
    for truth in series:
        noise = ", ".join(f"{v:.3f}" for v in truth.noise.values())
        table = Table(title=f"'{spec.name}', {truth.label}: share of {replicates} simulated studies whose verdict is "
                            f"\"transfers\" (every {plan.level:g} interval within ±{plan.tolerance:g} octave of the "
                            f"base optimum, fit {plan.fit}); seed noise by learning rate {noise}")
        table.add_column("truth")
        for n in seeds:
            table.add_column(f"{n} seeds a point", justify="right")
        for scenario in scenario_names(drifts):
            table.add_row(scenario, *(pass_rate(spec, truth, scenario, n, replicates, plan.seed).text()
                                      for n in seeds))
        console.print(table)
    print("identical: every shape's truth is the base's curve; aligned: each shape's own curve, moved until the "
          "report's fit of its noise-free means finds the base's optimum; drift D: the base's curve moved D octaves "
          "per 8x of width or depth; measured: the curves as measured. The rates are Monte Carlo estimates (± their "
          "standard errors).")
    return 0
