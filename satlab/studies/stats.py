"""Statistics of an ablation report: mean ± std over seeds, Welch's t-test, and the paper's ordering claims.

A claim is checked on the numbers it is given, never assumed: an ordering that the means do not show is reported
as not holding, and p-values come from Welch's unequal-variance t-test (two-sided) over the seeds.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

SIGNIFICANCE = 0.05


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation); the std is None for fewer than two values, both None for none."""
    if not values:
        return None, None
    array = np.asarray(values, dtype=float)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else None


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test between two samples; None when either has fewer than two values or the
    test is undefined (both samples constant)."""
    if len(a) < 2 or len(b) < 2:
        return None
    with warnings.catch_warnings():  # scipy warns on a constant sample (seeds that agree exactly): not news here
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(stats.ttest_ind(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_var=False).pvalue)
    return None if math.isnan(p) else p


def format_p(p: float | None) -> str:
    if p is None:
        return "—"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


@dataclass
class Verdict:
    """One claim: ``held`` is True or False, or None when the numbers to check it are missing."""

    claim: str
    held: bool | None
    detail: str

    def sentence(self) -> str:
        outcome = {True: "**held**", False: "**did not hold**", None: "**could not be checked**"}[self.held]
        return f"{self.claim}: {outcome}. {self.detail}"


def _describe(name: str, values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    return f"{name} {mean:.4f}" + (f" ± {std:.2g}" if std is not None else "") + f" (n={len(values)})"


def ordering_verdict(samples: Mapping[str, Sequence[float]], order: Sequence[str], claim: str,
                     lower_is_better: bool = True, labels: Mapping[str, str] | None = None) -> Verdict:
    """Whether the means follow ``order`` (best first: strictly lower, or higher with ``lower_is_better=False``),
    with Welch's p for each adjacent pair."""
    labels = labels or {}
    name = {k: labels.get(k, k) for k in order}
    missing = [name[k] for k in order if not samples.get(k)]
    if missing:
        return Verdict(claim, None, f"No values for {', '.join(missing)}.")
    means = {k: mean_std(samples[k])[0] for k in order}
    sign = 1 if lower_is_better else -1
    held = all(sign * means[a] < sign * means[b] for a, b in zip(order, order[1:], strict=False))
    observed = sorted(order, key=lambda k: sign * means[k])
    pairs = []
    for a, b in zip(order, order[1:], strict=False):
        p = welch_p(samples[a], samples[b])
        note = "" if p is None else " (significant)" if p < SIGNIFICANCE else " (not significant)"
        pairs.append(f"{name[a]} vs {name[b]}: Welch p = {format_p(p)}{note}")
    relation = " < " if lower_is_better else " > "
    detail = (f"Means: {'; '.join(_describe(name[k], samples[k]) for k in order)}. "
              f"Observed order: {relation.join(name[k] for k in observed)}. {'; '.join(pairs)}.")
    return Verdict(claim, held, detail)


def best_verdict(samples: Mapping[str, Sequence[float]], best: str, claim: str, higher_is_better: bool = True,
                 labels: Mapping[str, str] | None = None) -> Verdict:
    """Whether ``best`` has the best mean of all samples given, with Welch's p against the strongest other."""
    labels = labels or {}
    present = {k: v for k, v in samples.items() if v}
    if best not in present or len(present) < 2:
        return Verdict(claim, None, f"Values for {labels.get(best, best)} and at least one other are needed; "
                                    f"found {', '.join(labels.get(k, k) for k in present) or 'none'}.")
    sign = -1 if higher_is_better else 1
    means = {k: mean_std(v)[0] for k, v in present.items()}
    runner_up = min((k for k in present if k != best), key=lambda k: sign * means[k])
    held = sign * means[best] < sign * means[runner_up]
    p = welch_p(present[best], present[runner_up])
    note = "" if p is None else " (significant)" if p < SIGNIFICANCE else " (not significant)"
    ranking = sorted(present, key=lambda k: sign * means[k])
    detail = (f"{_describe(labels.get(best, best), present[best])} vs the strongest other, "
              f"{_describe(labels.get(runner_up, runner_up), present[runner_up])}: Welch p = {format_p(p)}{note}. "
              f"Ranking: {', '.join(labels.get(k, k) for k in ranking)}.")
    return Verdict(claim, held, detail)
