"""The shared backbone's parts: RMSNorm, RoPE, causal GQA attention with a pluggable value path, SwiGLU, block.

Every architecture uses these unchanged. What differs between architectures is (a) how a layer forms its values
(``value_path``, see the architectures in ``archs/``) and (b) how blocks are chained (the depth loop, see ``streams``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from satlab.models.cache import LayerKVCache
from satlab.models.parametrization import HIDDEN, INPUT, SCALAR, ParamClass, ParamDecl, branch_output_std

BRANCH_OUTPUT = ParamDecl(ParamClass.HIDDEN, std=branch_output_std)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``elementwise_affine=False`` gives the scale-free norm MUDD uses."""

    param_classes = {"weight": INPUT}

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, impl: str = "auto"):
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.impl = impl  # see MIXING_IMPLS
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.impl)

    def init_weights(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)


def handwritten(impl: str, x: Tensor) -> bool:
    """Whether the mixing implementation ``impl`` (one of :data:`MIXING_IMPLS`) computes ``x``'s mixing with the
    hand-written autograd functions."""
    return impl == "handwritten" or (impl == "auto" and x.device.type == "cpu")


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, impl: str = "auto") -> Tensor:
    """RMSNorm over the last dimension. The reference is F.rms_norm (a fused kernel on GPUs); the hand-written
    function below is for fp32 (and fp64) on a CPU. In low precision always F.rms_norm, which upcasts."""
    if handwritten(impl, x) and x.dtype in (torch.float32, torch.float64):
        return _RMSNormCPU.apply(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rstd(x: Tensor, eps: float) -> Tensor:
    """1 / RMS(x) over the last dimension, (..., 1)."""
    return torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) / x.shape[-1] + eps)


def _add_rstd_grad(dx: Tensor, x: Tensor, rstd: Tensor, drstd: Tensor) -> Tensor:
    """dx += drstd·∂rstd/∂x in place, with ∂rstd/∂x = -rstd³·x/d: the one pass over x the norm's gradient needs."""
    return dx.addcmul_(x, drstd * rstd.pow(3), value=-1.0 / x.shape[-1])


