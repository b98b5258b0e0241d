"""What each architecture is, without torch: its name and label, its options (the ``model.<name>`` section of the
config), its named variants, the condition under which it starts as the Transformer, and the spec's formula for its
extra parameters. One module per architecture here declares it (:func:`declare`); its implementation, the modules and
the math, is the module of the same name in :mod:`satlab.models.archs`, which registers it there
(:func:`satlab.models.architecture.register`).

The split keeps the configuration (and so ``satlab --help``, presets, study specs) free of torch: a config is read,
checked and printed before any model is imported. Importing this package imports every module in it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchSpec:
    """``options``: a dataclass of the architecture's settings (fields declare their ranges and choices, and a
    ``problems(cfg)`` method checks what depends on the sizes); ``variants``: named option sets for ``satlab archs``
    and the parity tests; ``exact_start``: model-config overrides under which the initial model equals the
    Transformer with the same weights (None: it does not start as the Transformer); ``extra_params``: the spec's
    count of parameters beyond the Transformer's; ``gate_fn``: the gate function of its value-path gates, for the
    gate analysis, and ``gate_target`` what they multiply; ``order``: where it is listed (tables, bench, reports),
    the Transformer first, then by lineage."""

    name: str
    label: str
    description: str
    options: type | None = None
    variants: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    exact_start: Mapping[str, Any] | None = None
    extra_params: Callable[[Any], int] | None = None
    gate_fn: Callable[[Any], str] | None = None
    gate_target: str = "V_1"  # value-access plots compare gates on V_1 only
    order: int = 1000

    def options_of(self, cfg: Any) -> Any:
        return getattr(cfg, self.name, None) if self.options is not None else None


ARCH_SPECS: dict[str, ArchSpec] = {}
"""Every declared architecture, in ``order``."""


def declare(spec: ArchSpec) -> ArchSpec:
    """Add ``spec`` (a later one of the same name replaces the earlier), keeping :data:`ARCH_SPECS` in ``order``."""
    entries = {**ARCH_SPECS, spec.name: spec}
    ARCH_SPECS.clear()
    ARCH_SPECS.update(sorted(entries.items(), key=lambda item: (item[1].order, item[0])))
    return spec


def label(name: str) -> str:
    """The display name of a declared architecture (the name itself for an unknown one)."""
    return ARCH_SPECS[name].label if name in ARCH_SPECS else name


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
