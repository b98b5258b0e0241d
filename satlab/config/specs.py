"""YAML files of plain keys and values, shared by the experiment loader and the drivers' specs (sweeps, ablations):
finding a spec by name or path, reading a file's top-level mapping into a plain dict, and dotted keys to nested
mappings and back.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.errors import ConfigError, unknown_name


def short_path(path: Path) -> str:
    """A short name for messages: relative to the working directory when possible."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def read_mapping(path: Path, label: str | None = None) -> dict[str, Any]:
    """A YAML file's top-level mapping as a plain dict (interpolations left as written). A file that cannot be read
    or holds something else is a :class:`ConfigError` that names it as ``label`` (default: the path)."""
    label = str(path) if label is None else label
    try:
        loaded = OmegaConf.load(path)
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{label}: cannot read YAML: {' '.join(str(e).split())}") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"{label}: expected a mapping of keys at the top level")
    return typing.cast(dict[str, Any], OmegaConf.to_container(loaded, resolve=False))


def spec_names(root: Path, suffix: str) -> list[str]:
    """The names of the specs under ``root`` (its files ending in ``suffix``, without it); none if it is missing."""
    return sorted(p.stem for p in root.glob(f"*{suffix}")) if root.is_dir() else []


def find_spec(name_or_path: str | Path, kind: str, root: Path, suffix: str) -> Path:
    """The file of a spec: ``name_or_path`` itself when it names a YAML file, else ``<root>/<name><suffix>``. A
    missing file, or an unknown name (with "did you mean" and the specs under ``root``), is a ConfigError."""
    as_path = Path(name_or_path)
    if as_path.suffix in (".yaml", ".yml") or as_path.is_file():
        if not as_path.is_file():
            raise ConfigError(f"{kind} spec not found: {name_or_path}")
        return as_path
    path = root / f"{name_or_path}{suffix}"
    if not path.is_file():
        raise ConfigError(unknown_name(kind, str(name_or_path), spec_names(root, suffix)) + f" (specs in {root})")
    return path


def read_spec(name_or_path: str | Path, kind: str, root: Path, suffix: str) -> tuple[Path, dict[str, Any]]:
    """(file, plain dict) of a spec name or YAML file (see :func:`find_spec`); ``name`` defaults to the file's."""
    path = find_spec(name_or_path, kind, root, suffix)
    data = read_mapping(path)
    data.setdefault("name", path.stem)
    return path, data


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}`` (for writing an experiment YAML)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def flatten_mapping(data: Mapping[str, Any], is_leaf: Callable[[Any], bool] | None = None,
                    prefix: str = "") -> dict[str, Any]:
    """Dotted keys down to the values ``is_leaf`` accepts (by default, every value that is not a mapping):
    ``{"model": {"arch": [..]}}`` -> ``{"model.arch": [..]}``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and not (is_leaf is not None and is_leaf(value)):
            flat.update(flatten_mapping(value, is_leaf, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
