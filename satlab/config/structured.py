"""The one validator of dataclass-shaped input: experiment configs and study specs are both built by merging plain
dict layers (files, then command-line items) into the structured defaults of a dataclass, one leaf at a time, so a
bad key or value in one place does not hide the next: every problem is collected, prefixed with where it came from.

A ``dict[str, ...]`` field is a mapping of dotted keys (``axes: {model.arch: [...]}``): layers merge into it key by
key, nested mappings flattened down to what the field's ``metadata["leaf"]`` predicate accepts (default: every
value that is not a mapping). A layer that sets such a field to null empties it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from types import UnionType
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.errors import ECHO_CHARS, clipped, did_you_mean, quoted, shown, unknown_name
from satlab.config.specs import flatten_mapping

T = TypeVar("T")
Layer = tuple[str, Mapping[str, Any]]
"""Where a layer came from (a file, an override), and its plain nested dict."""
Range = tuple[float, float, bool]
"""(low, high, whether low is excluded): the values of a numeric setting a user could mean."""


def build(cls: type[T], layers: Sequence[Layer], problems: list[str]) -> T | None:
    """``cls`` with the layers merged into its defaults; None (with the reason in ``problems``) when the merged
    values cannot make one."""
    merged = OmegaConf.structured(cls)
    for source, data in layers:
        merge(merged, cls, data, "", source, problems)
    try:
        return typing.cast(T, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        problems.append(f"{getattr(e, 'full_key', '') or cls.__name__}: {first_line(e)}")
        return None


def merge(root: Any, cls: type, data: Mapping[str, Any], prefix: str, source: str, problems: list[str]) -> None:
    """Assign ``data`` (for the section ``prefix`` of type ``cls``) into the structured ``root`` leaf by leaf, so
    that OmegaConf converts and checks each value on its own and a bad one is reported and skipped."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        full_key = f"{prefix}{key}"
        if key not in hints:
            hint = did_you_mean(key, hints) or f"; valid: {', '.join(hints)}"
            problems.append(f"{source}: unknown key {quoted(full_key)}{hint}")
            continue
        expected = hints[key]
        if dataclasses.is_dataclass(expected):
            if isinstance(value, Mapping):
                merge(root, typing.cast(type, expected), value, f"{full_key}.", source, problems)
            elif value is not None:
                sections = ", ".join(typing.get_type_hints(expected))
                problems.append(f"{source}: {quoted(full_key)} is a section ({sections}), got {shown(value)}")
            continue
        if typing.get_origin(expected) is dict:
            if value is None:
                OmegaConf.update(root, full_key, {}, merge=False)
            elif isinstance(value, Mapping):
                node = OmegaConf.select(root, full_key)
                floats = typing.get_args(expected)[1:] == (float,)
                for name, item in flatten_mapping(value, fields[key].metadata.get("leaf")).items():
                    if floats and isinstance(item, int) and not isinstance(item, bool):
                        item = float(item)  # OmegaConf deprecates converting it on assignment
                    try:
                        node[name] = item  # item access: a dotted key stays one key
                    except OmegaConfBaseException as e:
                        problems.append(f"{source}: {full_key}.{name}: {first_line(e)} (expected "
                                        f"{type_name(expected)})")
            else:
                problems.append(f"{source}: {quoted(full_key)} must be a mapping of keys to values, got {shown(value)}")
            continue
        if (problem := shape_problem(expected, value, fields[key])) is not None:
            problems.append(f"{source}: {full_key} {problem}")
            continue
        if value is None and expected is str:
            value = ""  # an empty text: the checks of the field say what it must hold (a run name, an architecture)
        try:
            OmegaConf.update(root, full_key, exact_int(value) if accepts_int(expected) else value, merge=False)
        except OmegaConfBaseException as e:
            problems.append(f"{source}: {full_key}: {first_line(e)} (expected {type_name(expected)})")


def shape_problem(hint: Any, value: Any, field: dataclasses.Field) -> str | None:
    """Why ``value`` cannot be a value of a field of type ``hint`` whatever its content, else None: no value (an
    empty ``key=`` or null) for a required field that is not text, or a list or mapping for a single value."""
    plain, optional = without_none(hint)
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    said = "" if default is dataclasses.MISSING else f" (the default is {shown(default)})"
    if value is None and not optional and plain is not str and plain is not Any:  # Any takes None too
        return (f"has no value, but it needs {type_phrase(plain)}{said}: give one, or leave the key out to keep the "
                "default")
    if isinstance(value, list | tuple | Mapping) and plain in (str, int, float, bool):
        shape = "a mapping" if isinstance(value, Mapping) else "a list"
        return f"takes {type_phrase(plain)}, got {shape}: {shown(value)}"
    return None


def without_none(hint: Any) -> tuple[Any, bool]:
    """``(int, True)`` for ``int | None``; ``(hint, False)`` for a hint that does not admit None."""
    optional = typing.get_origin(hint) in (typing.Union, UnionType) and type(None) in typing.get_args(hint)
    return (typing.get_args(hint)[0] if optional else hint), optional


def type_phrase(hint: Any) -> str:
    """``str`` -> "a text", ``int`` -> "an integer", ...: a type as a message says what a setting takes."""
    plain = {int: "an integer", float: "a number", bool: "true or false", str: "a text"}
    return plain.get(hint, f"a value of type {type_name(hint)}")


