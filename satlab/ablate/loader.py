"""Reading and validating ablation specs: YAML through OmegaConf, then the command line's ``key=value`` items.

An item whose first part is a spec field sets the spec (``axes.train.seed=[0,1]``, ``base=tiny/transformer``,
``baseline.model.arch=resformer``); any other item is a config override for every cell (``train.max_tokens=1e5``).
Every problem is collected into one :class:`ConfigError` (unknown keys with "did you mean", empty axes, wrong
types, a baseline outside its axis). The base experiment is then loaded with the fixed overrides and with every
value of every axis, so a bad key or value fails before the first cell runs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.ablate.spec import SPEC_SUFFIX, AblationSpec, default_ablations_dir, format_value
from satlab.config.errors import ConfigError, did_you_mean
from satlab.config.specs import flatten_mapping, read_spec, spec_names

_FIELDS = {f.name: f for f in dataclasses.fields(AblationSpec)}
_SECTIONS = ("overrides", "axes", "baseline")  # mappings of dotted config keys
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def list_ablations(ablations_dir: Path | None = None) -> list[str]:
    """The ablation names under ``ablations_dir`` (default: ``experiments/ablations``)."""
    return spec_names(ablations_dir or default_ablations_dir(), SPEC_SUFFIX)


def load_ablation(name_or_path: str | Path, items: Sequence[str] = ()) -> AblationSpec:
    """The validated spec of an ablation name (``arch_tiny``) or YAML file, with command-line ``key=value`` items
    (spec fields or config overrides), checked against the base experiment."""
    path, data = read_spec(name_or_path, "ablation", default_ablations_dir(), SPEC_SUFFIX)
    spec = spec_from_dict(apply_items(data, items), source=str(path))
    check_against_config(spec)
    return spec


def apply_items(data: dict[str, Any], items: Sequence[str]) -> dict[str, Any]:
    """``data`` with the command line's items applied (spec fields into the spec, other keys into overrides)."""
    data = {**data, **{s: flatten_mapping(data[s]) for s in _SECTIONS if isinstance(data.get(s), Mapping)}}
    problems = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or "" in key.split("."):
            problems.append(f"malformed item '{item}': expected key=value, e.g. train.max_tokens=1e5 or "
                            "axes.train.seed=[0,1]")
            continue
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            problems.append(f"malformed item '{item}': {' '.join(str(e).split())}")
            continue
        head, _, rest = key.partition(".")
        if head in _SECTIONS and rest:
            data[head] = {**(data.get(head) or {}), rest: value}
        elif head in _FIELDS and not rest:
            data[head] = value
        elif head in _FIELDS:
            problems.append(f"'{item}': the spec field '{head}' has no sub-keys")
        else:
            data["overrides"] = {**(data.get("overrides") or {}), key: value}
    if problems:
        raise ConfigError(problems)
    return data


def spec_from_dict(data: Mapping[str, Any], source: str = "ablation") -> AblationSpec:
    """A structurally validated spec from a plain dict (a YAML file's, or :meth:`AblationSpec.to_dict`'s)."""
    problems = [f"{source}: unknown key '{key}'{did_you_mean(key, _FIELDS) or '; valid: ' + ', '.join(_FIELDS)}"
                for key in data if key not in _FIELDS]
    values: dict[str, Any] = {}
    for name in ("name", "description", "base", "seed_key", "experiment", "out_dir"):
        if name in data:
            value = data[name]
            optional = name in ("experiment", "out_dir")
            if not (isinstance(value, str) or (optional and value is None)):
                problems.append(f"{source}: '{name}' must be a string, got {value!r}")
            else:
                values[name] = value
    if not _NAME.match(str(values.get("name", ""))):
        problems.append(f"{source}: 'name' must be letters, digits, '_', '.' or '-' (it names folders), "
                        f"got {data.get('name')!r}")
    timeout = data.get("timeout_minutes")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        problems.append(f"{source}: 'timeout_minutes' must be a positive number or null, got {timeout!r}")
    else:
        values["timeout_minutes"] = timeout
    for section in _SECTIONS:
        raw = data.get(section) or {}
        if not isinstance(raw, Mapping):
            problems.append(f"{source}: '{section}' must be a mapping of config keys, got {raw!r}")
            raw = {}
        values[section] = flatten_mapping(raw)
    problems.extend(_axes_problems(values, source))
    if problems:
        raise ConfigError(problems)
    return AblationSpec(**values)


def _axes_problems(values: dict[str, Any], source: str) -> list[str]:
    axes, overrides, baseline = values["axes"], values["overrides"], values["baseline"]
    seed_key = values.get("seed_key", "train.seed")
    if not axes:
        return [f"{source}: 'axes' is empty: give at least one config key with a list of values, "
                "e.g. axes: {model.arch: [transformer, satformer], train.seed: [0, 1, 2]}"]
    problems = []
    for key, choices in axes.items():
        if not isinstance(choices, list):
            problems.append(f"{source}: axis '{key}' must be a list of values, got {choices!r}")
        elif not choices:
            problems.append(f"{source}: axis '{key}' is empty: give it at least one value")
        elif len({format_value(c) for c in choices}) < len(choices):
            problems.append(f"{source}: axis '{key}' repeats a value: {choices}")
        if key in overrides:
            problems.append(f"{source}: '{key}' is both a fixed override and an axis; keep one")
    for key, value in baseline.items():
        if key == seed_key:
            problems.append(f"{source}: baseline cannot fix the seed axis '{seed_key}': p-values are over seeds")
        elif key not in axes:
            problems.append(f"{source}: baseline key '{key}' is not an axis{did_you_mean(key, axes)}; "
                            f"axes: {', '.join(axes)}")
        elif isinstance(axes[key], list) and format_value(value) not in {format_value(c) for c in axes[key]}:
            problems.append(f"{source}: baseline {key}={format_value(value)} is not among the axis values "
                            f"{axes[key]}")
    return problems


def check_against_config(spec: AblationSpec) -> None:
    """Load the base experiment with the fixed overrides, then with each value of each axis: every unknown key or
    bad value is reported at once, before anything runs."""
    problems: list[str] = []
    try:
        spec.base_config()
    except ConfigError as e:
        raise ConfigError([f"ablation '{spec.name}' (base {spec.base} + overrides): {p}" for p in e.problems]) from None
    for key, choices in spec.axes.items():
        for value in choices:
            try:
                spec.base_config([f"{key}={format_value(value)}"])
            except ConfigError as e:
                problems.extend(f"ablation '{spec.name}', axis {key}={format_value(value)}: {p}" for p in e.problems)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
