"""Group-sequential comparisons of an ablation's arms over seeds: alpha spending, boundaries, the paired t statistic
at each look, verdicts, repeated confidence intervals and the sharing of alpha among comparisons (numpy/scipy only).

- **Spending** (Lan & DeMets 1983), with ``a`` the one-sided level of one side (alpha for a one-sided test, alpha/2
  per side for a two-sided one), as gsDesign's ``sfLDOF``/``sfLDPocock`` and ldbounds write them:
  O'Brien-Fleming-type ``a*(t) = 2 - 2 Phi(z_{a/2} / sqrt t)``, Pocock-type ``a*(t) = a ln(1 + (e - 1) t)``, at the
  information fractions ``t_k = n_k / n_max`` of the look schedule.
- **Boundaries** by the recursive numerical integration of Armitage, McPherson & Rowe (1969) as Jennison & Turnbull
  (2000, ch. 19) describe it: the sub-density of the z statistic on the continuation region is carried from look to
  look on a grid (Simpson's rule), and each boundary solves "the probability of first crossing here equals the
  spending increment". No Monte Carlo.
- **The statistic**: the paired differences of the seeds both arms share, ``t = mean / (sd / sqrt n)``; the
  boundary's one-sided nominal tail ``p_k = 1 - Phi(b_k)`` becomes the critical value ``t_{n_k - 1}^{-1}(1 - p_k)``
  (the same nominal level through the t distribution at the current degrees of freedom).
- **The sign-flip check**: a rejection also needs the exact sign-flip (randomization) test of the same look to reach
  the same one-sided nominal level. Under the null that a paired difference is symmetric about zero, given the
  magnitudes the signs are fair coins, so its p-value is exact whatever the distribution of the differences; the t
  critical values assume normal ones, and on skewed, tied or two-valued differences (a retrieval run binds or it
  does not) they reject too often at the tiny nominal levels of the early looks. The smallest sign-flip p of n seeds
  is 2^-n: no comparison stops while 2^-n is above its nominal level (with O'Brien-Fleming spending over 3 to 20
  seeds, not before about 12 seeds; with Pocock's, from about 8); such a look spends nothing and passes its alpha
  to the next (:func:`boundaries` with ``floor``). Above :data:`EXACT_SIGN_FLIPS` seeds the t test
  stands alone: counting would take seconds per look (two halves of more than 2^20 sums), a Monte Carlo p would
  make the verdict depend on a draw, and by then the early looks' tiny nominal levels are behind a plan whose looks
  start at a handful of seeds, while at later looks the t distribution of a symmetric difference with a finite
  variance is close to its limit (the central limit theorem). Seeds that agree to rounding (a standard deviation
  below 1e-12 of the largest magnitude) have no spread: t is +-infinity when they agree on a nonzero difference
  (every seed of one arm bound, none of the other's: the strongest evidence a bimodal measure gives, decided by the
  sign-flip p alone, 2^-n) and undefined when it is zero.
- **Verdicts**: the first arm better, the second better, equivalent within the margin (the repeated confidence
  interval inside ±margin: two one-sided tests at the look's nominal level), continue, or undecided at n_max.
- **Repeated confidence intervals** (Jennison & Turnbull ch. 9): ``mean ± c_k se`` at every look, simultaneous over
  the looks; unlike the naive interval they stay valid whenever the comparison stops. They, and so the equivalence
  verdict, stay t-based (normal theory, no sign-flip check): a sign-flip test is of the null "symmetric about zero",
  not of a shifted one, and an interval would need inverting it over shifts. Seeds without spread give an unbounded
  interval (never "equivalent").
- **Multiplicity**: ``bonferroni`` tests each of the m comparisons at alpha/m (a union bound: valid whatever their
  dependence); ``holm`` starts there and, when a comparison is rejected, shares its alpha among the open ones, which
  are then tested again at every look so far with the boundaries of their larger alpha (the graphical approach for
  group-sequential designs, Maurer & Bretz 2013: a shortcut of a closed test whose intersection tests are weighted
  Bonferroni tests of group-sequential tests).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize, stats

from satlab.config.sequential import SequentialPlan

GRID_STEP = 0.01  # z units between grid points of the integration; boundaries are exact to about 1e-5
TAIL = 10.0  # the one-sided continuation region starts here (a null z below -10 has probability 8e-24)
EXACT_SIGN_FLIPS = 40  # seeds up to which the sign-flip p is counted exactly (two halves of 2^20 sums at most)
SPREAD_ROUNDING = 1e-12  # a standard deviation below this share of the largest |difference| is rounding: none
OUTCOMES = ("a_better", "b_better", "equivalent", "continue", "undecided", "waiting")
EARLY_STOP_NOTE = ("stopped before n_max: the naive mean difference is biased away from zero (a comparison stops "
                   "early when its running mean happens to be large); the repeated confidence interval is valid")
EQUIVALENCE_NOTE = ("stopped for equivalence before n_max: the naive mean difference is biased toward zero; the "
                    "repeated confidence interval is valid")


def spent(spending: str, t: float | np.ndarray, level: float) -> float | np.ndarray:
    """The one-sided alpha spent by information fraction ``t`` for a side of level ``level``."""
    t = np.asarray(t, dtype=float)
    if spending == "obrien_fleming":
        with np.errstate(divide="ignore"):
            out = 2.0 - 2.0 * stats.norm.cdf(stats.norm.isf(level / 2) / np.sqrt(t))
    elif spending == "pocock":
        out = level * np.log1p((math.e - 1.0) * t)
    else:
        raise ValueError(f"unknown spending function {spending!r}")
    return out if out.ndim else float(out)


def _simpson(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Grid points and Simpson weights on [lo, hi], about GRID_STEP apart (an odd count)."""
    n = max(3, 2 * math.ceil((hi - lo) / GRID_STEP / 2) + 1)
    z = np.linspace(lo, hi, n)
    w = np.ones(n)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return z, w * (z[1] - z[0]) / 3.0


