"""Can a ladder resolve the gain it looks for? Simulated ladders with a known law, a known compute multiplier and
seed noise, run through the fit, the bootstrap by run, the paired multiplier interval and the claim rule the report
uses; coverage of the true multiplier, the rate of each claim (a gain under m = 1 is a false gain; under m > 1 the
gain rate is the power).

The architecture's law is the reference's with N and D scaled: L_m(N, D) = L_ref(s_N N, s_D D) with
s_N = m**share and s_D = m**(1 - share). Under 6N FLOPs per token, a model of N parameters trained on D tokens costs
C = 6 N D, and L_m at (N, D) equals L_ref at a point costing 6 s_N N s_D D = m C; minimising over N at fixed C gives
L*_m(C) = L*_ref(m C) at EVERY C, so the true multiplier is exactly m across the whole range. In the law's terms:
A_m = A s_N**-alpha, B_m = B s_D**-beta, same E, alpha, beta. The default share beta / (alpha + beta) keeps the
compute-optimal N of both architectures equal at every C (the gain is all in loss, none in allocation).

Seed noise: each run draws one normal offset of sd `run_sd` on log loss that shifts all its points (a seed moves
the whole run), plus independent point noise of sd `point_sd` (0 by default). satlab's tiny-family runs spread about
0.05 in loss at a loss near 5 over seeds, about 0.01 on log loss: the default run_sd.

All replicates of a simulation are fitted in one batch through the same batched fit and bootstrap that
:func:`~satlab.studies.scaling_fit.fit_law` and :func:`~satlab.studies.scaling_fit.bootstrap_laws` wrap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from satlab.studies.scaling_fit import (
    CLAIM_LEVEL,
    Interval,
    RunPoints,
    ScalingLaw,
    StartGrid,
    bootstrap_many,
    claim,
    compute_for_size,
    fit_many,
    law_from_theta,
    multiplier_interval,
    run_arrays,
)

# Besiroglu et al. 2024's estimates of the Chinchilla law (the golden test's reference): the default true law.
EPOCH_LAW = ScalingLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)
# A coarse grid for simulations (108 starts): each replicate needs its own fit, and the truth is a smooth law.
SIM_GRID = StartGrid(coef=(0.0, 5.0, 10.0), e=(-1.0, 0.0, 1.0), exponent=(0.25, 0.75))
Intervals = Callable[..., Interval]


@dataclass(frozen=True)
class Ladder:
    """Rungs of a ladder: the parameter count of each, the token budgets as multiples of N (the decay points of one
    run) and the seeds (runs) per rung."""

    sizes: tuple[float, ...] = (2.5e5, 5e5, 1e6, 2e6, 4e6)
    tokens_per_param: tuple[float, ...] = (5.0, 10.0, 20.0, 40.0)
    seeds: tuple[int, ...] = (2, 2, 1, 1, 1)
    runs_per_budget: bool = False
    """True: each budget of each seed is a run of its own, with its own seed offset (satlab's ladders: one cosine
    run per budget); False: one run per seed decayed at every budget."""

    def __post_init__(self) -> None:
        sizes = np.asarray(self.sizes, dtype=float)
        if (len(self.sizes) < 3 or len(self.seeds) != len(self.sizes) or min(self.seeds) < 1
                or np.any(np.diff(sizes) <= 0) or sizes[0] <= 0 or len(self.tokens_per_param) < 1
                or min(self.tokens_per_param) <= 0):
            raise ValueError(f"a simulated ladder needs at least 3 increasing positive sizes, one seed count >= 1 per "
                             f"rung and positive token multiples (got {self}).")


def law_with_multiplier(reference: ScalingLaw, m: float, share: float | None = None) -> ScalingLaw:
    """The reference's law with a true compute multiplier of exactly m at every C (6N FLOPs per token): see the
    module's docstring. `share` is the part of the gain taken as parameter efficiency (s_N = m**share)."""
    if not m > 0:
        raise ValueError(f"the multiplier must be > 0 (got {m}).")
    a, b = reference.alpha, reference.beta
    share = b / (a + b) if share is None else share
    return ScalingLaw(E=reference.E, A=reference.A * m ** (-share * a), B=reference.B * m ** (-(1.0 - share) * b),
                      alpha=a, beta=b)


