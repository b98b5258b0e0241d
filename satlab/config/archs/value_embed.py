"""Value embeddings as in the modded-nanogpt speed records, V'_n = V_n + g_n ⊙ E_n[t] in a few layers
(:mod:`satlab.models.archs.value_embed`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare

GATE_INPUTS = 6  # dims of h_n and of E_n[t] the gate reads


@dataclass
class ValueEmbedOptions:
    ve_init: str = field(default="zeros", metadata={"choices": ("zeros", "normal_0.01")})


def ve_layers(n_layers: int) -> list[int]:
    """Layers 1, 2 and the last three, those that exist."""
    return sorted({n for n in (1, 2, n_layers - 3, n_layers - 2, n_layers - 1) if 0 <= n < n_layers})


def extra_params(cfg: Any) -> int:
    """A table (vocabulary × d_kv) and a gate (2·6 inputs per KV head) per layer of :func:`ve_layers`."""
    return len(ve_layers(cfg.n_layers)) * (cfg.vocab_size * cfg.n_kv_heads * cfg.head_dim
                                           + 2 * GATE_INPUTS * cfg.n_kv_heads)


declare(ArchSpec(
    "value_embed", "Value embeddings", "per-layer value embedding tables with a 2σ gate per KV head (modded-nanogpt)",
    options=ValueEmbedOptions, gate_fn=lambda cfg: "2sigmoid", gate_target="E_n[t]", extra_params=extra_params,
    variants=(("value_embed ve_init=normal_0.01", {"ve_init": "normal_0.01"}),),
    exact_start={},  # with the default zero tables
    order=80,
))
