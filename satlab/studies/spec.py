"""Study specs: what every study's spec shares (:class:`StudySpec`: base, overrides, trial settings, objective),
and sweeps (``sweeps/*.yaml``); ablation grids (``experiments/ablations/*.yml``: the ``.yml`` suffix keeps them out
of the experiment presets) are in :mod:`satlab.studies.ablation_spec`. The formats are in docs/studies.md; ranges
and choices are declared on the fields (``metadata``) and checked by :func:`satlab.config.structured.field_problems`."""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import shown
from satlab.config.loader import load_experiment, name_characters
from satlab.config.resolve import folder, resolve
from satlab.config.schema import MAX_TOKENS, ExperimentConfig
from satlab.config.structured import field_problems, in_range

PARAM_KEYS = ("type", "low", "high", "log", "step", "choices")
DEFAULT_SPACE = {"optim.lr": {"low": 1e-4, "high": 1e-2, "log": True}}
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]")


def format_value(value: Any) -> str:
    """A value as the config loader's override syntax reads it back: plain when that round-trips, else JSON."""
    if isinstance(value, str):
        try:
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]
        except (yaml.YAMLError, OmegaConfBaseException):
            parsed = None
        return value if parsed == value else json.dumps(value)
    return json.dumps(value)


def readable_value(value: Any) -> str:
    """A value as a person reads it in a run name: ``3.1e-3``, ``0.25``, ``satformer``."""
    if isinstance(value, float):
        if value != 0 and not 1e-2 <= abs(value) < 1e4:
            mantissa, exponent = f"{value:.1e}".split("e")
            return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
        return f"{value:.3g}"
    return format_value(value)


def short_label(values: Iterable[tuple[str, Any]]) -> str:
    """``arch=satformer seed=1`` for ``model.arch=satformer train.seed=1``: each key by its last part, unless two
    keys share it."""
    items = list(values)
    last = [key.rsplit(".", 1)[-1] for key, _ in items]
    return " ".join(f"{short if last.count(short) == 1 else key}={readable_value(value)}"
                    for (key, value), short in zip(items, last, strict=True))


def is_param(value: Any) -> bool:
    """Whether a mapping under ``space`` is one parameter rather than a level of nesting."""
    return isinstance(value, Mapping) and any(k in value for k in PARAM_KEYS)


@dataclass
class Param:
    type: str = field(default="float", metadata={"choices": ("float", "int", "categorical")})
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    def extremes(self) -> list[Any]:
        """Both ends of a range, or every choice: what the config check tries."""
        return list(self.choices or []) if self.type == "categorical" else [self.low, self.high]

    def problems(self) -> list[str]:
        if self.type == "categorical":
            if not isinstance(self.choices, list) or not self.choices:
                return ["'choices' must be a non-empty list"]
            scalars = not any(isinstance(c, dict | list) for c in self.choices)
            return [] if scalars else ["choices must be scalars (numbers, strings, booleans or null)"]
        if self.low is None or self.high is None:
            return [f"a {self.type} range needs numeric 'low' and 'high', got {shown(self.low)}, {shown(self.high)}"]
        checks = [(self.low < self.high, f"low must be < high, got low={shown(self.low)}, high={shown(self.high)}"),
                  (not self.log or self.low > 0, f"a log range needs low > 0, got {shown(self.low)}"),
                  (self.type != "int" or all(float(v).is_integer() for v in (self.low, self.high)),
                   f"an int range needs whole low and high, got {shown(self.low)}, {shown(self.high)}"),
                  (self.step is None or (self.step > 0 and not self.log),
                   "step must be > 0 and cannot be combined with log")]
        return [message for ok, message in checks if not ok][:1]


@dataclass
class Objective:
    metric: str = "val/loss"
    direction: str = field(default="minimize", metadata={"choices": ("minimize", "maximize")})


@dataclass
class SamplerSpec:
    name: str = field(default="tpe", metadata={"choices": ("tpe", "random"), "label": "sampler"})
    seed: int | None = 0
    n_startup_trials: int = field(default=5, metadata=in_range(0, 10**6))


@dataclass
class PrunerSpec:
    """Steps are tokens seen, so trials compare at equal token counts; ``min_tokens`` (Hyperband's) defaults to the
    base config's ``train.val_every_tokens``."""

    name: str = field(default="median", metadata={"choices": ("median", "hyperband", "none"), "label": "pruner"})
    warmup_tokens: int = field(default=0, metadata=in_range(0, MAX_TOKENS))
    n_startup_trials: int = field(default=3, metadata=in_range(0, 10**6))
    min_tokens: int | None = field(default=None, metadata=in_range(1, MAX_TOKENS))
    reduction_factor: int = field(default=3, metadata=in_range(2, 100))


@dataclass
class SaturationGuard:
    """The guard trips when ``val/gates/saturated_frac`` stays above ``threshold`` for ``patience`` validations;
    ``threshold: null`` turns it off. ``action: observe`` (the default) prunes nothing: the trial records when it
    would have been pruned (user attributes ``guard_would_prune_at``, ``guard_would_prune_reason``; MLflow tag
    ``guard.would_prune_at``) and trains on, and no constraint is recorded whatever ``constraint`` says, so that what
    the guard would exclude can be measured against the loss. ``action: prune`` stops the trial, and ``constraint``
    also tells the sampler.

    Why observe by default (the saturation study, 90 cells of the tiny SATFormer at 12-48 layers, docs/results/
    2026-12-03-saturation.md): with ReLU gates, the default, 26-67 % of heads are dead at every learning rate, and
    at these values (0.5, 2) the guard would prune 32 of 45 ReLU trials, 6 of the 9 that finished in the best
    quarter of their sweep group among them (precision 28 %, chance 20 %). With sigmoid gates it picks out the
    learning rates that pin them (8 pruned, 5 of them in the worst quarter, 1 in the best): set ``action: prune``
    for bounded gates. Saturated runs did end worse, by 0.04 nats at the same learning rate and gate function."""

    threshold: float | None = field(default=0.5, metadata=in_range(0, 1))
    patience: int = field(default=2, metadata=in_range(1, 10**6))
    windows: int = field(default=8, metadata=in_range(1, 10**5))
    constraint: bool = True
    action: str = field(default="observe", metadata={"choices": ("prune", "observe")})

    def records_constraint(self) -> bool:
        """Whether trials get a feasibility constraint (a guard that is on, a constraint, and not observing)."""
        return self.threshold is not None and self.constraint and self.action != "observe"


