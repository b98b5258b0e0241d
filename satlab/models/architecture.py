"""What an architecture is, in one place: its registry entry names its options (the ``model.<name>`` section), its
depth loop and value path, its label and named variants, the condition under which it starts exactly as the
Transformer, and the spec's formula for its extra parameters. Everything else (config validation, ``satlab archs``,
bench, reports, plots, parity tests) iterates over :data:`ARCHITECTURES`.

An architecture is one module in :mod:`satlab.models.archs` that calls :func:`register`; the package imports every
module in it, so adding one is adding a file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from satlab.models.streams import ResidualStream


def no_value_path(cfg: Any, layer: int) -> nn.Module | None:
    return None


def no_shared(cfg: Any) -> nn.Module | None:
    return None


@dataclass(frozen=True)
class Architecture:
    """``options``: a dataclass of the architecture's settings (fields may declare ``metadata`` ranges and choices,
    and a ``problems(cfg)`` method checks what depends on the sizes); ``stream``: the depth loop; ``value_path``:
    layer n's value path (or None); ``value_shared``: per-forward weights shared by the value paths;
    ``variants``: named option sets for ``satlab archs``; ``exact_start``: model-config overrides under which the
    initial model equals the Transformer with the same weights (None: it does not start as the Transformer);
    ``extra_params``: the spec's count of parameters beyond the Transformer's; ``gate_fn``: the gate function of
    its value-path gates, for the gate analysis; ``mixing_weights``: its static mixing weights for plots, from a
    built model (default: its depth loop's)."""

    name: str
    label: str
    description: str
    options: type | None = None
    stream: type[ResidualStream] = ResidualStream
    value_path: Callable[[Any, int], nn.Module | None] = no_value_path
    value_shared: Callable[[Any], nn.Module | None] = no_shared
    variants: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    exact_start: Mapping[str, Any] | None = None
    extra_params: Callable[[Any], int] | None = None
    gate_fn: Callable[[Any], str] | None = None
    gate_target: str = "V_1"  # what its gates multiply (value-access plots compare gates on V_1 only)
    mixing_weights: Callable[[Any], dict[str, MixingWeight]] | None = None
    order: int = 1000  # where it is listed (tables, bench, reports): the Transformer first, then by lineage

    def options_of(self, cfg: Any) -> Any:
        return getattr(cfg, self.name, None) if self.options is not None else None


@dataclass
class MixingWeight:
    """A static mixing weight as plotted: 1-D values per layer (from ``first_row``) or a 2-D matrix whose rows and
    columns mean ``row_label`` and ``col_label``; ``missing`` masks entries that do not exist (shown grey, not as 0);
    ``v1_coefficient``: the values are each layer's weight on V_1 (compared with SATFormer's mean gate)."""

    values: Tensor
    row_label: str = "layer"
    col_label: str = ""
    first_row: int = 1
    row_ticks: list[str] | None = None
    missing: Tensor | None = None
    v1_coefficient: bool = False


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Add ``arch`` to the registry (a later entry of the same name replaces the earlier one), kept in ``order``."""
    entries = {**ARCHITECTURES, arch.name: arch}
    ARCHITECTURES.clear()
    ARCHITECTURES.update(sorted(entries.items(), key=lambda item: (item[1].order, item[0])))
    return arch


def label(name: str) -> str:
    """The display name of a registered architecture (the name itself for an unknown one)."""
    return ARCHITECTURES[name].label if name in ARCHITECTURES else name
