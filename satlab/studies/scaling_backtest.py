"""The ladder's backtest, and how often it passes when the law is right.

The backtest fits the runs below the top rung and predicts each top-rung run with a prediction interval: the
lower-rung fit's bootstrap by run plus a new run's seed noise, the spread of log loss between seeds of one size and
budget. A 90 % interval misses a run one time in ten when everything is right, so a rule that wants every one of a
rung's k runs inside fails about 1 - 0.9**k of the time on a correct law (0.47 for six runs), and the runs share one
fit, so the true rate can be higher still. :func:`simulate_backtest` measures that rate on simulated ladders of a
given shape and law, through the same :func:`predict_held_out` the report uses, so that an observed backtest can be
read against what a correct law would give.

A ``simultaneous`` band judges the rung as a whole: each of the k runs gets the level 1 - (1 - level)/k
(Bonferroni), so that all k fall inside together with probability at least ``level`` on a correct law, whatever the
dependence between them; ``pointwise`` keeps each run at ``level``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from satlab.config.ladder import BANDS
from satlab.studies.scaling_fit import (
    CLAIM_LEVEL,
    HOFFMANN_GRID,
    Interval,
    RunPoints,
    ScalingLaw,
    StartGrid,
    bootstrap_laws,
    fit_law,
    loss_interval,
)
from satlab.studies.scaling_sim import Ladder, simulate_runs

BACKTEST_RESAMPLES = 200
"""Bootstrap refits of the backtest's lower-rung fit (its interval only needs the 5th and 95th percentiles)."""
TAIL_VALUES = 10
"""The fewest values (bootstrap fits x noise draws) beyond each end of a prediction interval."""


def run_level(level: float, judged: int, band: str = "pointwise") -> float:
    """The level of each judged run's interval: ``level`` (pointwise), or 1 - (1 - level)/judged (simultaneous)."""
    if band not in BANDS or judged < 1:
        raise ValueError(f"band must be one of {', '.join(BANDS)} and judged >= 1 (got {band!r}, {judged})")
    return level if band == "pointwise" else 1.0 - (1.0 - level) / judged


def judged_runs(held: Sequence[RunPoints], seeds: Sequence[int] = ()) -> list[RunPoints]:
    """The held-out runs the backtest judges: those of ``seeds``, or all when none are named."""
    return [run for run in held if not seeds or run.seed in seeds]


def spread_terms(runs: Sequence[RunPoints]) -> tuple[float, int]:
    """Sum of squared deviations of log loss from each (size, budget)'s seed mean, and its degrees of freedom. Each
    run is one budget of one seed (its first point)."""
    by_point: dict[tuple[float, float], list[float]] = {}
    for run in runs:
        by_point.setdefault((run.N, run.D[0]), []).append(math.log(run.L[0]))
    squares, dof = 0.0, 0
    for logs in by_point.values():
        if len(logs) > 1:
            squares += float(np.sum((np.array(logs) - np.mean(logs)) ** 2))
            dof += len(logs) - 1
    return squares, dof


def seed_spread(runs: Sequence[RunPoints]) -> float:
    """The pooled standard deviation of log loss between seeds of one (size, budget): the noise of a new run."""
    squares, dof = spread_terms(runs)
    return math.sqrt(squares / dof) if dof else 0.0


def predict_held_out(lower: Sequence[RunPoints], held: Sequence[RunPoints], noise_sd: float,
                     level: float = CLAIM_LEVEL, delta: float = 1e-3, grid: StartGrid | None = None,
                     resamples: int = BACKTEST_RESAMPLES, seed: int = 0) -> list[Interval]:
    """Fit `lower`, bootstrap it by run, and give each held-out run's prediction interval at its (N, D)."""
    grid = grid or HOFFMANN_GRID
    law = fit_law(lower, delta, grid)
    laws = bootstrap_laws(lower, resamples, seed, delta, full=law, grid=grid)
    draws = math.ceil(2 * TAIL_VALUES / ((1.0 - level) * len(laws)))
    return [loss_interval(law, laws, run.N, run.D[0], level, noise_sd=noise_sd, seed=seed, draws=draws)
            for run in held]


@dataclass(frozen=True)
class BacktestCalibration:
    """Simulated backtests of one ladder shape on a known law: per replicate, how many top-rung runs fell outside."""

    runs_per_replicate: int
    misses: tuple[int, ...]

    @property
    def replicates(self) -> int:
        return len(self.misses)

    @property
    def coverage(self) -> float:
        """The share of all simulated top-rung runs inside their interval."""
        return 1.0 - sum(self.misses) / (self.replicates * self.runs_per_replicate)

    @property
    def all_inside(self) -> float:
        """The share of replicates with every top-rung run inside: how often the strict rule passes."""
        return self.misses.count(0) / self.replicates

    def at_most(self, k: int) -> float:
        """The share of replicates with at most k runs outside."""
        return sum(m <= k for m in self.misses) / self.replicates

    def mc_se(self, rate: float) -> float:
        """The Monte Carlo standard error of a rate over replicates."""
        return float(np.sqrt(rate * (1.0 - rate) / self.replicates))


def simulate_backtest(law: ScalingLaw, ladder: Ladder, run_sd: float, replicates: int = 100, seed: int = 0,
                      level: float = CLAIM_LEVEL, delta: float = 1e-3, grid: StartGrid | None = None,
                      resamples: int = BACKTEST_RESAMPLES, top_shift: float = 0.0, band: str = "pointwise",
                      seeds: Sequence[int] = ()) -> BacktestCalibration:
    """`replicates` ladders drawn from `law` with seed noise `run_sd`, each backtested as the report does: the top
    rung held out, its runs of `seeds` (all when none) judged at the `band`'s level, the noise taken from the
    replicate's own seed spread (every rung's, as the report takes it). `top_shift` moves the top rung's log loss
    off the law (a law that breaks above the rungs fitted): 0 measures the backtest's pass rate when the law holds,
    a shift its power to see a break."""
    if replicates < 1 or len(ladder.sizes) < 4:
        raise ValueError(f"a backtest simulation needs replicates >= 1 and 4 rungs or more, 3 to fit below the one "
                         f"held out (got {replicates} replicates, {len(ladder.sizes)} rungs).")
    rng = np.random.default_rng(seed)
    top = ladder.sizes[-1]
    misses = []
    for i in range(replicates):
        runs = simulate_runs(law, ladder, rng, run_sd)
        lower = [run for run in runs if top > run.N]
        held = judged_runs([dataclasses.replace(run, L=tuple(v * math.exp(top_shift) for v in run.L))
                            for run in runs if top == run.N], seeds)
        each = run_level(level, len(held), band)
        intervals = predict_held_out(lower, held, seed_spread(runs), each, delta, grid, resamples, seed + i)
        misses.append(sum(not iv.lower <= run.L[0] <= iv.upper for iv, run in zip(intervals, held, strict=True)))
    return BacktestCalibration(len(held), tuple(misses))
