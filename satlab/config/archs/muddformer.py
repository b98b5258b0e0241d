"""MUDDFormer, multiway dynamic dense connections (:mod:`satlab.models.archs.muddformer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from satlab.config.archs import ArchSpec, declare


@dataclass
class MUDDFormerOptions:
    """``ffn_realloc``: SwiGLU width grows linearly with depth from 0.5x to 1.5x (same total)."""

    ffn_realloc: bool = False


def extra_params(cfg: Any) -> int:
    """Per DA i (1..L): W_1 d×4(i+1), W_2 4(i+1)×C(i+1), the static C×(i+1); C = 4, 1 for the last; plus the
    separate K and V input norms (2d per block)."""
    d, L = cfg.d_model, cfg.n_layers
    total = 2 * d * L
    for i in range(1, L + 1):
        sources, outputs = i + 1, 4 if i < L else 1
        total += d * 4 * sources + 4 * sources * outputs * sources + outputs * sources
    return total


declare(ArchSpec("muddformer", "MUDDFormer", "multiway dynamic dense connections (Q, K, V, R)",
                 options=MUDDFormerOptions, extra_params=extra_params, exact_start={},
                 variants=(("muddformer ffn_realloc", {"ffn_realloc": True}),), order=50))
