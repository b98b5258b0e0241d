"""Attention Residuals (Kimi, arXiv 2603.15031): every sublayer reads a softmax-weighted sum over the earlier
sublayers' outputs instead of a residual stream (``docs/architectures.md``). Two architectures:

- ``attnres`` (Full): h_s = Σ_{j≤s} α_{j→s} v_j with v_0 = X_0 (the embedding), v_{j+1} = F_j(h_j) the raw sublayer
  outputs, α_{j→s} = softmax_j(w_sᵀ RMSNorm(v_j)). No ``x + f`` remains. An extra query w_out attends over all
  sources for the output (then the final norm and head; the paper states it for Block, the analogue for Full is
  [unverified]).
- ``block_attnres``: blocks of ``block_size`` sublayers (default 4, boundaries before attention sublayers). b_0 = X_0,
  b_n = the sum of block n's outputs; the first sublayer of block n attends [b_0..b_{n-1}], a later one also the
  block's partial sum; the output attends [b_0..b_N], the last (possibly partial) block included.

One scalar weight per source (per-head mixing was worse in the paper's ablation), and the query is a learned vector,
independent of the input. The keys are RMSNorm(v_j) without a weight, computed once per source; each consumer's
key-norm weight (present [unverified], initialised to 1) folds into its query, w_s ⊙ g_s. The queries start at 0
(the paper: they "must be initialized to zero"), so every α is uniform and h_s = S_s / m_s, the Transformer's residual
stream over the number of sources: every consumer is an RMSNorm, so the model starts exactly as the Transformer only
when every RMSNorm eps is 0 (the parity condition below), up to O(eps) otherwise.

Full keeps its sources in a preallocated :class:`~satlab.models.depth_buffer.DepthBuffer` (no stack per sublayer);
Block, with at most N + 2 sources, stacks them. With the reference mixing (``model.mixing_impl``) both read their
sources as the sum Σ_j α_j v_j over a list (:func:`~satlab.models.depth_buffer.depth_sum`), the keys as F.rms_norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from satlab.config.archs.attnres import n_sublayers
from satlab.models.architecture import MixingWeight, register
from satlab.models.depth_buffer import depth_buffer, depth_sum
from satlab.models.layers import handwritten, rms_norm
from satlab.models.parametrization import INPUT, OUTPUT_ZERO
from satlab.models.streams import DepthContext, ResidualStream


class DepthQuery(nn.Module):
    """One consumer's query w_s (zero at the start: uniform weights) and key-norm weight g_s. The query is read out
    against the normalised width (a score w_sᵀ RMSNorm(v_j)): output-like for μP, though stored as a vector."""

    param_classes = {"query": OUTPUT_ZERO, "key_weight": INPUT}

    def __init__(self, d_model: int):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.key_weight = nn.Parameter(torch.ones(d_model))

    def init_weights(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_weight)

    def weights(self, keys: list[Tensor]) -> Tensor:
        """α over the sources (B, T, J) from their normalised keys (each (B, T, d)); the softmax in fp32."""
        q = (self.query * self.key_weight).unsqueeze(0)
        scores = torch.cat([F.linear(k, q.to(k.dtype)) for k in keys], dim=-1)
        return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)


def sublayers(ctx: DepthContext) -> list[Callable[[Tensor], Tensor]]:
    """Each block's attention, then its MLP when it has one, as functions of their (un-normalised) input."""
    out = []
    for i, block in enumerate(ctx.blocks):
        out.append(lambda h, i=i: ctx.attend(i, h))
        if block.mlp is not None:
            out.append(lambda h, i=i: ctx.feedforward(i, h))
    return out


class AttnResStream(ResidualStream):
    """Full AttnRes: 2L sublayer queries and the output's."""

    family = "attnres"  # its mixing weights' name in plots

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.eps, self.d = cfg.norm_eps, cfg.d_model
        self.mixing_impl = cfg.mixing_impl  # a depth loop with two implementations (see compile_blocks)
        self.queries = nn.ModuleList(DepthQuery(cfg.d_model) for _ in range(n_sublayers(cfg) + 1))

    def init_weights(self) -> None:
        for query in self.queries:
            query.init_weights()

    def key(self, v: Tensor) -> Tensor:
        return rms_norm(v, None, self.eps, self.mixing_impl)

    def sources_per_consumer(self) -> list[int]:
        return list(range(1, len(self.queries) + 1))

    def extra_flops_per_token(self) -> float:
        """Per consumer and source a score (2d) and its share of the weighted sum (2d), forward and backward."""
        return 3 * 4 * self.d * sum(self.sources_per_consumer())

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        functions = sublayers(ctx)
        sources = depth_buffer(x, len(functions) + 1, dim=-2, impl=self.mixing_impl)
        keys: list[Tensor] = []
        v = x
        for s, query in enumerate(self.queries):
            keys.append(self.key(v))
            h = sources.append(v, query.weights(keys).to(v.dtype).unsqueeze(-2)).squeeze(-2)
            if s == len(functions):
                return h
            v = functions[s](h)
        raise AssertionError("the output query is the last")

    def mixing_weights(self) -> dict[str, MixingWeight]:
        return {f"{self.family}/query_norm": query_norms(self.queries)}


class BlockAttnResStream(AttnResStream):
    family = "block_attnres"

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.block_size = cfg.block_attnres.block_size

    def sources_per_consumer(self) -> list[int]:
        counts = [s // self.block_size + 1 + (s % self.block_size > 0) for s in range(len(self.queries) - 1)]
        blocks = -(-(len(self.queries) - 1) // self.block_size)
        return [*counts, blocks + 1]

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        functions = sublayers(ctx)
        done, done_keys = [x], [self.key(x)]
        partial: Tensor | None = None
        for s, function in enumerate(functions):
            if s % self.block_size == 0 and partial is not None:
                done.append(partial)
                done_keys.append(self.key(partial))
                partial = None
            out = function(self.read(self.queries[s], done, done_keys, partial))
            partial = out if partial is None else partial + out
        if partial is not None:
            done.append(partial)
            done_keys.append(self.key(partial))
        return self.read(self.queries[-1], done, done_keys, None)

    def read(self, query: DepthQuery, done: list[Tensor], done_keys: list[Tensor], partial: Tensor | None) -> Tensor:
        sources = done if partial is None else [*done, partial]
        keys = done_keys if partial is None else [*done_keys, self.key(partial)]
        alpha = query.weights(keys).to(sources[0].dtype).unsqueeze(-2)  # (B, T, 1, J)
        if handwritten(self.mixing_impl, alpha):
            return torch.matmul(alpha, torch.stack(sources, dim=-2)).squeeze(-2)
        return depth_sum(alpha, sources, per_token=True).squeeze(-2)


def query_norms(queries: nn.ModuleList) -> MixingWeight:
    """‖w_s ⊙ g_s‖ per consumer (0: uniform weights over the sources), the output's last."""
    with torch.no_grad():
        norms = torch.stack([(q.query * q.key_weight).norm() for q in queries]).float().cpu()
    return MixingWeight(norms, "consumer (sublayer, then the output)", first_row=0)


# CompleteP: no branch multiplier: the read is a softmax-weighted mean over depth, uniform at the start, which
# already weights each sublayer's output by 1/(its number of sources); m_L^-alpha on top would count depth twice
register("attnres", stream=AttnResStream, residual_branches=False)
register("block_attnres", stream=BlockAttnResStream, residual_branches=False)
