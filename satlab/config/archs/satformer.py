"""SATFormer, selective access to early representations, V'_n = V_n + g_n(h_n) ⊙ V_1 in layers n >= 1
(:mod:`satlab.models.archs.satformer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from satlab.config.archs import ArchSpec, declare
from satlab.config.gate_functions import GATE_FUNCTIONS
from satlab.config.structured import in_range

GATE_GRANULARITIES = ("static_layer", "static_head", "token", "token_head", "token_channel")


@dataclass
class SATFormerOptions:
    """The gate ``g_n(h_n)`` that adds V_1 back in layer n: granularity, function and where it applies.

    ``static_init`` is satlab's choice for the initial value of static gates (the spec leaves it open):
    0.5 keeps a relu gate alive (relu has zero gradient at 0).
    """

    gate_granularity: str = field(default="token_head", metadata={"choices": GATE_GRANULARITIES})
    gate_fn: str = field(default="relu", metadata={"choices": tuple(GATE_FUNCTIONS)})
    last_k: int | None = None
    gate_bias: float | None = field(default=None, metadata=in_range(-100, 100))
    static_init: float = field(default=0.5, metadata=in_range(-100, 100))
    detach_v1: bool = False

    def problems(self, cfg: Any) -> list[str]:
        if self.last_k is not None and not 1 <= self.last_k <= max(cfg.n_layers - 1, 1):
            return [f"model.satformer.last_k={self.last_k} must be null or between 1 and n_layers-1={cfg.n_layers - 1}"]
        return []


def extra_params(cfg: Any) -> int:
    """Per gated layer: a Linear d -> G·C (+ bias), or the static G×C gates."""
    options = cfg.satformer
    groups = 1 if options.gate_granularity in ("token", "static_layer") else cfg.n_kv_heads
    channels = cfg.head_dim if options.gate_granularity == "token_channel" else 1
    per_layer = groups * channels * (1 if options.gate_granularity.startswith("static") else
                                     cfg.d_model + (options.gate_bias is not None))
    layers = cfg.n_layers - 1 if options.last_k is None else options.last_k
    return layers * per_layer


declare(ArchSpec(
    "satformer", "SATFormer", "selective access: V_n + g_n(h_n)·V_1, gate per token and head",
    options=SATFormerOptions, extra_params=extra_params,
    variants=(*((f"satformer {g} {f}", {"gate_granularity": g, "gate_fn": f})
                for g in GATE_GRANULARITIES for f in GATE_FUNCTIONS if (g, f) != ("token_head", "relu")),
              ("satformer last_k=2", {"last_k": 2})),
    gate_fn=lambda cfg: cfg.satformer.gate_fn,
    order=20,
))
