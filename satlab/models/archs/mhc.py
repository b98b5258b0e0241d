"""Manifold-constrained hyper-connections (mHC, DeepSeek, arXiv 2512.24880), n residual streams, as
``docs/architectures.md`` describes it.

X (B, T, n, d) starts as n copies of the embedding. Per sublayer s, from x̃ = vec(X) and r = ‖x̃‖/√(nd) (per token,
fp32): m = x̃φ/r split [pre n | post n | res n²], H_pre = σ(α_pre·m_pre + b_pre), H_post = 2σ(α_post·m_post + b_post),
H_res = Sinkhorn-Knopp(α_res·m_res + b_res) (exp, then 20 times "columns, then rows"), and
X_i ← Σ_j H_res[i,j] X_j + H_post,i · F_s(Σ_j H_pre,j X_j). Readout (DeepSeek-V4's head):
y = Σ_j σ(α_h(x̃φ_h)_j/r + b_h,j) X_j, then the final norm and head.

Zoo init (the spec's exact start, since the paper gives only α = 0.01): φ = φ_h = 0; b_post = 0 (H_post = 1);
b_res = ln(19(n−1))·I (doubly stochastic already, diagonal 0.95); b_pre = logit(p), p_{s mod n} = 1/2, the others
1/(2(n−1)) (a symmetric start would keep the streams identical for ever); b_h = −ln(n−1) (mean readout); every eps 0
(the norm r keeps the model's ``norm_eps`` inside its square root, where φ = 0 makes it irrelevant at the start).
Weight decay: b and α none, φ and φ_h as matrices.

Cost: no fused kernels (the paper's +6.7 % is with them), but nothing autograd would do in many passes: x̃φ/r is one
:func:`~satlab.models.layers.rms_linear`, Sinkhorn has its backward written out (it keeps only its logits and replays
its normalisations), and the read and write are the shared batched matmuls of
:func:`~satlab.models.streams.stream_write`. With ``recompute`` (default) the coefficients are recomputed per
sublayer in backward rather than stored; what they would store is now small (n² + 2n numbers per token), so this
saves little (the paper recomputes blockwise, the sublayers' stream states too).

Each of these has its reference beside it (``model.mixing_impl``, see :data:`~satlab.config.model.MIXING_IMPLS`):
Sinkhorn as the plain loop (:func:`sinkhorn_reference`), x̃φ/r as RMSNorm then the projection, the read and write as
``einsum``; autograd does their backward. It is what runs on a GPU, where torch.compile fuses it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from satlab.models.architecture import MixingWeight, register
from satlab.models.layers import handwritten, rms_linear
from satlab.models.parametrization import OUTPUT_ZERO, SCALAR
from satlab.models.streams import DepthContext, ResidualStream, recomputed, stream_read, stream_write


def sinkhorn(logits: Tensor, iters: int, impl: str = "auto") -> Tensor:
    """exp(logits - max), then ``iters`` times: normalise the columns, then the rows (rows last: each output stream
    is an exact convex combination). (..., n, n), differentiable through every iteration."""
    if handwritten(impl, logits):
        return _Sinkhorn.apply(logits, iters)
    return sinkhorn_reference(logits, iters)


def sinkhorn_reference(logits: Tensor, iters: int) -> Tensor:
    """:func:`sinkhorn` as the plain loop, autograd through every iteration. The max is subtracted for range only
    (it cancels in the first normalisation), so no gradient goes through it."""
    matrix = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True).detach())
    for _ in range(iters):
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)  # columns
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)  # rows
    return matrix


def _sinkhorn_steps(matrices: Tensor, iters: int, keep: bool = False) -> tuple[Tensor, Tensor, list]:
    """On (n, n, ...) matrices: the result, exp(logits - max), and with ``keep`` each normalisation's (result, sums,
    dim). Tokens last: a CPU sums and divides over a leading axis of 4 five to ten times faster than over a last."""
    start = matrix = torch.exp(matrices - matrices.amax(dim=(0, 1), keepdim=True))
    steps = []
    for _ in range(iters):
        for dim in (0, 1):  # columns, then rows
            sums = matrix.sum(dim=dim, keepdim=True)
            matrix = matrix / sums
            if keep:
                steps.append((matrix, sums, dim))
    return matrix, start, steps


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp with its backward written out: autograd's graph of 2·iters divisions of (N, n, n) tensors was
    most of mHC's step on a CPU. It keeps only the logits, replays the normalisations in backward and steps back
    through each, dM = (g - Σ_dim g ⊙ M') / s for M' = M / s; the max subtracted before exp cancels in the first
    normalisation, so no gradient goes through it."""

    @staticmethod
    def forward(ctx, logits: Tensor, iters: int) -> Tensor:
        ctx.iters = iters
        ctx.save_for_backward(logits)
        matrix = _sinkhorn_steps(logits.movedim((-2, -1), (0, 1)).contiguous(), iters)[0]
        return matrix.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (logits,) = ctx.saved_tensors
        _, start, steps = _sinkhorn_steps(logits.movedim((-2, -1), (0, 1)).contiguous(), ctx.iters, keep=True)
        grad = grad.movedim((-2, -1), (0, 1)).contiguous()
        for normalised, sums, dim in reversed(steps):
            grad = (grad - (grad * normalised).sum(dim=dim, keepdim=True)) / sums
        return (grad * start).movedim((0, 1), (-2, -1)).contiguous(), None


