"""SATFormer: selective access to early representations, V'_n = V_n + g_n(h_n) ⊙ V_1 in layers n >= 1."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from satlab.config.archs.satformer import SATFormerOptions
from satlab.config.gate_functions import apply_gate_fn
from satlab.models.architecture import register
from satlab.models.parametrization import INPUT, SCALAR, ParamClass, ParamDecl


class SATFormerGate(nn.Module):
    """V'_n = V_n + g_n(h_n) ⊙ V_1 (the paper's selective access to V_1).

    Granularity: ``token_head`` (default, Linear d -> H_kv), ``token`` (Linear d -> 1), ``token_channel``
    (Linear d -> H_kv·d_h), ``static_layer`` (one scalar), ``static_head`` (one per KV head). Static gates pass their
    parameter through the same gate function. ``detach_v1`` stops the gradient into layer 0 through this path.
    """

    lr_group = "gate"  # optim.gate_lr_multiplier applies to these parameters, on top of what their class derives

    @property
    def param_classes(self) -> dict[str, ParamDecl]:
        """The projection reads the width out to one gate per KV head (``token_head``): with the head dim fixed the
        head count grows with the width, so both of its dimensions grow (hidden, as mup's shape rule has it); to one
        gate (``token``: output-like); to one per channel (``token_channel``: d -> d_kv, hidden). Its bias is one per
        gate (input-like where their number grows); static gates are scalars."""
        grows = self.granularity in ("token_head", "token_channel")
        weight = ParamDecl(ParamClass.HIDDEN if grows else ParamClass.OUTPUT, std=lambda model, cfg: cfg.init_std)
        return {"proj.weight": weight, "proj.bias": INPUT if grows else SCALAR,
                "static": INPUT if self.granularity == "static_head" else SCALAR}

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
            # a copy, not the expanded view: the gates leave the block, which FSDP2 wants free of views
            return apply_gate_fn(self.gate_fn, self.static).expand(h.shape[0], h.shape[1], *self.shape).clone()
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


register("satformer", value_path=value_path)
