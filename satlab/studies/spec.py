"""Study specs: what a sweep searches (``sweeps/*.yaml``) and what an ablation's grid holds
(``experiments/ablations/*.yml``). Both start every trial from a base experiment with fixed overrides, run it as a
child ``satlab train`` and keep an MLflow parent run; they differ in how trials are chosen.

A sweep (every section optional but ``name``, which defaults to the file name)::

    base: default                        # experiment preset or YAML path the trials start from
    overrides: {model.d_model: 64}       # fixed config overrides for every trial (dotted or nested keys)
    space:                               # searched config keys (default: optim.lr log-uniform in [1e-4, 1e-2])
      optim.lr: {low: 1e-4, high: 3e-1, log: true}
      model.arch: {choices: [transformer, satformer]}
    objective: {metric: val/loss, direction: minimize}
    n_trials: 12                         # trials per `satlab sweep` invocation (shared by its --workers)
    sampler: {name: tpe, seed: 0, n_startup_trials: 5}
    pruner: {name: median, warmup_tokens: 0, n_startup_trials: 3}
    saturation: {threshold: 0.5, patience: 2, windows: 8, constraint: true}
    trial: {timeout_minutes: null, heartbeat_seconds: 10, grace_seconds: 60, max_retry: 2, threads: null}
    enqueue: [{optim.lr: 3e-3, model.arch: satformer}]   # points tried first, once per study
    storage: null                        # default sqlite:///<out_dir>/optuna.db
    experiment: null                     # MLflow experiment, default sweep-<name>
    out_dir: null                        # default sweeps/studies/<name>

Parameters under ``model.<architecture>.`` are only sampled for trials of that architecture. An ablation::

    base: tiny/satformer
    overrides: {train.max_tokens: 3e5}
    axes:                                # config key -> values; the grid is their product, first axis slowest
      model.satformer.gate_granularity: [static_layer, token, token_head]
      train.seed: [0, 1, 2]
    seed_key: train.seed                 # replicates: cells that differ only here form a group (mean ± std)
    baseline: {model.satformer.gate_granularity: token_head}  # the group p-values compare against (default:
                                                              # the first value of every axis)
    timeout_minutes: null                # wall-clock limit per cell
    trial: {heartbeat_seconds: 10, grace_seconds: 60, max_retry: 2, threads: null}
    storage: null                        # default sqlite:///<out_dir>/optuna.db; postgresql://... across hosts
    experiment: null                     # default ablation-<name>
    out_dir: null                        # default reports/ablations/<name>

The ``.yml`` suffix keeps ablations out of the experiment presets (every ``*.yaml`` under ``experiments/`` is one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.errors import unknown_name
from satlab.config.loader import default_experiments_dir, load_experiment
from satlab.config.model import ARCHITECTURE_NAMES
from satlab.config.schema import ExperimentConfig
from satlab.config.structured import Range, range_problems

PARAM_KEYS = ("type", "low", "high", "log", "step", "choices")
DEFAULT_SPACE = {"optim.lr": {"low": 1e-4, "high": 1e-2, "log": True}}
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def format_value(value: Any) -> str:
    """A value as the config loader's override syntax reads it back: plain when that round-trips, else JSON."""
    if isinstance(value, str):
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]
        except (yaml.YAMLError, OmegaConfBaseException):
            parsed = None
        return value if parsed == value else json.dumps(value)
    return json.dumps(value)


def override_items(values: Mapping[str, Any]) -> list[str]:
    """``key=value`` overrides for the experiment loader from dotted keys and Python values."""
    return [f"{key}={format_value(value)}" for key, value in values.items()]


def is_param(value: Any) -> bool:
    """Whether a mapping of a ``space`` section is one parameter (rather than a level of nesting)."""
    return isinstance(value, Mapping) and any(k in value for k in PARAM_KEYS)


