"""Does a sequential plan hold its error rate? Simulated studies run through the same function the report uses
(:func:`satlab.studies.sequential.evaluate`, alpha sharing included), and the same harness on the naive rule ("add
seeds and re-test at 0.05 with the paired t-test", Holm over the comparisons as the fixed-seed report does) as the
negative control; then power and expected seeds against a fixed-n test at n_max.

Null studies draw every arm's per-seed values so that each paired difference is N(0, sigma) (arm noise of std
sigma/sqrt 2; a seed effect shared by the arms would cancel in the differences), or from sign-flips of real observed
differences (the baseline at 0, each other arm a resampled difference with a random sign: every pair is then
symmetric about 0, the null, with the observed shape). The t statistic does not depend on sigma, so the type-I error
does not either; sigma sets the units of the power table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from satlab.config.sequential import SequentialPlan
from satlab.studies.sequential import differences, evaluate, pairs
from satlab.studies.stats import holm

Observations = dict[str, dict[int, float]]
Draw = Callable[[np.random.Generator, int], Observations]
Rule = Callable[[Observations], tuple[bool, float]]  # (any null rejected, seeds per arm used)

NAIVE_ALPHA = 0.05
POWER = 0.8


@dataclass
class Estimate:
    """A simulated rate with its Monte Carlo standard error."""

    rate: float
    studies: int
    seeds: float  # the mean seeds per arm the rule used

    @property
    def mcse(self) -> float:
        return math.sqrt(max(self.rate * (1 - self.rate), 1e-12) / self.studies)

    def text(self) -> str:
        return f"{self.rate:.4f} ± {self.mcse:.4f}"


def normal_draw(arms: Sequence[str], sigma: float, shift: Mapping[str, float] | None = None) -> Draw:
    """Each arm's values N(shift, sigma^2/2): paired differences N(shift_b - shift_a, sigma^2)."""
    shift = shift or {}

    def draw(rng: np.random.Generator, n: int) -> Observations:
        return {arm: dict(enumerate(rng.normal(shift.get(arm, 0.0), sigma / math.sqrt(2), n))) for arm in arms}

    return draw


def sign_flip_draw(arms: Sequence[str], baseline: str, observed: Sequence[float]) -> Draw:
    """The baseline at 0; each other arm a real observed difference drawn with replacement, its sign flipped at
    random."""
    pool = np.asarray(observed, dtype=float)
    if len(pool) < 2 or not np.any(pool):
        raise ValueError("sign-flips need at least two observed differences, not all zero")

    def draw(rng: np.random.Generator, n: int) -> Observations:
        out: Observations = {baseline: dict.fromkeys(range(n), 0.0)}
        for arm in arms:
            if arm != baseline:
                out[arm] = dict(enumerate(rng.choice(pool, n) * rng.choice((-1.0, 1.0), n)))
        return out

    return draw


def sequential_rule(plan: SequentialPlan, comparisons: Sequence[tuple[str, str]], lower_is_better: bool = True,
                    want: str | None = None) -> Rule:
    """The plan's verdicts: whether any comparison rejected (``want``: only that outcome counts, for power) and the
    seeds per arm used (the last look any comparison needed)."""

    def rule(observations: Observations) -> tuple[bool, float]:
        verdicts = evaluate(plan, observations, comparisons, lower_is_better)
        hit = any(v.outcome == want if want else v.outcome in ("a_better", "b_better") for v in verdicts)
        return hit, max(v.seeds for v in verdicts)

    return rule


def naive_rule(plan: SequentialPlan, comparisons: Sequence[tuple[str, str]], lower_is_better: bool = True,
               alpha: float = NAIVE_ALPHA) -> Rule:
    """Re-test at ``alpha`` with the two-sided paired t-test at every look, Holm over the open comparisons (the
    fixed-seed report's test, repeated as seeds are added); a comparison stops once significant."""

    def rule(observations: Observations) -> tuple[bool, float]:
        diffs = [differences(observations[a], observations[b], lower_is_better) for a, b in comparisons]
        for n in plan.schedule:
            ps = [two_sided_p(d[:n]) for d in diffs]
            if any(q is not None and q < alpha for q in holm(ps)):
                return True, n
        return False, plan.schedule[-1]

    return rule


