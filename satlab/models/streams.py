"""Depth loops: how the blocks are chained. The plain pre-norm residual is here; DenseFormer, hyper-connections and
MUDDFormer live in their own modules and implement the same interface.

A depth loop is called as ``stream(x0, ctx) -> x_final`` where ``ctx`` is a :class:`DepthContext`. The context runs
the blocks (a whole block, or its two sublayers) and carries what passes between layers explicitly: V_1, the
ResFormer weights, the RoPE tables, the KV cache and the collected gates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from satlab.models.cache import KVCache
from satlab.models.layers import Block, handwritten


class DepthContext:
    """What one forward pass hands from layer to layer. Created by the model for each call."""

    def __init__(self, blocks: nn.ModuleList, rope: tuple[Tensor, Tensor], v1_weights: Tensor | None,
                 cache: KVCache | None, tokens: Tensor | None = None):
        self.blocks = blocks
        self.tokens = tokens  # the token ids (B, T), for value paths that look tokens up (value embeddings)
        self.rope = rope
        self.v1_weights = v1_weights
        self.cache = cache
        self.v1: Tensor | None = None
        self.gates: list[Tensor | None] = [None] * len(blocks)

    def _layer_args(self, i: int):
        weight = None if self.v1_weights is None or i == 0 else self.v1_weights[i - 1]
        cache = None if self.cache is None else self.cache.layers[i]
        return weight, cache

    def block(self, i: int, x: Tensor) -> Tensor:
        """Run block i as a plain pre-norm residual block."""
        weight, cache = self._layer_args(i)
        x, v1, self.gates[i] = self.blocks[i](x, self.rope, self.v1, weight, cache, self.tokens)
        self.v1 = self.v1 if v1 is None else v1  # layer 0's V_1; later blocks hand back None
        return x

    def attend(self, i: int, xq: Tensor, xk: Tensor | None = None, xv: Tensor | None = None) -> Tensor:
        """Block i's attention sublayer (norm included, residual not added)."""
        weight, cache = self._layer_args(i)
        out = self.blocks[i](xq, self.rope, self.v1, weight, cache, self.tokens, xk=xk, xv=xv, part="attend")
        self.v1, self.gates[i] = self.v1 if out.v1 is None else out.v1, out.gate
        return out.out

    def feedforward(self, i: int, x: Tensor) -> Tensor:
        """Block i's MLP sublayer (norm included, residual not added)."""
        return self.blocks[i](x, part="feedforward")


class ResidualStream(nn.Module):
    """The Transformer's depth loop: x <- block(x) for every block."""

    def __init__(self, cfg):
        super().__init__()

    def make_block(self, cfg, layer_idx: int, value_path: nn.Module | None) -> Block:
        return Block(cfg, layer_idx, value_path, cfg.mlp_hidden)

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        for i in range(len(ctx.blocks)):
            x = ctx.block(i, x)
        return x

    def init_weights(self) -> None:
        """The plain residual has no parameters of its own."""

    def mixing_weights(self) -> dict:
        """Static mixing weights for plots (:class:`~satlab.models.architecture.MixingWeight`; none here)."""
        return {}

    def extra_flops_per_token(self) -> float:
        """Training FLOPs per token of the depth loop's own matmuls that 6·N does not cover (none here)."""
        return 0.0


def recomputed(fn: Callable[..., Any], *args: Tensor, enabled: bool = True) -> Any:
    """``fn(*args)``, its intermediates recomputed in backward instead of stored when ``enabled`` and autograd is
    recording (``torch.utils.checkpoint``, non-reentrant): for the small per-token mixing coefficients of the
    multi-stream residuals (hyper-connections, mHC), whose saved intermediates cost more memory than recomputing
    them costs time."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def stream_read(weights: Tensor, H: Tensor, impl: str = "auto") -> Tensor:
    """Σ_i w_i H_i per token, from weights (N, n) and streams H (N, n, d). Hand-written as one batched matmul with
    the weights made contiguous first: for an operand with no unit stride (a column of a coefficient tensor) the CPU
    bmm copies each token's matrices one by one, ten times slower."""
    if handwritten(impl, H):
        return torch.bmm(weights.unsqueeze(1).contiguous(), H).squeeze(1)
    return torch.einsum("ti,tid->td", weights, H)


def stream_write(o: Tensor, H: Tensor, a_r: Tensor, beta: Tensor, impl: str = "auto") -> Tensor:
    """H' = A_rᵀH + β ⊗ o per token: streams H (N, n, d), the sublayer output o (N, d), A_r (N, n, n), β (N, n), in
    the streams' dtype (autocast off: fp32 under bf16-mixed)."""
    o = o.to(H.dtype)
    if handwritten(impl, H):
        return _StreamWrite.apply(o, H, a_r, beta)
    with torch.autocast(H.device.type, enabled=False):
        return torch.einsum("tij,tid->tjd", a_r, H) + beta.unsqueeze(-1) * o.unsqueeze(-2)


class _StreamWrite(torch.autograd.Function):
    """The write of the multi-stream residuals (hyper-connections, mHC), its backward the four products it needs
    as batched matmuls and a dot, on contiguous operands (see :func:`stream_read`)."""

    @staticmethod
    def forward(ctx, o: Tensor, H: Tensor, a_r: Tensor, beta: Tensor) -> Tensor:
        with torch.autocast(H.device.type, enabled=False):  # the mixing in the streams' dtype (fp32 under bf16-mixed)
            out = torch.bmm(a_r.transpose(1, 2), H).addcmul_(beta.unsqueeze(-1), o.unsqueeze(1))
        ctx.save_for_backward(o, H, a_r, beta)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        o, H, a_r, beta = ctx.saved_tensors
        dout = dout.contiguous()  # the streams' final sum hands back an expanded gradient
        do = torch.bmm(beta.unsqueeze(1).contiguous(), dout).squeeze(1)
        dH = torch.bmm(a_r, dout)
        da_r = torch.bmm(H, dout.transpose(1, 2))
        dbeta = torch.linalg.vecdot(dout, o.unsqueeze(1))
        return do, dH, da_r, dbeta
