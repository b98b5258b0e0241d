"""ResFormer, the static value residual V'_n = λ_{n,1}·V_1 + λ_{n,2}·V_n (:mod:`satlab.models.archs.resformer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare


@dataclass
class ResFormerOptions:
    """``learnable``: λ1 = λ_scale·softmax(λ'), λ2 per layer (the paper's "plus" form); ``fixed``: 0.5/0.5."""

    mode: str = field(default="learnable", metadata={"choices": ("learnable", "fixed")})


def extra_params(cfg: Any) -> int:
    """λ' and λ2 per layer after the first, and λ_scale; none in fixed mode."""
    return 0 if cfg.resformer.mode == "fixed" else (cfg.n_layers - 1) + (cfg.n_layers - 1) + 1


declare(ArchSpec("resformer", "ResFormer", "static value residual: λ1·V_1 + λ2·V_n", options=ResFormerOptions,
                 variants=(("resformer fixed", {"mode": "fixed"}),), extra_params=extra_params, order=10))
