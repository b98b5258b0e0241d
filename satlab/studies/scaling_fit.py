"""Scaling-law fits with bootstrap intervals, and the compute multiplier of one architecture against a reference.

The law is Chinchilla's L(N, D) = E + A / N**alpha + B / D**beta (N parameters, D training tokens), fitted as
Hoffmann et al. (2022) and Besiroglu et al. (2024) did: the Huber loss (delta 1e-3) of log L minus the log of the
prediction written as a log-sum-exp, LSE(a - alpha log N, b - beta log D, e) with A = e^a, B = e^b, E = e^e, minimised
by L-BFGS from every start of a grid, the best objective winning. The grid's starts run together as one batch
(:mod:`satlab.studies.scaling_lbfgs`) so the 4,500-start grid takes seconds, and the best few are polished with
scipy's L-BFGS-B.

Uncertainty comes from the bootstrap over RUNS: every point (token budget) of a drawn run enters the resample
together, since the points of one run share its seed and are not independent. A resample is the same data with each
point weighted by how often its run was drawn, and its refit starts from the full fit's optimum and a few grid
starts, so thousands of refits cost about as much as one grid fit.

The compute multiplier of a law against a reference at compute C is the compute the reference needs to reach the
law's compute-optimal loss at C, divided by C (> 1: the law is better). Its interval pairs the i-th bootstrap fit of
each side (each side resampled on its own runs), and :func:`claim` turns the interval into the report's verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from satlab.studies.scaling_lbfgs import batched_lbfgs, huber_lse

FlopsPerToken = Callable[[np.ndarray], np.ndarray]
SORTABLE_INF = 1e300
"""An infinite log multiplier (a loss the reference never reaches) is held as ±this, so that bootstrap values sort."""
UNBOUNDED_SLOPE = SORTABLE_INF * 1e-50
"""A trend slope this large went through a held infinity: it is reported as ±inf."""
CLAIM_LEVEL = 0.9  # the claim rule reads the 90 % interval: a one-sided 5 % test either way
PARAMETERS = ("A", "B", "E", "alpha", "beta")


def six_n(N: np.ndarray) -> np.ndarray:
    """Training FLOPs per token of the usual approximation: 6 N (forward and backward, no attention or output)."""
    return 6.0 * np.asarray(N, dtype=float)


@dataclass(frozen=True)
class StartGrid:
    """Starting points: every combination of a coefficient value for each log-coefficient (a, b), an e value and an
    exponent value for each exponent (alpha, beta)."""

    coef: tuple[float, ...]
    e: tuple[float, ...]
    exponent: tuple[float, ...]

    def points(self, k: int) -> np.ndarray:
        """(starts, 2k + 1) rows [coef_1..coef_k, e, exponent_1..exponent_k]."""
        axes = [self.coef] * k + [self.e] + [self.exponent] * k
        return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 2 * k + 1).astype(float)


# Hoffmann et al. 2022 (Approach 3), as Besiroglu et al. 2024 reran it: a, b in {0, 5, ..., 25},
# e in {-1, -0.5, ..., 1}, alpha, beta in {0, 0.5, ..., 2}: 4,500 starts.
HOFFMANN_GRID = StartGrid(coef=(0.0, 5.0, 10.0, 15.0, 20.0, 25.0), e=(-1.0, -0.5, 0.0, 0.5, 1.0),
                          exponent=(0.0, 0.5, 1.0, 1.5, 2.0))
# Every other value of Hoffmann's axes: 3 x 3 x 3 x 3 x 3 = 243 starts, about 18 times faster, for quick looks at a
# partial ladder (`ladder.fit.grid: coarse`); the report names the grid it used.
COARSE_GRID = StartGrid(coef=(0.0, 10.0, 20.0), e=(-1.0, 0.0, 1.0), exponent=(0.0, 1.0, 2.0))
GRIDS = {"hoffmann": HOFFMANN_GRID, "coarse": COARSE_GRID}
# The single-variable L(C) law: compute exponents are small (~0.05-0.2), so the exponent axis is finer near 0.
COMPUTE_GRID = StartGrid(coef=(0.0, 5.0, 10.0, 15.0, 20.0, 25.0), e=(-1.0, -0.5, 0.0, 0.5, 1.0),
                         exponent=(0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0))


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A / N**alpha + B / D**beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, N: np.ndarray | float, D: np.ndarray | float) -> np.ndarray:
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N**self.alpha + self.B / D**self.beta

    def optimum(self, C: float, flops_per_token: FlopsPerToken = six_n) -> tuple[float, float, float]:
        """(N*, D*, L*): the loss minimised over N with D = C / flops_per_token(N)."""
        n, d, loss = optimal_points(law_matrix([self]), np.array([float(C)]), flops_per_token)
        return float(n[0]), float(d[0]), float(loss[0])


@dataclass(frozen=True)
class RunPoints:
    """One training run: its parameter count and the (tokens, loss) points it gave (one per decay point/budget)."""

    run: str
    N: float
    D: tuple[float, ...]
    L: tuple[float, ...]
    seed: int | None = None  # which seed of its size it is, where known (a backtest may judge some seeds only)


@dataclass(frozen=True)
class Interval:
    """A point estimate (from the full fits) and a percentile interval at `level` (from the bootstrap fits)."""

    point: float
    lower: float
    upper: float
    level: float


def claim(interval: Interval) -> str:
    """The report's verdict on a multiplier interval (meant for the CLAIM_LEVEL = 0.9 interval): "gain" when its
    lower bound is above 1, "loss" when its upper bound is below 1, "not resolved" otherwise."""
    if interval.lower > 1.0:
        return "gain"
    if interval.upper < 1.0:
        return "loss"
    return "not resolved"


def law_matrix(laws: Sequence[ScalingLaw]) -> np.ndarray:
    """One row [A, B, E, alpha, beta] per law: what the vectorised functions here take."""
    return np.array([[law.A, law.B, law.E, law.alpha, law.beta] for law in laws], dtype=float).reshape(-1, 5)


def law_from_theta(theta: np.ndarray) -> ScalingLaw:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return ScalingLaw(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)


def _check_runs(runs: Sequence[RunPoints]) -> None:
    valid = ("Valid: at least 3 runs with distinct parameter counts N, at least 3 distinct token counts D, more "
             "points than the law's 5 parameters, every N, D and loss finite and > 0, each run with as many "
             "losses as token counts and a name of its own.")
    problems = []
    names = [r.run for r in runs]
    if len(set(names)) != len(names):
        problems.append(f"run names repeat ({sorted({n for n in names if names.count(n) > 1})})")
    for r in runs:
        if len(r.D) != len(r.L) or not r.D:
            problems.append(f"run {r.run!r} has {len(r.D)} token counts and {len(r.L)} losses")
        values = np.array([r.N, *r.D, *r.L], dtype=float)
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            problems.append(f"run {r.run!r} has a non-positive or non-finite N, D or loss")
    if not problems:
        n_distinct = len({float(r.N) for r in runs})
        d_distinct = len({float(d) for r in runs for d in r.D})
        points = sum(len(r.D) for r in runs)
        if n_distinct < 3:
            problems.append(f"{n_distinct} distinct N (the size term needs at least 3)")
        if d_distinct < 3:
            problems.append(f"{d_distinct} distinct D (the data term needs at least 3)")
        if points <= 5:
            problems.append(f"{points} points for 5 parameters")
    if problems:
        raise ValueError(f"cannot fit a scaling law: {'; '.join(problems)}. {valid}")


def run_arrays(runs: Sequence[RunPoints]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X (points, 2) = [log N, log D], y = log L, run index of each point)."""
    logn = np.concatenate([np.full(len(r.D), np.log(r.N)) for r in runs])
    logd = np.log(np.concatenate([np.asarray(r.D, dtype=float) for r in runs]))
    y = np.log(np.concatenate([np.asarray(r.L, dtype=float) for r in runs]))
    owner = np.concatenate([np.full(len(r.D), i) for i, r in enumerate(runs)])
    return np.stack([logn, logd], axis=1), y, owner


