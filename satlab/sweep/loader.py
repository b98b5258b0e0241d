"""Reading and validating sweep specs: YAML through OmegaConf, then ``key=value`` overrides of the spec itself
(``n_trials=4``, ``space.optim.lr.high=1e-2``, ``overrides.train.max_tokens=1e5``).

Every problem is collected into one :class:`ConfigError` (unknown keys with "did you mean", wrong types, empty
space, bad ranges, unknown sampler or pruner). The base experiment is then loaded with the fixed overrides and with
every extreme value of every parameter, so a bad key or choice fails before the first trial rather than inside one.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.display import flatten
from satlab.config.errors import ConfigError, did_you_mean, unknown_name
from satlab.config.specs import flatten_mapping, nest, read_spec, short_path
from satlab.sweep.spec import (
    DEFAULT_SPACE,
    DIRECTIONS,
    PARAM_TYPES,
    PRUNERS,
    SAMPLERS,
    Objective,
    Param,
    PrunerSpec,
    SamplerSpec,
    SaturationGuard,
    SweepSpec,
    TrialSettings,
    default_sweeps_dir,
    format_value,
    is_param,
)

_BAD = object()


def load_sweep(name_or_path: str | Path, overrides: Sequence[str] = ()) -> SweepSpec:
    """The validated spec of a sweep name (``lr_tiny``) or YAML file, with ``key=value`` overrides of the spec."""
    path, data = read_spec(name_or_path, "sweep", default_sweeps_dir(), ".yaml")
    data = _nest_sections(data)
    problems: list[str] = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"malformed sweep override '{item}': expected key=value, e.g. n_trials=4")
            continue
        try:
            data = _merge(data, OmegaConf.to_container(OmegaConf.from_dotlist([item])))
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            problems.append(f"malformed sweep override '{item}': {' '.join(str(e).split())}")
    if problems:
        raise ConfigError(problems)
    spec = spec_from_dict(data, source=short_path(path))
    check_against_config(spec)
    return spec


def spec_from_dict(data: Mapping[str, Any], source: str = "sweep") -> SweepSpec:
    """A structurally validated spec from a plain dict (a YAML file's, or :meth:`SweepSpec.to_json`'s)."""
    problems: list[str] = []
    data = _nest_sections(dict(data))
    hints = typing.get_type_hints(SweepSpec)
    problems.extend(_unknown_key("", key, hints) for key in data if key not in hints)
    if not isinstance(data.get("name"), str) or not data.get("name"):
        problems.append("'name' must be a non-empty string")
    kwargs: dict[str, Any] = {"name": str(data.get("name") or "sweep")}
    for key in ("description", "base", "storage", "experiment", "out_dir", "n_trials"):
        if key in data and (value := _scalar(data[key], hints[key], key, problems)) is not _BAD:
            kwargs[key] = value
    for key, cls in (("objective", Objective), ("sampler", SamplerSpec), ("pruner", PrunerSpec),
                     ("saturation", SaturationGuard), ("trial", TrialSettings)):
        kwargs[key] = _section(cls, data.get(key) or {}, key, problems)
    overrides = data.get("overrides") or {}
    if isinstance(overrides, Mapping):
        kwargs["overrides"] = flatten_mapping(overrides)
    else:
        problems.append(f"'overrides' must be a mapping of config keys to values, got {overrides!r}")
    kwargs["space"] = _space(data.get("space", DEFAULT_SPACE), problems)
    # A searched key replaces a fixed override of the same key (so `space.optim.warmup_fraction...` works on the CLI)
    kwargs["overrides"] = {k: v for k, v in kwargs.get("overrides", {}).items() if k not in kwargs["space"]}
    kwargs["enqueue"] = []
    for i, point in enumerate(data.get("enqueue") or []):
        if isinstance(point, Mapping):
            kwargs["enqueue"].append(flatten_mapping(point))
        else:
            problems.append(f"enqueue[{i}] must be a mapping of searched keys to values, got {point!r}")
    spec = SweepSpec(**kwargs)
    problems.extend(_value_problems(spec))
    if problems:
        raise ConfigError([f"{source}: {p}" for p in problems])
    return spec


def check_against_config(spec: SweepSpec) -> None:
    """Load the base experiment with the fixed overrides, and with every extreme value of every parameter, so that
    unknown keys, bad choices and out-of-range bounds are reported with the experiment loader's "did you mean"."""
    try:
        cfg = spec.base_config()
    except ConfigError as e:
        raise ConfigError([f"sweep '{spec.name}' (base '{spec.base}' + overrides): {p}" for p in e.problems]) from None
    known = flatten(cfg)
    problems = []
    for name, param in spec.space.items():
        if name not in known:
            problems.append(f"space: unknown config key '{name}'{did_you_mean(name, known)}")
            continue
        for value in param.extremes():
            override = f"{name}={format_value(value)}"
            try:
                spec.base_config([override])
            except ConfigError as e:
                prefix = f"override '{override}': "
                problems.extend(f"space.{name}: {value!r}: {p.removeprefix(prefix)}" for p in e.problems)
    if problems:
        raise ConfigError([f"sweep '{spec.name}': {p}" for p in problems])


