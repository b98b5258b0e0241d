"""DenseFormer: a depth-weighted average (DWA) of all earlier block outputs after each block.

Block i (1..L) consumes Y_{i-1} (Y_0 = X_0, the embedding) and outputs X_i; then Y_i = Σ_j a_{i,j} X_j over
j ∈ {0..i} with j ≡ i (mod dilation), and only after every ``period``-th block (elsewhere Y_i = X_i). The weights
start at a_{i,i} = 1, others 0, so the model starts as the Transformer.

The outputs live in one preallocated :class:`~satlab.models.depth_buffer.DepthBuffer` of shape (L+1, B, T, d);
each DWA is a single (1 × J) @ (J × B·T·d) product over a view of it (strided for ``dilation`` > 1), with the
gradients accumulated in place in a second buffer. With the reference mixing (``model.mixing_impl``) they live in a
list and each DWA is the sum Σ_j a_{i,j} X_j as written (:class:`~satlab.models.depth_buffer.DepthList`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from satlab.config.archs.denseformer import dwa_sources
from satlab.models.architecture import MixingWeight, register
from satlab.models.depth_buffer import depth_buffer
from satlab.models.parametrization import SCALAR, ParamDecl
from satlab.models.streams import DepthContext, ResidualStream


class DenseFormerStream(ResidualStream):
    def __init__(self, cfg):
        super().__init__(cfg)
        opts = cfg.denseformer
        self.dilation, self.period, self.n_layers = opts.dilation, opts.period, cfg.n_layers
        self.dwa_layers = [i for i in range(1, cfg.n_layers + 1) if i % self.period == 0]
        self.mixing_impl = cfg.mixing_impl  # a depth loop with two implementations (see compile_blocks)
        self.weights = nn.ParameterDict(
            {str(i): nn.Parameter(torch.zeros(len(dwa_sources(i, self.dilation)))) for i in self.dwa_layers}
        )
        self.init_weights()

    @property
    def no_weight_decay_params(self) -> tuple[str, ...]:
        return tuple(f"weights.{i}" for i in self.weights)

    @property
    def param_classes(self) -> dict[str, ParamDecl]:
        """The DWA weights: one scalar per source."""
        return {f"weights.{i}": SCALAR for i in self.weights}

    def init_weights(self) -> None:
        for weight in self.weights.values():
            nn.init.zeros_(weight)
            weight.data[-1] = 1.0  # the last source is j = i: the block's own output

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        outputs = depth_buffer(x, len(ctx.blocks) + 1, impl=self.mixing_impl)
        y = outputs.append(x)
        for i in range(1, len(ctx.blocks) + 1):
            out = ctx.block(i - 1, y)
            weights = self.weights.get(str(i))  # None after blocks without a DWA (period > 1)
            # the entries j ≡ i (mod dilation), in the order of dwa_sources(i)
            y = outputs.append(out, weights, start=i % self.dilation, step=self.dilation)
        return y

    def mixing_weights(self) -> dict[str, MixingWeight]:
        """The DWA weights as an (L, L+1) matrix: row i-1 holds a_{i,j}; entries without a weight are missing."""
        table = torch.zeros(self.n_layers, self.n_layers + 1)
        missing = torch.ones(self.n_layers, self.n_layers + 1, dtype=torch.bool)
        for key, a in self.weights.items():
            i = int(key)
            table[i - 1, dwa_sources(i, self.dilation)] = a.detach().float().cpu()
            missing[i - 1, dwa_sources(i, self.dilation)] = False
        return {"denseformer/dwa": MixingWeight(table, "DWA after block i", "source X_j (0 = embedding)", 1,
                                                missing=missing)}


register("denseformer", stream=DenseFormerStream)
