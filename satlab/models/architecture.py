"""An architecture's implementation, in one place: its depth loop, its value path and the weights it plots. What it
is without torch (name, label, options, variants, exact start, extra parameters) is declared in
:mod:`satlab.config.archs`; :func:`register` joins the two into an :class:`Architecture`. Everything else (config
validation, ``satlab archs``, bench, reports, plots, parity tests) iterates over :data:`ARCHITECTURES` or, without
torch, over :data:`~satlab.config.archs.ARCH_SPECS`.

An architecture is one module in :mod:`satlab.config.archs` that declares it and one of the same name in
:mod:`satlab.models.archs` that registers its implementation; each package imports every module in it, so adding one
is adding the two files (``docs/architectures.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from satlab.config.archs import ARCH_SPECS, ArchSpec, label
from satlab.config.errors import ConfigError
from satlab.models.streams import ResidualStream


def no_value_path(cfg: Any, layer: int) -> nn.Module | None:
    return None


def no_shared(cfg: Any) -> nn.Module | None:
    return None


@dataclass(frozen=True)
class Architecture(ArchSpec):
    """The declaration (:class:`~satlab.config.archs.ArchSpec`) and its implementation: ``stream``, the depth loop;
    ``value_path``, layer n's value path (or None); ``value_shared``, per-forward weights shared by the value paths;
    ``mixing_weights``, its static mixing weights for plots, from a built model (default: its depth loop's);
    ``residual_branches``: its blocks add their sublayers' outputs to a residual, so CompleteP's depth rules apply
    (``model.parametrization``; False for AttnRes, whose softmax read over depth already weights each branch by its
    share). The classes of the parameters it adds are declared by its modules (``param_classes``, see
    :mod:`satlab.models.parametrization`)."""

    stream: type[ResidualStream] = ResidualStream
    value_path: Callable[[Any, int], nn.Module | None] = no_value_path
    value_shared: Callable[[Any], nn.Module | None] = no_shared
    mixing_weights: Callable[[Any], dict[str, MixingWeight]] | None = None
    residual_branches: bool = True


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
"""Every implemented architecture, in the declarations' order."""


def register(name: str, **implementation: Any) -> Architecture:
    """Implement the declared architecture ``name`` with ``implementation`` (the fields :class:`Architecture` adds to
    its declaration); a later implementation of the same name replaces the earlier one."""
    if name not in ARCH_SPECS:
        raise ConfigError(f"cannot implement architecture '{name}': it is not declared (satlab/config/archs/"
                          f"{name}.py declares it with satlab.config.archs.declare); declared: {', '.join(ARCH_SPECS)}")
    spec = ARCH_SPECS[name]
    arch = Architecture(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(ArchSpec)}, **implementation)
    entries = {**ARCHITECTURES, name: arch}
    ARCHITECTURES.clear()
    ARCHITECTURES.update((key, entries[key]) for key in ARCH_SPECS if key in entries)
    return arch


__all__ = ["ARCHITECTURES", "Architecture", "MixingWeight", "label", "register"]