class _RMSNormCPU(torch.autograd.Function):
    """RMSNorm in fp32 on a CPU with its backward written out. There F.rms_norm is composite, and autograd through
    a composite form makes more passes over x than the gradient needs: forward and backward at (8, 256, 128) take
    0.6-0.7 ms here against 0.95 ms for F.rms_norm and 0.75 ms for the best composite (vecdot). Every block norms
    two to four inputs (MUDDFormer three, plus its depth aggregates), and QK-norm two more."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        rstd = _rstd(x, eps)
        out = x * rstd
        if weight is not None:
            out.mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        d = x.shape[-1]
        g = grad if weight is None else grad * weight
        dot = torch.linalg.vecdot(g, x).unsqueeze(-1)
        dx = _add_rstd_grad(g * rstd if weight is None else g.mul_(rstd), x, rstd, dot)
        d_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            d_weight = torch.linalg.vecdot(grad.reshape(-1, d), (x * rstd).reshape(-1, d), dim=0)
        return dx, d_weight, None


def rms_parts(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """rstd (..., 1) and U = x Wᵀ (..., k): RMSNorm(x) Wᵀ = U·rstd without the normalised copy of x."""
    return _rstd(x, eps), F.linear(x, weight)


def rms_parts_backward(x: Tensor, weight: Tensor, rstd: Tensor, u: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of x and W from that of U·rstd: two matmuls and one pass over x for ∂rstd/∂x."""
    du = grad * rstd
    drstd = (grad * u).sum(-1, keepdim=True)
    d_weight = torch.mm(du.reshape(-1, du.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
    return _add_rstd_grad(torch.matmul(du, weight), x, rstd, drstd), d_weight


class _RMSLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):  # in x's dtype: mixing weights in fp32 under bf16-mixed
            rstd, u = rms_parts(x, weight.to(x.dtype), eps)
        ctx.save_for_backward(x, weight, rstd, u)
        return u * rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight, rstd, u = ctx.saved_tensors
        dx, d_weight = rms_parts_backward(x, weight.to(x.dtype), rstd, u, grad.to(x.dtype))
        return dx, d_weight.to(weight.dtype), None


def rms_linear(x: Tensor, weight: Tensor, eps: float, impl: str = "auto") -> Tensor:
    """RMSNorm(x) Wᵀ for a norm without scale (fold a scale into W), computed in x's dtype (autocast off: the
    mixing weights stay fp32 under bf16-mixed). The skinny projections of the mixing weights (MUDDFormer's depth
    aggregates, mHC's coefficients and readout; hyper-connections use its parts inside their read) hand-written
    read x once and never materialise RMSNorm(x), in forward or backward, where autograd's own form makes several
    passes over x for ∂rstd/∂x."""
    if handwritten(impl, x):
        return _RMSLinear.apply(x, weight, eps)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(F.rms_norm(x, (x.shape[-1],), None, eps), weight.to(x.dtype))


class Rotary(nn.Module):
    """RoPE on the full head dim (rotate-half form), with cos/sin tables up to ``max_seq_len``."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        device = self.cos.device
        if device.type == "meta":
            return
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, device=device).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def tables(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin for positions [start, start + length), shaped (length, 1, head_dim) for (B, T, H, d_h)."""
        if start + length > self.max_seq_len:
            raise ValueError(
                f"sequence position {start + length} exceeds model.max_seq_len={self.max_seq_len} (the RoPE table); "
                "raise model.max_seq_len or shorten the sequence"
            )
        return self.cos[start : start + length, None, :], self.sin[start : start + length, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class SwiGLU(nn.Module):
    param_classes = {"gate_proj.weight": HIDDEN, "up_proj.weight": HIDDEN, "down_proj.weight": BRANCH_OUTPUT}

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor, out_scale: Tensor | None = None) -> Tensor:
        """``out_scale``: CompleteP's branch multiplier, folded into the down projection's weight."""
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if out_scale is None:
            return self.down_proj(hidden)
        return F.linear(hidden, self.down_proj.weight * out_scale)  # CompleteP: the branch x m_L^-alpha


class AttentionOutput(NamedTuple):
    out: Tensor
    v1: Tensor | None  # layer 0's raw values (B, T, n_kv_heads * head_dim) from layer 0, None from later layers
    gate: Tensor | None  # this layer's gate values (B, T, G, C), when its value path has a gate


class Attention(nn.Module):
    """Causal self-attention: bias-free q/k/v/o, QK-norm before RoPE, GQA, SDPA, KV cache.

    The first layer to attend (``v1`` is None: layer 0) records its raw value projection as V_1. A layer with a
    ``value_path`` forms ``V'_n = value_path(V_n, V_1, h_n, v1_weight, tokens)`` before attending; V'_n is what goes
    into the KV cache.

    A block sharded by FSDP2 must not return a view (FSDP2 warns that an in-place op on one would skip its
    pre-backward hook), and FSDP2 hands a block its tensor inputs as views of themselves. So layer 0 hands V_1 on as
    the projection's own output, (B, T, n_kv_heads * head_dim), viewed per head where it is used, and later layers
    return None in its place instead of their V_1 input (the depth loop keeps layer 0's).

    ``attn_scale`` is the attention-logit scale (None: SDPA's 1/sqrt(d_head); μP sets sqrt(d_base)/d_head off the
    base head dim, a float that only changes with the head dim, which changes the shapes anyway).
    """

    param_classes = {"q_proj.weight": HIDDEN, "k_proj.weight": HIDDEN, "v_proj.weight": HIDDEN,
                     "o_proj.weight": BRANCH_OUTPUT, "q_norm.weight": SCALAR, "k_norm.weight": SCALAR}
    # the per-head QK-norm gains (head dim, fixed) are scalars here, whatever RMSNorm declares of its own gain

    def __init__(self, cfg, layer_idx: int, value_path: nn.Module | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        d = cfg.d_model
        self.q_proj = nn.Linear(d, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, impl=cfg.mixing_impl)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, impl=cfg.mixing_impl)
        self.value_path = value_path
        self.attn_scale: float | None = None

    def forward(
        self,
        hq: Tensor,
        hk: Tensor,
        hv: Tensor,
        rope: tuple[Tensor, Tensor],
        v1: Tensor | None,
        v1_weight: Tensor | None = None,
        cache: LayerKVCache | None = None,
        tokens: Tensor | None = None,
        out_scale: Tensor | None = None,
    ) -> AttentionOutput:
        """``out_scale``: CompleteP's branch multiplier, folded into the output projection's weight."""
        B, T, _ = hq.shape
        q = self.q_proj(hq).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(hk).view(B, T, self.n_kv_heads, self.head_dim)
        projected = self.v_proj(hv)
        v = projected.view(B, T, self.n_kv_heads, self.head_dim)
        gate, first_v1 = None, None
        if v1 is None:  # layer 0, the first to attend: its values are V_1. The role comes in as data (None or a
            v1 = first_v1 = projected  # tensor), not from layer_idx: dynamo specialises on module ints
        if self.value_path is not None:
            v, gate = self.value_path(v, v1.view(B, T, self.n_kv_heads, self.head_dim), hq, v1_weight, tokens)
        cos, sin = rope
        q = apply_rotary(self.q_norm(q), cos, sin).transpose(1, 2)
        k = apply_rotary(self.k_norm(k), cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        mask, causal = None, True
        if cache is not None:
            start = cache.length
            k, v = cache.append(k, v)
            causal = start == 0 and T > 1
            if start > 0 and T > 1:
                positions = torch.arange(start + T, device=q.device)
                mask = positions[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
            elif T == 1:
                causal = False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.n_kv_heads != self.n_heads,
            scale=self.attn_scale,  # μP: sqrt(d_base)/d_head where set
        )
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if out_scale is not None:  # CompleteP: the branch x m_L^-alpha, in the projection's weight
            return AttentionOutput(F.linear(y, self.o_proj.weight * out_scale), first_v1, gate)
        return AttentionOutput(self.o_proj(y), first_v1, gate)


class Block(nn.Module):
    """Pre-norm block. Its forward runs one of three ``part``s: the whole block (``"block"``: returns (output, V_1,
    gate)), or one of its two sublayers without the residual add (``"attend"``: an :class:`AttentionOutput`;
    ``"feedforward"``: the MLP's output), so a depth loop that is not a plain residual (hyper-connections, MUDD) can
    wire them its own way. The sublayers are reached through the module's call, never as methods, so that whatever
    wraps ``forward`` (FSDP's unsharding, activation checkpointing, torch.compile) applies to them too.

    ``separate_kv_norms`` gives the key and value inputs their own RMSNorm (MUDDFormer feeds q, k and v from
    different aggregates); otherwise one norm feeds all three. ``mlp_hidden=0`` leaves the MLP sublayer out
    (attention-only blocks, as in Zoology's associative-recall models): ``feedforward`` then adds nothing.

    Under ``completep`` both sublayers' outputs are multiplied by the branch multiplier m_L^-alpha
    (:meth:`set_branch_multiplier`), in every ``part``, so every depth loop gets it. It is a tensor (a non-persistent
    buffer), not a float attribute: dynamo guards a float attribute's value, and the multiplier changes with the
    depth, so a float would compile the block again per depth.
    """

    def __init__(self, cfg, layer_idx: int, value_path: nn.Module | None, mlp_hidden: int,
                 separate_kv_norms: bool = False):
        super().__init__()
        self.layer_idx = layer_idx  # for reading a model; forward never branches on it (see Attention.forward)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, impl=cfg.mixing_impl)
        self.attn_norm_k = RMSNorm(cfg.d_model, cfg.norm_eps, impl=cfg.mixing_impl) if separate_kv_norms else None
        self.attn_norm_v = RMSNorm(cfg.d_model, cfg.norm_eps, impl=cfg.mixing_impl) if separate_kv_norms else None
        self.attn = Attention(cfg, layer_idx, value_path)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, impl=cfg.mixing_impl) if mlp_hidden > 0 else None
        self.mlp = SwiGLU(cfg.d_model, mlp_hidden) if mlp_hidden > 0 else None
        self.register_buffer("branch_scale", None, persistent=False)  # a 0-dim tensor once set (below)
        self.branch_value = 1.0

    def set_branch_multiplier(self, value: float) -> None:
        """Multiply both sublayers' outputs by ``value`` (CompleteP's m_L^-alpha); 1 leaves the block as it is."""
        self.branch_value = float(value)
        if value != 1.0:
            self.register_buffer("branch_scale", torch.tensor(float(value)), persistent=False)

    def init_weights(self) -> None:
        """Refill the branch multiplier (a non-persistent buffer: empty after a model built on the meta device is
        materialised)."""
        if self.branch_scale is not None and self.branch_scale.device.type != "meta":
            self.branch_scale.fill_(self.branch_value)

    def _attend(self, xq: Tensor, rope, v1, v1_weight, cache, xk: Tensor | None, xv: Tensor | None,
                tokens: Tensor | None) -> AttentionOutput:
        hq = self.attn_norm(xq)
        hk = hq if xk is None else self.attn_norm_k(xk)
        hv = hq if xv is None else self.attn_norm_v(xv)
        return self.attn(hq, hk, hv, rope, v1, v1_weight, cache, tokens, self.branch_scale)

    def _feedforward(self, x: Tensor) -> Tensor:
        if self.mlp is None:
            return torch.zeros_like(x)
        return self.mlp(self.mlp_norm(x), self.branch_scale)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, v1: Tensor | None = None,
                v1_weight: Tensor | None = None, cache: LayerKVCache | None = None, tokens: Tensor | None = None,
                xk: Tensor | None = None, xv: Tensor | None = None, part: str = "block"):
        """``part="block"``: (x + attention, then + MLP; V_1 from layer 0, else None; gate). ``"attend"``: the
        attention sublayer of x (and of ``xk``, ``xv`` when the keys and values have inputs of their own), norm
        included. ``"feedforward"``: the MLP sublayer of x, norm included."""
        if part == "feedforward":
            return self._feedforward(x)
        attn = self._attend(x, rope, v1, v1_weight, cache, xk, xv, tokens)
        if part == "attend":
            return attn
        x = x + attn.out
        if self.mlp is not None:
            x = x + self._feedforward(x)
        return x, attn.v1, attn.gate
