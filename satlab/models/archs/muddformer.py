"""MUDDFormer (Xiao et al., arXiv 2502.12170): multiway dynamic dense connections.

After block i outputs X_i, a depth-aggregate (DA) module builds the next block's four inputs c ∈ {Q, K, V, R}
from X_0..X_i per token: A = GELU(RMSNorm_noscale(X_i) W_1) W_2 + a, reshaped to C × (i+1), and
X̄^c = Σ_j A[c, j]·X_j. The next block computes a = MHA(Norm_q(X̄^Q), Norm_k(X̄^K), Norm_v(X̄^V)) + X̄^R and
X_{i+1} = a + MLP(Norm(a)). The last DA produces only R, which goes to the final norm.

W_1: d -> K_i with K_i = 4(i+1) for every DA (the last one too; satlab's reading of the spec), init N(0, 1/d);
W_2 = 0 and a = one-hot at j = i, so the model starts as the Transformer. X_0..X_L live in a preallocated
:class:`~satlab.models.depth_buffer.DepthBuffer` of shape (B, T, L+1, d), or, with the reference mixing
(``model.mixing_impl``), in a list whose sums are the formula (:class:`~satlab.models.depth_buffer.DepthList`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from satlab.models.architecture import MixingWeight, register
from satlab.models.depth_buffer import depth_buffer
from satlab.models.layers import Block, rms_linear
from satlab.models.parametrization import SCALAR, ParamClass, ParamDecl
from satlab.models.streams import DepthContext, ResidualStream

STREAMS = ("q", "k", "v", "r")


class DepthAggregate(nn.Module):
    no_weight_decay_params = ("static",)
    # W_1 reads the width out to 4(i+1) (output-like; its own init N(0, 1/d) is evaluated at the base width, then
    # μP's 1/m_w applies); W_2 and the static weights are depth-sized only
    param_classes = {"w1.weight": ParamDecl(ParamClass.OUTPUT, std=lambda model, cfg: 1.0 / math.sqrt(cfg.d_model)),
                     "w2.weight": SCALAR, "static": SCALAR}

    def __init__(self, d_model: int, n_sources: int, n_outputs: int, eps: float, impl: str = "auto"):
        super().__init__()
        self.d_model, self.n_sources, self.n_outputs, self.impl = d_model, n_sources, n_outputs, impl
        hidden = 4 * n_sources
        self.eps = eps
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_outputs * n_sources, bias=False)
        self.static = nn.Parameter(torch.empty(n_outputs, n_sources))
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(self.d_model))
        nn.init.zeros_(self.w2.weight)
        nn.init.zeros_(self.static)
        if self.static.device.type != "meta":
            self.static.data[:, -1] = 1.0

    def forward(self, last: Tensor) -> Tensor:
        """The per-token weights A, (B, T, C, i+1), from X_i = ``last``."""
        weights = self.w2(F.gelu(rms_linear(last, self.w1.weight, self.eps, self.impl)))
        return weights.view(*last.shape[:-1], self.n_outputs, self.n_sources) + self.static


def realloc_widths(base: int, n_layers: int) -> list[int]:
    """SwiGLU widths growing linearly from 0.5x to 1.5x of ``base`` with depth (same total up to rounding)."""
    if n_layers == 1:
        return [base]
    return [round(base * (0.5 + i / (n_layers - 1))) for i in range(n_layers)]


class MUDDStream(ResidualStream):
    def __init__(self, cfg):
        super().__init__(cfg)
        L = cfg.n_layers
        self.mixing_impl = cfg.mixing_impl  # a depth loop with two implementations (see compile_blocks)
        self.aggregates = nn.ModuleList(DepthAggregate(cfg.d_model, i + 1, 4 if i < L else 1, cfg.norm_eps,
                                                       cfg.mixing_impl) for i in range(1, L + 1))
        base = cfg.mlp_hidden
        self.widths = realloc_widths(base, L) if cfg.muddformer.ffn_realloc else [base] * L

    def make_block(self, cfg, layer_idx: int, value_path: nn.Module | None) -> Block:
        return Block(cfg, layer_idx, value_path, self.widths[layer_idx], separate_kv_norms=True)

    def init_weights(self) -> None:
        for da in self.aggregates:
            da.init_weights()

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        sources = depth_buffer(x, len(ctx.blocks) + 1, dim=-2, impl=self.mixing_impl)
        xq = xk = xv = xr = sources.append(x)
        for i in range(len(ctx.blocks)):
            a = ctx.attend(i, xq, xk, xv) + xr
            out = a + ctx.feedforward(i, a)
            # X̄^c = Σ_j A[c, j]·X_j: one batched (C × (i+1)) @ ((i+1) × d) product per token over the buffer
            mixed = sources.append(out, self.aggregates[i](out))
            if mixed.shape[-2] == 1:
                return mixed.squeeze(-2)
            xq, xk, xv, xr = mixed.unbind(-2)
        raise AssertionError("the last depth aggregate returns a single stream")

    def mixing_weights(self) -> dict[str, MixingWeight]:
        """Static part a of each DA, per output stream: (L, L+1) matrices, row i-1 = the DA after block i (the
        last DA produces only R: its Q, K and V rows are missing, as are sources j > i)."""
        L = len(self.aggregates)
        tables = {c: torch.zeros(L, L + 1) for c in STREAMS}
        missing = {c: torch.ones(L, L + 1, dtype=torch.bool) for c in STREAMS}
        for i, da in enumerate(self.aggregates):
            static = da.static.detach().float().cpu()
            names = STREAMS if da.n_outputs == 4 else ("r",)
            for c, row in zip(names, static, strict=True):
                tables[c][i, : da.n_sources] = row
                missing[c][i, : da.n_sources] = False
        return {f"muddformer/static_{c}": MixingWeight(t, "depth aggregate after block i",
                                                       "source X_j (0 = embedding)", 1, missing=missing[c])
                for c, t in tables.items()}


register("muddformer", stream=MUDDStream)