@dataclass
class Param:
    """One searched config key: a float or int range (``log`` for log-uniform, optional ``step``) or choices."""

    type: str = "float"
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    def extremes(self) -> list[Any]:
        """The values that bound what a trial can get: both ends of a range, or every choice."""
        return list(self.choices or []) if self.type == "categorical" else [self.low, self.high]

    def problems(self, where: str) -> list[str]:
        if self.type not in ("float", "int", "categorical"):
            return [unknown_name(f"{where}.type", self.type, ("float", "int", "categorical"))]
        if self.type == "categorical":
            if not isinstance(self.choices, list) or not self.choices:
                return [f"{where}: 'choices' must be a non-empty list"]
            return [f"{where}: choices must be scalars (numbers, strings, booleans or null)"] \
                if any(isinstance(c, dict | list) for c in self.choices) else []
        if self.low is None or self.high is None:
            return [f"{where}: a {self.type} range needs numeric 'low' and 'high', got {self.low!r}, {self.high!r}"]
        checks = [(self.low < self.high, f"low must be < high, got low={self.low!r}, high={self.high!r}"),
                  (not self.log or self.low > 0, f"a log range needs low > 0, got {self.low!r}"),
                  (self.type != "int" or all(float(v).is_integer() for v in (self.low, self.high)),
                   f"an int range needs whole low and high, got {self.low!r}, {self.high!r}"),
                  (self.step is None or (self.step > 0 and not self.log),
                   "step must be > 0 and cannot be combined with log")]
        return [f"{where}: {message}" for ok, message in checks if not ok][:1]


@dataclass
class Objective:
    """The metric a trial returns (its final value, e.g. final ``val/loss``) and which way is better."""

    metric: str = "val/loss"
    direction: str = "minimize"


@dataclass
class SamplerSpec:
    name: str = "tpe"
    seed: int | None = 0
    n_startup_trials: int = 5


@dataclass
class PrunerSpec:
    """``median``: prune below the median of earlier trials (of the same architecture when ``model.arch`` is
    searched) at the same token count, after ``warmup_tokens`` and ``n_startup_trials`` finished trials;
    ``hyperband``: successive halving from ``min_tokens`` (default: the base config's ``train.val_every_tokens``);
    ``none``. Steps are tokens seen: trials compare at equal token counts."""

    name: str = "median"
    warmup_tokens: int = 0
    n_startup_trials: int = 3
    min_tokens: int | None = None
    reduction_factor: int = 3


@dataclass
class SaturationGuard:
    """Prune a trial whose ``val/gates/saturated_frac`` (on ``windows`` fixed validation windows) stays above
    ``threshold`` for ``patience`` validations in a row; ``constraint`` also tells the sampler about it.
    ``threshold: null`` turns the guard off."""

    threshold: float | None = 0.5
    patience: int = 2
    windows: int = 8
    constraint: bool = True


@dataclass
class TrialSettings:
    """How each trial runs: heartbeats (a trial whose worker stops beating for ``grace_seconds`` is failed and
    retried up to ``max_retry`` times) and CPU threads (default: cores / workers)."""

    heartbeat_seconds: int = 10
    grace_seconds: int = 60
    max_retry: int = 2
    threads: int | None = None


@dataclass
class SweepTrialSettings(TrialSettings):
    timeout_minutes: float | None = None


_TRIAL_RANGES: dict[str, Range] = {"heartbeat_seconds": (1, 86400, False), "grace_seconds": (1, 10**6, False),
                                   "max_retry": (0, 1000, False), "threads": (1, 4096, False)}


