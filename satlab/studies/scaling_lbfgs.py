"""Many L-BFGS minimisations of the scaling-law objective at once, as arrays: one row per start (or per bootstrap
resample and start), each with its own curvature memory and backtracking line search, so a 4,500-start grid or a
few thousand bootstrap refits cost a few hundred array evaluations instead of a Python loop of scipy calls.

The objective is Hoffmann et al.'s: sum_i w_i Huber_delta(y_i - LSE(c_1 - x_1 X_i1, ..., c_k - x_k X_ik, e)), with
y = log loss and X the log inputs (log N, log D for the two-variable law; log C for the single-variable one), the
row's parameters laid out as [c_1..c_k, e, x_1..x_k]. It is divided by delta times the total weight, which changes no
minimiser but keeps the values near the mean absolute residual, so the stopping rule reads the same for any data.
"""

from __future__ import annotations

import numpy as np

MEMORY = 6
ARMIJO = 1e-4


def huber_lse(theta: np.ndarray, X: np.ndarray, y: np.ndarray, w: np.ndarray,
              delta: float) -> tuple[np.ndarray, np.ndarray]:
    """(objective (rows,), gradient (rows, 2k + 1)) of every row of theta (rows, 2k + 1); y is (points,) or
    (rows, points), w is (rows, points) or (1, points)."""
    k = X.shape[1]
    terms = [theta[:, j, None] - theta[:, k + 1 + j, None] * X[:, j] for j in range(k)]  # each (rows, points)
    e = theta[:, k, None]
    top = np.maximum(terms[0], e)
    for t in terms[1:]:
        np.maximum(top, t, out=top)
    z = [np.exp(t - top) for t in terms] + [np.exp(e - top)]
    total = z[0] + z[1]
    for t in z[2:]:
        total += t
    r = y - top - np.log(total)  # y - prediction
    psi = np.clip(r, -delta, delta)  # Huber's derivative; Huber(r) = psi (r - psi / 2)
    scale = delta * w.sum(axis=1)
    f = (w * psi * (r - 0.5 * psi)).sum(axis=1) / scale
    psi *= w
    psi /= scale[:, None] * total  # now -d objective / d prediction, over the softmax denominator
    grads = [(psi * t) for t in z]  # -d objective / d (log-term j): psi times term j's softmax weight
    g = np.empty_like(theta)
    for j in range(k):
        g[:, j] = -grads[j].sum(axis=1)
        g[:, k + 1 + j] = grads[j] @ X[:, j]
    g[:, k] = -grads[k].sum(axis=1)
    return f, g


def _direction(g: np.ndarray, S: np.ndarray, Y: np.ndarray, rho: np.ndarray, newest: np.ndarray,
               rows: np.ndarray) -> np.ndarray:
    """The two-loop recursion for the given rows, in arrays; pairs with rho = 0 are empty and do nothing."""
    m = S.shape[0]
    q = g.copy()
    alphas = np.zeros((m, len(g)))
    order = [(newest - j) % m for j in range(m)]  # newest first
    for j, idx in enumerate(order):
        s, yv, r = S[idx, rows], Y[idx, rows], rho[idx, rows]
        alphas[j] = r * np.einsum("ij,ij->i", s, q)
        q -= alphas[j][:, None] * yv
    s_new, y_new = S[newest, rows], Y[newest, rows]
    yy = np.einsum("ij,ij->i", y_new, y_new)
    has = (rho[newest, rows] > 0) & (yy > np.finfo(float).tiny)  # y . y can underflow though s . y > 0
    gamma = np.where(has, np.einsum("ij,ij->i", s_new, y_new) / np.where(has, yy, 1.0),
                     1.0 / np.maximum(np.linalg.norm(g, axis=1), 1e-300))
    z = gamma[:, None] * q
    for j in reversed(range(m)):
        idx = order[j]
        s, yv, r = S[idx, rows], Y[idx, rows], rho[idx, rows]
        b = r * np.einsum("ij,ij->i", yv, z)
        z += (alphas[j] - b)[:, None] * s
    return -z


def batched_lbfgs(theta0: np.ndarray, X: np.ndarray, y: np.ndarray, w: np.ndarray, delta: float,
                  max_iter: int = 400, ftol: float = 1e-9, gtol: float = 1e-10) -> tuple[np.ndarray, np.ndarray]:
    """Minimise every row from its start (y and w as in :func:`huber_lse`); returns (ends, objective values). A row
    stops when its relative decrease falls below ftol, its gradient's largest entry below gtol, or its line search
    finds no decrease."""
    theta = np.array(theta0, dtype=float)
    rows, dim = theta.shape
    shared_w, shared_y = w.shape[0] == 1, y.ndim == 1

    def evaluate(idx: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(over="ignore", invalid="ignore"):
            return huber_lse(t, X, y if shared_y else y[idx], w if shared_w else w[idx], delta)

    f, g = evaluate(np.arange(rows), theta)
    S, Y = np.zeros((MEMORY, rows, dim)), np.zeros((MEMORY, rows, dim))
    rho = np.zeros((MEMORY, rows))
    newest = np.zeros(rows, dtype=int)
    active = np.isfinite(f) & (np.abs(g).max(axis=1) > gtol)
    for _ in range(max_iter):
        idx = np.flatnonzero(active)
        if not len(idx):
            break
        d = _direction(g[idx], S, Y, rho, newest[idx], idx)
        slope = np.einsum("ij,ij->i", d, g[idx])
        bad = ~(slope < 0)
        if bad.any():  # not a descent direction: forget the memory and go down the gradient
            rho[:, idx[bad]] = 0.0
            d[bad] = -g[idx[bad]] / np.maximum(np.linalg.norm(g[idx[bad]], axis=1), 1e-300)[:, None]
            slope[bad] = np.einsum("ij,ij->i", d[bad], g[idx[bad]])
        step = np.ones(len(idx))
        new_t, new_f, new_g = theta[idx].copy(), f[idx].copy(), g[idx].copy()
        pending = np.arange(len(idx))
        for _ in range(40):
            trial = theta[idx[pending]] + step[pending, None] * d[pending]
            tf, tg = evaluate(idx[pending], trial)
            ok = np.isfinite(tf) & (tf <= f[idx[pending]] + ARMIJO * step[pending] * slope[pending])
            done = pending[ok]
            new_t[done], new_f[done], new_g[done] = trial[ok], tf[ok], tg[ok]
            pending = pending[~ok]
            if not len(pending):
                break
            step[pending] *= 0.5
        stalled = np.zeros(len(idx), dtype=bool)
        stalled[pending] = True
        s, yv = new_t - theta[idx], new_g - g[idx]
        sy = np.einsum("ij,ij->i", s, yv)
        keep = ~stalled & (sy > 1e-12 * np.einsum("ij,ij->i", yv, yv))
        slot = (newest[idx] + 1) % MEMORY
        ki, ks = idx[keep], slot[keep]
        S[ks, ki], Y[ks, ki], rho[ks, ki] = s[keep], yv[keep], 1.0 / sy[keep]
        newest[ki] = ks
        decrease = f[idx] - new_f
        theta[idx], f[idx], g[idx] = new_t, new_f, new_g
        converged = (decrease <= ftol * np.maximum(np.abs(f[idx]), 1e-12)) | (np.abs(g[idx]).max(axis=1) <= gtol)
        active[idx[stalled | converged]] = False
    return theta, f
