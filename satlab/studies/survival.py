"""Censored time-to-event statistics in numpy/scipy: the Kaplan-Meier estimate with Greenwood's variance, its median
with the Brookmeyer-Crowley interval (log-log transform), the restricted mean with its variance, and the Wilson
interval of a proportion.

A recall run's time-to-bind (``recall/steps_to_bind``) is an event time: the step at which held-out accuracy first
reached the bind threshold, or, for a run that never did, a censoring time (the run's last step, its budget). The
estimates here treat the censored runs as "not bound by then", not as "bound then", which a plain mean of the steps
would do. Conventions are those of R's ``survival::survfit`` (``conf.type = "log-log"``): at a tied time events come
before censorings; the median is the first time the survival curve is at or below 0.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm


@dataclass(frozen=True)
class KaplanMeier:
    """The estimate at each distinct event time: ``survival[i]`` is S just after ``times[i]`` (the fraction not yet
    bound), ``greenwood[i]`` the cumulative sum of d / (n (n - d)) up to it (Greenwood: Var S = S^2 x that sum)."""

    times: np.ndarray
    at_risk: np.ndarray
    events: np.ndarray
    survival: np.ndarray
    greenwood: np.ndarray
    n: int

    def at(self, t: float) -> float:
        """S(t): the fraction with no event by time ``t`` (right-continuous step function)."""
        i = np.searchsorted(self.times, t, side="right")
        return 1.0 if i == 0 else float(self.survival[i - 1])

    def std_error(self) -> np.ndarray:
        """Greenwood's standard error of S at each event time."""
        return self.survival * np.sqrt(self.greenwood)

    def interval(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """The pointwise interval of S at each event time through the log-log transform (inside [0, 1] by
        construction): S^exp(+-z se), se = sqrt(greenwood) / |log S|; S = 1 or 0 give a degenerate interval."""
        z = norm.ppf(0.5 + level / 2)
        s = self.survival
        lower, upper = s.copy(), s.copy()
        inside = (s > 0) & (s < 1) & np.isfinite(self.greenwood)
        se = np.sqrt(self.greenwood[inside]) / np.abs(np.log(s[inside]))
        lower[inside] = s[inside] ** np.exp(z * se)
        upper[inside] = s[inside] ** np.exp(-z * se)
        return lower, upper


def kaplan_meier(durations: Sequence[float], observed: Sequence[bool | float]) -> KaplanMeier:
    """The Kaplan-Meier estimate of ``durations`` where ``observed`` marks an event (true) or a censoring (false)."""
    time = np.asarray(durations, dtype=float)
    event = np.asarray(observed, dtype=float) > 0
    if time.shape != event.shape or time.ndim != 1 or time.size == 0:
        raise ValueError(f"kaplan_meier needs two equally long non-empty lists, got {time.shape} and {event.shape}")
    times = np.unique(time[event])
    at_risk = np.array([(time >= t).sum() for t in times], dtype=float)
    events = np.array([((time == t) & event).sum() for t in times], dtype=float)
    survival = np.cumprod(1.0 - events / at_risk)
    with np.errstate(divide="ignore"):
        greenwood = np.cumsum(np.where(at_risk > events, events / (at_risk * (at_risk - events)), np.inf))
    return KaplanMeier(times, at_risk, events, survival, greenwood, int(time.size))


def median_time(km: KaplanMeier, level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """(median, lower, upper): the first time S <= 0.5, and Brookmeyer and Crowley's interval, the times whose
    log-log interval of S holds 0.5: from the first time the lower bound is <= 0.5 to the first time the upper bound
    is. None where the curve (or the bound) never gets to 0.5 within the follow-up (a median not reached, or an
    interval open to the right)."""
    lower, upper = km.interval(level)

    def first(values: np.ndarray) -> float | None:
        hit = np.flatnonzero(values <= 0.5 + 1e-12)
        return float(km.times[hit[0]]) if hit.size else None

    return first(km.survival), first(lower), first(upper)


def restricted_mean(km: KaplanMeier, tau: float, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper): the restricted mean time to the event, the area under S from 0 to ``tau``, with the
    normal interval of its variance sum over event times t_i <= tau of A_i^2 d_i / (n_i (n_i - d_i)), A_i the area
    under S from t_i to tau (Klein and Moeschberger, 4.5). Censored at tau, it is the mean of min(time, tau)."""
    keep = km.times <= tau
    times, survival = km.times[keep], km.survival[keep]
    edges = np.concatenate([[0.0], times, [tau]])
    heights = np.concatenate([[1.0], survival])
    pieces = heights * np.diff(edges)
    mean = float(pieces.sum())
    tails = np.cumsum(pieces[::-1])[::-1][1:]  # A_i: the area from times[i] to tau
    d, n = km.events[keep], km.at_risk[keep]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(tails > 0, tails ** 2 * d / (n * (n - d)), 0.0)
    half = float(norm.ppf(0.5 + level / 2) * np.sqrt(terms.sum()))
    return mean, mean - half, mean + half


def wilson(successes: int, n: int, level: float = 0.95) -> tuple[float, float, float]:
    """(proportion, lower, upper): the Wilson score interval of ``successes`` out of ``n``."""
    if n <= 0:
        raise ValueError(f"wilson needs n >= 1, got {n}")
    z = norm.ppf(0.5 + level / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return p, max(0.0, float(centre - half)), min(1.0, float(centre + half))
