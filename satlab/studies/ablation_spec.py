"""An ablation's spec: a grid of cells (axes, optional sub-grids, a baseline), with the optional plans that ride on
it (a sequential plan, an LR-transfer section, a scaling ladder). The shared parts of every study's spec, and the
sweep's, are in :mod:`satlab.studies.spec`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from satlab.config.errors import quoted, shown, unknown_name
from satlab.config.ladder import LadderPlan
from satlab.config.lr_transfer import LRTransferPlan
from satlab.config.sequential import SequentialPlan
from satlab.studies.spec import _SLUG_UNSAFE, SaturationGuard, StudySpec, format_value, short_label


@dataclass(frozen=True)
class Cell:
    """One point of the grid: the axis values in axis order; ``seed_key`` is the replicates' axis."""

    values: tuple[tuple[str, Any], ...]
    seed_key: str
    slug: str

    @property
    def key(self) -> str:
        """``model.arch=satformer train.seed=0``: unique in the grid, the child run's tag, a list of overrides."""
        return " ".join(self.overrides())

    @property
    def group(self) -> str:
        """The key without the seed axis: the cells of one group differ only in their seed."""
        return " ".join(f"{k}={format_value(v)}" for k, v in self.values if k != self.seed_key) or "all"

    @property
    def group_values(self) -> dict[str, Any]:
        return {k: v for k, v in self.values if k != self.seed_key}

    @property
    def seed(self) -> Any:
        return dict(self.values).get(self.seed_key)

    def overrides(self) -> list[str]:
        return [f"{k}={format_value(v)}" for k, v in self.values]

    @property
    def label(self) -> str:
        """The child run's name in MLflow: ``arch=satformer seed=1``."""
        return short_label(self.values)


