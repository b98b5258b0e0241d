"""Dynamic hyper-connections (Zhu et al., arXiv 2409.19606) with expansion n.

The residual stream is n copies H (B·T, n, d), initialised to n copies of the embedding. Each sublayer (attention:
module k = 2·layer, MLP: k = 2·layer + 1) reads h = A_mᵀH, computes o = F(RMSNorm(h)) and writes
H <- β ⊗ o + A_rᵀH, where with H̄ = RMSNorm(H) per copy:
A_m = e_{k mod n} + s_α·tanh(H̄ W_m), A_r = I_n + s_α·tanh(H̄ W_r), β = 1 + s_β·tanh(H̄ W_β).
The static parts (e_k, I_n, 1) are learnable and take no weight decay.

At the end the copies are summed and, as satlab's choice, divided by n before the final RMSNorm. RMSNorm is scale
invariant, so this is the spec's sum except for the norm's eps; it makes the initial model exactly the Transformer
(a plain sum would differ from it by eps·(1 - 1/n²)/mean(x²), about 1e-3 relative at init).

Cost: RMSNorm(H)·W is computed as (H·W')·rstd with W' = W·diag(norm scale), so the normalised copies H̄ (n·d per
token and sublayer) are never materialised. The read (coefficients and h) and the write are autograd functions with
their backward written out, which make about half the passes over H that autograd's own graph makes (H is n·d per
token: at d = 128 as large as the MLP's hidden layer, and a CPU is bound by its memory traffic). Backward keeps H,
which the stream holds anyway, and with ``recompute`` (default) rebuilds the per-copy coefficients from it instead
of storing them. The rest of what HC stores per sublayer, H itself, is what its backward needs (dA = H·dhᵀ).

Beside them the reference (``model.mixing_impl``, see :data:`~satlab.config.model.MIXING_IMPLS`): the formulas
above as written (:meth:`HyperConnection.coefficients`, ``einsum`` for A_mᵀH and A_rᵀH), autograd doing the backward,
``recompute`` through activation checkpointing. It is what runs on a GPU, where torch.compile fuses it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from satlab.models.architecture import MixingWeight, register
from satlab.models.layers import RMSNorm, handwritten, rms_parts, rms_parts_backward
from satlab.models.parametrization import INPUT, OUTPUT_ZERO, SCALAR
from satlab.models.streams import DepthContext, ResidualStream, recomputed, stream_read, stream_write


class HyperConnection(nn.Module):
    no_weight_decay_params = ("static_m", "static_r", "static_beta", "s_alpha", "s_beta")
    # the dynamic weights read the width out to n + 2 coefficients (output-like, zero at the start)
    param_classes = {"norm.weight": INPUT, "w_m.weight": OUTPUT_ZERO, "w_r.weight": OUTPUT_ZERO,
                     "w_beta.weight": OUTPUT_ZERO, **{name: SCALAR for name in no_weight_decay_params}}

    def __init__(self, d_model: int, n: int, k: int, eps: float, impl: str = "auto"):
        super().__init__()
        self.n, self.k, self.impl = n, k, impl
        self.norm = RMSNorm(d_model, eps)
        self.w_m = nn.Linear(d_model, 1, bias=False)
        self.w_r = nn.Linear(d_model, n, bias=False)
        self.w_beta = nn.Linear(d_model, 1, bias=False)
        self.static_m = nn.Parameter(torch.empty(n))
        self.static_r = nn.Parameter(torch.empty(n, n))
        self.static_beta = nn.Parameter(torch.empty(n))
        self.s_alpha = nn.Parameter(torch.empty(1))  # (1,), not 0-dim: FSDP2's fully_shard refuses scalars
        self.s_beta = nn.Parameter(torch.empty(1))
        self.init_weights()

    def init_weights(self) -> None:
        self.norm.init_weights()
        for w in (self.w_m, self.w_r, self.w_beta):
            nn.init.zeros_(w.weight)
        if self.static_m.device.type == "meta":
            return
        with torch.no_grad():
            self.static_m.copy_(F.one_hot(torch.tensor(self.k % self.n), self.n).float())
            self.static_r.copy_(torch.eye(self.n))
            self.static_beta.fill_(1.0)
            self.s_alpha.fill_(0.01)
            self.s_beta.fill_(0.01)

    def read(self, H: Tensor, recompute: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """The sublayer input h = A_mᵀH (N, d) of the streams H (N, n, d), plus A_r (N, n, n) and β (N, n) for
        :meth:`write`. Hand-written, the coefficients are the columns of C = static + scale·tanh(H̄ W'),
        W' = [W_m | W_r | W_β] with the norm's scale folded in, from one :class:`_Read`."""
        if not handwritten(self.impl, H):
            a_m, a_r, beta = recomputed(self.coefficients, H, enabled=recompute)
            with torch.autocast(H.device.type, enabled=False):
                return torch.einsum("ti,tid->td", a_m, H), a_r, beta  # h = A_mᵀH
        n, dtype = self.n, H.dtype
        weight = torch.cat([self.w_m.weight, self.w_r.weight, self.w_beta.weight]) * self.norm.weight
        static = torch.cat([self.static_m.unsqueeze(-1), self.static_r, self.static_beta.unsqueeze(-1)], dim=-1)
        scale = torch.cat([self.s_alpha.expand(n + 1), self.s_beta])
        h, coeffs = _Read.apply(H, weight.to(dtype), static.to(dtype), scale.to(dtype), self.norm.eps, recompute)
        return h, coeffs[..., 1:n + 1], coeffs[..., n + 1]

    def coefficients(self, H: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The reference: A_m (N, n), A_r (N, n, n) and β (N, n) from H̄ = RMSNorm(H) per copy, in H's dtype,
        A_m = e + s_α·tanh(H̄ W_m), A_r = I + s_α·tanh(H̄ W_r), β = 1 + s_β·tanh(H̄ W_β)."""
        dtype = H.dtype
        with torch.autocast(H.device.type, enabled=False):  # the mixing in the streams' dtype (fp32 under bf16-mixed)
            Hbar = F.rms_norm(H, (H.shape[-1],), self.norm.weight.to(dtype), self.norm.eps)
            s_alpha, s_beta = self.s_alpha.to(dtype), self.s_beta.to(dtype)
            a_m = self.static_m.to(dtype) + s_alpha * torch.tanh(F.linear(Hbar, self.w_m.weight.to(dtype))).squeeze(-1)
            a_r = self.static_r.to(dtype) + s_alpha * torch.tanh(F.linear(Hbar, self.w_r.weight.to(dtype)))
            beta = self.static_beta.to(dtype) + s_beta * torch.tanh(
                F.linear(Hbar, self.w_beta.weight.to(dtype))).squeeze(-1)
        return a_m, a_r, beta

    def write(self, o: Tensor, H: Tensor, a_r: Tensor, beta: Tensor) -> Tensor:
        """H <- β ⊗ o + A_rᵀH."""
        return stream_write(o, H, a_r, beta, self.impl)


def _coefficient_parts(H: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """rstd (N, n, 1), U = H W'ᵀ (N, n, n + 2) and Z = tanh(U·rstd)."""
    rstd, u = rms_parts(H, weight, eps)
    return rstd, u, torch.tanh(u * rstd)


class _Read(torch.autograd.Function):
    """h = A_mᵀH and C = static + scale·Z of :meth:`HyperConnection.read`, with a backward written out: autograd's
    own takes about twice the passes over H (n·d per token), five gradients of H summed one add at a time among
    them. Forward keeps only H, which the stream holds anyway, and with ``recompute`` rebuilds rstd, U and Z from it
    in backward (one norm, one skinny matmul) instead of storing them."""

    @staticmethod
    def forward(ctx, H: Tensor, weight: Tensor, static: Tensor, scale: Tensor, eps: float,
                recompute: bool) -> tuple[Tensor, Tensor]:
        with torch.autocast(H.device.type, enabled=False):  # the mixing in the streams' dtype (fp32 under bf16-mixed)
            rstd, u, z = _coefficient_parts(H, weight, eps)
            coeffs = torch.addcmul(static, scale, z)
            h = stream_read(coeffs[..., 0], H, "handwritten")
        ctx.eps = eps
        ctx.save_for_backward(H, weight, static, scale, *(() if recompute else (rstd, u, z)))
        return h, coeffs

    @staticmethod
    @once_differentiable
    def backward(ctx, dh: Tensor | None, dcoeffs: Tensor | None):
        H, weight, static, scale, *parts = ctx.saved_tensors
        rstd, u, z = parts or _coefficient_parts(H, weight, ctx.eps)
        dcoeffs = torch.zeros_like(z) if dcoeffs is None else dcoeffs.clone()
        if dh is not None:  # A_m's gradient, dh·H_i
            dcoeffs[..., 0] += torch.linalg.vecdot(H, dh.unsqueeze(1))
        d_static, d_scale = dcoeffs.sum(0), (dcoeffs * z).sum((0, 1))
        dH, d_weight = rms_parts_backward(H, weight, rstd, u, dcoeffs * scale * (1 - z * z))  # through tanh
        if dh is not None:
            dH.addcmul_(torch.addcmul(static[:, :1], scale[:1], z[..., :1]), dh.unsqueeze(1))  # A_m ⊗ dh
        return dH, d_weight, d_static, d_scale, None, None


class HyperConnectionStream(ResidualStream):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.n = cfg.hyperconnections.expansion
        self.recompute = cfg.hyperconnections.recompute
        self.connections = nn.ModuleList(
            HyperConnection(cfg.d_model, self.n, k, cfg.norm_eps, cfg.mixing_impl) for k in range(2 * cfg.n_layers)
        )
        self.mixing_impl = cfg.mixing_impl  # a depth loop with two implementations (compile_blocks looks for it)

    def init_weights(self) -> None:
        for hc in self.connections:
            hc.init_weights()

    def output_init_std(self, std: float) -> float:
        """o_proj and down_proj start with std / sqrt(n), as in the HC paper."""
        return std / math.sqrt(self.n)

    def extra_flops_per_token(self) -> float:
        """The stream mixing A_mᵀH (2·n·d) and A_rᵀH (2·n²·d) per sublayer, forward and backward (x3)."""
        d = self.connections[0].norm.dim
        return len(self.connections) * 3 * 2 * self.n * (self.n + 1) * d

    def forward(self, x: Tensor, ctx: DepthContext) -> Tensor:
        B, T, d = x.shape
        H = x.reshape(B * T, 1, d).expand(B * T, self.n, d).contiguous()  # the streams of token t: H[t] (n, d)
        for i in range(len(ctx.blocks)):
            attn_hc, mlp_hc = self.connections[2 * i], self.connections[2 * i + 1]
            h, a_r, beta = attn_hc.read(H, self.recompute)
            H = attn_hc.write(ctx.attend(i, h.view(B, T, d)).view(B * T, d), H, a_r, beta)
            h, a_r, beta = mlp_hc.read(H, self.recompute)
            H = mlp_hc.write(ctx.feedforward(i, h.view(B, T, d)).view(B * T, d), H, a_r, beta)
        return (H.sum(dim=1) / self.n).view(B, T, d)

    def mixing_weights(self) -> dict[str, MixingWeight]:
        """Static parts per sublayer: A_m's static row (2L, n), β's static part (2L, n), A_r's diagonal (2L, n)."""
        return {f"hyperconnections/{name}": sublayer_matrix(torch.stack([part(c).detach().float().cpu()
                                                                         for c in self.connections]), "residual copy")
                for name, part in (("static_m", lambda c: c.static_m), ("static_beta", lambda c: c.static_beta),
                                   ("static_r_diag", lambda c: c.static_r.diagonal()))}


def sublayer_matrix(values: Tensor, col_label: str) -> MixingWeight:
    """A (2L, n) weight with one row per sublayer, labelled a0, m0, a1, ... (attention, MLP)."""
    return MixingWeight(values, "sublayer (a = attention, m = MLP)", col_label, 0,
                        row_ticks=[f"{'am'[k % 2]}{k // 2}" for k in range(values.shape[0])])


register("hyperconnections", stream=HyperConnectionStream)
