"""Showing and saving a resolved config: YAML text, flat MLflow params, a rich panel, and loading YAML back."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax

from satlab.config.errors import ConfigError
from satlab.config.loader import config_from_dict
from satlab.config.schema import ExperimentConfig
from satlab.console import console as make_console

Param = str | int | float | bool


def to_yaml(cfg: ExperimentConfig) -> str:
    """The config as YAML, every field written out; :func:`config_from_yaml` reads it back to an equal config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: ExperimentConfig) -> dict[str, Param]:
    """Dotted keys to scalar values, for MLflow params (``{"optim.lr": 0.003, "optim.betas": "[0.9, 0.95]"}``).

    ``None`` becomes ``"null"`` and sequences become ``"[a, b]"``, so ``f"{key}={value}"`` is a valid override.
    """
    flat: dict[str, Param] = {}

    def walk(prefix: str, section: dict[str, Any]) -> None:
        for key, value in section.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            elif value is None:
                flat[f"{prefix}{key}"] = "null"
            elif isinstance(value, list | tuple):
                flat[f"{prefix}{key}"] = "[" + ", ".join(str(v) for v in value) + "]"
            else:
                flat[f"{prefix}{key}"] = value

    walk("", dataclasses.asdict(cfg))
    return flat


def print_config(cfg: ExperimentConfig, console: Console | None = None) -> None:
    """Print the config as syntax-highlighted YAML in a panel titled with its name and description."""
    console = console if console is not None else make_console()
    body = Syntax(to_yaml(cfg).rstrip(), "yaml", theme="ansi_dark", background_color="default", word_wrap=True)
    title = f"[bold]experiment[/] [cyan]{cfg.name}[/]"
    console.print(Panel(body, title=title, subtitle=cfg.description or None, expand=False, border_style="blue"))


def config_from_yaml(text_or_path: str | Path) -> ExperimentConfig:
    """A validated config from YAML text or a YAML file (e.g. the resolved config saved next to a checkpoint).

    A :class:`~pathlib.Path`, or a one-line string naming an existing file or ending in ``.yaml``/``.yml``, is
    read as a file; any other string is YAML text.
    """
    source = "config text"
    text = str(text_or_path)
    one_line = "\n" not in text
    is_path = isinstance(text_or_path, Path) or (one_line and (_is_file(text) or text.endswith((".yaml", ".yml"))))
    try:
        if is_path:
            source = str(text_or_path)
            loaded = OmegaConf.load(text_or_path)
        else:
            loaded = OmegaConf.create(text)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {text_or_path}") from None
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{source}: cannot read YAML: {' '.join(str(e).split())}") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level")
    data = typing.cast(dict[str, Any], OmegaConf.to_container(loaded, resolve=False))
    return config_from_dict(data, source)


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # for example a one-line YAML text longer than a file name may be
        return False