@dataclass
class AblationSpec(StudySpec):
    kind: ClassVar[str] = "ablation"
    spec_artifact: ClassVar[str] = "ablation.yaml"
    axes: dict[str, Any] = field(default_factory=dict)
    seed_key: str = "train.seed"
    baseline: dict[str, Any] = field(default_factory=dict)
    timeout_minutes: float | None = None  # type: ignore[assignment]  # a field here (the format's), not a property
    compare_with: str | None = None  # another ablation (name or file) whose loss orders the report sets beside these
    # Off unless set; it may only observe (a pruned cell would leave a hole in the grid): each cell records when the
    # guard would have pruned it, so what a sweep's guard excludes can be judged against full-budget losses.
    saturation: SaturationGuard = field(default_factory=lambda: SaturationGuard(threshold=None))
    # A group-sequential plan (satlab.config.sequential); off without looks: the seed axis is then fixed.
    sequential: SequentialPlan = field(default_factory=SequentialPlan)
    # A union of sub-grids: each entry narrows some axes to a subset of their values (the others keep all of
    # theirs); the grid is every cell of the full product that some entry selects, in the product's order.
    grids: list[dict[str, Any]] = field(default_factory=list)
    # The report's learning-rate transfer section (satlab.config.lr_transfer); off without lr_key.
    lr_transfer: LRTransferPlan = field(default_factory=LRTransferPlan)
    # A scaling ladder (satlab.config.ladder, docs/ladder.md); off without rungs. The loader expands it into the
    # axes and one sub-grid per rung (satlab.studies.ladder), so the rest of the engine sees an ordinary grid.
    ladder: LadderPlan = field(default_factory=LadderPlan)

    def default_out(self) -> Path:
        return self.out_of(self.name)

    @staticmethod
    def out_of(name: str) -> Path:
        """An ablation's folder without ``out_dir``: where ``satlab report <name>`` looks for its study when no
        spec file has the name (an ablation run from a spec elsewhere)."""
        return Path("reports") / "ablations" / name

    def group_axes(self) -> list[str]:
        return [k for k in self.axes if k != self.seed_key]

    def baseline_values(self) -> dict[str, Any]:
        return {k: self.baseline.get(k, self.axes[k][0]) for k in self.group_axes()}

    def identity(self) -> dict[str, Any]:
        """Not the axes: a grid with more seeds or values keeps its finished cells."""
        return {"base": self.base, "overrides": self.overrides, "seed_key": self.seed_key}

    def cells(self) -> list[Cell]:
        """The grid, first axis slowest, with directory-safe slugs (``arch=satformer,seed=0``)."""
        keys = list(self.axes)
        short = {k: k.rsplit(".", 1)[-1] for k in keys}
        if len(set(short.values())) < len(keys):  # two axes end alike (a.x, b.x): use the full keys
            short = {k: k for k in keys}
        short = {k: "arch" if k == "model.arch" else v for k, v in short.items()}
        cells = []
        for combo in self.combinations():
            values = tuple(zip(keys, combo, strict=True))
            slug = ",".join(f"{short[k]}={_SLUG_UNSAFE.sub('-', format_value(v))}" for k, v in values)
            cells.append(Cell(values, self.seed_key, slug))
        if len({c.slug for c in cells}) < len(cells):  # values that only differ in unsafe characters
            cells = [dataclasses.replace(c, slug=f"{i:03d}-{c.slug}") for i, c in enumerate(cells)]
        return cells

    def combinations(self) -> list[tuple]:
        """The axis values of every cell, first axis slowest: the whole product, or the union of the sub-grids'
        products (built from each sub-grid, not by filtering the whole product, which grows with every axis)."""
        if not self.grids:
            return list(itertools.product(*self.axes.values()))
        picked: set[tuple[int, ...]] = set()
        for grid in self.grids:
            kept = {k: set(map(format_value, grid[k])) for k in grid}
            choices = [[i for i, v in enumerate(values) if k not in kept or format_value(v) in kept[k]]
                       for k, values in self.axes.items()]
            picked.update(itertools.product(*choices))
        values = list(self.axes.values())
        return [tuple(values[a][i] for a, i in enumerate(index)) for index in sorted(picked)]

    def run_order(self) -> list[Cell]:
        """The cells in the order they run: seed by seed, so an interrupted ablation leaves whole replicates."""
        seeds = [format_value(s) for s in self.axes.get(self.seed_key, [])]
        return sorted(self.cells(), key=lambda c: seeds.index(format_value(c.seed)) if seeds else 0)

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.timeout_minutes is not None and not self.timeout_minutes > 0:
            problems.append(f"'timeout_minutes' must be a positive number or null, got {shown(self.timeout_minutes)}")
        if self.trial.timeout_minutes is not None:
            problems.append("trial.timeout_minutes: an ablation's limit per cell is its top-level timeout_minutes")
        if not self.seed_key:
            problems.append("'seed_key' is empty: it names the axis of replicates (default train.seed)")
        if not self.axes:
            return problems + ["'axes' is empty: give at least one config key with a list of values, "
                               "e.g. axes: {model.arch: [transformer, satformer], train.seed: [0, 1, 2]}"]
        for key, choices in self.axes.items():
            if not isinstance(choices, list):
                problems.append(f"axis {quoted(key)} must be a list of values, got {shown(choices)}")
            elif not choices:
                problems.append(f"axis {quoted(key)} is empty: give it at least one value")
            elif repeated := _repeated(choices):
                problems.append(f"axis {quoted(key)} repeats a value ({shown(repeated[0])}); each value of an axis is "
                                f"one column of the grid, so give it once: {shown(choices)}")
            if key in self.overrides:
                problems.append(f"{quoted(key)} is both a fixed override and an axis; keep one")
        problems.extend(self.grid_problems())
        problems.extend(self.lr_transfer.problems(self.axes, self.seed_key))
        problems.extend(self.sequential.problems())
        problems.extend(self.sequential.grid_problems(self.axes, self.seed_key))
        if self.sequential.enabled and len({c.group for c in self.cells()}) < 2:
            problems.append("sequential: the plan compares groups of cells, but the grid has one; give an axis "
                            "besides the seeds, e.g. model.arch: [transformer, satformer]")
        if self.saturation.action != "observe":
            problems.append("saturation.action must be 'observe' in an ablation: a pruned cell would leave a hole "
                            "in the grid (a sweep's guard can prune)")
        for key, value in self.baseline.items():
            if key == self.seed_key:
                problems.append(f"baseline cannot fix the seed axis {quoted(self.seed_key)}: p-values are over seeds")
            elif key not in self.axes:
                problems.append(unknown_name("baseline key (not an axis)", key, self.axes))
            elif isinstance(self.axes[key], list) and format_value(value) not in map(format_value, self.axes[key]):
                problems.append(f"baseline {quoted(key)} = {shown(value)} is not among the axis values "
                                f"{shown(self.axes[key])}")
        return problems


    def grid_problems(self) -> list[str]:
        """Each sub-grid of ``grids`` narrows axes to values they have; none with a sequential plan (its looks add
        seeds to whole axes)."""
        problems = []
        if self.grids and self.sequential.enabled:
            problems.append("grids cannot be combined with a sequential plan: its looks add seeds to the whole grid")
        for i, grid in enumerate(self.grids):
            if not isinstance(grid, Mapping) or not grid:
                problems.append(f"grids[{i}] must map axes to lists of their values, got {shown(grid)}")
                continue
            for key, values in grid.items():
                if key not in self.axes:
                    problems.append(unknown_name(f"grids[{i}] key (not an axis)", key, self.axes))
                elif not isinstance(values, list) or not values:
                    problems.append(f"grids[{i}]: {quoted(key)} must be a non-empty list of its axis values, "
                                    f"got {shown(values)}")
                elif isinstance(self.axes[key], list) and (
                        bad := [v for v in values if format_value(v) not in map(format_value, self.axes[key])]):
                    problems.append(f"grids[{i}]: {quoted(key)} value {shown(bad[0])} is not among the axis values "
                                    f"{shown(self.axes[key])}: the axes list every value, a sub-grid picks some")
        return problems


def _repeated(values: list[Any]) -> list[Any]:
    """The values of ``values`` given more than once (as an override writes them, :func:`format_value`)."""
    seen, again = set(), []
    for value in values:
        if (text := format_value(value)) in seen:
            again.append(value)
        seen.add(text)
    return again