def at_least_fp32(x: Tensor) -> Tensor:
    """x in fp32 when it is in a lower precision (the spec's coefficients are fp32); fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class ManifoldConnection(nn.Module):
    """The coefficients of one sublayer s: φ (nd × (n² + 2n)), b, and α_pre, α_post, α_res."""

    no_weight_decay_params = ("b_pre", "b_post", "b_res", "alpha")
    # φ reads the n·d streams out to n² + 2n coefficients (output-like, zero at the start)
    param_classes = {"phi.weight": OUTPUT_ZERO, **{name: SCALAR for name in no_weight_decay_params}}

    def __init__(self, d_model: int, n: int, s: int, iters: int, eps: float, impl: str = "auto"):
        super().__init__()
        self.n, self.s, self.iters, self.eps, self.impl = n, s, iters, eps, impl
        self.phi = nn.Linear(n * d_model, n * n + 2 * n, bias=False)
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.alpha = nn.Parameter(torch.empty(3))
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.zeros_(self.phi.weight)
        if self.b_pre.device.type == "meta":
            return
        n = self.n
        with torch.no_grad():
            p = torch.full((n,), 1 / (2 * (n - 1)))
            p[self.s % n] = 0.5
            self.b_pre.copy_(torch.log(p / (1 - p)))
            self.b_post.zero_()
            self.b_res.copy_(math.log(19 * (n - 1)) * torch.eye(n))
            self.alpha.fill_(0.01)

    def forward(self, X: Tensor, recompute: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(H_pre (N, n), H_post (N, n), H_res (N, n, n)) for the streams X (N, n, d), in fp32. x̃φ/r is one
        :func:`rms_linear` (x̃ read once, no normalised copy); what follows works on n² + 2n numbers per token, and
        with ``recompute`` it (Sinkhorn's 2·iters normalisations included) is recomputed in backward."""
        m = rms_linear(at_least_fp32(X.flatten(-2)), self.phi.weight, self.eps, self.impl)
        return recomputed(self.coefficients, m, enabled=recompute)

    def coefficients(self, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.n
        pre, post, res = m.split((n, n, n * n), dim=-1)
        h_pre = torch.sigmoid(self.alpha[0] * pre + self.b_pre)
        h_post = 2 * torch.sigmoid(self.alpha[1] * post + self.b_post)
        h_res = sinkhorn(self.alpha[2] * res.unflatten(-1, (n, n)) + self.b_res, self.iters, self.impl)
        return h_pre, h_post, h_res


class ManifoldHead(nn.Module):
    """The readout y = Σ_j σ(α_h(x̃φ_h)_j / r + b_h,j) X_j."""

    no_weight_decay_params = ("b", "alpha")
    param_classes = {"phi.weight": OUTPUT_ZERO, **{name: SCALAR for name in no_weight_decay_params}}

    def __init__(self, d_model: int, n: int, eps: float, impl: str = "auto"):
        super().__init__()
        self.n, self.eps, self.impl = n, eps, impl
        self.phi = nn.Linear(n * d_model, n, bias=False)
        self.b = nn.Parameter(torch.empty(n))
        self.alpha = nn.Parameter(torch.empty(1))  # (1,): FSDP2 refuses 0-dim parameters
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.zeros_(self.phi.weight)
        if self.b.device.type != "meta":
            with torch.no_grad():
                self.b.fill_(-math.log(self.n - 1))
                self.alpha.fill_(0.01)

    def forward(self, X: Tensor) -> Tensor:
        m = rms_linear(at_least_fp32(X.flatten(-2)), self.phi.weight, self.eps, self.impl)
        weights = torch.sigmoid(self.alpha * m + self.b)
        return stream_read(weights.to(X.dtype), X, self.impl)


class MHCStream(ResidualStream):
    def __init__(self, cfg: Any):
        super().__init__(cfg)
        options = cfg.mhc
        self.n = options.streams
        self.recompute = options.recompute
        self.mixing_impl = impl = cfg.mixing_impl  # a depth loop with two implementations (see compile_blocks)
        self.connections = nn.ModuleList(ManifoldConnection(cfg.d_model, self.n, s, options.sinkhorn_iters,
                                                            cfg.norm_eps, impl) for s in range(2 * cfg.n_layers))
        self.head = ManifoldHead(cfg.d_model, self.n, cfg.norm_eps, impl)

    def init_weights(self) -> None:
        for module in (*self.connections, self.head):
            module.init_weights()

    def extra_flops_per_token(self) -> float:
        """Per sublayer the stream mixing Σ_j H_pre,j X_j (2nd) and H_res X (2n²d), and the readout's (2nd), forward
        and backward (x3); the coefficient matmuls x̃φ are parameters (in 6·N), the rest elementwise."""
        d = self.connections[0].phi.in_features // self.n
        return 3 * (len(self.connections) * 2 * self.n * (self.n + 1) * d + 2 * self.n * d)

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        B, T, d = x.shape
        X = x.reshape(B * T, 1, d).expand(B * T, self.n, d).contiguous()  # the streams of token t: X[t] (n, d)
        for i in range(len(ctx.blocks)):
            for s, sublayer in ((2 * i, ctx.attend), (2 * i + 1, ctx.feedforward)):
                h_pre, h_post, h_res = (c.to(X.dtype) for c in self.connections[s](X, self.recompute))
                out = sublayer(i, stream_read(h_pre, X, self.mixing_impl).view(B, T, d))
                # H_res X + H_post ⊗ out
                X = stream_write(out.view(B * T, d), X, h_res.transpose(-1, -2), h_post, self.mixing_impl)
        return self.head(X).view(B, T, d)

    def mixing_weights(self) -> dict[str, MixingWeight]:
        """The static parts at zero input: σ(b_pre), 2σ(b_post) and diag Sinkhorn(b_res) per sublayer (2L, n)."""
        with torch.no_grad():
            parts = {"pre": [torch.sigmoid(c.b_pre) for c in self.connections],
                     "post": [2 * torch.sigmoid(c.b_post) for c in self.connections],
                     "res_diag": [sinkhorn(c.b_res, c.iters, c.impl).diagonal() for c in self.connections]}
        return {f"mhc/{name}": MixingWeight(torch.stack(rows).float().cpu(), "sublayer (a = attention, m = MLP)",
                                            "stream", 0, row_ticks=[f"{'am'[k % 2]}{k // 2}" for k in range(len(rows))])
                for name, rows in parts.items()}


register("mhc", stream=MHCStream)