def fit_many(X: np.ndarray, Y: np.ndarray, delta: float, grid: StartGrid, polish: int) -> np.ndarray:
    """The fit of each data set (rows of Y, log losses at the log inputs X): L-BFGS from every start of `grid`, all
    sets and starts in one batch, then scipy's L-BFGS-B from the best `polish` ends of each set; the best objective
    wins. Returns (sets, 2k + 1) parameter rows [log coefficients, e, exponents]."""
    starts = grid.points(X.shape[1])
    S = len(starts)
    ones = np.ones((1, X.shape[0]))
    ends, values = batched_lbfgs(np.tile(starts, (len(Y), 1)), X, np.repeat(Y, S, axis=0), ones, delta)
    ends, values = ends.reshape(len(Y), S, -1), np.where(np.isfinite(values), values, np.inf).reshape(len(Y), S)
    best = np.empty((len(Y), ends.shape[2]))
    for i, y in enumerate(Y):
        order = np.argsort(values[i])
        best[i], best_value = ends[i, order[0]], values[i, order[0]]
        for start in ends[i, order[:polish]]:
            res = minimize(lambda t, y=y: tuple(v[0] for v in huber_lse(t[None], X, y, ones, delta)), start,
                           jac=True, method="L-BFGS-B", options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
            if np.isfinite(res.fun) and res.fun < best_value:
                best[i], best_value = res.x, float(res.fun)
    return best


def fit_law(runs: Sequence[RunPoints], delta: float = 1e-3, grid: StartGrid | None = None,
            polish: int = 5) -> ScalingLaw:
    """The best Huber(delta) fit of log L over the starts of `grid` (Hoffmann et al.'s 4,500 by default)."""
    _check_runs(runs)
    _check_delta(delta)
    X, y, _ = run_arrays(runs)
    return law_from_theta(fit_many(X, y[None], delta, grid or HOFFMANN_GRID, polish)[0])


def _check_delta(delta: float) -> None:
    if not delta > 0:
        raise ValueError(f"the Huber delta must be > 0 (got {delta}); 1e-3 is Hoffmann et al.'s.")


def bootstrap_many(X: np.ndarray, Y: np.ndarray, owner: np.ndarray, fulls: np.ndarray, resamples: int,
                   seeds: Sequence[int], delta: float, grid: StartGrid, extra_starts: int,
                   chunk: int = 2000) -> np.ndarray:
    """Bootstrap refits of each data set (rows of Y; `owner` gives each point's run): (sets, resamples, 5)."""
    grid_starts = grid.points(X.shape[1])
    n_runs, dim = int(owner.max()) + 1, fulls.shape[1]
    k = 1 + extra_starts
    rows_y, rows_w, rows_t = [], [], []  # per (set, resample, start): its data, its weights, its start
    for i, (y, seed) in enumerate(zip(Y, seeds, strict=True)):
        start_values, _ = huber_lse(grid_starts, X, y, np.ones((1, len(y))), delta)
        starts = np.vstack([fulls[i][None], grid_starts[np.argsort(start_values)[:extra_starts]]])
        counts = np.zeros((resamples, n_runs))
        draws = np.random.default_rng(seed).integers(0, n_runs, size=(resamples, n_runs))
        np.add.at(counts, (np.arange(resamples)[:, None], draws), 1.0)
        rows_w.append(np.repeat(counts[:, owner], k, axis=0))  # a point counts as often as its run was drawn
        rows_t.append(np.tile(starts, (resamples, 1)))
        rows_y.append(np.broadcast_to(y, (resamples * k, len(y))))
    W, T, Yr = np.concatenate(rows_w), np.concatenate(rows_t), np.concatenate(rows_y)
    best = np.empty((len(W) // k, dim))
    per_chunk = max(1, chunk // k) * k
    for lo in range(0, len(W), per_chunk):
        ends, values = batched_lbfgs(T[lo:lo + per_chunk], X, Yr[lo:lo + per_chunk], W[lo:lo + per_chunk], delta)
        values = np.where(np.isfinite(values), values, np.inf).reshape(-1, k)
        best[lo // k:lo // k + len(values)] = ends.reshape(-1, k, dim)[np.arange(len(values)), values.argmin(1)]
    return best.reshape(len(Y), resamples, dim)


def bootstrap_laws(runs: Sequence[RunPoints], resamples: int, seed: int, delta: float = 1e-3,
                   full: ScalingLaw | None = None, grid: StartGrid | None = None,
                   extra_starts: int = 2) -> list[ScalingLaw]:
    """Refits of `resamples` bootstrap resamples of the RUNS (a drawn run brings all its points), reproducible from
    `seed`. Each refit starts from the full fit's optimum (`full`, fitted here when not given) and the
    `extra_starts` grid starts with the lowest objective on the full data; the best end wins."""
    _check_runs(runs)
    _check_delta(delta)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1 (got {resamples}); Besiroglu et al. used 4,000.")
    X, y, owner = run_arrays(runs)
    full = full or fit_law(runs, delta, grid)
    fits = bootstrap_many(X, y[None], owner, theta_of(full)[None], resamples, [seed], delta, grid or HOFFMANN_GRID,
                          extra_starts)
    return [law_from_theta(t) for t in fits[0]]


def theta_of(law: ScalingLaw) -> np.ndarray:
    return np.array([np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta])


def standard_errors(laws: Sequence[ScalingLaw]) -> dict[str, float]:
    """The sample standard deviation (ddof 1) of each parameter over bootstrap fits."""
    if len(laws) < 2:
        raise ValueError(f"standard errors need at least 2 bootstrap fits (got {len(laws)}).")
    return dict(zip(PARAMETERS, (float(s) for s in law_matrix(laws).std(axis=0, ddof=1)), strict=True))


def fit_compute_law(C: Sequence[float], L: Sequence[float], delta: float = 1e-3, grid: StartGrid | None = None,
                    polish: int = 5) -> tuple[float, float, float]:
    """(E, A, alpha) of the single-variable law L(C) = E + A / C**alpha, fitted like :func:`fit_law`: Huber(delta)
    on log L against LSE(a - alpha log C, e), L-BFGS from every start of `grid` (COMPUTE_GRID by default)."""
    c, loss = np.asarray(C, dtype=float).ravel(), np.asarray(L, dtype=float).ravel()
    problems = []
    if c.shape != loss.shape:
        problems.append(f"{c.size} compute values and {loss.size} losses")
    elif not (np.all(np.isfinite(c)) and np.all(np.isfinite(loss)) and np.all(c > 0) and np.all(loss > 0)):
        problems.append("a non-positive or non-finite compute or loss")
    elif len(np.unique(c)) < 3 or c.size <= 3:
        problems.append(f"{len(np.unique(c))} distinct compute values in {c.size} points")
    if not delta > 0:
        problems.append(f"Huber delta {delta}")
    if problems:
        raise ValueError(f"cannot fit L(C): {'; '.join(problems)}. Valid: equally many compute values and losses, "
                         "all finite and > 0, at least 3 distinct compute values and more than 3 points, delta > 0.")
    a, e, alpha = fit_many(np.log(c)[:, None], np.log(loss)[None], delta, grid or COMPUTE_GRID, polish)[0]
    return float(np.exp(e)), float(np.exp(a)), float(alpha)


def _loss_at(P: np.ndarray, u: np.ndarray, logc: np.ndarray, flops: FlopsPerToken) -> np.ndarray:
    """Each law's loss at N = e^u with D = C / flops(N)."""
    n = np.exp(u)
    d = np.exp(logc) / np.asarray(flops(n), dtype=float)
    return P[:, 2] + P[:, 0] / n ** P[:, 3] + P[:, 1] / d ** P[:, 4]


def optimal_points(P: np.ndarray, C: np.ndarray, flops: FlopsPerToken = six_n,
                   iterations: int = 80) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N*, D*, L*) of each law (rows of P = [A, B, E, alpha, beta]) at compute C, by golden-section search over
    log N within 12 nats either side of the 6N closed form. `flops` must take and return arrays."""
    logc = np.broadcast_to(np.log(np.asarray(C, dtype=float)), (len(P),))
    alpha, beta = np.maximum(P[:, 3], 1e-6), np.maximum(P[:, 4], 1e-6)
    guess = (np.log(alpha * P[:, 0] / (beta * P[:, 1])) + beta * (logc - np.log(6.0))) / (alpha + beta)
    guess = np.where(np.isfinite(guess), guess, 0.5 * (logc - np.log(6.0)))
    lo, hi = guess - 12.0, guess + 12.0
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    f1, f2 = _loss_at(P, x1, logc, flops), _loss_at(P, x2, logc, flops)
    for _ in range(iterations):
        left = f1 <= f2  # the minimum lies in [lo, x2]: drop (x2, hi]; otherwise drop [lo, x1)
        lo, hi = np.where(left, lo, x1), np.where(left, x2, hi)
        x1, x2 = np.where(left, hi - ratio * (hi - lo), x2), np.where(left, x1, lo + ratio * (hi - lo))
        f_new = _loss_at(P, np.where(left, x1, x2), logc, flops)
        f1, f2 = np.where(left, f_new, f2), np.where(left, f1, f_new)
    u = 0.5 * (lo + hi)
    n = np.exp(u)
    return n, np.exp(logc) / np.asarray(flops(n), dtype=float), _loss_at(P, u, logc, flops)


def _compute_for_loss(P: np.ndarray, target: np.ndarray, logc0: np.ndarray, flops: FlopsPerToken,
                      iterations: int = 30) -> np.ndarray:
    """log of the compute at which each law's compute-optimal loss equals `target` (+inf where target <= E): Newton
    on log(L*(C) - E) against log C, nearly a line, with the slope from the envelope theorem."""
    logc = np.array(logc0, dtype=float)
    reachable = target > P[:, 2]
    goal = np.log(np.where(reachable, target - P[:, 2], 1.0))
    for _ in range(iterations):
        n, d, loss = optimal_points(P, np.exp(logc), flops)
        excess = np.maximum(loss - P[:, 2], 1e-300)
        slope = -P[:, 4] * P[:, 1] / d ** P[:, 4] / excess  # d log(L* - E) / d log C
        step = np.clip((goal - np.log(excess)) / np.where(slope < 0, slope, -1e-3), -5.0, 5.0)
        logc = logc + np.where(reachable, step, 0.0)
        if np.all(np.abs(step[reachable]) < 1e-13):
            break
    return np.where(reachable, logc, np.inf)


def _log_multipliers(P: np.ndarray, R: np.ndarray, C: float, flops: FlopsPerToken,
                     reference_flops: FlopsPerToken) -> np.ndarray:
    if not (np.isfinite(C) and C > 0):
        raise ValueError(f"the compute C must be finite and > 0 (got {C}).")
    _, _, target = optimal_points(P, np.full(len(P), float(C)), flops)
    return _compute_for_loss(R, target, np.full(len(R), np.log(C)), reference_flops) - np.log(C)


def compute_multiplier(law: ScalingLaw, reference: ScalingLaw, C: float, flops: FlopsPerToken = six_n,
                       reference_flops: FlopsPerToken = six_n) -> float:
    """How many times C the reference needs to reach `law`'s compute-optimal loss at C (> 1: law is better; inf
    when the reference's E is above that loss)."""
    return float(np.exp(_log_multipliers(law_matrix([law]), law_matrix([reference]), C, flops, reference_flops)[0]))


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    finite = np.nan_to_num(values, posinf=SORTABLE_INF, neginf=-SORTABLE_INF)  # unreachable: sorts as the largest
    return tuple(float(v) for v in np.quantile(finite, [(1.0 - level) / 2.0, (1.0 + level) / 2.0]))


def _check_pairs(laws: Sequence[ScalingLaw], reference_laws: Sequence[ScalingLaw], level: float) -> None:
    if len(laws) != len(reference_laws) or len(laws) < 2:
        raise ValueError(f"a paired interval needs as many bootstrap fits of the law as of the reference, at least 2 "
                         f"(got {len(laws)} and {len(reference_laws)}).")
    if not 0.0 < level < 1.0:
        raise ValueError(f"the interval's level must be in (0, 1) (got {level}); the claim rule reads 0.9.")


def multiplier_interval(laws: Sequence[ScalingLaw], reference_laws: Sequence[ScalingLaw], C: float,
                        level: float = CLAIM_LEVEL, *, law: ScalingLaw, reference: ScalingLaw,
                        flops: FlopsPerToken = six_n, reference_flops: FlopsPerToken = six_n) -> Interval:
    """The multiplier of the full fits `law` against `reference` at C, with the percentile interval of the paired
    bootstrap multipliers (the i-th fit of each side; each side resampled on its own runs)."""
    _check_pairs(laws, reference_laws, level)
    point = compute_multiplier(law, reference, C, flops, reference_flops)
    logm = _log_multipliers(law_matrix(laws), law_matrix(reference_laws), C, flops, reference_flops)
    lo, hi = _percentiles(logm, level)
    with np.errstate(over="ignore"):
        return Interval(point, float(np.exp(lo)), float(np.exp(hi)), level)


def multiplier_trend(laws: Sequence[ScalingLaw], reference_laws: Sequence[ScalingLaw], C_range: tuple[float, float],
                     level: float = CLAIM_LEVEL, *, law: ScalingLaw, reference: ScalingLaw,
                     flops: FlopsPerToken = six_n, reference_flops: FlopsPerToken = six_n,
                     points: int = 9) -> Interval:
    """The least-squares slope of log multiplier against log C over `points` log-spaced computes in C_range (< 0:
    the gain shrinks with scale), from the full fits, with the percentile interval of the paired bootstrap slopes."""
    _check_pairs(laws, reference_laws, level)
    c_lo, c_hi = C_range
    if not (0 < c_lo < c_hi and np.isfinite(c_hi)) or points < 2:
        raise ValueError(f"the trend needs 0 < C_lo < C_hi and at least 2 points (got {C_range}, {points}).")
    logc = np.linspace(np.log(c_lo), np.log(c_hi), points)
    weights = (logc - logc.mean()) / ((logc - logc.mean()) ** 2).sum()

    def slopes(P: np.ndarray, R: np.ndarray) -> np.ndarray:
        logm = np.stack([_log_multipliers(P, R, float(np.exp(c)), flops, reference_flops) for c in logc], axis=1)
        return np.nan_to_num(logm, posinf=SORTABLE_INF, neginf=-SORTABLE_INF) @ weights

    def unbounded(slope: float) -> float:
        return slope if abs(slope) < UNBOUNDED_SLOPE else float(np.copysign(np.inf, slope))

    point = unbounded(float(slopes(law_matrix([law]), law_matrix([reference]))[0]))
    lo, hi = _percentiles(slopes(law_matrix(laws), law_matrix(reference_laws)), level)
    return Interval(point, unbounded(lo), unbounded(hi), level)


def compute_for_size(reference: ScalingLaw, N: float, flops: FlopsPerToken = six_n) -> float:
    """The compute whose optimal model size under `reference` is N: where dL/dlog N = 0 at D = C / flops(N), i.e.
    C = flops(N) (beta B s / (alpha A N^-alpha))^(1/beta), s = dlog flops / dlog N."""
    if not (np.isfinite(N) and N > 0):
        raise ValueError(f"the model size must be finite and > 0 (got {N}).")
    if min(reference.A, reference.B, reference.alpha, reference.beta) <= 0:
        raise ValueError(f"an optimal size needs A, B, alpha, beta > 0 (got {reference}).")
    h = 1e-5
    s = float(np.log(flops(np.array([N * np.exp(h)]))[0] / flops(np.array([N * np.exp(-h)]))[0]) / (2 * h))
    inner = reference.beta * reference.B * s / (reference.alpha * reference.A * N ** -reference.alpha)
    return float(flops(np.array([float(N)]))[0] * inner ** (1.0 / reference.beta))


def loss_interval(law: ScalingLaw, laws: Sequence[ScalingLaw], N: float, D: float, level: float = CLAIM_LEVEL,
                  noise_sd: float = 0.0, seed: int = 0, draws: int = 1) -> Interval:
    """The loss predicted at (N, D) by the full fit, with the percentile interval of the bootstrap fits'
    predictions; noise_sd (on log loss, per run) adds a new run's seed noise, making it a prediction interval.
    ``draws`` noise draws per bootstrap fit: a level near 1 needs more values than fits to place its ends."""
    _check_pairs(laws, laws, level)
    pred = law_matrix(laws)
    values = pred[:, 2] + pred[:, 0] / float(N) ** pred[:, 3] + pred[:, 1] / float(D) ** pred[:, 4]
    values = np.repeat(values, draws)
    values = values * np.exp(noise_sd * np.random.default_rng(seed).standard_normal(len(values)))
    lo, hi = _percentiles(values, level)
    return Interval(float(law.loss(N, D)), lo, hi, level)
