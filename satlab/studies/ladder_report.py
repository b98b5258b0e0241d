"""The "Scaling ladder" section of an ablation's report, for a spec with a ``ladder:`` block (docs/ladder.md): per
architecture the Chinchilla-form fit L(N, D) = E + A/N^alpha + B/D^beta with bootstrap standard errors (resampling
runs), each architecture's compute multiplier against the reference at the compute where the reference's optimal
model has 1 B, 10 B and 100 B parameters (a model-based extrapolation) with its interval and the claim it supports,
the trend of the multiplier with compute, a backtest that fits the lower rungs and predicts the top rung, and a
figure of loss against compute with each fitted frontier. The fitting is :mod:`satlab.studies.scaling_fit`.

Compute is counted as 6 N D (Chinchilla's convention, with N the count the ladder's budgets use); the analytic FLOPs
per token of each rung (attention and the output layer included) are in the rung table beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from satlab.studies import scaling_backtest
from satlab.studies.ablation_claims import arch_names
from satlab.studies.ablation_plots import save_figure
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.ladder import Rung, plan, rung_of
from satlab.studies.results import GroupResult
from satlab.studies.scaling_fit import (
    GRIDS,
    RunPoints,
    ScalingLaw,
    bootstrap_laws,
    claim,
    compute_for_size,
    fit_law,
    law_matrix,
    multiplier_interval,
    multiplier_trend,
    optimal_points,
    standard_errors,
)


def ladder_runs(spec: AblationSpec, groups: Sequence[GroupResult], rungs: Sequence[Rung]) \
        -> dict[str, list[tuple[Rung, RunPoints]]]:
    """Per architecture, each finished run as (its rung, RunPoints): N the count the budgets use, D its tokens, L its
    final validation loss. One run per budget (docs/ladder.md), so each run is one point."""
    per = spec.ladder.per
    found: dict[str, list[tuple[Rung, RunPoints]]] = {}
    for group in groups:
        rung = rung_of(rungs, group.values)
        if rung is None:
            continue
        arch = group.values["model.arch"]
        for cell in group.cells:
            loss = cell.metrics.get("val_loss")
            if loss is not None and math.isfinite(loss) and loss > 0:
                found.setdefault(arch, []).append((rung, RunPoints(cell.cell.key, float(rung.sizes[arch].count(per)),
                                                                   (float(group.values["train.max_tokens"]),),
                                                                   (float(loss),), seed=cell.cell.seed)))
    return found


def seed_spread(runs: Sequence[tuple[Rung, RunPoints]]) -> float:
    """The pooled standard deviation of log loss between seeds of one (rung, budget): the noise of a new run."""
    return scaling_backtest.seed_spread([run for _, run in runs])


def pooled_seed_spread(found: dict[str, list[tuple[Rung, RunPoints]]]) -> tuple[float, int]:
    """:func:`seed_spread` pooled over architectures (each compared only with its own seeds), and its degrees of
    freedom (0: no point has two seeds yet)."""
    terms = [scaling_backtest.spread_terms([run for _, run in runs]) for runs in found.values()]
    squares, dof = sum(t[0] for t in terms), sum(t[1] for t in terms)
    return (math.sqrt(squares / dof) if dof else 0.0), dof


def backtest(spec: AblationSpec, runs: Sequence[tuple[Rung, RunPoints]], top: int) -> dict[str, Any] | None:
    """Fit the runs below rung ``top``; does each judged top-rung run's loss fall inside its prediction interval
    (at the band's level per run: docs/ladder.md)?"""
    fit = spec.ladder.fit
    lower = [run for rung, run in runs if rung.index < top]
    held = scaling_backtest.judged_runs([run for rung, run in runs if rung.index == top], fit.backtest_seeds)
    if not held or len({run.N for run in lower}) < 3:
        return None
    noise = seed_spread(runs)
    each = scaling_backtest.run_level(fit.level, len(held), fit.band)
    intervals = scaling_backtest.predict_held_out(lower, held, noise, each, fit.huber_delta, GRIDS[fit.grid],
                                                  min(fit.resamples, scaling_backtest.BACKTEST_RESAMPLES), fit.seed)
    rows = []
    for run, iv in zip(held, intervals, strict=True):
        side = "below" if run.L[0] < iv.lower else "above" if run.L[0] > iv.upper else "inside"
        rows.append({"run": run.run, "seed": run.seed, "tokens": run.D[0], "loss": run.L[0], "predicted": iv.point,
                     "lower": iv.lower, "upper": iv.upper, "inside": side == "inside", "side": side})
    inside = sum(r["inside"] for r in rows)
    return {"rung": top, "fitted_runs": len(lower), "noise_sd": noise, "band": fit.band, "run_level": each,
            "seeds": sorted({r["seed"] for r in rows if r["seed"] is not None}), "runs": rows, "inside": inside,
            "passed": inside == len(rows)}


def analyse(spec: AblationSpec, groups: Sequence[GroupResult]) -> dict[str, Any]:
    """Everything the section reports, as plain data (summary.json's ``ladder``)."""
    ladder, fit = spec.ladder, spec.ladder.fit
    rungs = plan(spec)
    found = ladder_runs(spec, groups, rungs)
    fits: dict[str, dict[str, Any]] = {}
    laws: dict[str, tuple[ScalingLaw, list[ScalingLaw]]] = {}
    for arch, runs in found.items():
        points = [run for _, run in runs]
        entry: dict[str, Any] = {"runs": len(points), "rungs": len({rung.index for rung, _ in runs})}
        if len({run.N for run in points}) >= 3:
            law = fit_law(points, fit.huber_delta, GRIDS[fit.grid])
            boot = bootstrap_laws(points, fit.resamples, fit.seed, fit.huber_delta, full=law, grid=GRIDS[fit.grid])
            laws[arch] = (law, boot)
            entry |= {"law": {k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta")},
                      "se": standard_errors(boot)}
        if fit.backtest == "top_rung" and len(rungs) > 3:
            entry["backtest"] = backtest(spec, runs, rungs[-1].index)
        fits[arch] = entry
    multipliers: dict[str, Any] = {}
    reference = laws.get(ladder.reference)
    if reference is not None:
        ref_law, ref_boot = reference
        computes = [6.0 * run.N * run.D[0] for runs in found.values() for _, run in runs]
        targets = {f"{n:.0e}": compute_for_size(ref_law, n) for n in fit.target_params}
        for arch, (law, boot) in laws.items():
            if arch == ladder.reference:
                continue
            rows = {}
            for name, c in targets.items():
                interval = multiplier_interval(boot, ref_boot, c, fit.level, law=law, reference=ref_law)
                rows[name] = {"compute": c, "point": interval.point, "lower": interval.lower,
                              "upper": interval.upper, "claim": claim(interval)}
            top = max(computes)
            inside = multiplier_interval(boot, ref_boot, top, fit.level, law=law, reference=ref_law)
            trend = {}
            for label, span in (("measured", (min(computes), top)), ("extrapolated", (top, max(targets.values())))):
                if span[0] < span[1]:
                    t = multiplier_trend(boot, ref_boot, span, fit.level, law=law, reference=ref_law)
                    trend[label] = {"from": span[0], "to": span[1], "slope": t.point, "lower": t.lower,
                                    "upper": t.upper}
            multipliers[arch] = {"targets": rows, "top_compute": {"compute": top, "point": inside.point,
                                                                  "lower": inside.lower, "upper": inside.upper,
                                                                  "claim": claim(inside)}, "trend": trend}
    return {"reference": ladder.reference, "per": ladder.per, "level": fit.level, "resamples": fit.resamples,
            "grid": fit.grid,
            "rungs": [{"index": r.index, "values": r.values, "tokens": list(r.tokens),
                       "params": {a: s.params for a, s in r.sizes.items()},
                       "non_embedding": {a: s.non_embedding_params for a, s in r.sizes.items()},
                       "flops_per_token": {a: s.flops_per_token for a, s in r.sizes.items()}} for r in rungs],
            "fits": fits, "multipliers": multipliers, "_laws": laws, "_runs": found}


def frontier(laws: Sequence[ScalingLaw], computes: np.ndarray) -> np.ndarray:
    """The compute-optimal loss of each law at each compute (rows: laws)."""
    P = law_matrix(laws)
    return np.stack([optimal_points(P, np.full(len(laws), c))[2] for c in computes], axis=1)


def figure(result: dict[str, Any], path: Path, title: str) -> Path | None:
    """Loss against compute (6 N D) per architecture: the runs, the fitted compute-optimal frontier with its band,
    drawn on to the compute of the largest target size (dashed beyond the runs: extrapolation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    laws, runs, level = result["_laws"], result["_runs"], result["level"]
    if not laws:
        return None
    names = arch_names()
    computes = [6.0 * run.N * run.D[0] for found in runs.values() for _, run in found]
    targets = [m["compute"] for v in result["multipliers"].values() for m in v["targets"].values()]
    low, top = min(computes), max(computes)
    end = max([top, *targets])
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (arch, (law, boot)) in enumerate(laws.items()):
        color = f"C{i}"
        c = np.array([6.0 * run.N * run.D[0] for _, run in runs[arch]])
        ax.scatter(c, [run.L[0] for _, run in runs[arch]], s=12, color=color, alpha=0.6)
        grid = np.geomspace(low, end, 60)
        band = frontier(boot, grid)
        lo, hi = np.nanpercentile(band, [(1 - level) * 50, (1 + level) * 50], axis=0)
        line = frontier([law], grid)[0]
        measured = grid <= top
        ax.plot(grid[measured], line[measured], color=color, label=names.get(arch, arch))
        ax.plot(grid[~measured], line[~measured], color=color, linestyle="--")
        ax.fill_between(grid, lo, hi, color=color, alpha=0.15)
    for c in sorted(set(targets)):  # the computes of the target sizes
        ax.axvline(c, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute, 6 N D (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.legend(fontsize=8)
    return save_figure(fig, path, title)


def _signed(x: float) -> str:
    return f"{x:+.3f}" if math.isfinite(x) else ("+∞" if x > 0 else "−∞")


def _interval(row: dict[str, Any]) -> str:
    def f(x: float) -> str:
        return "∞" if not math.isfinite(x) else f"{x:.3g}"

    return f"{f(row['point'])} [{f(row['lower'])}, {f(row['upper'])}]"


def ladder_section(spec: AblationSpec, groups: Sequence[GroupResult], out: Path) \
        -> tuple[list[str], dict[str, Any] | None, Path | None]:
    """(markdown lines, summary.json entry, figure); empty when the spec has no ``ladder``."""
    if not spec.ladder.enabled:
        return [], None, None
    result = analyse(spec, groups)
    names = arch_names()
    level = f"{result['level'] * 100:g} %"
    path = figure(result, out / "ladder_fit.png", f"{spec.name}: loss against compute, fitted compute-optimal "
                  f"frontiers with {level} bands (dashed: extrapolated)")
    lines = ["## Scaling ladder", "",
             f"Per architecture, L(N, D) = E + A/N^α + B/D^β fitted to every finished run (N: {result['per']} "
             f"parameters; D: tokens; L: final validation loss) with a Huber loss on log loss from a multi-start "
             f"grid ({result['grid']}); standard errors and {level} intervals from {result['resamples']} bootstrap "
             "refits that resample runs. Compute is 6 N D. The multipliers are a **model-based extrapolation** "
             "from the rungs measured: how many times the compute the reference needs to reach the architecture's "
             "compute-optimal loss, at the compute where the reference's optimal model has the stated size. A gain "
             "is claimed only when the interval's lower bound is above 1 (a loss when its upper bound is below 1). "
             "A percentile bootstrap over few rungs can be too narrow for an extrapolation: the backtest below is "
             "the check on it.", ""]
    table = [["architecture", "runs (rungs)", "E", "A", "B", "α", "β"]]
    for arch, entry in result["fits"].items():
        law, se = entry.get("law"), entry.get("se", {})
        cells = [f"{law[k]:.4g} ± {se.get(k, math.nan):.2g}" for k in ("E", "A", "B", "alpha", "beta")] if law \
            else ["fewer than 3 sizes"] + [""] * 4
        table.append([names.get(arch, arch), f"{entry['runs']} ({entry['rungs']})", *cells])
    lines += [pd.DataFrame(table[1:], columns=table[0]).to_markdown(index=False, disable_numparse=True), ""]
    if result["multipliers"]:
        targets = list(next(iter(result["multipliers"].values()))["targets"])
        header = ["architecture", "at the top rung's compute", *(f"N* = {t}" for t in targets),
                  "trend (measured)", "trend (extrapolated)"]
        rows = []
        for arch, m in result["multipliers"].items():
            trend = [f"{_signed(t['slope'])} [{_signed(t['lower'])}, {_signed(t['upper'])}]" if t else "—"
                     for t in (m["trend"].get("measured"), m["trend"].get("extrapolated"))]
            rows.append([names.get(arch, arch), f"{_interval(m['top_compute'])}: {m['top_compute']['claim']}",
                         *(f"{_interval(m['targets'][t])}: {m['targets'][t]['claim']}" for t in targets), *trend])
        lines += [f"Compute multiplier against {names.get(result['reference'], result['reference'])} "
                  f"(point [{level} interval]: claim). Trend: the slope of log multiplier against log compute "
                  "(negative: the gain shrinks with scale), over the runs' compute and beyond it to the largest "
                  "target.", "", pd.DataFrame(rows, columns=header).to_markdown(index=False, disable_numparse=True),
                  ""]
    else:
        lines += [f"No multiplier: the reference ({result['reference']}) or the others lack a fit.", ""]
    tests = {arch: e["backtest"] for arch, e in result["fits"].items() if e.get("backtest")}
    if tests:
        lines += ["Backtest: each architecture fitted on the rungs below the top one, and the top rung's runs "
                  f"predicted with a prediction interval (the fit's bootstrap plus the seed spread of log loss "
                  f"measured between seeds); {_band_words(next(iter(tests.values())), result['level'])}", ""]
        for arch, b in tests.items():
            verdict = (" passed" if b["passed"] else " failed") if b.get("band") == "simultaneous" else ""
            outside = [r for r in b["runs"] if not r["inside"]]
            lines.append(f"- {names.get(arch, arch)}{verdict}: {b['inside']} of {len(b['runs'])} top-rung runs inside "
                         f"(seed sd {b['noise_sd']:.3f})" + "".join(
                             f"; {r['tokens']:,.0f} tokens, seed {r['seed']}: {r['loss']:.4f}, {r['side']} "
                             f"[{r['lower']:.4f}, {r['upper']:.4f}]" for r in outside))
        lines += [""]
    if path is not None:
        lines += ["![scaling ladder](ladder_fit.png)", ""]
    summary = {k: v for k, v in result.items() if not k.startswith("_")}
    return lines, summary, path


def _band_words(test: dict[str, Any], level: float) -> str:
    """What the backtest's intervals are, and how they are read."""
    seeds = test.get("seeds") or []
    which = f"the top rung's runs of seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}" if seeds \
        else "every top-rung run"
    if test.get("band") == "simultaneous":
        return (f"{which} judged with a simultaneous {level * 100:g} % band: each run's interval at "
                f"{test['run_level'] * 100:.3g} % (Bonferroni over {len(test['runs'])} runs), so that all are inside "
                f"together at least {level * 100:g} % of the time when the law holds. The backtest passes when every "
                "run judged is inside.")
    return (f"{which} judged, each in its own {level * 100:g} % interval: a correct law still misses about "
            f"{(1 - level) * 100:.3g} % of runs (`satlab ladder --simulate-backtest` gives how often all are inside).")
