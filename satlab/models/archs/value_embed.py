"""Value embeddings as in the modded-nanogpt speed records: V'_n = V_n + g_n ⊙ E_n[t] in a few layers, where E_n is
a free per-layer table over the vocabulary (width d_kv) and g_n = 2σ(W_n·[h_n[:6], E_n[t][:6]]) one gate per KV
head (``docs/architectures.md``).

Layout: tables in layers 1, 2 and the last three (modded-nanogpt's five at L = 11; at fewer layers the set is
whatever of those exists). Zoo choices, per the spec: width d_kv (n_kv_heads · head_dim), a gate per KV head, h_n the
normalised tensor fed to q/k/v (modded-nanogpt normalises without a weight), no MUDD gate in the last layer, and the
tables' optimizer settings (Adam lr ×75, wd ×5 there) left at this platform's shared ones. ``ve_init``: ``zeros``
(the 2025-12 form; the model then starts exactly as the Transformer, with every gate at 1) or ``normal_0.01``
(modded-nanogpt today: V + ve from the first step).

SATFormer's V_1 is itself a value embedding of this kind (layer 0 sees only the token's own embedding), shared and
tied to E and W_v^(0); SATFormer with ``gate_fn: 2sigmoid``, zero gate weights and E_n := V_1 is this with one table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from satlab.config.archs.value_embed import GATE_INPUTS, ve_layers
from satlab.models.architecture import register
from satlab.models.parametrization import INPUT


class ValueEmbedding(nn.Module):
    """One layer's table E_n (vocab × d_kv) and gate W_n (H_kv × 12, zero: g = 1). Both only grow in their
    fan-out with the width (d_kv, H_kv): input-like."""

    param_classes = {"table.weight": INPUT, "gate_proj.weight": INPUT}

    def __init__(self, vocab_size: int, n_kv_heads: int, head_dim: int, ve_init: str):
        super().__init__()
        self.shape, self.ve_init = (n_kv_heads, head_dim), ve_init
        self.table = nn.Embedding(vocab_size, n_kv_heads * head_dim)
        self.gate_proj = nn.Linear(2 * GATE_INPUTS, n_kv_heads, bias=False)

    def init_weights(self) -> None:
        if self.ve_init == "zeros":
            nn.init.zeros_(self.table.weight)
        else:
            nn.init.normal_(self.table.weight, std=0.01)
        nn.init.zeros_(self.gate_proj.weight)

    def forward(self, v: Tensor, v1: Tensor, h: Tensor, v1_weight: Tensor | None,
                tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if tokens is None:
            raise ValueError("value embeddings look the tokens up: call the model with token ids")
        ve = self.table(tokens)  # (B, T, d_kv)
        logits = self.gate_proj(torch.cat([h[..., :GATE_INPUTS], ve[..., :GATE_INPUTS]], -1))
        gate = 2 * torch.sigmoid(logits.unsqueeze(-1))  # (B, T, H_kv, 1), a tensor of its own (not a view): it
        # leaves the block, which FSDP2 wants free of views
        return v + gate * ve.view(*ve.shape[:-1], *self.shape), gate


def value_path(cfg: Any, layer: int) -> nn.Module | None:
    if layer not in ve_layers(cfg.n_layers):
        return None
    return ValueEmbedding(cfg.vocab_size, cfg.n_kv_heads, cfg.head_dim, cfg.value_embed.ve_init)


register("value_embed", value_path=value_path)
