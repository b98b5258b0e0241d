"""What the coordinate check records: the RMS of every probed output of a model (embedding, attention logits,
each attention and MLP branch before its depth multiplier, block outputs, SATFormer's gate logits and V_1 term, the
dynamic mixing weights of hyper-connections, mHC and MUDDFormer, the logits), per layer, at each step.
:mod:`satlab.bench.coord` trains the models and fits the slopes; ``docs/coord-check.md`` lists the probes."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

PER_LAYER = ("attn_logits", "attn_out", "mlp_out", "block_out", "gate_logits", "value_term", "dyn_weights")
"""Probes recorded per layer (or per connection), reported as the first, the last and all layers together."""


class Probes(TorchFunctionMode):
    """Forward hooks that sum the squares of each probed output, per probe kind and layer, for the current step.

    Attention logits are not a module's output: this mode sees every call of scaled-dot-product attention and forms
    q·kᵀ times the scale the attention module passes (1/sqrt(d_head) when it passes none), over the causal entries.
    The dynamic mixing weights of hyper-connections and mHC are computed inside functions, not modules: their
    pre-activations (RMSNorm(H)·W) are recomputed from the connection's input and own weights.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.sums: dict[tuple[str, int], list[float]] = {}
        self.layer = 0
        self.handles: list = []
        self.patched: list[nn.Module] = []
        self._install()

    # -- recording
    def add(self, kind: str, index: int, x: torch.Tensor) -> None:
        x = x.detach().double()
        entry = self.sums.setdefault((kind, index), [0.0, 0.0])
        entry[0] += float(x.pow(2).sum())
        entry[1] += x.numel()

    def collect(self) -> dict[str, float]:
        """The step's RMS per probe (first, last and all layers for the per-layer kinds), then a clean slate."""
        out: dict[str, float] = {}
        kinds = sorted({k for k, _ in self.sums})
        for kind in kinds:
            entries = {i: v for (k, i), v in self.sums.items() if k == kind}
            rms = {i: math.sqrt(s / n) for i, (s, n) in entries.items() if n}
            if kind not in PER_LAYER:
                out[kind] = rms[0]
                continue
            layers = sorted(rms)
            out[f"{kind}[first]"], out[f"{kind}[last]"] = rms[layers[0]], rms[layers[-1]]
            out[f"{kind}[mid]"] = rms[layers[math.ceil(len(layers) / 2) - 1]]  # relative depth 1/2 at even depths
            out[f"{kind}[all]"] = math.sqrt(sum(s for s, _ in entries.values()) / sum(n for _, n in entries.values()))
        self.sums.clear()
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            if q.shape[1] != k.shape[1]:  # GQA: each key head serves a group of query heads
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scale = kwargs.get("scale", args[6] if len(args) > 6 else None)  # (q, k, v, mask, dropout, causal, scale)
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            logits = (q.detach() @ k.detach().transpose(-2, -1)) * scale
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            self.add("attn_logits", self.layer, logits[..., causal])
        return func(*args, **kwargs)

    # -- hooks
    def _hook(self, module: nn.Module, fn: Callable, pre: bool = False) -> None:
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self.handles.append(register(fn, with_kwargs=pre))

    def _install(self) -> None:
        from satlab.models.archs.hyperconnections import HyperConnection
        from satlab.models.archs.mhc import ManifoldConnection, ManifoldHead
        from satlab.models.archs.muddformer import DepthAggregate
        from satlab.models.archs.satformer import SATFormerGate
        from satlab.models.layers import Attention, Block, SwiGLU, rms_linear

        model = self.model
        self._hook(model.embed, lambda m, i, o: self.add("embed", 0, o))
        self._hook(model, lambda m, i, o: self.add("logits", 0, o.logits))
        counters: dict[str, int] = {}

        def index(kind: str) -> int:
            counters[kind] = counters.get(kind, -1) + 1
            return counters[kind]

        # A sublayer's output is probed before its block's depth multiplier (CompleteP's m_L^-alpha, folded into the
        # output projection): that multiplier scales it as 1/L by design; what must not move with depth is F(h).
        unscale = {sub: 1.0 / block.branch_value for block in model.modules() if isinstance(block, Block)
                   for sub in (block.attn, block.mlp) if sub is not None}
        for module in model.modules():
            if isinstance(module, Attention):
                n = index("attention")
                self._hook(module, lambda m, a, kw, n=n: setattr(self, "layer", n), pre=True)
                self._hook(module, lambda m, i, o, n=n: self.add("attn_out", n, o.out * unscale.get(m, 1.0)))
                if module.value_path is not None:  # v' - v: SATFormer's g ⊙ V_1, ResFormer's λ·V_1, ...
                    self._hook(module.value_path, lambda m, i, o, n=n: self.add("value_term", n, o[0] - i[0]))
            elif isinstance(module, SwiGLU):
                n = index("mlp")
                self._hook(module, lambda m, i, o, n=n: self.add("mlp_out", n, o * unscale.get(m, 1.0)))
            elif isinstance(module, Block):
                n = index("block")
                self._hook(module, lambda m, i, o, n=n: self.add("block_out", n, o[0])
                           if isinstance(o, tuple) and not hasattr(o, "out") else None)
            elif isinstance(module, SATFormerGate) and module.proj is not None:
                n = index("gate")
                self._hook(module.proj, lambda m, i, o, n=n: self.add("gate_logits", n, o))
            elif isinstance(module, DepthAggregate):
                n = index("dyn")
                self._hook(module.w2, lambda m, i, o, n=n: self.add("dyn_weights", n, o))
            elif isinstance(module, (ManifoldConnection, ManifoldHead)):
                n = index("dyn")  # x̃φ/r, the pre-activations of H_pre, H_post, H_res (and of the readout)
                self._hook(module, lambda m, a, kw, n=n: self.add("dyn_weights", n, rms_linear(
                    a[0].detach().flatten(-2).float(), m.phi.weight.detach(), m.eps, "reference")), pre=True)
            elif isinstance(module, HyperConnection):
                self._wrap_read(module, index("dyn"), rms_linear)

    def _wrap_read(self, hc: nn.Module, n: int, rms_linear: Callable) -> None:
        """Hyper-connections call ``read`` as a method: record RMSNorm(H)·[W_m | W_r | W_β] from its input."""
        read = hc.read

        def probed(H, *args, **kwargs):
            with torch.no_grad():
                weight = torch.cat([hc.w_m.weight, hc.w_r.weight, hc.w_beta.weight]) * hc.norm.weight
                self.add("dyn_weights", n, rms_linear(H.detach(), weight, hc.norm.eps, "reference"))
            return read(H, *args, **kwargs)

        hc.read = probed
        self.patched.append(hc)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for hc in self.patched:
            del hc.read  # the instance attribute: the class's method again
