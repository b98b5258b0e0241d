"""Dynamic hyper-connections, n residual copies mixed by input-dependent weights
(:mod:`satlab.models.archs.hyperconnections`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare
from satlab.config.structured import in_range


@dataclass
class HyperConnectionOptions:
    """Dynamic hyper-connections with ``expansion`` residual copies."""

    expansion: int = field(default=4, metadata=in_range(1, 64))
    recompute: bool = True  # recompute the mixing coefficients in backward instead of storing them


def extra_params(cfg: Any) -> int:
    """Per sublayer: W_m (d), W_r (n·d), W_β (d), the norm (d), static e (n), I (n²), 1 (n), s_α, s_β."""
    n, d = cfg.hyperconnections.expansion, cfg.d_model
    return 2 * cfg.n_layers * ((n + 3) * d + n * n + 2 * n + 2)


declare(ArchSpec("hyperconnections", "Hyper-Connections", "dynamic hyper-connections, n residual copies",
                 options=HyperConnectionOptions, extra_params=extra_params, exact_start={}, order=40))