def simulate_runs(law: ScalingLaw, ladder: Ladder, rng: np.random.Generator, run_sd: float,
                  point_sd: float = 0.0) -> list[RunPoints]:
    """One simulated ladder: every seed of every rung a run, its points at the rung's budgets."""
    runs = []
    for size, seeds in zip(ladder.sizes, ladder.seeds, strict=True):
        D = np.asarray(ladder.tokens_per_param, dtype=float) * size
        for s in range(seeds):
            if ladder.runs_per_budget:
                for d in D:
                    noise = run_sd * rng.standard_normal() + point_sd * rng.standard_normal()
                    runs.append(RunPoints(f"N{size:.3g}-D{d:.3g}-s{s}", float(size), (float(d),),
                                          (float(law.loss(size, d)) * float(np.exp(noise)),), seed=s))
                continue
            noise = run_sd * rng.standard_normal() + point_sd * rng.standard_normal(len(D))
            runs.append(RunPoints(f"N{size:.3g}-s{s}", float(size), tuple(D), tuple(law.loss(size, D) * np.exp(noise)),
                                  seed=s))
    return runs


@dataclass
class SimulationResult:
    """Rates over replicates (each with its Monte Carlo standard error: sqrt(p (1 - p) / replicates))."""

    multiplier: float
    C: float
    replicates: int
    coverage: float
    gain: float
    loss: float
    intervals: list[Interval] = field(repr=False)

    @property
    def not_resolved(self) -> float:
        return 1.0 - self.gain - self.loss

    def mc_se(self, rate: float) -> float:
        return float(np.sqrt(rate * (1.0 - rate) / self.replicates))


@dataclass
class SimulatedFits:
    """The full and bootstrap fits of every replicate, for each side: (replicates, 5) and (replicates, resamples, 5)."""

    multiplier: float
    C: float
    fits: dict[str, np.ndarray]
    boots: dict[str, np.ndarray]


def simulate_fits(multiplier: float, ladder: Ladder | None = None, reference: ScalingLaw = EPOCH_LAW,
                  replicates: int = 20, resamples: int = 100, run_sd: float = 0.01, point_sd: float = 0.0,
                  size: float = 1e10, seed: int = 0, grid: StartGrid = SIM_GRID, delta: float = 1e-3,
                  extra_starts: int = 1, polish: int = 1) -> SimulatedFits:
    """Simulate `replicates` ladders of the reference and of an architecture with a true `multiplier`, fit both and
    bootstrap both by run (`resamples` each); C is where the true reference's optimal size is `size`."""
    if replicates < 1 or resamples < 2:
        raise ValueError(f"a simulation needs replicates >= 1 and resamples >= 2 (got {replicates}, {resamples}).")
    ladder = ladder or Ladder()
    rng = np.random.default_rng(seed)
    laws = {"reference": reference, "arch": law_with_multiplier(reference, multiplier)}
    fits, boots = {}, {}
    for j, (name, law) in enumerate(laws.items()):
        ladders = [simulate_runs(law, ladder, rng, run_sd, point_sd) for _ in range(replicates)]
        X, _, owner = run_arrays(ladders[0])
        Y = np.stack([run_arrays(runs)[1] for runs in ladders])
        fits[name] = fit_many(X, Y, delta, grid, polish)
        seeds = [seed * 1_000_003 + 2 * i + j + 1 for i in range(replicates)]
        boots[name] = bootstrap_many(X, Y, owner, fits[name], resamples, seeds, delta, grid, extra_starts)
    return SimulatedFits(multiplier, compute_for_size(reference, size), fits, boots)


def score(sim: SimulatedFits, level: float = CLAIM_LEVEL,
          interval: Intervals = multiplier_interval) -> SimulationResult:
    """Each replicate's multiplier interval (`interval` at `level`) and the claim rule's verdict on it."""
    intervals = []
    for i in range(len(sim.fits["arch"])):
        intervals.append(interval([law_from_theta(t) for t in sim.boots["arch"][i]],
                                  [law_from_theta(t) for t in sim.boots["reference"][i]], sim.C, level,
                                  law=law_from_theta(sim.fits["arch"][i]),
                                  reference=law_from_theta(sim.fits["reference"][i])))
    claims = [claim(iv) for iv in intervals]
    n = len(intervals)
    covered = [iv.lower <= sim.multiplier <= iv.upper for iv in intervals]
    return SimulationResult(sim.multiplier, sim.C, n, float(np.mean(covered)), claims.count("gain") / n,
                            claims.count("loss") / n, intervals)


def simulate_ladder(multiplier: float, level: float = CLAIM_LEVEL, interval: Intervals = multiplier_interval,
                    **knobs: object) -> SimulationResult:
    """:func:`simulate_fits` (its knobs) scored by :func:`score`."""
    return score(simulate_fits(multiplier, **knobs), level, interval)  # type: ignore[arg-type]


def simulation_table(multipliers: Sequence[float] = (1.0, 1.5, 2.0), **knobs: object) -> list[SimulationResult]:
    """:func:`simulate_ladder` at each multiplier (1.0: the false-gain rate; above 1: the power)."""
    return [simulate_ladder(m, **knobs) for m in multipliers]  # type: ignore[arg-type]