@dataclass
class TrialSettings:
    """A trial whose driver stops beating for ``grace_seconds`` is failed and retried up to ``max_retry`` times."""

    heartbeat_seconds: int = field(default=10, metadata=in_range(1, 86400))
    grace_seconds: int = field(default=60, metadata=in_range(2, 10**6))
    max_retry: int = field(default=2, metadata=in_range(0, 1000))
    threads: int | None = field(default=None, metadata=in_range(1, 4096))
    timeout_minutes: float | None = field(default=None, metadata=in_range(0, 10**7, True))


@dataclass
class StudySpec(abc.ABC):
    """What sweeps and ablations share; ``kind`` names the subclass in a study's stored attributes."""

    kind: ClassVar[str]  # its kind in satlab.config.resolve (where its files are, their suffix)
    spec_artifact: ClassVar[str]  # the spec as run, on the parent run
    name: str
    description: str = ""
    base: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)
    trial: TrialSettings = field(default_factory=TrialSettings)
    storage: str | None = None
    experiment: str | None = None
    out_dir: str | None = None

    @property
    def experiment_name(self) -> str:
        return self.experiment or f"{self.kind}-{self.name}"

    @property
    def timeout_minutes(self) -> float | None:
        return self.trial.timeout_minutes

    def base_config(self, extra: Sequence[str] = ()) -> ExperimentConfig:
        overrides = [f"{k}={format_value(v)}" for k, v in self.overrides.items()]
        return load_experiment(self.base_path(), [*overrides, *extra])

    def base_path(self) -> Path:
        return resolve("experiment", self.base).resolve()

    def out_path(self) -> Path:
        return Path(self.out_dir) if self.out_dir else self.default_out()

    @abc.abstractmethod
    def default_out(self) -> Path:
        """Where the storage, logs, trial files and report go without ``out_dir``."""

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.out_path() / 'optuna.db').resolve()}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """What trials must share to be compared (hashed by :meth:`fingerprint`)."""

    def fingerprint(self) -> str:
        """A sweep refuses to join a study of another fingerprint; an ablation's study is named by it, so finished
        cells of another budget or setting are never taken for this one's."""
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def problems(self) -> list[str]:
        problems = [] if _NAME.fullmatch(self.name) else [
            f"'name' must be letters, digits, '_', '.' or '-' of ASCII only (a-z, A-Z, 0-9: no accented or other "
            f"non-ASCII letters, no spaces), starting with a letter or digit (it names the study, its folder and its "
            f"runs), got {shown(self.name)}"
            f"{name_characters(self.name, _NAME_CHARS)}"]
        if self.trial.grace_seconds <= self.trial.heartbeat_seconds:
            problems.append("trial.grace_seconds must be larger than trial.heartbeat_seconds")
        return problems + field_problems(self, skip=("sequential",))  # its own problems() checks it


@dataclass
class SweepSpec(StudySpec):
    kind: ClassVar[str] = "sweep"
    spec_artifact: ClassVar[str] = "sweep.yaml"
    space: dict[str, Any] = field(default_factory=dict, metadata={"leaf": is_param})
    objective: Objective = field(default_factory=Objective)
    n_trials: int = field(default=20, metadata=in_range(1, 10**6))  # ``--n-trials 0`` rewrites the report
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    pruner: PrunerSpec = field(default_factory=PrunerSpec)
    saturation: SaturationGuard = field(default_factory=SaturationGuard)
    enqueue: list[dict[str, Any]] = field(default_factory=list)

    def default_out(self) -> Path:
        return folder(self.kind) / "studies" / self.name

    def identity(self) -> dict[str, Any]:
        """More trials, another sampler or pruner join the same study."""
        return {"base": self.base, "overrides": self.overrides, "objective": dataclasses.asdict(self.objective),
                "space": {k: dataclasses.asdict(p) for k, p in self.space.items()}}

    def active_params(self, arch: str) -> list[str]:
        """The searched keys that matter for ``arch``, ``model.arch`` first (it decides the others)."""
        names = sorted(self.space, key=lambda n: n != "model.arch")
        return [n for n in names if not (n.split(".")[0] == "model" and n.split(".")[1] in ARCH_SPECS
                                         and n.split(".")[1] != arch)]

    def problems(self) -> list[str]:
        problems = super().problems()
        if not self.space:
            problems.append("the search space is empty: add at least one parameter under 'space', e.g. "
                            "optim.lr: {low: 1e-4, high: 1e-2, log: true}")
        for name, param in self.space.items():
            problems.extend(f"space.{name}: {p}" for p in param.problems() + field_problems(param))
        if not self.objective.metric:
            problems.append("objective.metric must name a logged metric, e.g. val/loss")
        for i, point in enumerate(self.enqueue):
            if unknown := [k for k in point if k not in self.space]:
                problems.append(f"enqueue[{i}]: {shown(unknown)} not in the search space "
                                f"({', '.join(self.space)})")
        return problems
