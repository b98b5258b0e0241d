"""Statistics of an ablation report: mean ± std over seeds, Welch's and the paired t-test (two-sided), the power
behind a comparison, and the paper's claims checked on the numbers given, never assumed.

A claim is **held** (the claimed order, every step of it significant after Holm's correction over the report's
claims), **contradicted** (some step significantly the other way), **not resolved** (neither; the minimum
detectable difference at 80 % power and the seeds that would resolve the observed difference say what it would take)
or, for a metric with a chance level where every architecture is within noise of it, **not measurable at this
scale**. Cells that share a seed share their data order and initial draws, so when both groups have the same seeds
the verdict uses the paired test (the seed-to-seed variation cancels in the differences); Welch's is reported
beside it, and used when the seeds differ.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

SIGNIFICANCE = 0.05
POWER = 0.8
MANY_SEEDS = 1000  # a text says "more than" this (a difference the spread cannot show); summary.json keeps it


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, sample std); the std is None for fewer than two values, both None for none."""
    if not values:
        return None, None
    array = np.asarray(values, dtype=float)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else None


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """None when either side has fewer than two values or the test is undefined (both samples constant)."""
    if len(a) < 2 or len(b) < 2:
        return None
    with warnings.catch_warnings():  # scipy warns on a constant sample (seeds that agree exactly): not news here
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(stats.ttest_ind(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_var=False).pvalue)
    return None if math.isnan(p) else p