@dataclass
class StudySpec:
    """What sweeps and ablations share; ``kind`` names the subclass in a study's stored attributes."""

    kind: ClassVar[str]
    suffix: ClassVar[str]
    spec_artifact: ClassVar[str]  # the spec as run, on the parent run
    name: str
    description: str = ""
    base: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)
    storage: str | None = None
    experiment: str | None = None
    out_dir: str | None = None

    @property
    def experiment_name(self) -> str:
        return self.experiment or f"{self.kind}-{self.name}"

    def base_config(self, extra: Sequence[str] = ()) -> ExperimentConfig:
        """The base experiment with the fixed overrides (and ``extra`` ones) applied, validated."""
        return load_experiment(self.base_path(), [*override_items(self.overrides), *extra])

    def base_path(self) -> Path:
        """The base experiment's file (a preset name resolved under ``experiments/``)."""
        as_path = Path(self.base)
        if as_path.suffix in (".yaml", ".yml") or as_path.is_file():
            return as_path.resolve()
        return (default_experiments_dir() / f"{self.base}.yaml").resolve()

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.out_path() / 'optuna.db').resolve()}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def problems(self) -> list[str]:
        problems = [] if _NAME.match(self.name) else [
            f"'name' must be letters, digits, '_', '.' or '-' (it names the study, its folder and its runs), "
            f"got {self.name!r}"]
        return problems + range_problems(self.trial, _TRIAL_RANGES, "trial.") + (
            [] if self.trial.grace_seconds > self.trial.heartbeat_seconds
            else ["trial.grace_seconds must be larger than trial.heartbeat_seconds"])

    def out_path(self) -> Path:
        raise NotImplementedError


@dataclass
class SweepSpec(StudySpec):
    kind: ClassVar[str] = "sweep"
    suffix: ClassVar[str] = ".yaml"
    spec_artifact: ClassVar[str] = "sweep.yaml"
    space: dict[str, Any] = field(default_factory=dict, metadata={"leaf": is_param})
    objective: Objective = field(default_factory=Objective)
    n_trials: int = 20
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    pruner: PrunerSpec = field(default_factory=PrunerSpec)
    saturation: SaturationGuard = field(default_factory=SaturationGuard)
    trial: SweepTrialSettings = field(default_factory=SweepTrialSettings)
    enqueue: list[dict[str, Any]] = field(default_factory=list)

    @property
    def timeout_minutes(self) -> float | None:
        return self.trial.timeout_minutes

    def out_path(self) -> Path:
        return Path(self.out_dir) if self.out_dir else default_specs_dir(self) / "studies" / self.name

    def active_params(self, arch: str) -> list[str]:
        """The searched keys that matter for ``arch``, ``model.arch`` first (it decides the others)."""
        names = sorted(self.space, key=lambda n: n != "model.arch")
        return [n for n in names if not (n.split(".")[0] == "model" and n.split(".")[1] in ARCHITECTURE_NAMES
                                         and n.split(".")[1] != arch)]

    def problems(self) -> list[str]:
        problems = super().problems()
        if not self.space:
            problems.append("the search space is empty: add at least one parameter under 'space', e.g. "
                            "optim.lr: {low: 1e-4, high: 1e-2, log: true}")
        for name, param in self.space.items():
            problems.extend(param.problems(f"space.{name}"))
        choices = {"objective.direction": (self.objective.direction, ("minimize", "maximize")),
                   "sampler": (self.sampler.name, ("tpe", "random")),
                   "pruner": (self.pruner.name, ("median", "hyperband", "none"))}
        problems.extend(unknown_name(key, value, valid) for key, (value, valid) in choices.items()
                        if value not in valid)
        if not self.objective.metric:
            problems.append("objective.metric must name a logged metric, e.g. val/loss")
        ranges: dict[str, Range] = {
            "n_trials": (0, 10**6, False), "sampler.n_startup_trials": (0, 10**6, False),
            "pruner.n_startup_trials": (0, 10**6, False), "pruner.warmup_tokens": (0, 10**15, False),
            "pruner.min_tokens": (1, 10**15, False), "pruner.reduction_factor": (2, 100, False),
            "saturation.threshold": (0, 1, False), "saturation.patience": (1, 10**6, False),
            "saturation.windows": (1, 10**5, False), "trial.timeout_minutes": (0, 10**7, True)}
        problems.extend(range_problems(self, ranges))
        for i, point in enumerate(self.enqueue):
            if unknown := [k for k in point if k not in self.space]:
                problems.append(f"enqueue[{i}]: {', '.join(unknown)} not in the search space "
                                f"({', '.join(self.space)})")
        return problems


