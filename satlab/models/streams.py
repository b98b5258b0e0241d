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
from torch.utils.checkpoint import checkpoint

from satlab.models.cache import KVCache
from satlab.models.layers import Block


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
        x, self.v1, self.gates[i] = self.blocks[i](x, self.rope, self.v1, weight, cache, self.tokens)
        return x

    def attend(self, i: int, xq: Tensor, xk: Tensor | None = None, xv: Tensor | None = None) -> Tensor:
        """Block i's attention sublayer (norm included, residual not added)."""
        weight, cache = self._layer_args(i)
        out = self.blocks[i].attend(xq, self.rope, self.v1, weight, cache, xk=xk, xv=xv, tokens=self.tokens)
        self.v1, self.gates[i] = out.v1, out.gate
        return out.out

    def feedforward(self, i: int, x: Tensor) -> Tensor:
        """Block i's MLP sublayer (norm included, residual not added)."""
        return self.blocks[i].feedforward(x)


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