class _Recursion:
    """The null sub-density of Z_k on the continuation region, carried from look to look (J&T ch. 19).

    Z_k = S_k / sqrt(I_k) with independent increments of S; ``sides == 2`` continues on (-b_k, b_k), ``sides == 1``
    on (-TAIL, b_k). Only upper crossings are counted; a two-sided design is symmetric, so its lower ones are equal.
    """

    def __init__(self, sides: int):
        self.sides = sides
        self.info = 0.0
        self.z: np.ndarray | None = None  # grid of the last look's continuation region
        self.mass: np.ndarray | None = None  # density times Simpson weight on that grid

    def upper(self, b: float, info: float) -> float:
        """P(no crossing before, Z_k >= b) at the next look of information ``info``."""
        if self.z is None:
            return float(stats.norm.sf(b))
        step = math.sqrt(info - self.info)
        return float(self.mass @ stats.norm.sf((b * math.sqrt(info) - self.z * math.sqrt(self.info)) / step))

    def advance(self, b: float, info: float) -> None:
        """Move to the next look with boundary ``b`` (math.inf: no stopping there)."""
        top = min(b, TAIL + 2.0)
        z, w = _simpson(-top if self.sides == 2 else -TAIL, top)
        if self.z is None:
            density = stats.norm.pdf(z)
        else:
            step = math.sqrt(info - self.info)
            kernel = stats.norm.pdf((z[:, None] * math.sqrt(info) - self.z[None, :] * math.sqrt(self.info)) / step)
            density = kernel @ self.mass * math.sqrt(info) / step
        self.z, self.mass, self.info = z, density * w, info


def crossing(bounds: Sequence[float], fractions: Sequence[float], sides: int) -> list[float]:
    """The null probability of first crossing the upper boundary at each look (per side for ``sides == 2``)."""
    recursion, out = _Recursion(sides), []
    for b, t in zip(bounds, fractions, strict=True):
        out.append(recursion.upper(b, t))
        recursion.advance(b, t)
    return out