def format_p(p: float | None) -> str:
    return "—" if p is None else f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def paired_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """The paired t-test's p over equal-length samples in seed order; None below two pairs or when undefined."""
    if len(a) < 2 or len(a) != len(b):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(stats.ttest_rel(np.asarray(a, dtype=float), np.asarray(b, dtype=float)).pvalue)
    return None if math.isnan(p) else p


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of the p-values given (None stays None): the i-th smallest of m times
    m - i + 1, made monotone, at most 1. (Plain numpy: statsmodels' multipletests runs a garbage collection per call,
    0.15 s, which the sequential simulation's hundred thousand calls cannot afford.)"""
    present = [i for i, p in enumerate(pvalues) if p is not None]
    adjusted: list[float | None] = [None] * len(pvalues)
    if present:
        values = np.array([pvalues[i] for i in present], dtype=float)
        order = np.argsort(values, kind="stable")
        scaled = values[order] * (len(values) - np.arange(len(values)))
        monotone = np.minimum(np.maximum.accumulate(scaled), 1.0)
        for rank, q in zip(order, monotone, strict=True):
            adjusted[present[rank]] = float(q)
    return adjusted


@dataclass
class Comparison:
    """``better`` against ``worse`` on one measure, in the claim's direction: ``gain`` > 0 is the claimed one."""

    better: str
    worse: str
    gain: float
    paired: bool  # whether ``p`` is the paired test's (same seeds on both sides) or Welch's
    paired_p: float | None
    welch_p: float | None
    mdd: float | None  # the smallest |gain| the test would find at 80 % power with these seeds and this spread
    seeds_needed: int | None  # seeds per side for 80 % power at the observed gain
    p_adjusted: float | None = None  # Holm over the report's claims

    @property
    def p(self) -> float | None:
        return self.paired_p if self.paired else self.welch_p

    @property
    def significant(self) -> bool:
        return self.p_adjusted is not None and self.p_adjusted < SIGNIFICANCE


def compare(better: str, worse: str, samples: Mapping[str, Mapping[object, float]],
            lower_is_better: bool = True) -> Comparison | None:
    """``samples[arch][seed]`` compared; None when a side has fewer than two values."""
    from statsmodels.stats.power import TTestIndPower, TTestPower
    from statsmodels.tools.sm_exceptions import ConvergenceWarning  # its import sets an "always" filter: import first

    a, b = samples.get(better, {}), samples.get(worse, {})
    if len(a) < 2 or len(b) < 2:
        return None
    sign = 1.0 if lower_is_better else -1.0
    gain = sign * (float(np.mean(list(b.values()))) - float(np.mean(list(a.values()))))
    paired = set(a) == set(b)
    seeds = sorted(a, key=str)
    if paired:
        spread = float(np.std([b[s] - a[s] for s in seeds], ddof=1))
        power, sizes = TTestPower(), {"nobs": len(seeds)}
    else:
        spread = math.sqrt((np.var(list(a.values()), ddof=1) + np.var(list(b.values()), ddof=1)) / 2)
        power, sizes = TTestIndPower(), {"nobs1": len(a), "ratio": len(b) / len(a)}
    mdd = needed = None
    if spread > 0:
        with warnings.catch_warnings():  # the solver warns where it gives up (nan): an effect under 2 seeds resolve
            warnings.simplefilter("ignore", ConvergenceWarning)
            effect = float(power.solve_power(effect_size=None, alpha=SIGNIFICANCE, power=POWER, **sizes))
            mdd = None if math.isnan(effect) else spread * effect
            if gain != 0:
                size = {"nobs": None} if paired else {"nobs1": None, "ratio": 1.0}
                n = float(power.solve_power(effect_size=abs(gain) / spread, alpha=SIGNIFICANCE, power=POWER, **size))
                needed = 2 if math.isnan(n) else max(2, math.ceil(n))
    return Comparison(better, worse, gain, paired, paired_p([a[s] for s in seeds], [b[s] for s in seeds])
                      if paired else None, welch_p(list(a.values()), list(b.values())), mdd, needed)


def at_chance(samples: Mapping[str, Mapping[object, float]], chance: float) -> bool:
    """Every architecture within noise of ``chance``: none differs from it by a one-sample t-test over its seeds,
    Holm-corrected over the architectures (with ten of them, one would pass an uncorrected 5 % test by luck four
    times in ten); seeds that agree exactly differ from chance unless they equal it."""
    pvalues = []
    for values in samples.values():
        array = np.asarray(list(values.values()), dtype=float)
        if len(array) < 2:
            return False
        if array.std(ddof=1) == 0:
            pvalues.append(1.0 if array.mean() == chance else 0.0)
        else:
            pvalues.append(float(stats.ttest_1samp(array, chance).pvalue))
    return all(p >= SIGNIFICANCE for p in holm(pvalues))


OUTCOMES = ("held", "contradicted", "not resolved", "not measurable at this scale", "could not be checked")


@dataclass
class Verdict:
    """One claim: its ``outcome`` (one of :data:`OUTCOMES`) and the comparisons behind it; ``key`` names the claim
    where its sentence cannot (an MLflow tag, say), set by whoever states it."""

    claim: str
    outcome: str
    detail: str
    comparisons: list[Comparison] = field(default_factory=list)
    key: str = ""

    def sentence(self) -> str:
        return f"{self.claim}: **{self.outcome}**. {self.detail}"

    def decide(self) -> Verdict:
        """The outcome from the comparisons once their Holm-adjusted p-values are set."""
        if self.outcome in ("held", "contradicted", "not resolved"):
            if all(c.significant and c.gain > 0 for c in self.comparisons):
                self.outcome = "held"
            elif any(c.significant and c.gain < 0 for c in self.comparisons):
                self.outcome = "contradicted"
            else:
                self.outcome = "not resolved"
            self.detail += " " + "; ".join(comparison_text(c) for c in self.comparisons) + "."
        return self


def comparison_text(c: Comparison) -> str:
    seeds = "" if c.seeds_needed is None else \
        f"about {c.seeds_needed}" if c.seeds_needed <= MANY_SEEDS else f"more than {MANY_SEEDS:,}"
    needed = "" if c.significant or not seeds else f", {seeds} seeds a side would resolve {abs(c.gain):.3g}"
    used = "the paired test" if c.paired else "Welch"
    return (f"{c.better} vs {c.worse}: {c.gain:+.3g} in the claimed direction, paired p {format_p(c.paired_p)}, "
            f"Welch p {format_p(c.welch_p)} (the verdict uses {used}, Holm-adjusted {format_p(c.p_adjusted)}), "
            f"minimum detectable difference "
            f"{'—' if c.mdd is None else f'{c.mdd:.3g}'}{needed}")


def decide_all(verdicts: Sequence[Verdict]) -> list[Verdict]:
    """Holm over every comparison of every claim, then each claim's outcome."""
    comparisons = [c for v in verdicts for c in v.comparisons]
    for c, q in zip(comparisons, holm([c.p for c in comparisons]), strict=True):
        c.p_adjusted = q
    return [v.decide() for v in verdicts]


def _describe(name: str, values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    return f"{name} {mean:.4f}" + (f" ± {std:.2g}" if std is not None else "") + f" (n={len(values)})"


def ordering_verdict(samples: Mapping[str, Mapping[object, float]], order: Sequence[str], claim: str,
                     lower_is_better: bool = True, labels: Mapping[str, str] | None = None,
                     chance: float | None = None) -> Verdict:
    """The claim that the measure follows ``order`` (best first), one comparison per adjacent pair; undecided
    until :func:`decide_all`."""
    name = {k: (labels or {}).get(k, k) for k in samples.keys() | set(order)}
    comparisons = [compare(a, b, samples, lower_is_better) for a, b in zip(order, order[1:], strict=False)]
    if None in comparisons:
        short = [name[k] for k in order if len(samples.get(k, {})) < 2]
        return Verdict(claim, "could not be checked", f"Fewer than two values for {', '.join(short)}.")
    sign = 1 if lower_is_better else -1
    present = sorted(samples, key=lambda k: sign * float(np.mean(list(samples[k].values()))))
    observed = (" < " if lower_is_better else " > ").join(name[k] for k in present if k in order)
    means = f"Means: {'; '.join(_describe(name[k], list(samples[k].values())) for k in order)}."
    if chance is not None and at_chance(samples, chance):
        return Verdict(claim, "not measurable at this scale",
                       f"{means} Every architecture is within noise of chance ({chance:g}): nothing was measured.")
    for c in comparisons:
        c.better, c.worse = name[c.better], name[c.worse]
    return Verdict(claim, "not resolved", f"{means} Observed order: {observed}.", comparisons)


def best_verdict(samples: Mapping[str, Mapping[object, float]], best: str, claim: str, higher_is_better: bool = True,
                 labels: Mapping[str, str] | None = None, chance: float | None = None) -> Verdict:
    """The claim that ``best`` beats the strongest other architecture (by mean)."""
    present = {k: v for k, v in samples.items() if len(v) >= 2}
    if best not in present or len(present) < 2:
        name = {k: (labels or {}).get(k, k) for k in samples}
        found = ", ".join(name[k] for k in present) or "none"
        return Verdict(claim, "could not be checked",
                       f"Two values or more are needed for {name.get(best, best)} and one other; found {found}.")
    sign = -1 if higher_is_better else 1
    rank = sorted(present, key=lambda k: sign * float(np.mean(list(present[k].values()))))
    runner_up = next(k for k in rank if k != best)
    verdict = ordering_verdict(present, [best, runner_up], claim, lower_is_better=not higher_is_better,
                               labels=labels, chance=chance)
    verdict.detail += f" Ranking: {', '.join((labels or {}).get(k, k) for k in rank)}."
    return verdict
