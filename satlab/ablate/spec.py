"""Ablation specs (``experiments/ablations/*.yml``): a base experiment, fixed overrides and axes whose product is
the grid of cells. The ``.yml`` suffix keeps them out of the experiment presets (every ``*.yaml`` under
``experiments/`` is a preset, loaded and built by the tests). The format (every key but ``axes`` optional)::

    name: granularity                    # default: the file name
    description: SATFormer gate granularity
    base: tiny/satformer                 # experiment preset or YAML path every cell starts from
    overrides: {train.max_tokens: 3e5}   # fixed config overrides for every cell (dotted or nested keys)
    axes:                                # config key -> values; the grid is their product, first axis slowest
      model.satformer.gate_granularity: [static_layer, static_head, token, token_head, token_channel]
      train.seed: [0, 1, 2]
    seed_key: train.seed                 # replicates: cells that differ only here form a group (mean ± std, t-test)
    baseline: {model.satformer.gate_granularity: token_head}  # the group p-values compare against (default: the
                                                              # first value of every axis)
    experiment: null                     # MLflow experiment of the parent and child runs (default ablation-<name>)
    out_dir: null                        # state, cell configs, logs and report (default reports/ablations/<name>)
    timeout_minutes: null                # wall-clock limit per cell

Reading and validating a spec is :mod:`satlab.ablate.loader`'s job.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from satlab.config.loader import default_experiments_dir, load_experiment
from satlab.config.schema import ExperimentConfig

ABLATIONS_SUBDIR = "ablations"
SPEC_SUFFIX = ".yml"
REPORTS_DIR = Path("reports") / "ablations"
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def format_value(value: Any) -> str:
    """A value in the config loader's override syntax (``null``, ``true``, ``0.001``, ``token_head``)."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: the axis values in axis order, and which axis holds the replicates (seeds)."""

    values: tuple[tuple[str, Any], ...]
    seed_key: str
    slug: str

    @property
    def key(self) -> str:
        """``model.arch=satformer train.seed=0``: unique in the grid, stored as the child run's tag, and a valid
        list of overrides."""
        return " ".join(f"{k}={format_value(v)}" for k, v in self.values)

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


@dataclass
class AblationSpec:
    name: str
    axes: dict[str, list[Any]]
    description: str = ""
    base: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)
    seed_key: str = "train.seed"
    baseline: dict[str, Any] = field(default_factory=dict)
    experiment: str | None = None
    out_dir: str | None = None
    timeout_minutes: float | None = None

    @property
    def experiment_name(self) -> str:
        return self.experiment or f"ablation-{self.name}"

    def out_path(self) -> Path:
        return Path(self.out_dir) if self.out_dir else REPORTS_DIR / self.name

    def group_axes(self) -> list[str]:
        return [k for k in self.axes if k != self.seed_key]

    def baseline_values(self) -> dict[str, Any]:
        """The baseline group's value of every non-seed axis (the spec's ``baseline`` or the axis' first value)."""
        return {k: self.baseline.get(k, self.axes[k][0]) for k in self.group_axes()}

    def cells(self) -> list[Cell]:
        """The grid, first axis slowest, with directory-safe slugs (``arch=satformer,seed=0``)."""
        keys = list(self.axes)
        short = {k: k.rsplit(".", 1)[-1] for k in keys}
        if len(set(short.values())) < len(keys):  # two axes end alike (a.x, b.x): use the full keys
            short = {k: k for k in keys}
        short = {k: "arch" if k == "model.arch" else v for k, v in short.items()}
        cells = []
        for combo in itertools.product(*self.axes.values()):
            values = tuple(zip(keys, combo, strict=True))
            slug = ",".join(f"{short[k]}={_UNSAFE.sub('-', format_value(v))}" for k, v in values)
            cells.append(Cell(values, self.seed_key, slug))
        slugs = [c.slug for c in cells]
        if len(set(slugs)) < len(slugs):  # values that only differ in unsafe characters: number the slugs
            cells = [dataclasses.replace(c, slug=f"{i:03d}-{c.slug}") for i, c in enumerate(cells)]
        return cells

    def base_config(self, extra: Sequence[str] = ()) -> ExperimentConfig:
        """The base experiment with the fixed overrides (and ``extra`` ones) applied, validated."""
        return load_experiment(self.base_path(), [*override_items(self.overrides), *extra])

    def base_path(self) -> Path:
        """The base experiment's file (a preset name resolved under ``experiments/``)."""
        as_path = Path(self.base)
        if as_path.suffix in (".yaml", ".yml") or as_path.is_file():
            return as_path.resolve()
        return (default_experiments_dir() / f"{self.base}.yaml").resolve()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def override_items(values: Mapping[str, Any]) -> list[str]:
    """``key=value`` overrides for the experiment loader from dotted keys and Python values."""
    return [f"{key}={format_value(value)}" for key, value in values.items()]


def default_ablations_dir() -> Path:
    """``experiments/ablations`` next to the experiment presets (``$SATLAB_EXPERIMENTS_DIR`` moves both)."""
    return default_experiments_dir() / ABLATIONS_SUBDIR