def two_sided_p(d: np.ndarray) -> float | None:
    """The paired t-test's two-sided p of the differences ``d`` (what :func:`satlab.studies.stats.paired_p` gives,
    without scipy's per-call overhead: tested equal)."""
    from scipy import stats

    sd = float(d.std(ddof=1))
    if sd == 0:
        return None
    return float(2 * stats.t.sf(abs(d.mean()) / (sd / math.sqrt(len(d))), len(d) - 1))


def fixed_rule(plan: SequentialPlan, comparisons: Sequence[tuple[str, str]], lower_is_better: bool = True) -> Rule:
    """One test at n_max: the plan's alpha (Bonferroni over the comparisons), one- or two-sided as the plan; counts
    rejections in favour of the first arm."""
    from scipy import stats

    level = plan.alpha / len(comparisons) / plan.sides
    n = plan.schedule[-1]

    def rule(observations: Observations) -> tuple[bool, float]:
        for a, b in comparisons:
            d = differences(observations[a], observations[b], lower_is_better)[:n]
            sd = float(d.std(ddof=1))
            if sd > 0 and d.mean() / (sd / math.sqrt(n)) >= stats.t.isf(level, n - 1):
                return True, n
        return False, n

    return rule


def simulate(rule: Rule, draw: Draw, n_max: int, studies: int, seed: int = 0) -> Estimate:
    rng = np.random.default_rng(seed)
    hits, seeds = 0, 0.0
    for _ in range(studies):
        hit, used = rule(draw(rng, n_max))
        hits += hit
        seeds += used
    return Estimate(hits / studies, studies, seeds / studies)


def mdd(plan: SequentialPlan, sigma: float, power: float = POWER) -> float:
    """The minimum detectable difference of the fixed-n paired t-test at n_max (the plan's alpha and sides, one
    comparison) at ``power``."""
    from statsmodels.stats.power import TTestPower

    effect = TTestPower().solve_power(effect_size=None, nobs=plan.schedule[-1], alpha=plan.alpha, power=power,
                                      alternative="two-sided" if plan.sides == 2 else "larger")
    return float(effect) * sigma


@dataclass
class PowerRow:
    factor: float  # true difference in units of the MDD
    difference: float
    sequential: Estimate
    fixed: Estimate


def power_table(plan: SequentialPlan, sigma: float, studies: int, factors: Sequence[float] = (0.0, 0.5, 1.0, 2.0),
                seed: int = 0) -> list[PowerRow]:
    """Power (verdict "a better") and mean seeds per arm of the plan against the fixed-n test at n_max, one
    comparison, true differences ``factor * MDD`` in favour of the first arm."""
    comparisons = [("a", "b")]
    unit = mdd(plan, sigma)
    rows = []
    for i, factor in enumerate(factors):
        draw = normal_draw(["a", "b"], sigma, {"b": factor * unit})
        rows.append(PowerRow(factor, factor * unit,
                             simulate(sequential_rule(plan, comparisons, want="a_better"), draw, plan.schedule[-1],
                                      studies, seed + i),
                             simulate(fixed_rule(plan, comparisons), draw, plan.schedule[-1], studies, seed + i)))
    return rows


def null_studies(plan: SequentialPlan, arms: Sequence[str], baseline: str, studies: int, sigma: float,
                 observed: Sequence[float] | None = None, seed: int = 0) -> dict[str, Estimate]:
    """The family-wise error under the global null of the plan's comparisons among ``arms``: the plan (normal and,
    given ``observed``, sign-flipped differences) and the naive rule (normal)."""
    comparisons = pairs(arms, baseline, plan.comparisons)
    n_max = plan.schedule[-1]
    normal = normal_draw(arms, sigma)
    out = {"plan, normal": simulate(sequential_rule(plan, comparisons), normal, n_max, studies, seed),
           "naive re-test at 0.05, normal": simulate(naive_rule(plan, comparisons), normal, n_max, studies, seed)}
    if observed is not None:
        out["plan, sign-flips"] = simulate(sequential_rule(plan, comparisons), sign_flip_draw(arms, baseline, observed),
                                           n_max, studies, seed + 1)
    return out
