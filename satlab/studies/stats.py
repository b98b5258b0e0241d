"""Statistics of an ablation report: mean ± std over seeds, Welch's t-test (two-sided), and the paper's claims
checked on the numbers given, never assumed: an order that the means do not show is reported as not holding."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

SIGNIFICANCE = 0.05


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


def _welch_text(a: Sequence[float], b: Sequence[float]) -> str:
    p = welch_p(a, b)
    return f"Welch p = {format_p(p)}" + ("" if p is None else " (significant)" if p < SIGNIFICANCE else
                                         " (not significant)")


def ordering_verdict(samples: Mapping[str, Sequence[float]], order: Sequence[str], claim: str,
                     lower_is_better: bool = True, labels: Mapping[str, str] | None = None) -> Verdict:
    """Whether the means follow ``order`` (best first), with Welch's p for each adjacent pair."""
    name = {k: (labels or {}).get(k, k) for k in order}
    if missing := [name[k] for k in order if not samples.get(k)]:
        return Verdict(claim, None, f"No values for {', '.join(missing)}.")
    sign = 1 if lower_is_better else -1
    means = {k: sign * mean_std(samples[k])[0] for k in order}
    pairs = list(zip(order, order[1:], strict=False))
    observed = (" < " if lower_is_better else " > ").join(name[k] for k in sorted(order, key=means.get))
    detail = (f"Means: {'; '.join(_describe(name[k], samples[k]) for k in order)}. Observed order: {observed}. "
              + "; ".join(f"{name[a]} vs {name[b]}: {_welch_text(samples[a], samples[b])}" for a, b in pairs) + ".")
    return Verdict(claim, all(means[a] < means[b] for a, b in pairs), detail)


def best_verdict(samples: Mapping[str, Sequence[float]], best: str, claim: str, higher_is_better: bool = True,
                 labels: Mapping[str, str] | None = None) -> Verdict:
    """Whether ``best`` has the best mean of all samples given, with Welch's p against the strongest other."""
    name = {k: (labels or {}).get(k, k) for k in samples}
    present = {k: v for k, v in samples.items() if v}
    if best not in present or len(present) < 2:
        return Verdict(claim, None, f"Values for {name[best]} and at least one other are needed; "
                                    f"found {', '.join(name[k] for k in present) or 'none'}.")
    sign = -1 if higher_is_better else 1
    means = {k: sign * mean_std(v)[0] for k, v in present.items()}
    runner_up = min((k for k in present if k != best), key=means.get)
    detail = (f"{_describe(name[best], present[best])} vs the strongest other, "
              f"{_describe(name[runner_up], present[runner_up])}: {_welch_text(present[best], present[runner_up])}. "
              f"Ranking: {', '.join(name[k] for k in sorted(present, key=means.get))}.")
    return Verdict(claim, means[best] < means[runner_up], detail)
