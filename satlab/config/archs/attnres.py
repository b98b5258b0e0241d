"""Attention Residuals, Full and Block (:mod:`satlab.models.archs.attnres`): every sublayer reads a softmax-weighted
sum over the earlier sublayers' outputs instead of a residual stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare
from satlab.config.structured import in_range


@dataclass
class BlockAttnResOptions:
    block_size: int = field(default=4, metadata=in_range(2, 4096))  # sublayers per block

    def problems(self, cfg: Any) -> list[str]:
        if cfg.mlp_hidden > 0 and self.block_size % 2:
            return [f"model.block_attnres.block_size={self.block_size} must be even: blocks begin at attention "
                    "sublayers (each layer is an attention and an MLP sublayer)"]
        return []


def n_sublayers(cfg: Any) -> int:
    return cfg.n_layers * (2 if cfg.mlp_hidden > 0 else 1)


def extra_params(cfg: Any) -> int:
    """(2L + 1)·d queries and as many key-norm weights (one per consumer: the sublayers and the output)."""
    return 2 * (n_sublayers(cfg) + 1) * cfg.d_model


declare(ArchSpec(
    "attnres", "AttnRes", "Attention Residuals (Full): softmax over all earlier sublayer outputs, no residual add",
    extra_params=extra_params, exact_start={"norm_eps": 0.0}, order=70,
))
declare(ArchSpec(
    "block_attnres", "Block AttnRes", "Attention Residuals over blocks of sublayers (block sums and a partial sum)",
    options=BlockAttnResOptions, extra_params=extra_params, exact_start={"norm_eps": 0.0},
    variants=(("block_attnres block_size=2", {"block_size": 2}),), order=75,
))