@dataclass(frozen=True)
class Boundaries:
    """One design: the z boundary at each look, its one-sided nominal level, and the cumulative spend (per side)."""

    looks: tuple[int, ...]
    fractions: tuple[float, ...]
    z: tuple[float, ...]
    nominal: tuple[float, ...]
    spent: tuple[float, ...]

    def critical(self, k: int) -> float:
        """The t critical value of look ``k`` (0-based) at n_k - 1 degrees of freedom, same nominal tail."""
        return _t_critical(self.nominal[k], self.looks[k] - 1)


@functools.lru_cache(maxsize=4096)
def _t_critical(nominal: float, df: int) -> float:
    return math.inf if nominal <= 0 else float(stats.t.isf(nominal, df))


@functools.lru_cache(maxsize=1024)
def boundaries(looks: tuple[int, ...], level: float, spending: str, sides: int, floor: bool = False) -> Boundaries:
    """The Lan-DeMets boundaries of a side of one-sided level ``level`` at the looks (cumulative seed counts).

    ``floor``: the looks of the sign-flip check (what :func:`evaluate` uses). A look of n seeds whose nominal level
    would be below 2^-n, the smallest sign-flip p of n seeds, cannot reject: it spends nothing (boundary infinite)
    and its increment carries over to the next look, as Lan-DeMets spending allows for a look that does not stop.
    Fixed by the plan before any data, so the error stays at ``level``; without it, Pocock-type spending over 3
    comparisons would spend half its alpha at looks that cannot reject. Without ``floor``: the published designs."""
    fractions = tuple(n / looks[-1] for n in looks)
    cumulative = [float(spent(spending, t, level)) for t in fractions]
    cumulative[-1] = level  # the whole level is spent at n_max, whatever rounding says
    recursion, zs, previous, spends = _Recursion(sides), [], 0.0, []
    for n, t, total in zip(looks, fractions, cumulative, strict=True):
        target = total - previous
        if target <= 1e-15:
            b = math.inf
        else:
            b = optimize.brentq(lambda x, t=t, target=target: recursion.upper(x, t) - target, -TAIL, 40.0,
                                xtol=1e-10)
            if floor and n <= EXACT_SIGN_FLIPS and stats.norm.sf(b) < 2.0 ** -n:
                b = math.inf
        zs.append(b)
        recursion.advance(b, t)
        previous = previous if math.isinf(b) else total
        spends.append(previous)
    nominal = tuple(float(stats.norm.sf(b)) for b in zs)
    return Boundaries(looks, fractions, tuple(zs), nominal, tuple(spends))


def constant_boundary(fractions: Sequence[float], alpha: float, sides: int, delta: float = 0.5) -> float:
    """The constant C of the Wang-Tsiatis boundaries b_k = C t_k^(delta - 1/2) with total error ``alpha`` (two-sided
    for ``sides == 2``): delta 0.5 is Pocock's test (C_P), delta 0 O'Brien and Fleming's (C_B)."""
    level = alpha / sides
    shape = [t ** (delta - 0.5) for t in fractions]
    return float(optimize.brentq(lambda c: sum(crossing([c * s for s in shape], fractions, sides)) - level,
                                 0.5, 10.0, xtol=1e-10))


@functools.lru_cache(maxsize=16)
def _sign_vectors(n: int) -> np.ndarray:
    """Every vector of n signs, a row each (2^n x n)."""
    return np.array(list(itertools.product((1.0, -1.0), repeat=n))).reshape(2 ** n, n)


def _signed_sums(magnitudes: np.ndarray) -> np.ndarray:
    """Every sum of ``±m_i``: 2^len values (one product with the cached sign vectors for the few values of a
    simulated look, doubling an array beyond)."""
    if len(magnitudes) <= 10:
        return _sign_vectors(len(magnitudes)) @ magnitudes
    sums = np.zeros(1)
    for m in magnitudes:
        sums = np.concatenate((sums + m, sums - m))
    return sums


