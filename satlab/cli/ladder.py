"""`satlab ladder <spec> [--dry-run] [key=value ...]`: run (or resume) a scaling ladder, an ablation with a
``ladder:`` block (docs/ladder.md), through the same path as `satlab ablate`; ``--dry-run`` prints each rung's
sizes, FLOPs per token, budgets, runs and cost, then the grid with what the study records of each cell."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.table import Table

from satlab.config.errors import ConfigError
from satlab.console import console as make_console
from satlab.studies.ablation_spec import AblationSpec, Cell
from satlab.studies.loader import load_ablation

if TYPE_CHECKING:
    from satlab.studies.ladder import Rung
    from satlab.studies.scaling_backtest import BacktestCalibration
    from satlab.studies.scaling_fit import ScalingLaw
    from satlab.studies.scaling_sim import Ladder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC",
                        help="a ladder under experiments/ablations/ (ladder_cpu, ladder_gpu) or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="spec fields (ladder.seeds=[2,2,1,1,1], out_dir=...) or config overrides for every "
                             "cell (train.val_tokens=4096)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="cells run in parallel on this host (default 1), as for satlab ablate")
    parser.add_argument("--storage", metavar="URL",
                        help="Optuna storage of the ladder's cells (default sqlite:///<out_dir>/optuna.db); a shared "
                             "postgresql:// URL lets several hosts (or a SLURM array) take cells from one queue")
    mode = parser.add_mutually_exclusive_group()  # each runs nothing but itself: two at once is refused (exit 2)
    mode.add_argument("--dry-run", action="store_true",
                      help="print each rung's parameters, FLOPs per token, budgets, runs and cost, and the grid; "
                           "run nothing")
    parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    mode.add_argument("--simulate", action="store_true",
                      help="run nothing: simulate this ladder (its sizes, budgets and seeds) with a known law and "
                           "a known multiplier through the report's fit, interval and claim rule, and print the "
                           "coverage, false-gain rate and power at each target size (docs/scaling-laws.md)")
    mode.add_argument("--simulate-backtest", action="store_true",
                      help="run nothing: how often the report's backtest passes when the law is right: simulated "
                           "ladders of this shape drawn from a known law (--law, --run-sd), each backtested as the "
                           "report does; prints the runs' coverage and how often every top-rung run is inside")
    parser.add_argument("--replicates", type=int, default=100, metavar="N",
                        help="--simulate: ladders per multiplier; --simulate-backtest: ladders")
    parser.add_argument("--sim-resamples", type=int, default=100, metavar="N",
                        help="--simulate: bootstrap refits per simulated ladder")
    parser.add_argument("--run-sd", default="0.01", metavar="SD",
                        help="--simulate, --simulate-backtest: seed noise of a run on log loss (default 0.01, "
                             "satlab's tiny runs), or 'measured': the seed spread of this ladder's finished runs")
    parser.add_argument("--top-shift", type=float, default=0.0, metavar="X",
                        help="--simulate-backtest: move the top rung's log loss off the law by X (a law that breaks "
                             "above the rungs fitted; default 0, the law holds): the backtest's power to see it")
    parser.add_argument("--law", choices=("epoch", "fitted"), default="epoch",
                        help="--simulate, --simulate-backtest: the true law of the reference architecture: Epoch's "
                             "Chinchilla estimates (default; known before any run), or 'fitted': the law fitted to "
                             "this ladder's finished runs of the reference architecture (at least 3 rungs)")
    mode.add_argument("--fit", action="store_true",
                      help="run nothing: fit the finished ladder and write its report (refused while a cell is "
                           "unfinished; `satlab report` writes a partial one)")


def run(args: argparse.Namespace) -> int:
    from satlab.cli.ablate import grid_status, print_grid, run_grid

    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    spec = load_ablation(args.spec, args.overrides)
    if not spec.ladder.enabled:
        raise ConfigError(f"'{spec.name}' is an ablation without a ladder: block (no rungs); run it with satlab "
                          "ablate, or give it ladder: {rungs: [...], budgets: [...], seeds: [...], lr: ...} "
                          "(docs/ladder.md)")
    if args.dry_run:
        status = grid_status(spec, args.storage)
        print_ladder(spec, [cell for cell in spec.cells() if not status[cell.key].startswith("finished")])
        print_grid(spec, args.storage, status)
        return 0
    if args.fit:
        return fit_ladder(spec, args.spec)
    if args.simulate:
        return simulate(spec, args.replicates, args.sim_resamples, args.run_sd, args.law, args.spec)
    if args.simulate_backtest:
        return simulate_backtest(spec, args.replicates, args.run_sd, args.law, args.spec, args.top_shift)
    return run_grid(spec, args.workers, args.storage, not args.no_report)


def simulate(spec: AblationSpec, replicates: int, resamples: int, run_sd_text: str, law_name: str = "epoch",
             target: str | None = None) -> int:
    """Coverage, false gains (m = 1) and power (m = 2) of the report's claim at the top rung's size (inside the
    ladder) and at each target size (extrapolated), on simulated ladders of this one's shape. The true law is
    Epoch's, or (``law_name`` "fitted") the one fitted to the ladder's finished runs of its reference architecture;
    ``run_sd_text`` a number or "measured" (the finished runs' pooled seed spread)."""
    import dataclasses

    from satlab.studies.scaling_fit import compute_for_size
    from satlab.studies.scaling_sim import score, simulate_fits

    if replicates < 2 or resamples < 2:
        raise ConfigError(f"--replicates and --sim-resamples must be >= 2 (got {replicates}, {resamples})")
    law, run_sd, source = true_law(spec, replicates, run_sd_text, law_name, target)
    shape = ladder_shape(spec)
    sizes = {"top rung": shape.sizes[-1], **{f"N* = {n:.0e}": n for n in spec.ladder.fit.target_params}}
    table = Table(title=f"ladder '{spec.name}' simulated: {replicates} ladders per multiplier, {resamples} "
                        f"bootstrap refits each, seed noise {run_sd:.3g} on log loss, the true law {source}; claim "
                        f"at the {spec.ladder.fit.level:g} interval")
    for column in ("true multiplier", "at", "coverage", "gain claimed", "loss claimed", "not resolved"):
        table.add_column(column, justify="left" if column == "at" else "right")
    for m in (1.0, 2.0):
        sim = simulate_fits(m, shape, reference=law, replicates=replicates, resamples=resamples, run_sd=run_sd,
                            seed=spec.ladder.fit.seed)
        for label, n in sizes.items():
            result = score(dataclasses.replace(sim, C=compute_for_size(law, n)), spec.ladder.fit.level)
            table.add_row(f"{m:g}", label, *(f"{v:.2f} ± {result.mc_se(v):.2f}" for v in
                                             (result.coverage, result.gain, result.loss, result.not_resolved)))
    make_console().print(table)
    print("A gain claimed under multiplier 1 is a false gain (at most 0.05 by design); under 2 it is the power. "
          "The rates are Monte Carlo estimates (± their standard errors).")
    return 0


def simulate_backtest(spec: AblationSpec, replicates: int, run_sd_text: str, law_name: str = "epoch",
                      target: str | None = None, top_shift: float = 0.0) -> int:
    """How often the report's backtest (the top rung held out, the judged runs inside their intervals at the band's
    level) passes on ladders of this shape drawn from a known law, through the report's own fit, bootstrap and
    interval; with ``top_shift``, on ladders whose top rung is off the law by that much log loss (its power)."""
    from satlab.studies.scaling_backtest import BACKTEST_RESAMPLES, run_level
    from satlab.studies.scaling_backtest import simulate_backtest as simulate_many
    from satlab.studies.scaling_fit import GRIDS

    shape = ladder_shape(spec)
    if len(shape.sizes) < 4:
        raise ConfigError(f"--simulate-backtest needs a ladder of 4 rungs or more (3 to fit below the top one held "
                          f"out); '{spec.name}' has {len(shape.sizes)}")
    if not math.isfinite(top_shift) or abs(top_shift) >= 1:
        raise ConfigError(f"--top-shift is a shift of log loss, a number between -1 and 1 (0.02 is 2 % of the loss), "
                          f"got {top_shift}")
    law, run_sd, source = true_law(spec, replicates, run_sd_text, law_name, target)
    fit = spec.ladder.fit
    result = simulate_many(law, shape, run_sd, replicates, fit.seed, fit.level, fit.huber_delta,
                           GRIDS[fit.grid], min(fit.resamples, BACKTEST_RESAMPLES), top_shift, fit.band,
                           fit.backtest_seeds)
    k = result.runs_per_replicate
    each = run_level(fit.level, k, fit.band)
    judged = f"seeds {', '.join(map(str, fit.backtest_seeds))}" if fit.backtest_seeds else "every seed"
    shifted = f"the top rung shifted by {top_shift:+g} in log loss" if top_shift else "the law holding at every rung"
    table = Table(title=f"ladder '{spec.name}': its backtest on {replicates} simulated ladders, {shifted}, seed "
                        f"noise {run_sd:.3g} on log loss, the true law {source}; {k} top-rung runs judged "
                        f"({judged}), {fit.band} band: {each:.4g} prediction interval per run")
    for column in ("measure", "rate", "if runs missed independently"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    table.add_row("judged runs inside their interval", _rate(result, result.coverage), f"{each:.3f}")
    table.add_row(f"ladders with all {k} inside (the backtest passes)", _rate(result, result.all_inside),
                  f"{each ** k:.2f}")
    table.add_row("ladders with at most 1 outside", _rate(result, result.at_most(1)),
                  f"{each ** k + k * (1 - each) * each ** (k - 1):.2f}")
    make_console().print(table)
    print("With no shift the law is right in every simulated ladder, so the pass rate is the most an architecture "
          "whose law holds can be expected to meet; with a shift it is the chance of missing the break (1 - power). "
          "The rates are Monte Carlo estimates (± their standard errors).")
    return 0


def _rate(result: BacktestCalibration, rate: float) -> str:
    return f"{rate:.2f} ± {result.mc_se(rate):.2f}"


def true_law(spec: AblationSpec, replicates: int, run_sd_text: str, law_name: str,
             target: str | None) -> tuple[ScalingLaw, float, str]:
    """The simulations' truth: the reference's law (Epoch's Chinchilla fit, or fitted to the ladder's finished
    runs), the seed noise of a run (a number, or the finished runs' pooled seed spread), and a line saying which."""
    from satlab.studies.scaling_sim import EPOCH_LAW

    measured = run_sd_text == "measured"
    try:
        run_sd = math.nan if measured else float(run_sd_text)
    except ValueError:
        run_sd = math.nan
    if replicates < 2 or not (measured or run_sd >= 0):
        raise ConfigError(f"--replicates must be >= 2 and --run-sd a number >= 0 or 'measured' "
                          f"(got {replicates}, {run_sd_text!r})")
    law, source = EPOCH_LAW, "Epoch's Chinchilla fit"
    if measured or law_name == "fitted":
        fitted, spread, dof, runs = finished_ladder(spec, target or spec.name)
        if law_name == "fitted":
            if fitted is None:
                raise ConfigError(f"--law fitted needs finished runs of the reference architecture "
                                  f"'{spec.ladder.reference}' at 3 or more rungs; the ladder '{spec.name}' has "
                                  f"{runs}: run more of it (satlab ladder {target}) or use --law epoch")
            law, source = fitted, (f"fitted to the {runs} finished {spec.ladder.reference} runs (E {fitted.E:.3g}, "
                                   f"A {fitted.A:.3g}, alpha {fitted.alpha:.3g}, B {fitted.B:.3g}, "
                                   f"beta {fitted.beta:.3g})")
        if measured:
            if dof == 0:
                raise ConfigError(f"--run-sd measured needs two finished seeds of one rung and budget; the ladder "
                                  f"'{spec.name}' has none yet: give --run-sd a number (e.g. 0.01)")
            run_sd = spread
            source += f"; seed noise measured on the finished runs ({dof} degrees of freedom)"
    return law, run_sd, source


def ladder_shape(spec: AblationSpec) -> Ladder:
    """The ladder's rung sizes (the count its budgets use), budgets and seeds, one run per budget, for simulation."""
    from satlab.studies import ladder as L
    from satlab.studies.scaling_sim import Ladder

    rungs = L.plan(spec)
    return Ladder(sizes=tuple(float(r.counted) for r in rungs), tokens_per_param=tuple(spec.ladder.budgets),
                  seeds=tuple(r.seeds for r in rungs), runs_per_budget=True)


def finished_ladder(spec: AblationSpec, target: str) -> tuple[ScalingLaw | None, float, int, int]:
    """From the ladder's finished runs, as the report reads them: the reference architecture's fitted law (None
    below 3 rungs), the seed spread pooled over architectures, its degrees of freedom, and the reference's run
    count."""
    from satlab.studies.ladder import plan
    from satlab.studies.ladder_report import ladder_runs, pooled_seed_spread
    from satlab.studies.lookup import open_ablation
    from satlab.studies.results import collect
    from satlab.studies.scaling_fit import GRIDS, fit_law

    try:
        spec, client, parent_run_id = open_ablation(target)
    except ConfigError as e:
        raise ConfigError(f"the ladder '{spec.name}' has not run yet, so it has no finished runs to take a law or a "
                          f"seed spread from ({'; '.join(e.problems)}): run it with satlab ladder {target}, or "
                          f"simulate with --law epoch and a number for --run-sd") from None
    found = ladder_runs(spec, collect(spec, client, parent_run_id), plan(spec))
    spread, dof = pooled_seed_spread(found)
    reference = [run for _, run in found.get(spec.ladder.reference, [])]
    fit = spec.ladder.fit
    law = fit_law(reference, fit.huber_delta, GRIDS[fit.grid]) if len({r.N for r in reference}) >= 3 else None
    return law, spread, dof, len(reference)


def fit_ladder(spec: AblationSpec, target: str) -> int:
    """The report (with its scaling-ladder section) of a ladder whose every cell has finished."""
    from satlab.studies.ablation_report import write_report
    from satlab.studies.lookup import open_ablation
    from satlab.studies.results import cell_runs

    try:
        spec, client, parent_run_id = open_ablation(target)
    except ConfigError as e:
        raise ConfigError(f"the ladder '{spec.name}' has not run yet, so there is nothing to fit: run it with "
                          f"satlab ladder {target} ({'; '.join(e.problems)})") from None
    finished = cell_runs(client, parent_run_id)
    missing = [c.key for c in spec.cells() if c.key not in finished]
    if missing:
        raise ConfigError(f"the ladder '{spec.name}' has {len(missing)} of {len(spec.cells())} cells unfinished "
                          f"(first: {missing[0]}), and the fit is of a finished ladder: run satlab ladder {target} "
                          f"to finish them, or satlab report {target} for a report of what has finished")
    write_report(spec, client, parent_run_id, console=make_console())
    return 0


def print_ladder(spec: AblationSpec, left: Sequence[Cell] | None = None) -> None:
    """Per rung and architecture: sizes, FLOPs per token, budgets, runs; per rung the cost, then the totals, and
    those of the cells ``left`` to run (when some have finished)."""
    from satlab.studies import ladder as L

    ladder, rungs = spec.ladder, L.plan(spec)
    cpu = spec.base_config().train.accelerator == "cpu"
    budgets = ", ".join(f"{b:g}" for b in ladder.budgets)
    table = Table(title=f"ladder '{spec.name}': {len(rungs)} rungs, budgets {budgets}"
                        f" tokens per {ladder.per.replace('_', '-')} parameter of {ladder.reference}")
    keys = "/".join(k.removeprefix("model.") for k in ladder.rung_keys())
    for column in ("rung", keys, "arch", "params", "non-embedding", "FLOPs/token", "budgets (tokens)", "steps",
                   "lr", "runs", "CPU time" if cpu else "GPU-hours"):
        table.add_column(column, justify="left" if column in (keys, "arch", "budgets (tokens)") else "right")
    for rung in rungs:
        shape = "/".join(str(v) for v in rung.values.values())
        cost = _duration(rung.cpu_seconds()) if cpu else f"{rung.gpu_hours():,.0f}"
        for j, (arch, size) in enumerate(rung.sizes.items()):
            first = j == 0
            table.add_row(str(rung.index) if first else "", shape if first else "", arch, _count(size.params),
                          _count(size.non_embedding_params), _si(size.flops_per_token),
                          ", ".join(_si(t) for t in rung.tokens) if first else "",
                          ", ".join(f"{s:,}" for s in rung.steps) if first else "",
                          f"{rung.lr:.3g}" if first else "",
                          f"{len(rung.tokens)}x{rung.seeds}", cost if first else "")
    console = make_console()
    console.print(table)
    runs = sum(r.runs for r in rungs)
    spans = {a: math.log10(max(c for r in rungs for c in r.compute(a)) / min(c for r in rungs for c in r.compute(a)))
             for a in rungs[0].sizes}
    console.print(f"{runs} runs (per architecture: budgets x seeds at each rung); training compute "
                  f"spans {min(spans.values()):.2f} to {max(spans.values()):.2f} decades per architecture; warmup "
                  f"{ladder.warmup:g} x N tokens; each budget its own run with its own cosine schedule", soft_wrap=True)
    remaining = ""
    if left is not None and not left:
        remaining = "; every run has finished"
    elif left is not None and len(left) < runs:
        cost = [_cell_cost(rungs, cell, cpu) for cell in left]
        remaining = (f"; {len(left)} of {runs} runs left to run: "
                     + (f"{_duration(sum(cost))} ({_duration(sum(cost) / 2)} with --workers 2)" if cpu
                        else f"{sum(cost):,.0f} GPU-hours"))
    if cpu:
        seconds = sum(r.cpu_seconds() for r in rungs)
        console.print(f"CPU time: {_duration(seconds)} of one thread in all ({L.CPU_SECONDS_PER_GFLOP} s per GFLOP + "
                      f"{L.CPU_SECONDS_PER_TOKEN:g} s per token + {L.CPU_SECONDS_PER_RUN:g} s per run, fitted to "
                      "ladder_cpu_tuned's runs: satlab/studies/ladder.py), "
                      f"{_duration(seconds / 2)} with --workers 2 of one thread each{remaining}", soft_wrap=True)
    else:
        console.print(f"GPU-hours: {sum(r.gpu_hours() for r in rungs):,.0f} in all, at an ASSUMED {L.GPU_MFU:.0%} MFU "
                      f"of {L.GPU_PEAK_LABEL} (no ladder has been timed on a GPU; `satlab bench` measures the MFU "
                      f"of a size){remaining}", soft_wrap=True)


def _cell_cost(rungs: Sequence[Rung], cell: Cell, cpu: bool) -> float:
    """One cell's CPU seconds or GPU-hours, from its rung, architecture and tokens."""
    from satlab.studies.ladder import rung_of

    values = cell.group_values
    rung, arch, tokens = rung_of(rungs, values), values["model.arch"], values["train.max_tokens"]
    return rung.run_cpu_seconds(arch, tokens) if cpu else rung.run_gpu_hours(arch, tokens)


def _si(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**8 else f"{n / 1e6:,.1f} M"


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"
