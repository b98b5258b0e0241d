"""DenseFormer, a depth-weighted average of all earlier block outputs after each block
(:mod:`satlab.models.archs.denseformer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare
from satlab.config.structured import in_range


@dataclass
class DenseFormerOptions:
    """Depth-weighted average after every ``period``-th block, over blocks j with j ≡ i (mod ``dilation``)."""

    dilation: int = field(default=1, metadata=in_range(1, 4096))
    period: int = field(default=1, metadata=in_range(1, 4096))


def dwa_sources(i: int, dilation: int) -> list[int]:
    """Indices j of the block outputs that the DWA after block i averages (j ≡ i mod dilation)."""
    return [j for j in range(i + 1) if (i - j) % dilation == 0]


def extra_params(cfg: Any) -> int:
    """One weight per source of each DWA."""
    options = cfg.denseformer
    return sum(len(dwa_sources(i, options.dilation)) for i in range(1, cfg.n_layers + 1) if i % options.period == 0)


declare(ArchSpec("denseformer", "DenseFormer", "depth-weighted average of all earlier block outputs",
                 options=DenseFormerOptions, extra_params=extra_params, exact_start={},
                 variants=(("denseformer dilation=2 period=2", {"dilation": 2, "period": 2}),), order=30))
