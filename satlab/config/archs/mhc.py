"""mHC, manifold-constrained hyper-connections (:mod:`satlab.models.archs.mhc`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare
from satlab.config.structured import in_range


@dataclass
class MHCOptions:
    streams: int = field(default=4, metadata=in_range(2, 16))
    sinkhorn_iters: int = field(default=20, metadata=in_range(1, 1000))
    recompute: bool = True  # recompute H_pre, H_post, H_res (Sinkhorn included) in backward instead of storing them


def extra_params(cfg: Any) -> int:
    """2L(nd(n² + 2n) + n² + 2n + 3) + n²d + n + 1 (the spec's count)."""
    n, d, L = cfg.mhc.streams, cfg.d_model, cfg.n_layers
    return 2 * L * (n * d * (n * n + 2 * n) + n * n + 2 * n + 3) + n * n * d + n + 1


declare(ArchSpec(
    "mhc", "mHC", "manifold-constrained hyper-connections: n streams, doubly stochastic mixing (Sinkhorn-Knopp)",
    options=MHCOptions, extra_params=extra_params, exact_start={}, order=60,
))