def _unknown_key(where: str, key: str, valid: Mapping[str, Any]) -> str:
    return f"unknown key '{where}{key}'{did_you_mean(key, valid) or '; valid: ' + ', '.join(valid)}"


def _nest_sections(data: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys of ``overrides``/``space``/``enqueue`` entries expanded, so CLI overrides merge into them."""
    out = dict(data)
    if isinstance(out.get("overrides"), Mapping):
        out["overrides"] = nest(flatten_mapping(out["overrides"]))
    if isinstance(out.get("space"), Mapping):
        out["space"] = nest(flatten_mapping(out["space"], is_param))
    return out


def _merge(base: Any, update: Any) -> Any:
    if isinstance(base, Mapping) and isinstance(update, Mapping):
        return {**base, **{k: _merge(base.get(k), v) for k, v in update.items()}}
    return update


def _space(data: Any, problems: list[str]) -> dict[str, Param]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        problems.append(f"'space' must be a mapping of config keys to ranges or choices, got {data!r}")
        return {}
    space = {}
    for name, entry in flatten_mapping(data, is_param).items():
        if not isinstance(entry, Mapping):
            problems.append(f"space.{name}: expected a range (low/high[/log/step]) or choices, got {entry!r}")
            continue
        entry = dict(entry)
        entry.setdefault("type", "categorical" if "choices" in entry else "float")
        space[name] = _section(Param, entry, f"space.{name}", problems)
    return space


def _section(cls: type, data: Any, where: str, problems: list[str]) -> Any:
    """A dataclass from a mapping: unknown keys reported with "did you mean", values type-checked."""
    if not isinstance(data, Mapping):
        problems.append(f"'{where}' must be a mapping, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            problems.append(_unknown_key(f"{where}.", key, hints))
        elif (checked := _scalar(value, hints[key], f"{where}.{key}", problems)) is not _BAD:
            kwargs[key] = checked
    return cls(**kwargs)


def _scalar(value: Any, hint: Any, where: str, problems: list[str]) -> Any:
    """``value`` checked against a field type (int, float, bool, str, optional, list); whole floats become ints.
    A wrong value is reported and comes back as ``_BAD``, so the field keeps its default for the later checks."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else (hint,)
    if value is None and type(None) in args:
        return None
    if int in args and isinstance(value, float) and value.is_integer():
        return int(value)
    accepted = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
    ok = isinstance(value, accepted) and not (isinstance(value, bool) and bool not in accepted)
    if float in accepted and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        problems.append(f"'{where}' must be {names}, got {value!r}")
        return _BAD
    return value


def _value_problems(spec: SweepSpec) -> list[str]:
    problems = []
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec.name):
        problems.append(f"name '{spec.name}' must be letters, digits, '_', '.' or '-' (it names the study, its folder "
                        "and its runs)")
    if not spec.space:
        problems.append("the search space is empty: add at least one parameter under 'space', e.g. "
                        "optim.lr: {low: 1e-4, high: 1e-2, log: true}")
    for name, p in spec.space.items():
        where = f"space.{name}"
        if p.type not in PARAM_TYPES:
            problems.append(unknown_name(f"{where}.type", p.type, PARAM_TYPES))
        elif p.type == "categorical":
            if not isinstance(p.choices, list) or not p.choices:
                problems.append(f"{where}: 'choices' must be a non-empty list")
            elif any(isinstance(c, dict | list) for c in p.choices):
                problems.append(f"{where}: choices must be scalars (numbers, strings, booleans or null)")
        elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (p.low, p.high)):
            problems.append(f"{where}: a {p.type} range needs numeric 'low' and 'high', got {p.low!r}, {p.high!r}")
        elif p.low >= p.high:
            problems.append(f"{where}: low must be < high, got low={p.low!r}, high={p.high!r}")
        elif p.log and p.low <= 0:
            problems.append(f"{where}: a log range needs low > 0, got {p.low!r}")
        elif p.type == "int" and not all(float(v).is_integer() for v in (p.low, p.high)):
            problems.append(f"{where}: an int range needs whole low and high, got {p.low!r}, {p.high!r}")
        elif p.step is not None and (p.step <= 0 or p.log):
            problems.append(f"{where}: step must be > 0 and cannot be combined with log")
    checks = [
        (spec.objective.direction in DIRECTIONS, unknown_name("objective.direction", spec.objective.direction,
                                                              DIRECTIONS)),
        (bool(spec.objective.metric), "objective.metric must name a logged metric, e.g. val/loss"),
        (spec.sampler.name in SAMPLERS, unknown_name("sampler", spec.sampler.name, SAMPLERS)),
        (spec.pruner.name in PRUNERS, unknown_name("pruner", spec.pruner.name, PRUNERS)),
        (spec.n_trials >= 0, f"n_trials must be >= 0, got {spec.n_trials}"),
        (spec.sampler.n_startup_trials >= 0 and spec.pruner.n_startup_trials >= 0, "n_startup_trials must be >= 0"),
        (spec.pruner.warmup_tokens >= 0, "pruner.warmup_tokens must be >= 0"),
        (spec.pruner.min_tokens is None or spec.pruner.min_tokens > 0, "pruner.min_tokens must be > 0 or null"),
        (spec.pruner.reduction_factor >= 2, "pruner.reduction_factor must be >= 2"),
        (spec.saturation.threshold is None or 0 <= spec.saturation.threshold <= 1,
         f"saturation.threshold must be in [0, 1] or null, got {spec.saturation.threshold}"),
        (spec.saturation.patience >= 1 and spec.saturation.windows >= 1,
         "saturation.patience and saturation.windows must be >= 1"),
        (spec.trial.timeout_minutes is None or spec.trial.timeout_minutes > 0, "trial.timeout_minutes must be > 0"),
        (spec.trial.heartbeat_seconds >= 1 and spec.trial.grace_seconds > spec.trial.heartbeat_seconds,
         "trial.heartbeat_seconds must be >= 1 and trial.grace_seconds larger than it"),
        (spec.trial.max_retry >= 0, "trial.max_retry must be >= 0"),
        (spec.trial.threads is None or spec.trial.threads >= 1, "trial.threads must be >= 1 or null"),
    ]
    problems.extend(message for ok, message in checks if not ok)
    for i, point in enumerate(spec.enqueue):
        unknown = [k for k in point if k not in spec.space]
        if unknown:
            problems.append(f"enqueue[{i}]: {', '.join(unknown)} not in the search space "
                            f"({', '.join(spec.space)})")
    return problems
