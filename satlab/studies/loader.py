"""Reading study specs: YAML and command-line items through the experiment configs' structured validator, then a
load of the base experiment with every value a trial can get, so a bad key or value fails before the first trial.

An item whose first part is a spec field sets the spec (``n_trials=4``, ``space.optim.lr.high=1e-2``); for an
ablation any other item overrides the config of every cell, for a sweep it is an error (``overrides.<key>=...``).
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from satlab.config.display import flatten
from satlab.config.errors import ConfigError, did_you_mean, shown
from satlab.config.loader import override_source
from satlab.config.resolve import names, read_spec
from satlab.config.schema import ExperimentConfig
from satlab.config.specs import flatten_mapping, parse_item, short_path
from satlab.config.structured import build, setting_hint, type_phrase, value_type_problem, without_none
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.spec import DEFAULT_SPACE, PARAM_KEYS, Param, StudySpec, SweepSpec, format_value, is_param

KINDS: dict[str, type[StudySpec]] = {cls.kind: cls for cls in (SweepSpec, AblationSpec)}
"""Every kind of study spec by its ``kind``: what a stored spec names."""

S = TypeVar("S", bound=StudySpec)


def list_specs(kind: type[StudySpec], root: Path | None = None) -> list[str]:
    return names(kind.kind, root)


def load_spec(kind: type[S], name_or_path: str | Path, items: Sequence[str] = ()) -> S:
    """The spec of a name (``lr_tiny``) or YAML file, with command-line items, checked against the base experiment."""
    path, data = read_spec(kind.kind, name_or_path, _keys(kind))
    spec = spec_from_dict(kind, apply_items(kind, data, items), source=short_path(path))
    check_against_config(spec)
    return spec


def load_sweep(name_or_path: str | Path, items: Sequence[str] = ()) -> SweepSpec:
    return load_spec(SweepSpec, name_or_path, items)


def load_ablation(name_or_path: str | Path, items: Sequence[str] = ()) -> AblationSpec:
    return load_spec(AblationSpec, name_or_path, items)


def apply_items(kind: type[StudySpec], data: Mapping[str, Any], items: Sequence[str]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(kind)}
    out = {k: flatten_mapping(v, fields[k].metadata.get("leaf")) if _is_mapping_field(kind, k)
           and isinstance(v, Mapping) else v for k, v in data.items()}
    problems = []
    for item in items:
        try:
            key, value = parse_item(item, "item", "n_trials=4, train.max_tokens=1e5 or axes.train.seed=[0,1]")
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        head, _, rest = key.partition(".")
        if head not in fields and kind is AblationSpec:
            head, rest = "overrides", key
        if rest and _is_mapping_field(kind, head):
            section = dict(out.get(head) or {})
            name = next((n for n in sorted(section, key=len, reverse=True) if rest.startswith(f"{n}.")), None)
            parent, _, leaf = rest.rpartition(".")
            if name is not None and isinstance(section[name], Mapping):  # one key of a parameter
                section[name] = {**section[name], rest[len(name) + 1:]: value}
            elif parent and leaf in PARAM_KEYS and fields[head].metadata.get("leaf") is is_param:
                section[parent] = {leaf: value}  # the first key of a new parameter
            else:
                section[rest] = value
            out[head] = section
        elif rest:
            out[head] = _set(out.get(head), rest.split("."), value)
        else:
            out[head] = value
    if problems:
        raise ConfigError(problems)
    return out


def spec_from_dict(kind: type[S], data: Mapping[str, Any], source: str | None = None) -> S:
    """A validated spec from a plain dict (a YAML file's, or :meth:`StudySpec.to_dict`'s)."""
    source = source or kind.kind
    problems: list[str] = []
    if kind is SweepSpec and "space" not in data:
        data = {**data, "space": DEFAULT_SPACE}
    spec = build(kind, [(source, data)], problems)
    if spec is None:
        raise ConfigError(problems)
    if isinstance(spec, SweepSpec):
        space = {}
        for name, entry in flatten_mapping(spec.space, is_param).items():
            if not isinstance(entry, Mapping):
                problems.append(f"{source}: space.{name}: expected a range (low/high[/log/step]) or choices, "
                                f"got {shown(entry)}")
                continue
            layer = {"type": "categorical" if "choices" in entry else "float", **entry}
            space[name] = build(Param, [(f"{source}: space.{name}", layer)], problems) or Param()
        # a searched key replaces a fixed override of the same key
        overrides = {k: v for k, v in spec.overrides.items() if k not in space}
        enqueue = [flatten_mapping(p) if isinstance(p, Mapping) else p for p in spec.enqueue]
        spec = dataclasses.replace(spec, space=space, overrides=overrides, enqueue=enqueue)
    if isinstance(spec, AblationSpec):  # sub-grids and the base shape written nested (model: {d_model: ...})
        grids = [flatten_mapping(g) if isinstance(g, Mapping) else g for g in spec.grids]
        transfer = dataclasses.replace(spec.lr_transfer, base=flatten_mapping(spec.lr_transfer.base))
        spec = dataclasses.replace(spec, grids=grids, lr_transfer=transfer)
        if spec.ladder.enabled:
            spec = with_ladder(spec, source)
    problems.extend(f"{source}: {p}" for p in spec.problems())
    if problems:
        raise ConfigError(problems)
    return spec


def with_ladder(spec: AblationSpec, source: str) -> AblationSpec:
    """``spec`` with its ladder's rungs as dotted config keys (``d_model`` is ``model.d_model``), checked, then
    expanded into axes and sub-grids (:func:`satlab.studies.ladder.expand`)."""
    from satlab.studies.ladder import expand, ladder_problems

    rungs = [{k if "." in k else f"model.{k}": v for k, v in flatten_mapping(r).items()}
             if isinstance(r, Mapping) else r for r in spec.ladder.rungs]
    spec = dataclasses.replace(spec, ladder=dataclasses.replace(spec.ladder, rungs=rungs))
    if problems := spec.problems() + ladder_problems(spec):
        raise ConfigError(list(dict.fromkeys(f"{source}: {p}" for p in problems)))
    try:
        return expand(spec)
    except ConfigError as e:
        raise ConfigError([f"{source}: {p}" for p in e.problems]) from None


def check_against_config(spec: StudySpec) -> None:
    """Load the base experiment with the fixed overrides, then with each value a trial can get (range ends, choices,
    axis values), reporting every unknown key and bad value at once. The axes a sub-grid narrows are loaded with
    their values together, grid by grid, not one at a time: a value can be valid only beside its grid's others
    (4 heads suit width 64 but not, under CompleteP with base width 64, width 48)."""
    try:
        cfg = spec.base_config()
    except ConfigError as e:
        raise ConfigError([f"{spec.kind} '{spec.name}' (base {spec.base} + overrides): {p}"
                           for p in e.problems]) from None
    known = flatten(cfg)
    points = {k: p.extremes() for k, p in spec.space.items()} if isinstance(spec, SweepSpec) else spec.axes
    if isinstance(spec, AblationSpec) and spec.ladder.enabled:  # a rung's values go together: the ladder's plan
        points = {k: v for k, v in points.items() if k not in spec.ladder.rung_keys()}  # loaded each rung whole
    problems = []
    if isinstance(spec, AblationSpec) and spec.grids:
        problems.extend(grid_problems(spec, points))
        narrowed = {k for grid in spec.grids for k in grid if k != spec.seed_key}
        points = {k: v for k, v in points.items() if k not in narrowed}
    for key, values in points.items():
        if isinstance(spec, SweepSpec) and key not in known:
            problems.append(f"{spec.kind} '{spec.name}': space: unknown config key '{key}'{did_you_mean(key, known)}")
            continue
        if typed := type_problems(spec, key):
            problems.extend(typed)
            continue
        for value in values:
            override = f"{key}={format_value(value)}"
            try:
                spec.base_config([override])
            except ConfigError as e:
                source = override_source(override)
                problems.extend(f"{spec.kind} '{spec.name}', {source.removeprefix('override ')}: "
                                f"{p.removeprefix(f'{source}: ')}" for p in e.problems)
    if isinstance(spec, AblationSpec) and spec.compare_with is not None:
        try:  # read now, not at the end of the grid: it must be an ablation
            read_spec(spec.kind, spec.compare_with, _keys(type(spec)))
        except ConfigError as e:
            problems.extend(f"{spec.kind} '{spec.name}': compare_with: {p}" for p in e.problems)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))


def grid_problems(spec: AblationSpec, points: Mapping[str, Any]) -> list[str]:
    """The axes any sub-grid narrows (of ``points``; not the seed) loaded together, grid by grid: every combination
    of their values in the grid (a grid that leaves such an axis out takes all its values), each combination once."""
    problems, loaded = [], set()
    narrowed = [k for k in points if k != spec.seed_key and any(k in grid for grid in spec.grids)]
    if typed := [p for k in narrowed for p in type_problems(spec, k)]:
        return typed
    for i, grid in enumerate(spec.grids):
        for combo in itertools.product(*(grid.get(k, points[k]) for k in narrowed)):
            overrides = tuple(f"{k}={format_value(v)}" for k, v in zip(narrowed, combo, strict=True))
            if overrides in loaded:
                continue
            loaded.add(overrides)
            try:
                spec.base_config(list(overrides))
            except ConfigError as e:
                problems.extend(f"{spec.kind} '{spec.name}', grids[{i}] ({' '.join(overrides)}): {p}"
                                for p in e.problems)
    return problems


def type_problems(spec: StudySpec, key: str) -> list[str]:
    """What in the search space or the axis of ``key`` does not fit the setting's type: a numeric range over a text
    or a switch, a float range over an integer setting, a choice or axis value of another type (a number for a
    text setting, which the config would take as the text "1")."""
    hint = setting_hint(ExperimentConfig, key)
    if hint is None:
        return []  # no such setting: the config load names it
    plain = without_none(hint)[0]
    where = f"{spec.kind} '{spec.name}': {'space' if isinstance(spec, SweepSpec) else 'axis'} {key}"
    param = spec.space[key] if isinstance(spec, SweepSpec) else None
    if param is not None and param.type != "categorical":
        if plain not in (int, float) or plain is bool:
            return [f"{where} is a numeric range (low/high), but {key} takes {type_phrase(plain)}: a range over it "
                    f"means nothing. Search it with a list of values instead, e.g. {key}: {{choices: [a, b]}}"]
        if plain is int and param.type == "float":
            return [f"{where} is a float range, but {key} takes an integer: a trial would get fractions. Give the "
                    "range type: int (whole low and high)"]
        return []
    values = param.choices if param is not None else spec.axes.get(key)
    bad = [(v, p) for v in (values if isinstance(values, list) else []) if (p := value_type_problem(hint, v))]
    return [f"{where}: {key} {problem}; {'choices' if param is not None else 'axis values'} must be values of the "
            f"setting's type, as it is written in a config" for _, problem in bad[:3]]


def _keys(kind: type[StudySpec]) -> list[str]:
    return [f.name for f in dataclasses.fields(kind)]


def _is_mapping_field(kind: type, name: str) -> bool:
    hint = typing.get_type_hints(kind).get(name)
    return typing.get_origin(hint) is dict


def _set(node: Any, path: list[str], value: Any) -> Any:
    node = dict(node) if isinstance(node, Mapping) else {}
    node[path[0]] = value if len(path) == 1 else _set(node.get(path[0]), path[1:], value)
    return node
