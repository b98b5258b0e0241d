"""Value-path variants: how layer n >= 1 forms its values from its own V_n and layer 0's raw V_1.

A value path is called as ``value_path(v, v1, h, v1_weight) -> (v', gate)`` with v, v1 of shape (B, T, H_kv, d_h)
and h the normalised attention input (B, T, d). ``gate`` is (B, T, G, C) or None, where G is 1 or H_kv and C is 1
or d_h. A model without a value path for a layer (the Transformer, or SATFormer layers outside ``last_k``) attends
with V_n unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ResFormerLambdas(nn.Module):
    """The model-level part of the learnable ResFormer: λ_{n,1} = λ_scale · softmax(λ')_n over layers 1..L-1.

    The softmax couples the layers, so these weights are computed once per forward pass by the model and handed to
    each layer's :class:`ResFormerValue` as ``v1_weight``: no module reads another's state.
    """

    def __init__(self, n_layers: int):
        super().__init__()
        self.n_layers = n_layers
        self.logits = nn.Parameter(torch.zeros(max(n_layers - 1, 1)))
        self.scale = nn.Parameter(torch.tensor(float(n_layers)))

    def init_weights(self) -> None:
        nn.init.zeros_(self.logits)
        nn.init.constant_(self.scale, float(self.n_layers))

    def forward(self) -> Tensor:
        """λ_{n,1} for layers n = 1..L-1, as a tensor of L-1 scalars."""
        return self.scale * torch.softmax(self.logits, dim=0)


class ResFormerValue(nn.Module):
    """V'_n = λ_{n,1}·V_1 + λ_{n,2}·V_n, λ_{n,2} learnable (init 0.5); ``fixed`` mode: 0.5·V_1 + 0.5·V_n."""

    no_weight_decay_params = ("lambda2",)

    def __init__(self, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.lambda2 = None if fixed else nn.Parameter(torch.tensor(0.5))

    def init_weights(self) -> None:
        if self.lambda2 is not None:
            nn.init.constant_(self.lambda2, 0.5)

    def forward(self, v: Tensor, v1: Tensor, h: Tensor, v1_weight: Tensor | None) -> tuple[Tensor, None]:
        if self.fixed:
            return 0.5 * v1 + 0.5 * v, None
        return v1_weight * v1 + self.lambda2 * v, None


def apply_gate_fn(name: str, logits: Tensor) -> Tensor:
    """Gate values from logits shaped (..., G, C); softmax variants normalise over the head axis G and multiply by
    its size, so the mean gate is 1 (with G = 1, as for ``token`` gates, softmax is the constant 1)."""
    if name == "relu":
        return F.relu(logits)
    if name == "sigmoid":
        return torch.sigmoid(logits)
    if name == "tanh":
        return torch.tanh(logits)
    if name == "identity":
        return logits
    heads = logits.shape[-2]
    if name == "softmax":
        return torch.softmax(logits, dim=-2) * heads
    if name == "softmax_sigmoid":
        return torch.softmax(logits, dim=-2) * torch.sigmoid(logits) * heads
    raise ValueError(f"unknown gate function {name!r}")


class SATFormerGate(nn.Module):
    """V'_n = V_n + g_n(h_n) ⊙ V_1 (the paper's selective access to V_1).

    Granularity: ``token_head`` (default, Linear d -> H_kv), ``token`` (Linear d -> 1), ``token_channel``
    (Linear d -> H_kv·d_h), ``static_layer`` (one scalar), ``static_head`` (one per KV head). Static gates pass their
    parameter through the same gate function. ``detach_v1`` stops the gradient into layer 0 through this path.
    """

    def __init__(self, d_model: int, n_kv_heads: int, head_dim: int, options, init_std: float):
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

    def forward(self, v: Tensor, v1: Tensor, h: Tensor, v1_weight: Tensor | None) -> tuple[Tensor, Tensor]:
        gate = self.gate(h)
        if self.detach_v1:
            v1 = v1.detach()
        return v + gate * v1, gate
