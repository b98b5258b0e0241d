"""Learning-rate transfer: per shape a least-squares quadratic of the final validation loss against log2(lr), its
optimum with a bootstrap interval, and per series (an architecture under a parametrisation) whether the optimum
stays put across the width and depth series. The report's section is :mod:`satlab.studies.lr_transfer_report`.

The bootstrap resamples seeds within each learning rate (a seed is one training run: the unit that is replicated),
keeping each point's count, refits, and takes the percentile interval of the refitted optima. With two or three
seeds a point, plain resampling understates the spread of a point's mean by the factor (n - 1) / n (a sample of two
resampled with replacement repeats one value half the time), so each resampled value is moved away from its point's
mean by sqrt(n / (n - 1)), which makes the resampled mean's variance the usual unbiased s^2 / n (Davison & Hinkley,
*Bootstrap Methods and their Application*, 1997, section 3.3's modified residuals), and further by t / z at the
interval's tail with the seeds' degrees of freedom (sum of n - 1 over the learning rates: the noise is estimated
from that few), Hesterberg's expanded percentile interval (*What teachers should know about the bootstrap*, The
American Statistician 69, 2015). ``tests/test_lr_transfer.py`` measures the coverage this gives on synthetic curves
of a known optimum (about 0.82 at two seeds a point, 0.88 at three, for a nominal 0.9), and the plain resampling's
shortfall (about 0.6 at two seeds).

An optimum is reported only inside the swept range: a fit that curves down (c <= 0) has no minimum, and one whose
vertex lies beyond the smallest or largest learning rate swept is an extrapolation; both are stated as such.

One parabola over the whole sweep is a model of the curve, and short runs break it: their loss rises steeply below
the optimum and slowly, sometimes not at all, above it, so the vertex is pulled towards the flat side and the
bootstrap, which sees only seed noise, gives it a tight interval anyway. :func:`lack_of_fit_p` tests the parabola
against the seeds' own scatter (the pure-error F test of a replicated design; Draper & Smith, *Applied Regression
Analysis*, 3rd ed., section 2.1). :func:`local_optimum` is the alternative that assumes the curve is a parabola only
near its minimum: the vertex of the parabola through the mean losses at the best learning rate and its two
neighbours, the best learning rate picked again in every bootstrap resample, so the interval includes that choice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

INTERIOR, NO_MINIMUM, BELOW, ABOVE = "interior", "no interior minimum", "below the swept range", "above the swept range"


@dataclass(frozen=True)
class QuadraticFit:
    """y = a + b x + c x^2 by least squares; ``residual_sd`` is sqrt(SSR / (n - 3)), ``std_errors`` those of a, b,
    c (from the residual variance), ``r_squared`` against the mean."""

    a: float
    b: float
    c: float
    residual_sd: float
    std_errors: tuple[float, float, float]
    r_squared: float
    n: int


def fit_quadratic(x: Sequence[float], y: Sequence[float]) -> QuadraticFit:
    """The least-squares quadratic through (x, y), solved on x centred and scaled (x^2 of raw values such as
    NIST's Pontius loads, 1e5 to 3e6, would leave the normal equations near singular) and mapped back."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.size < 4 or len(np.unique(xs)) < 3:
        raise ValueError(f"a quadratic fit with a residual needs at least 3 distinct x and 4 points, got {xs.size} "
                         f"points at {len(np.unique(xs))} x")
    m, s = float(xs.mean()), float(xs.std()) or 1.0
    t = (xs - m) / s
    design = np.stack([np.ones_like(t), t, t * t], axis=1)
    coef, *_ = np.linalg.lstsq(design, ys, rcond=None)
    residuals = ys - design @ coef
    ssr = float(residuals @ residuals)
    dof = xs.size - 3
    variance = ssr / dof
    # back to raw x: a0 + a1 t + a2 t^2 with t = (x - m) / s
    to_raw = np.array([[1, -m / s, m * m / (s * s)], [0, 1 / s, -2 * m / (s * s)], [0, 0, 1 / (s * s)]])
    raw = to_raw @ coef
    covariance = to_raw @ (variance * np.linalg.inv(design.T @ design)) @ to_raw.T
    sst = float(((ys - ys.mean()) ** 2).sum())
    return QuadraticFit(float(raw[0]), float(raw[1]), float(raw[2]), math.sqrt(variance),
                        tuple(float(v) for v in np.sqrt(np.diag(covariance))),  # type: ignore[arg-type]
                        1 - ssr / sst if sst > 0 else 1.0, int(xs.size))


def vertex(b: np.ndarray | float, c: np.ndarray | float, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """The minimum -b / (2c) of each fit and its status: ``INTERIOR``, ``NO_MINIMUM`` (c <= 0: NaN), ``BELOW`` or
    ``ABOVE`` the range [low, high] (-inf or +inf: never a value outside the sweep)."""
    b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(c > 0, -b / (2 * c), np.nan)
    status = np.full(x.shape, INTERIOR, dtype=object)
    status[~(c > 0)] = NO_MINIMUM
    status[(c > 0) & (x < low)], status[(c > 0) & (x > high)] = BELOW, ABOVE
    x = np.where(status == BELOW, -np.inf, np.where(status == ABOVE, np.inf, x))
    return x, status


@dataclass(frozen=True)
class Optimum:
    """A shape's optimum in log2(lr): the fit's, its status, and the bootstrap interval (None when more than
    1 - level of the resamples had no minimum at all; a bound beyond the sweep is -inf or +inf)."""

    log2_lr: float | None
    status: str
    interval: tuple[float, float] | None
    fit: QuadraticFit
    no_minimum_share: float
    seeds: int
    window: tuple[float, float] = (-math.inf, math.inf)
    """The log2 learning rates the fit used (the whole sweep, or the local fit's three)."""
    lack_of_fit_p: float | None = None
    """The pure-error F test of a fit to more than three learning rates (None without the degrees of freedom)."""

    @property
    def lr(self) -> float | None:
        return None if self.log2_lr is None else 2.0 ** self.log2_lr


def points_arrays(points: Mapping[float, Sequence[float]]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(log2 lr per observation, loss per observation, the observations' indices per learning rate)."""
    x, y, index = [], [], []
    for lr, losses in sorted(points.items()):
        index.append(np.arange(len(y), len(y) + len(losses)))
        x += [math.log2(lr)] * len(losses)
        y += list(losses)
    return np.array(x), np.array(y, dtype=float), index


def resampled_losses(y: np.ndarray, index: Sequence[np.ndarray], resamples: int, rng: np.random.Generator,
                     level: float = 0.9, adjust: bool = True) -> np.ndarray:
    """``resamples`` columns of the losses, each learning rate's seeds drawn with replacement from its own; with
    ``adjust`` each draw is pushed from its point's mean by sqrt(n / (n - 1)) and t / z (the module docstring)."""
    out = np.empty((y.size, resamples))
    dof = sum(rows.size - 1 for rows in index)
    tail = 1 - (1 - level) / 2
    expand = float(stats.t.ppf(tail, dof) / stats.norm.ppf(tail)) if dof > 0 else 1.0
    for rows in index:
        values = y[rows]
        draws = values[rng.integers(0, rows.size, size=(rows.size, resamples))]
        if adjust and rows.size > 1:
            mean = values.mean()
            draws = mean + (draws - mean) * math.sqrt(rows.size / (rows.size - 1)) * expand
        out[rows] = draws
    return out


def optimum(points: Mapping[float, Sequence[float]], level: float = 0.9, resamples: int = 2000, seed: int = 0,
            adjust: bool = True) -> Optimum:
    """The shape's optimum from ``points`` (learning rate -> the final losses of its seeds)."""
    x, y, index = points_arrays(points)
    fit = fit_quadratic(x, y)
    low, high = float(x.min()), float(x.max())
    best, status = vertex(fit.b, fit.c, low, high)
    rng = np.random.default_rng(seed)
    draws = resampled_losses(y, index, resamples, rng, level, adjust)
    t = (x - x.mean()) / (x.std() or 1.0)
    design = np.stack([np.ones_like(t), t, t * t], axis=1)
    coef = np.linalg.lstsq(design, draws, rcond=None)[0]  # every resample at once: one design, many columns
    s, m = x.std() or 1.0, x.mean()
    b, c = coef[1] / s - 2 * coef[2] * m / (s * s), coef[2] / (s * s)
    optima, _ = vertex(b, c, low, high)
    interval, lacking = percentile_interval(optima, level)
    value = float(best) if status == INTERIOR else None
    seeds = min(len(i) for i in index)
    return Optimum(value, str(status), interval, fit, lacking, seeds, (low, high), lack_of_fit_p(x, y, index, fit))


def percentile_interval(optima: np.ndarray, level: float) -> tuple[tuple[float, float] | None, float]:
    """(the percentile interval of the resampled optima, None when more than 1 - level had no minimum; that share)."""
    lacking = float(np.isnan(optima).mean())
    if lacking > 1 - level:
        return None, lacking
    ordered = np.sort(optima[~np.isnan(optima)])
    tail = (1 - level) / 2
    lower = ordered[int(math.floor(tail * ordered.size))]
    upper = ordered[max(int(math.ceil((1 - tail) * ordered.size)) - 1, 0)]
    return (float(lower), float(upper)), lacking


def lack_of_fit_p(x: np.ndarray, y: np.ndarray, index: Sequence[np.ndarray], fit: QuadraticFit) -> float | None:
    """The p-value of the quadratic's lack of fit: its residual sum of squares split into the seeds' scatter about
    their learning rate's mean (pure error, n - k degrees of freedom) and the rest (k - 3), compared by F. A small p
    says the curve is not a parabola at the precision the seeds give. None with one seed everywhere or three
    learning rates (no degrees of freedom for one of the two)."""
    pure = float(sum(((y[rows] - y[rows].mean()) ** 2).sum() for rows in index))
    pure_dof, lack_dof = y.size - len(index), len(index) - 3
    if pure_dof < 1 or lack_dof < 1 or pure <= 0:
        return None
    lack = max(fit.residual_sd ** 2 * (y.size - 3) - pure, 0.0)
    return float(stats.f.sf((lack / lack_dof) / (pure / pure_dof), lack_dof, pure_dof))


def three_point_vertex(x: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c, b, a) of the parabola through three points per column: ``x`` and ``m`` are (3, R)."""
    (x0, x1, x2), (m0, m1, m2) = x, m
    denominator = (x0 - x1) * (x0 - x2) * (x1 - x2)
    c = (x2 * (m1 - m0) + x1 * (m0 - m2) + x0 * (m2 - m1)) / denominator
    b = (x2 ** 2 * (m0 - m1) + x1 ** 2 * (m2 - m0) + x0 ** 2 * (m1 - m2)) / denominator
    a = m0 - b * x0 - c * x0 ** 2
    return c, b, a


def local_vertex(levels: np.ndarray, means: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``means`` (learning rates x resamples): the vertex of the parabola through the lowest mean and
    its two neighbours, and its status; at the first or last learning rate the optimum is not located (BELOW or
    ABOVE, -inf or +inf). Also the best learning rate's index."""
    best = np.argmin(means, axis=0)
    middle = np.clip(best, 1, levels.size - 2)
    rows = np.stack([middle - 1, middle, middle + 1])
    columns = np.arange(means.shape[1])
    c, b, _ = three_point_vertex(levels[rows], means[rows, columns])
    optima, status = vertex(b, c, float(levels[0]), float(levels[-1]))
    status[best == 0], status[best == levels.size - 1] = BELOW, ABOVE
    optima = np.where(best == 0, -np.inf, np.where(best == levels.size - 1, np.inf, optima))
    return optima, status, best


def local_optimum(points: Mapping[float, Sequence[float]], level: float = 0.9, resamples: int = 2000, seed: int = 0,
                  adjust: bool = True) -> Optimum:
    """The shape's optimum near its best learning rate (the module docstring): the parabola through the mean losses
    at the best swept learning rate and its neighbours; the bootstrap resamples seeds as :func:`optimum` does and
    picks the best learning rate again in each resample. An optimum at the first or last learning rate swept is
    not located (BELOW or ABOVE)."""
    x, y, index = points_arrays(points)
    levels = np.array([x[rows[0]] for rows in index])
    means = np.array([[y[rows].mean()] for rows in index])
    best_x, status, best = local_vertex(levels, means)
    middle = int(np.clip(best[0], 1, levels.size - 2))
    window = levels[middle - 1:middle + 2]
    c, b, a = three_point_vertex(window[:, None], means[middle - 1:middle + 2])
    chosen = np.concatenate([index[i] for i in range(middle - 1, middle + 2)])
    pure = sum(((y[index[i]] - y[index[i]].mean()) ** 2).sum() for i in range(middle - 1, middle + 2))
    dof = chosen.size - 3
    fit = QuadraticFit(float(a[0]), float(b[0]), float(c[0]), math.sqrt(pure / dof) if dof > 0 else math.nan,
                       (math.nan, math.nan, math.nan), 1.0, int(chosen.size))
    draws = resampled_losses(y, index, resamples, np.random.default_rng(seed), level, adjust)
    resampled_means = np.stack([draws[rows].mean(axis=0) for rows in index])
    optima, _, _ = local_vertex(levels, resampled_means)
    interval, lacking = percentile_interval(optima, level)
    value = float(best_x[0]) if status[0] == INTERIOR else None
    return Optimum(value, str(status[0]), interval, fit, lacking, min(len(i) for i in index),
                   (float(window[0]), float(window[-1])))


@dataclass(frozen=True)
class SeriesVerdict:
    """One series' verdict: ``transfers`` when every shape's interval lies within ±tolerance of the base
    optimum, ``does not transfer`` otherwise (the shapes listed in ``outside``), ``not measurable`` without a base
    optimum; and the shift of the optimum from the first to the last shape of the width and of the depth series
    (octaves; None when an end has no interior optimum)."""

    outcome: str
    base_log2_lr: float | None
    outside: tuple[str, ...]
    width_shift: float | None
    depth_shift: float | None


def within(interval: tuple[float, float] | None, centre: float, tolerance: float) -> bool:
    return interval is not None and centre - tolerance <= interval[0] and interval[1] <= centre + tolerance


def series_verdict(optima: Mapping[str, Optimum], base: str, width_series: Sequence[str],
                   depth_series: Sequence[str], tolerance: float) -> SeriesVerdict:
    """The verdict over the shapes of ``optima`` (shape label -> optimum), ``base`` one of them; the series are
    shape labels from the smallest to the largest."""
    def shift(series: Sequence[str]) -> float | None:
        ends = [optima[s].log2_lr for s in (series[0], series[-1])] if len(series) > 1 else [None]
        return None if None in ends else float(ends[1] - ends[0])  # type: ignore[operator]

    reference = optima[base].log2_lr if base in optima else None
    if reference is None:
        return SeriesVerdict("not measurable", None, (), shift(width_series), shift(depth_series))
    outside = tuple(s for s, o in optima.items() if not within(o.interval, reference, tolerance))
    return SeriesVerdict("does not transfer" if outside else "transfers", reference, outside,
                         shift(width_series), shift(depth_series))
