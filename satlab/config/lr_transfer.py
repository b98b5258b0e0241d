"""The ``lr_transfer:`` block of an ablation spec: it turns on the report's "Learning-rate transfer" section
(:mod:`satlab.studies.lr_transfer`) and names what it reads. ``lr_key`` is the learning-rate axis; ``width_keys``
and ``depth_keys`` the axes that make a shape (the width keys move together, e.g. ``model.d_model`` and
``model.mlp_hidden``); ``tied_keys`` axes set by the shape but neither its width nor its depth (a ladder rung's
token budget and warmup, which grow with its parameters); ``base`` the base shape's value of each of them. Every
other axis but the seeds splits the cells into series (an architecture under a parametrisation), each with its own
base-shape optimum. Without ``lr_key`` (the default) there is no section. docs/lr-transfer.md explains the fit, the
interval and the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from satlab.config.errors import quoted, shown
from satlab.config.structured import in_range

FITS = ("all", "local")
"""The ways a shape's optimum is fitted (``LRTransferPlan.fit``)."""

MIN_LRS = 3
"""The fewest learning rates a quadratic can be fitted to with a residual left; the shipped study has eight."""


@dataclass
class LRTransferPlan:
    """``level``: the bootstrap interval's coverage (0.9); ``resamples`` and ``seed`` fix the bootstrap;
    ``tolerance``: how far (in octaves of the learning rate, log2 units) a shape's interval may reach from the base
    shape's optimum and still count as transferred."""

    lr_key: str | None = None
    width_keys: list[str] = field(default_factory=lambda: ["model.d_model"])
    depth_keys: list[str] = field(default_factory=lambda: ["model.n_layers"])
    # Axes whose value comes with the shape (e.g. train.max_tokens at a fixed number of tokens per parameter): part
    # of a shape's label and of its base value, but neither a width nor a depth (no series is drawn along them).
    tied_keys: list[str] = field(default_factory=list)
    base: dict[str, Any] = field(default_factory=dict)
    level: float = field(default=0.9, metadata=in_range(0, 0.999, True))
    resamples: int = field(default=2000, metadata=in_range(100, 10**6))
    seed: int = 0
    tolerance: float = field(default=0.5, metadata=in_range(0, 10, True))
    # Which quadratic gives a shape's optimum: ``all`` fits every learning rate; ``local`` the best learning rate
    # and its two neighbours (satlab.studies.lr_transfer.local_optimum), for curves a single parabola does not fit.
    fit: str = "all"
    # An earlier LR-transfer study (its spec name, report folder or summary.json) whose optima the report sets beside
    # this one's, shape by shape: the same grid at another horizon or seed count shows how far the optimum moved.
    compare_with: str | None = None

    @property
    def enabled(self) -> bool:
        return self.lr_key is not None

    @property
    def shape_keys(self) -> list[str]:
        return [*self.width_keys, *self.depth_keys, *self.tied_keys]

    def problems(self, axes: Mapping[str, Any], seed_key: str, prefix: str = "lr_transfer.") -> list[str]:
        """The block against the grid's axes: the learning-rate axis (positive numbers, at least ``MIN_LRS``), the
        shape axes, and a base shape among their values."""
        if not self.enabled:
            return [f"{prefix}base is set but {prefix}lr_key is empty: name the learning-rate axis, e.g. "
                    f"lr_key: optim.lr"] if self.base else []
        problems = []
        if self.fit not in FITS:
            problems.append(f"{prefix}fit {shown(self.fit)} is not one of {', '.join(FITS)}: 'all' fits a quadratic to "
                            "every learning rate of a shape, 'local' to its best learning rate and the two beside it")
        lrs = axes.get(self.lr_key)
        if lrs is None:
            return [f"{prefix}lr_key {quoted(self.lr_key)} is not an axis of the grid (axes: "
                    f"{', '.join(axes) or 'none'}): the section fits the loss against the learning rates of an "
                    f"axis, e.g. optim.lr: [1.0e-3, 2.0e-3, 4.0e-3, ...]"]
        if not isinstance(lrs, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                                                 for v in lrs) or len(lrs) < MIN_LRS:
            problems.append(f"axis {quoted(self.lr_key)} must list at least {MIN_LRS} positive learning rates for "
                            f"the quadratic fit, got {shown(lrs)}")
        keys = self.shape_keys
        if not keys:
            problems.append(f"{prefix}width_keys and depth_keys are both empty: name the shape axes")
        for key in keys:
            if key not in axes:
                problems.append(f"{prefix}: shape key {quoted(key)} is not an axis of the grid (axes: "
                                f"{', '.join(axes)})")
            elif key in (self.lr_key, seed_key):
                problems.append(f"{prefix}: {quoted(key)} cannot be both a shape key and the learning-rate or "
                                "seed axis")
        if len(set(keys)) < len(keys):
            problems.append(f"{prefix}: a key is given twice among width_keys, depth_keys and tied_keys: "
                            f"{shown(keys)}")
        missing = [k for k in keys if k not in self.base]
        extra = [k for k in self.base if k not in keys]
        if missing or extra:
            problems.append(f"{prefix}base must give the base shape's value of each shape key ({', '.join(keys)})"
                            + (f"; missing {', '.join(missing)}" if missing else "")
                            + (f"; not a shape key: {', '.join(extra)}" if extra else ""))
        for key, value in self.base.items():
            if key in keys and isinstance(axes.get(key), list) and value not in axes[key]:
                problems.append(f"{prefix}base {quoted(key)} = {shown(value)} is not among the axis values "
                                f"{shown(axes[key])}")
        return problems