@dataclass(frozen=True)
class Cell:
    """One point of the grid: the axis values in axis order, and which axis holds the replicates (seeds)."""

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


@dataclass
class AblationSpec(StudySpec):
    kind: ClassVar[str] = "ablation"
    suffix: ClassVar[str] = ".yml"
    spec_artifact: ClassVar[str] = "ablation.yaml"
    axes: dict[str, Any] = field(default_factory=dict)
    seed_key: str = "train.seed"
    baseline: dict[str, Any] = field(default_factory=dict)
    timeout_minutes: float | None = None
    trial: TrialSettings = field(default_factory=TrialSettings)

    def out_path(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("reports") / "ablations" / self.name

    def group_axes(self) -> list[str]:
        return [k for k in self.axes if k != self.seed_key]

    def baseline_values(self) -> dict[str, Any]:
        """The baseline group's value of every non-seed axis (the spec's ``baseline`` or the axis' first value)."""
        return {k: self.baseline.get(k, self.axes[k][0]) for k in self.group_axes()}

    def fingerprint(self) -> str:
        """What the cells share besides their axis values. A study (and its parent run) is reused only with the
        same fingerprint: finished cells of another budget or setting are never taken for this one's."""
        text = json.dumps({"base": self.base, "overrides": self.overrides, "seed_key": self.seed_key},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

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
            slug = ",".join(f"{short[k]}={_SLUG_UNSAFE.sub('-', format_value(v))}" for k, v in values)
            cells.append(Cell(values, self.seed_key, slug))
        if len({c.slug for c in cells}) < len(cells):  # values that only differ in unsafe characters
            cells = [dataclasses.replace(c, slug=f"{i:03d}-{c.slug}") for i, c in enumerate(cells)]
        return cells

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.timeout_minutes is not None and not self.timeout_minutes > 0:
            problems.append(f"'timeout_minutes' must be a positive number or null, got {self.timeout_minutes!r}")
        if not self.axes:
            return problems + ["'axes' is empty: give at least one config key with a list of values, "
                               "e.g. axes: {model.arch: [transformer, satformer], train.seed: [0, 1, 2]}"]
        for key, choices in self.axes.items():
            if not isinstance(choices, list):
                problems.append(f"axis '{key}' must be a list of values, got {choices!r}")
            elif not choices:
                problems.append(f"axis '{key}' is empty: give it at least one value")
            elif len({format_value(c) for c in choices}) < len(choices):
                problems.append(f"axis '{key}' repeats a value: {choices}")
            if key in self.overrides:
                problems.append(f"'{key}' is both a fixed override and an axis; keep one")
        for key, value in self.baseline.items():
            if key == self.seed_key:
                problems.append(f"baseline cannot fix the seed axis '{self.seed_key}': p-values are over seeds")
            elif key not in self.axes:
                problems.append(unknown_name("baseline key (not an axis)", key, self.axes))
            elif isinstance(self.axes[key], list) and format_value(value) not in map(format_value, self.axes[key]):
                problems.append(f"baseline {key}={format_value(value)} is not among the axis values {self.axes[key]}")
        return problems


KINDS: dict[str, type[StudySpec]] = {cls.kind: cls for cls in (SweepSpec, AblationSpec)}


def default_specs_dir(kind: StudySpec | type[StudySpec]) -> Path:
    """Where specs of a kind live: ``sweeps/`` (``$SATLAB_SWEEPS_DIR``) or ``experiments/ablations/`` (next to the
    presets, so ``$SATLAB_EXPERIMENTS_DIR`` moves both)."""
    if kind.kind == "ablation":
        return default_experiments_dir() / "ablations"
    if os.environ.get("SATLAB_SWEEPS_DIR"):
        return Path(os.environ["SATLAB_SWEEPS_DIR"]).expanduser()
    repo_dir = Path(__file__).resolve().parents[2] / "sweeps"
    return repo_dir if repo_dir.is_dir() else Path.cwd() / "sweeps"
