"""Sweep specs (``sweeps/*.yaml``): what to search, how to judge a trial, and how to stop bad ones early.

The spec format (every section optional but ``name``, which defaults to the file name)::

    name: lr_tiny
    base: default                        # experiment preset or YAML path the trials start from
    overrides: {model.d_model: 64}       # fixed config overrides for every trial (dotted or nested keys)
    space:                               # searched config keys (default: optim.lr log-uniform in [1e-4, 1e-2])
      optim.lr: {low: 1e-4, high: 3e-1, log: true}
      model.arch: {choices: [transformer, satformer]}
      model.satformer.gate_bias: {type: float, low: -2, high: 2, step: 0.5}
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

Parameters under ``model.<architecture>.`` (``model.satformer.gate_bias``) are only sampled for trials of that
architecture, so a study over ``model.arch`` does not waste the sampler's attention on inert knobs. Reading and
validating a spec is :mod:`satlab.sweep.loader`'s job.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.loader import load_experiment
from satlab.config.model import ARCHITECTURE_NAMES
from satlab.config.schema import ExperimentConfig

ENV_SWEEPS_DIR = "SATLAB_SWEEPS_DIR"
PARAM_TYPES = ("float", "int", "categorical")
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")
DIRECTIONS = ("minimize", "maximize")
PARAM_KEYS = ("type", "low", "high", "log", "step", "choices")
DEFAULT_SPACE = {"optim.lr": {"low": 1e-4, "high": 1e-2, "log": True}}


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


@dataclass
class Objective:
    """The metric a trial returns (its last logged value, e.g. final ``val/loss``) and which way is better."""

    metric: str = "val/loss"
    direction: str = "minimize"


@dataclass
class SamplerSpec:
    name: str = "tpe"
    seed: int | None = 0
    n_startup_trials: int = 5


@dataclass
class PrunerSpec:
    """``median``: prune below the median of earlier trials (of the same architecture when ``model.arch`` is searched)
    at the same token count, after ``warmup_tokens`` and ``n_startup_trials`` finished trials; ``hyperband``:
    successive halving from ``min_tokens`` (default: the base config's ``train.val_every_tokens``); ``none``.
    Steps are tokens seen: trials compare at equal token counts as long as the batch size is not searched."""

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
    """How each trial runs: a wall-clock timeout, heartbeats (a trial whose worker stops beating for
    ``grace_seconds`` is failed and retried up to ``max_retry`` times) and CPU threads (default: cores / workers)."""

    timeout_minutes: float | None = None
    heartbeat_seconds: int = 10
    grace_seconds: int = 60
    max_retry: int = 2
    threads: int | None = None


@dataclass
class SweepSpec:
    name: str
    description: str = ""
    base: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)
    space: dict[str, Param] = field(default_factory=dict)
    objective: Objective = field(default_factory=Objective)
    n_trials: int = 20
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    pruner: PrunerSpec = field(default_factory=PrunerSpec)
    saturation: SaturationGuard = field(default_factory=SaturationGuard)
    trial: TrialSettings = field(default_factory=TrialSettings)
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    storage: str | None = None
    experiment: str | None = None
    out_dir: str | None = None

    def base_config(self, extra: Sequence[str] = ()) -> ExperimentConfig:
        """The base experiment with the fixed overrides (and ``extra`` ones) applied, validated."""
        return load_experiment(self.base, [*override_items(self.overrides), *extra])

    def to_json(self) -> str:
        """The resolved spec as JSON (a trial process reads it back with ``loader.spec_from_dict``)."""
        return json.dumps(dataclasses.asdict(self))

    def study_dir(self) -> Path:
        """Where the study's default storage, logs, trial runs and report live."""
        return Path(self.out_dir) if self.out_dir else default_sweeps_dir() / "studies" / self.name

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.study_dir() / 'optuna.db').resolve()}"


def default_sweeps_dir() -> Path:
    """``$SATLAB_SWEEPS_DIR``, else the repository's ``sweeps/``, else ``./sweeps``."""
    if os.environ.get(ENV_SWEEPS_DIR):
        return Path(os.environ[ENV_SWEEPS_DIR]).expanduser()
    repo_dir = Path(__file__).resolve().parents[2] / "sweeps"
    return repo_dir if repo_dir.is_dir() else Path.cwd() / "sweeps"


def active_params(spec: SweepSpec, arch: str) -> list[str]:
    """The searched keys that matter for ``arch``, ``model.arch`` first (it decides the others)."""
    names = sorted(spec.space, key=lambda n: n != "model.arch")
    return [n for n in names if not (n.split(".")[0] == "model" and n.split(".")[1] in ARCHITECTURE_NAMES
                                     and n.split(".")[1] != arch)]


def override_items(values: Mapping[str, Any]) -> list[str]:
    """``key=value`` overrides for the experiment loader from dotted keys and Python values."""
    return [f"{key}={format_value(value)}" for key, value in values.items()]


def format_value(value: Any) -> str:
    """A value as the loader's override syntax reads it back: plain when that round-trips, else JSON (quoted)."""
    if isinstance(value, str):
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]
        except (yaml.YAMLError, OmegaConfBaseException):
            parsed = None
        return value if parsed == value else json.dumps(value)
    return json.dumps(value)


def is_param(value: Any) -> bool:
    """Whether a mapping of a ``space`` section is one parameter (rather than a level of nesting)."""
    return isinstance(value, Mapping) and any(k in value for k in PARAM_KEYS)

