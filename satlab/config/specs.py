"""YAML files of plain keys and values, shared by the experiment loader and the drivers' specs (sweeps, ablations):
reading a file's top-level mapping into a plain dict, command-line ``key=value`` items, and dotted keys to nested
mappings and back. Which file a name or a path means is :mod:`satlab.config.resolve`'s.
"""

from __future__ import annotations

import io
import stat
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from satlab.config.errors import ECHO_CHARS, ConfigError, quoted


def short_path(path: Path) -> str:
    """A short name for messages: relative to the working directory when possible."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


MAX_YAML_BYTES = 1 << 20
"""The largest experiment or spec file read (1 MiB): the largest shipped one is a few kB, and YAML of 10 MB takes
minutes to parse."""
MAX_EXPANDED_CHARS = 4 * MAX_YAML_BYTES
"""The most characters a file may hold once its YAML aliases are expanded: a file of 1 MiB that aliases one long
value a thousand times (or nests aliases, the "billion laughs") would otherwise become gigabytes in memory."""
MAX_ITEM_CHARS = 10_000
"""The longest ``key=value`` command-line item: longer text belongs in a file."""


def read_mapping(path: Path, label: str | None = None, what: str = "config file") -> dict[str, Any]:
    """A YAML file's top-level mapping as a plain dict (interpolations left as written).

    The file must be a regular file of at most :data:`MAX_YAML_BYTES` of UTF-8 YAML holding a mapping (whether it
    is a file of the kind asked for, :func:`satlab.config.resolve.read_file` says). Anything else is a
    :class:`ConfigError` naming the file as ``label`` (default: the path) and never quoting its content.
    """
    label = str(path) if label is None else label
    text = _read_text(path, label)
    try:  # the node kinds first: OmegaConf would parse a top-level string again as YAML
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and not isinstance(node, yaml.MappingNode):
            shape = "a list" if isinstance(node, yaml.SequenceNode) else "a single value"
            raise ConfigError(f"{label} holds {shape} at the top level, not a mapping of keys: it is not a satlab "
                              f"{what}")
        if node is not None and (size := expanded_size(node)) > MAX_EXPANDED_CHARS:
            raise ConfigError(f"{label}: its aliases (*name) expand its {len(text):,} characters of YAML to about "
                              f"{size:,}; experiment and spec files may expand to at most {MAX_EXPANDED_CHARS:,} "
                              "characters (repeat a value by writing it again, not by aliasing it many times over)")
        loaded = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}{_yaml_error(e, text)}") from None
    except RecursionError:  # ``[[[[...`` a hundred thousand deep
        raise ConfigError(f"{label}: invalid YAML: it nests deeper than it can be read; experiment and spec files "
                          "are mappings a few levels deep") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{label}: cannot read YAML: {type(e).__name__}") from None
    return typing.cast(dict[str, Any], OmegaConf.to_container(loaded, resolve=False))


def expanded_size(node: yaml.Node) -> int:
    """The characters of a composed YAML document with every alias expanded (each node counted as one more), counted
    without expanding it: an alias is the node it names, so each node's size is computed once."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = 1  # a node that contains itself (a recursive alias) counts once
        if isinstance(n, yaml.ScalarNode):
            total = 1 + len(n.value)
        elif isinstance(n, yaml.SequenceNode):
            total = 1 + sum(size(child) for child in n.value)
        else:
            total = 1 + sum(size(k) + size(v) for k, v in n.value)
        sizes[id(n)] = total
        return total

    return size(node)


def _read_text(path: Path, label: str) -> str:
    """The UTF-8 text of a regular file of at most :data:`MAX_YAML_BYTES`; checked before it is opened, so a FIFO or
    a device (``/dev/stdin``) is refused rather than read for ever."""
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{label} is a folder, not a YAML file")
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{label} is not a regular file (a device, pipe or socket), not a YAML file")
        if info.st_size > MAX_YAML_BYTES:
            raise ConfigError(f"{label} is {info.st_size:,} bytes; experiment and spec files are at most 1 MiB "
                              f"({MAX_YAML_BYTES:,} bytes) of YAML")
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:  # missing, a symlink loop, no permission
        raise ConfigError(f"{label}: cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_YAML_BYTES:  # it grew since the stat
        raise ConfigError(f"{label} is over {MAX_YAML_BYTES:,} bytes; experiment and spec files are at most 1 MiB "
                          "of YAML")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{label} is not UTF-8 text (the byte at offset {e.start}, 0x{raw[e.start]:02x}, cannot be "
                          "decoded); experiment and spec files are YAML text") from None


def _yaml_error(error: yaml.YAMLError, text: str) -> str:
    """Where (line, column) and what the parser found wrong, without the file's lines that PyYAML's message quotes."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    if isinstance(error, yaml.MarkedYAMLError) and mark is not None:
        what = ": ".join(p for p in (error.context, error.problem) if p)
        return f", line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {what}"
    if isinstance(error, yaml.reader.ReaderError):  # a control character: ``character`` is its code
        line, line_start = text.count("\n", 0, error.position) + 1, text.rfind("\n", 0, error.position) + 1
        return (f", line {line}, column {error.position - line_start + 1}: invalid YAML: character "
                f"#x{error.character:04x} is not allowed in YAML text")
    return f": invalid YAML ({type(error).__name__})"


def parse_item(item: str, what: str, example: str) -> tuple[str, Any]:
    """One command-line ``key=value`` item (an experiment's override, a study spec's item) as its dotted key and its
    value, read as YAML by OmegaConf's dotlist (``1e-3``, ``[0, 1]``, ``null``); the one parser of both. A
    :class:`ConfigError` says why ``item`` (``what``: "override", "item") is refused, with ``example``."""
    if len(item) > MAX_ITEM_CHARS:
        raise ConfigError(f"the item {quoted(item, 40)} is {len(item):,} characters; a command-line item is at most "
                          f"{MAX_ITEM_CHARS:,} (put long text in a YAML file)")
    key, sep, text = item.partition("=")
    if not sep or not key.strip() or "" in key.split("."):
        raise ConfigError(f"malformed {what} {quoted(item)}: expected key=value, e.g. {example}")
    try:
        return key, OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"malformed {what} {quoted(item)}: {' '.join(str(e).split())[:ECHO_CHARS]}") from None


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
