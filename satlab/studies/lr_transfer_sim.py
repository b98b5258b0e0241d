"""How often the LR-transfer verdict says "transfers", simulated through the report's own analysis.

The verdict (:func:`satlab.studies.lr_transfer.series_verdict`) asks every shape's bootstrap interval to lie within
±tolerance octaves of the base shape's optimum. A study that fails it is evidence of a moving optimum only if the
verdict usually passes when the optimum does not move, and whether it does depends on the curves' flatness, the seed
noise and the seeds per point. So a finished study's own measurements are taken as the truth:

- per shape, its curve is the natural cubic spline of the mean final loss against log2(lr) through the measured
  means, continued as a straight line beyond the swept range (:class:`Curve`);
- seed noise is Gaussian, with the standard deviation measured at each learning rate, pooled over the series' shapes.

Synthetic studies of the same design (the same learning rates and shapes, ``seeds`` per point) are drawn from it and
go through :func:`satlab.studies.lr_transfer_report.analyse`, the function the report calls; the share whose verdict
is "transfers" is the pass rate. The scenarios (the base shape always keeps its own curve):

- ``identical``: every shape's truth is the base shape's curve. The optimum does not move, and nothing else differs.
- ``aligned``: every shape keeps its own curve, moved along log2(lr) until the report's fit of its noise-free
  means finds the base's optimum (:func:`alignment`): the drift the fit sees removed, each shape's flatness and
  asymmetry kept.
- ``drift D``: the base's curve moved by D x log2(size / base size) / 3 octaves along the shape's series (width or
  depth), so the shape 8x the base's has its optimum D octaves from the base's.
- ``measured``: every shape's own curve as measured (the study's estimated drift taken as the truth).

docs/results/2026-12-07-lr-transfer-criterion.md is the study this was written for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import CubicSpline

from satlab.config.errors import ConfigError
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.lr_transfer import fit_quadratic, local_vertex
from satlab.studies.lr_transfer_report import analyse, series_and_shape
from satlab.studies.results import CellResult, GroupResult

IDENTICAL, ALIGNED, MEASURED = "identical", "aligned", "measured"


@dataclass(frozen=True)
class Curve:
    """A shape's mean final loss as a function of log2(lr): a natural cubic spline through the measured means,
    straight beyond the first and last learning rate (with the spline's slope there)."""

    spline: CubicSpline
    low: float
    high: float

    @classmethod
    def through(cls, levels: Sequence[float], means: Sequence[float]) -> Curve:
        return cls(CubicSpline(levels, means, bc_type="natural"), float(min(levels)), float(max(levels)))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        below, above = np.minimum(x - self.low, 0.0), np.maximum(x - self.high, 0.0)
        return (self.spline(np.clip(x, self.low, self.high)) + below * self.spline(self.low, 1)
                + above * self.spline(self.high, 1))


@dataclass(frozen=True)
class SeriesTruth:
    """One series of a finished study as the simulation's truth: per shape its curve, its size step (log2 of its
    width or depth over the base's), its real groups by learning rate (their axis values and parameter counts are
    the synthetic groups') and its ``aligned`` move; per learning rate the seed noise pooled over the shapes."""

    label: str
    base: str
    curves: dict[str, Curve]
    steps: dict[str, float]
    groups: dict[str, dict[float, GroupResult]]
    noise: dict[float, float]
    alignment: dict[str, float]  # per shape the move (octaves) that puts its noise-free optimum on the base's


@dataclass(frozen=True)
class PassRate:
    passed: int
    replicates: int

    @property
    def rate(self) -> float:
        return self.passed / self.replicates

    @property
    def mc_se(self) -> float:
        return math.sqrt(self.rate * (1 - self.rate) / self.replicates)

    def text(self) -> str:
        return f"{self.rate:.2f} ± {self.mc_se:.2f}"


def scenario_names(drifts: Sequence[float]) -> list[str]:
    return [IDENTICAL, ALIGNED, *(f"drift {d:g}" for d in drifts), MEASURED]


def truths(spec: AblationSpec, groups: Sequence[GroupResult]) -> list[SeriesTruth]:
    """Each series of the finished ``groups`` (with a base optimum) as a :class:`SeriesTruth`; a series without two
    seeds at some shape of every learning rate is refused (its noise would be unknown)."""
    plan = spec.lr_transfer
    by_series: dict[str, dict[str, dict[float, GroupResult]]] = {}
    for group in groups:
        if group.samples("val_loss"):
            series, shape = series_and_shape(spec, group)
            by_series.setdefault(series, {}).setdefault(shape, {})[float(group.values[plan.lr_key])] = group
    out = []
    for entry in analyse(spec, groups):
        if entry["verdict"].base_log2_lr is None:
            continue
        shapes = {name: by_series[entry["label"]][name] for name in entry["optima"]}
        curves = {name: Curve.through([math.log2(lr) for lr in sorted(at)],
                                      [float(np.mean(at[lr].samples("val_loss"))) for lr in sorted(at)])
                  for name, at in shapes.items()}
        deviations: dict[float, list[float]] = {}
        dof: dict[float, int] = {}
        for at in shapes.values():
            for lr, group in at.items():
                values = np.array(group.samples("val_loss"))
                deviations.setdefault(lr, []).append(float(((values - values.mean()) ** 2).sum()))
                dof[lr] = dof.get(lr, 0) + values.size - 1
        if unreplicated := [f"{lr:g}" for lr in sorted(dof) if dof[lr] == 0]:
            raise ConfigError(f"series {entry['label']} has one finished seed per shape at learning rate(s) "
                              f"{', '.join(unreplicated)}, so its seed noise there is unknown: the simulation needs "
                              "two seeds or more at some shape of every learning rate")
        noise = {lr: math.sqrt(sum(deviations[lr]) / dof[lr]) for lr in sorted(deviations)}
        levels = {name: np.log2(sorted(at)) for name, at in shapes.items()}
        target = noise_free_optimum(plan.fit, levels[entry["base"]], curves[entry["base"]](levels[entry["base"]]))
        out.append(SeriesTruth(entry["label"], entry["base"], curves,
                               {name: size_step(spec, entry["shapes"][name]["values"]) for name in shapes},
                               shapes, noise,
                               {name: alignment(plan.fit, levels[name], curves[name], target) for name in shapes}))
    return out


def noise_free_optimum(fit: str, levels: np.ndarray, means: np.ndarray) -> float:
    """The report's point optimum (log2 lr) of a curve known without noise: the local parabola's vertex, or the
    all-points quadratic's; +-inf or nan where it has none."""
    if fit == "local":
        return float(local_vertex(levels, means[:, None])[0][0])
    quadratic = fit_quadratic(levels, means)
    return -quadratic.b / (2 * quadratic.c) if quadratic.c > 0 else math.nan


ALIGNMENT_STEPS = np.round(np.arange(-2.0, 2.0001, 0.01), 2)
"""The moves tried when aligning a shape's curve (octaves)."""


def alignment(fit: str, levels: np.ndarray, curve: Curve, target: float) -> float:
    """The move of ``curve`` along log2(lr), among :data:`ALIGNMENT_STEPS`, that brings the report's fit of its
    noise-free means closest to ``target`` (the smallest such move). Moving a curve sampled at fixed learning rates
    does not move the fitted vertex by as much (the best rate and its neighbours change in steps), so the move is
    searched, not taken from the difference of the estimates."""
    misses = np.array([abs(noise_free_optimum(fit, levels, curve(levels + move)) - target)
                       for move in ALIGNMENT_STEPS])
    misses = np.where(np.isfinite(misses), misses, np.inf)
    best = np.flatnonzero(misses <= misses.min() + 1e-9)
    return float(ALIGNMENT_STEPS[best[np.argmin(np.abs(ALIGNMENT_STEPS[best]))]])


def size_step(spec: AblationSpec, values: dict) -> float:
    """log2 of a shape's size over the base's along its series: the first width key's ratio where the depth is the
    base's, else the first depth key's where the width is the base's, else 0."""
    plan = spec.lr_transfer
    for moving, fixed in ((plan.width_keys, plan.depth_keys), (plan.depth_keys, plan.width_keys)):
        if moving and all(values[k] == plan.base[k] for k in fixed):
            return math.log2(values[moving[0]] / plan.base[moving[0]])
    return 0.0


def true_means(truth: SeriesTruth, scenario: str, shape: str, levels: np.ndarray) -> np.ndarray:
    """The scenario's true mean loss of ``shape`` at ``levels`` (log2 lr)."""
    base = truth.curves[truth.base]
    if shape == truth.base or scenario == IDENTICAL:
        return base(levels)
    if scenario == MEASURED:
        return truth.curves[shape](levels)
    if scenario == ALIGNED:
        return truth.curves[shape](levels + truth.alignment[shape])
    drift = float(scenario.removeprefix("drift "))
    return base(levels - drift * truth.steps[shape] / 3)


def synthetic_groups(truth: SeriesTruth, scenario: str, seeds: int, rng: np.random.Generator) -> list[GroupResult]:
    """One simulated study of the series: ``seeds`` losses per shape and learning rate, drawn from the truth."""
    out = []
    for shape, at in truth.groups.items():
        lrs = sorted(at)
        means = true_means(truth, scenario, shape, np.log2(lrs))
        for lr, mean in zip(lrs, means, strict=True):
            real = at[lr]
            losses = mean + rng.normal(0.0, truth.noise[lr], seeds)
            out.append(GroupResult(real.label, real.values, seeds,
                                   [CellResult(real.cells[0].cell, f"simulated-{i}", {"val_loss": float(v)},
                                               real.params, []) for i, v in enumerate(losses)]))
    return out


def pass_rate(spec: AblationSpec, truth: SeriesTruth, scenario: str, seeds: int, replicates: int,
              seed: int = 0) -> PassRate:
    """The share of ``replicates`` simulated studies of the series whose verdict, by the report's analysis, is
    "transfers"."""
    rng = np.random.default_rng([seed, seeds, *scenario.encode()])
    passed = 0
    for _ in range(replicates):
        entries = analyse(spec, synthetic_groups(truth, scenario, seeds, rng))
        passed += any(e["label"] == truth.label and e["verdict"].outcome == "transfers" for e in entries)
    return PassRate(passed, replicates)