def sign_flip_p(diffs: np.ndarray) -> float | None:
    """The exact one-sided p of the sign-flip test in the direction of the mean of ``diffs``: the share of the 2^n
    sign vectors whose signed sum of the magnitudes is at least as far from zero on that side as the one observed
    (ties count, so it is never below the truth). Counted by meeting in the middle (the sums of each half, one half
    sorted); None above :data:`EXACT_SIGN_FLIPS` values."""
    n = len(diffs)
    if n > EXACT_SIGN_FLIPS:
        return None
    magnitudes = np.abs(np.asarray(diffs, dtype=float))
    observed = abs(float(np.sum(diffs)))
    tolerance = 1e-9 * max(float(magnitudes.sum()), 1e-300)  # sums equal but for rounding count as ties
    first, second = np.sort(_signed_sums(magnitudes[: n // 2])), np.sort(_signed_sums(magnitudes[n // 2:]))
    # needles in ascending order: searchsorted walks the sorted half once (4x faster at 40 values)
    at_least = len(second) - np.searchsorted(second, observed - tolerance - first[::-1], side="left")
    return float(at_least.sum()) / 2.0 ** n


@dataclass
class LookRecord:
    """One look at one comparison: what a reviewer needs to replay the decision."""

    pair: str
    look: int  # 1-based
    seeds: int
    mean: float  # of the differences, positive = the first arm better
    se: float
    t: float
    critical: float  # |t| at or above this rejects (for the first arm only when one-sided)
    z_boundary: float
    nominal: float  # the look's one-sided nominal level
    alpha: float  # the comparison's share of alpha when this look was decided
    rci: tuple[float, float]
    decision: str  # one of OUTCOMES
    note: str = ""
    sign_flip_p: float | None = None  # the exact one-sided sign-flip p in the direction of the mean, at every look
    # (None beyond EXACT_SIGN_FLIPS seeds: the t test alone)


@dataclass
class PairVerdict:
    a: str
    b: str
    outcome: str = "waiting"
    stopped_at: int | None = None  # the look (1-based) of the decision
    seeds: int = 0
    records: list[LookRecord] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.a} vs {self.b}"


def pairs(arms: Sequence[str], baseline: str | None, comparisons: str) -> list[tuple[str, str]]:
    """The comparisons of a plan: each arm against the baseline (the arm first), or every pair in order."""
    if comparisons == "baseline":
        if baseline not in arms:
            raise ValueError(f"baseline {baseline!r} is not among the arms {list(arms)}")
        return [(arm, baseline) for arm in arms if arm != baseline]
    return list(itertools.combinations(arms, 2))


def differences(a: Mapping[object, float], b: Mapping[object, float], lower_is_better: bool) -> np.ndarray:
    """The paired differences over the seeds both arms have, in seed order; positive when ``a`` is better."""
    seeds = sorted(set(a) & set(b), key=lambda s: (str(type(s)), s))
    sign = 1.0 if lower_is_better else -1.0
    return np.array([sign * (b[s] - a[s]) for s in seeds], dtype=float)


def _look(diffs: np.ndarray, k: int, design: Boundaries, plan: SequentialPlan, name: str, level: float) -> LookRecord:
    n = design.looks[k]
    x = diffs[:n]
    mean = float(x.mean())
    sd = float(x.std(ddof=1))
    if sd <= SPREAD_ROUNDING * float(np.abs(x).max(initial=0.0)):
        sd = 0.0  # equal values whose mean rounded (3 x 0.1 -> 0.10000000000000002): no spread, not 1e-17 of it
    se = sd / math.sqrt(n)
    c = design.critical(k)
    # no spread: the seeds agree; on a nonzero difference t is infinite and the exact sign-flip p (2^-n) decides, on
    # zero it is undefined (no evidence either way, as stats.paired_p's None)
    t = mean / se if se > 0 else math.copysign(math.inf, mean) if mean else math.nan
    rci = (mean - c * se, mean + c * se) if se > 0 else (-math.inf, math.inf)
    p = sign_flip_p(x)
    confirmed = p is None or p <= design.nominal[k]  # the sign-flip test agrees at the same nominal level
    if t >= c and confirmed:
        decision = "a_better"
    elif plan.sides == 2 and t <= -c and confirmed:
        decision = "b_better"
    elif plan.margin is not None and -plan.margin < rci[0] and rci[1] < plan.margin:
        decision = "equivalent"
    else:
        decision = "undecided" if k == len(design.looks) - 1 else "continue"
    return LookRecord(name, k + 1, n, mean, se, t, c, design.z[k], design.nominal[k], level, rci, decision,
                      sign_flip_p=p)


def evaluate(plan: SequentialPlan, observations: Mapping[str, Mapping[object, float]],
             comparisons: Sequence[tuple[str, str]], lower_is_better: bool = True) -> list[PairVerdict]:
    """Replay the plan on the values seen so far (``observations[arm][seed]``): the looks whose seed count every open
    comparison has reached, in order, with alpha shared as the plan says. Pure: the same values give the same
    records, so a reviewer (or the simulation) replays every decision."""
    looks = plan.schedule
    m = len(comparisons)
    verdicts = [PairVerdict(a, b) for a, b in comparisons]
    diffs = [differences(observations.get(a, {}), observations.get(b, {}), lower_is_better) for a, b in comparisons]
    weight = [1.0 / m] * m
    side = plan.alpha / plan.sides
    for k, n in enumerate(looks):
        open_ = [i for i, v in enumerate(verdicts) if v.outcome in ("waiting", "continue")]
        if not open_ or any(len(diffs[i]) < n for i in open_):
            break
        for i in open_:
            design = boundaries(looks, side * weight[i], plan.spending, plan.sides, floor=True)
            record = _look(diffs[i], k, design, plan, verdicts[i].name, plan.alpha * weight[i])
            _decide(verdicts[i], record, len(looks))
        if plan.sharing == "holm":
            _recycle(plan, looks, k, verdicts, diffs, weight, side)
    return verdicts


def _decide(verdict: PairVerdict, record: LookRecord, n_looks: int) -> None:
    verdict.records.append(record)
    verdict.outcome, verdict.seeds = record.decision, record.seeds
    if record.decision in ("a_better", "b_better", "equivalent", "undecided"):
        verdict.stopped_at = record.look
        if record.look < n_looks and record.decision != "undecided":
            record.note = EQUIVALENCE_NOTE if record.decision == "equivalent" else EARLY_STOP_NOTE


def _recycle(plan: SequentialPlan, looks: tuple[int, ...], k: int, verdicts: list[PairVerdict],
             diffs: list[np.ndarray], weight: list[float], side: float) -> None:
    """Holm's graphical step: the weight of each rejected comparison passes in equal parts to those not rejected;
    open comparisons are tested again at looks 1..k with the larger alpha, until no new rejection."""
    passed: set[int] = set()
    while True:
        rejected = [i for i, v in enumerate(verdicts) if v.outcome in ("a_better", "b_better") and i not in passed]
        keep = [i for i, v in enumerate(verdicts) if v.outcome not in ("a_better", "b_better")]
        if not rejected or not keep:
            return
        for i in rejected:
            for j in keep:
                weight[j] += weight[i] / len(keep)
            weight[i] = 0.0
            passed.add(i)
        for j in keep:
            if verdicts[j].outcome not in ("continue", "undecided"):
                continue  # stopped for equivalence: not tested again
            design = boundaries(looks, side * weight[j], plan.spending, plan.sides, floor=True)
            for look in range(k + 1):
                record = _look(diffs[j], look, design, plan, verdicts[j].name, plan.alpha * weight[j])
                if record.decision in ("a_better", "b_better"):
                    record.note = f"rejected after alpha passed on at look {k + 1}"
                    verdicts[j].records.append(record)
                    verdicts[j].outcome, verdicts[j].stopped_at = record.decision, k + 1
                    verdicts[j].seeds = looks[k]
                    if k + 1 < len(looks):
                        record.note += f"; {EARLY_STOP_NOTE}"
                    break
