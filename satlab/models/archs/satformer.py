"""SATFormer: selective access to early representations, V'_n = V_n + g_n(h_n) ⊙ V_1 in layers n >= 1."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from satlab.models.architecture import Architecture, register
from satlab.models.gate_functions import GATE_FUNCTIONS, apply_gate_fn

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
    gate_bias: float | None = field(default=None, metadata={"range": (-100, 100, False)})
    static_init: float = field(default=0.5, metadata={"range": (-100, 100, False)})
    detach_v1: bool = False

    def problems(self, cfg: Any) -> list[str]:
        if self.last_k is not None and not 1 <= self.last_k <= max(cfg.n_layers - 1, 1):
            return [f"model.satformer.last_k={self.last_k} must be null or between 1 and n_layers-1={cfg.n_layers - 1}"]
        return []


class SATFormerGate(nn.Module):
    """V'_n = V_n + g_n(h_n) ⊙ V_1 (the paper's selective access to V_1).

    Granularity: ``token_head`` (default, Linear d -> H_kv), ``token`` (Linear d -> 1), ``token_channel``
    (Linear d -> H_kv·d_h), ``static_layer`` (one scalar), ``static_head`` (one per KV head). Static gates pass their
    parameter through the same gate function. ``detach_v1`` stops the gradient into layer 0 through this path.
    """

    lr_group = "gate"  # optim.gate_lr_multiplier applies to these parameters

    def __init__(self, d_model: int, n_kv_heads: int, head_dim: int, options: SATFormerOptions, init_std: float):
        super().__init__()
        self.granularity = options.gate_granularity
        self.gate_fn = options.gate_fn
        self.detach_v1 = options.detach_v1
        self.gate_bias = options.gate_bias
        self.static_init = options.static_init
        self.init_std = init_std
        groups = 1 if self.granularity in ("token", "static_layer") else n_kv_heads
        channels = head_dim if self.granularity == "token_channel" else 1
        self.shape = (groups, channels)
        if self.granularity.startswith("static"):
            self.proj = None
            self.static = nn.Parameter(torch.full((groups, channels), float(self.static_init)))
        else:
            self.static = None
            self.proj = nn.Linear(d_model, groups * channels, bias=self.gate_bias is not None)

    @property
    def no_weight_decay_params(self) -> tuple[str, ...]:
        return ("static",) if self.static is not None else ()

    def init_weights(self) -> None:
        if self.static is not None:
            nn.init.constant_(self.static, self.static_init)
            return
        nn.init.normal_(self.proj.weight, std=self.init_std)
        if self.proj.bias is not None:
            nn.init.constant_(self.proj.bias, self.gate_bias)

    def gate(self, h: Tensor) -> Tensor:
        """Gate values (B, T, G, C) for the normalised attention input h (B, T, d)."""
        if self.static is not None:
            return apply_gate_fn(self.gate_fn, self.static).expand(h.shape[0], h.shape[1], *self.shape)
        logits = self.proj(h).view(h.shape[0], h.shape[1], *self.shape)
        return apply_gate_fn(self.gate_fn, logits)

    def forward(self, v: Tensor, v1: Tensor, h: Tensor, v1_weight: Tensor | None,
                tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        gate = self.gate(h)
        if self.detach_v1:
            v1 = v1.detach()
        return torch.addcmul(v, gate, v1), gate  # v + gate ⊙ v1 in one pass


def value_path(cfg: Any, layer: int) -> nn.Module | None:
    last_k = cfg.satformer.last_k
    if layer == 0 or (last_k is not None and layer < cfg.n_layers - last_k):
        return None
    return SATFormerGate(cfg.d_model, cfg.n_kv_heads, cfg.head_dim, cfg.satformer, cfg.init_std)


def extra_params(cfg: Any) -> int:
    """Per gated layer: a Linear d -> G·C (+ bias), or the static G×C gates."""
    options = cfg.satformer
    groups = 1 if options.gate_granularity in ("token", "static_layer") else cfg.n_kv_heads
    channels = cfg.head_dim if options.gate_granularity == "token_channel" else 1
    per_layer = groups * channels * (1 if options.gate_granularity.startswith("static") else
                                     cfg.d_model + (options.gate_bias is not None))
    layers = cfg.n_layers - 1 if options.last_k is None else options.last_k
    return layers * per_layer


register(Architecture(
    "satformer", "SATFormer", "selective access: V_n + g_n(h_n)·V_1, gate per token and head",
    options=SATFormerOptions, value_path=value_path, extra_params=extra_params,
    variants=(*((f"satformer {g} {f}", {"gate_granularity": g, "gate_fn": f})
                for g in GATE_GRANULARITIES for f in GATE_FUNCTIONS if (g, f) != ("token_head", "relu")),
              ("satformer last_k=2", {"last_k": 2})),
    gate_fn=lambda cfg: cfg.satformer.gate_fn,
    order=20,
))