def in_range(low: float, high: float, low_excluded: bool = False, note: str = "") -> dict[str, Any]:
    """The ``metadata`` of a numeric field whose values lie in [low, high] ((low, high] with ``low_excluded``), for
    :func:`field_problems`; ``note`` ends the message of a value outside it (``"; null means model.init_std"``)."""
    return {"range": (low, high, low_excluded), **({"note": note} if note else {})}


def field_problems(obj: Any, prefix: str = "", skip: Collection[str] = ()) -> list[str]:
    """The values of ``obj`` (and of its dataclass sections; not the fields named in ``skip``) outside what their
    fields declare in ``metadata``, one message each, keys prefixed with ``prefix``:

    - ``"range"``: a :data:`Range` (see :func:`in_range`). None passes (an optional setting left unset); NaN,
      infinities and non-numbers never do, and a field typed ``int`` (or ``int | None``) takes integers only.
    - ``"choices"``: the valid values; ``"label"`` names the setting in the message instead of its key.
    - ``"note"``: text appended to the message, e.g. what 0 or null means for the setting.
    """
    problems = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value, key, note = getattr(obj, f.name), f"{prefix}{f.name}", f.metadata.get("note", "")
        if dataclasses.is_dataclass(value):
            problems.extend(field_problems(value, f"{key}."))
        elif "range" in f.metadata:
            integer = without_none(hints[f.name])[0] is int
            if (problem := _range_problem(value, f.metadata["range"], integer)) is not None:
                problems.append(f"{key} {problem}{note}")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(unknown_name(f.metadata.get("label", key), value, f.metadata["choices"]) + note)
    return problems


def _range_problem(value: Any, bounds: Range, integer: bool) -> str | None:
    """Why ``value`` is outside ``bounds``, else None (also for None: an optional setting left unset)."""
    low, high, low_excluded = bounds
    if value is None:
        return None
    number = isinstance(value, int if integer else int | float) and not isinstance(value, bool)
    if number and (low < value <= high if low_excluded else low <= value <= high):
        return None
    kind = "an integer in" if integer else "in" if number else "a number in"
    return f"must be {kind} {'(' if low_excluded else '['}{_bound(low)}, {_bound(high)}], got {shown(value)}"


def _bound(x: float) -> str:
    """A bound as a person reads it: 0.999, a round large number as 1e+15, any other integer in full (4,096, 65,536,
    and 4,294,967,295, which %g would round)."""
    text = f"{x:g}"
    return f"{int(x):,}" if float(x).is_integer() and ("e" not in text or float(text) != x) else text


def setting_hint(cls: type, key: str) -> Any:
    """The type hint of the dotted setting ``key`` of the dataclass ``cls`` (``data.text_field`` -> ``str``); a key
    under a ``dict[str, V]`` field has ``V``; None for a key that is no setting."""
    hint: Any = cls
    for i, part in enumerate(parts := key.split(".")):
        if typing.get_origin(hint) is dict:
            return typing.get_args(hint)[1] if typing.get_args(hint) else Any
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return None
        hint = typing.get_type_hints(hint).get(part)
        if hint is None:
            return None
        if i == len(parts) - 1:
            return hint
    return None


def value_type_problem(hint: Any, value: Any) -> str | None:
    """Why ``value`` is not a value of a setting of type ``hint`` as a person wrote it (a number for a text, a text
    for a number, a fraction for an integer, anything but true/false for a switch), else None. Values OmegaConf
    would silently convert (``1`` to the text ``"1"``) are refused here: a search over them means nothing."""
    plain, optional = without_none(hint)
    if value is None:
        return None if optional or plain is str else f"takes {type_phrase(plain)}, not null"
    if plain is str:
        return None if isinstance(value, str) else f"takes a text, got {shown(value)}"
    if plain is bool:
        return None if isinstance(value, bool) else f"takes true or false, got {shown(value)}"
    if plain is int:
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return None if whole and not isinstance(value, bool) else f"takes an integer, got {shown(value)}"
    if plain is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number else f"takes a number, got {shown(value)}"
    return None  # lists, tuples, mappings: the config load checks them


def accepts_int(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, UnionType):
        return int in typing.get_args(hint)
    return hint is int


def exact_int(value: Any) -> Any:
    """``1e6`` (a YAML float) or ``"1.5e6"`` as an int when it is a whole number; anything else unchanged, so
    that OmegaConf reports it."""
    if isinstance(value, bool) or not isinstance(value, float | str):
        return value
    try:
        number = Decimal(value) if isinstance(value, str) else Decimal(repr(value))
    except InvalidOperation:
        return value
    return int(number) if number.is_finite() and number == number.to_integral_value() else value


def type_name(hint: Any) -> str:
    plain_class = isinstance(hint, type) and typing.get_origin(hint) is None
    return hint.__name__ if plain_class else str(hint).replace("typing.", "")


def first_line(error: Exception) -> str:
    """The first line of a library's error message, cut in its middle when it quotes a long value."""
    return clipped(str(error).splitlines()[0], 2 * ECHO_CHARS) if str(error) else type(error).__name__
