"""The two implementations of the depth mixing (``model.mixing_impl``) compute the same thing: the reference (the
plain formulas, autograd's backward, what torch.compile traces on a GPU) and the hand-written autograd functions
(the CPU's fast path). In float64, per function and for every registered architecture and variant as a whole
model: the same values and the same gradients of every input and parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from satlab.config.errors import ConfigError
from satlab.config.model import MIXING_IMPLS
from satlab.config.resume import resume_problems
from satlab.config.schema import ExperimentConfig
from satlab.models import ARCHITECTURES, build_model
from satlab.models.archs.hyperconnections import HyperConnection
from satlab.models.archs.mhc import sinkhorn
from satlab.models.depth_buffer import DepthBuffer, DepthList, depth_buffer
from satlab.models.layers import handwritten, rms_linear, rms_norm
from satlab.models.streams import ResidualStream, stream_read, stream_write

IMPLS = ("reference", "handwritten")
# At least 6 layers: the dense loops' sums then span 7 sources, Block AttnRes closes several blocks.
DEEP = dict(d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, mlp_hidden=48, vocab_size=61, max_seq_len=32)
TIGHT = dict(rtol=1e-9, atol=1e-11)  # float64: what differs is only the order of the sums

VARIANTS = [dict(arch=name) for name in ARCHITECTURES] + [  # the variants of the depth loops with mixing
    dict(arch=arch.name, **{arch.name: dict(options)}) for arch in ARCHITECTURES.values()
    for _, options in arch.variants if arch.stream is not ResidualStream
] + [dict(arch="hyperconnections", hyperconnections=dict(recompute=False)),
     dict(arch="mhc", mhc=dict(recompute=False, sinkhorn_iters=5))]


def variant_id(variant: dict) -> str:
    return "-".join(str(v) if k == "arch" else ",".join(f"{a}={b}" for a, b in v.items())
                    for k, v in variant.items())


def randn(*shape: int, seed: int = 0, grad: bool = True) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.requires_grad_(grad)


def values_and_grads(fn, inputs: list[torch.Tensor], seed: int = 99):
    """``fn()``'s outputs and the gradients of ``inputs`` under a fixed random probe of every output."""
    outputs = fn()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    loss = sum((out * randn(*out.shape, seed=seed + k, grad=False)).sum() for k, out in enumerate(outputs))
    return [o.detach() for o in outputs], torch.autograd.grad(loss, inputs)


def assert_same(got, want, **tolerance) -> None:
    for name, a, b in zip(("values", "gradients"), got, want, strict=True):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(x, y, **(tolerance or TIGHT), msg=lambda m, n=name, k=k: f"{n} {k}: {m}")


def test_auto_is_handwritten_on_a_cpu_only_and_the_setting_is_validated_and_resumable():
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    assert handwritten("auto", cpu) and not handwritten("auto", meta)
    assert handwritten("handwritten", meta) and not handwritten("reference", cpu)
    assert set(MIXING_IMPLS) == {"auto", *IMPLS}
    with pytest.raises(ConfigError, match="unknown model.mixing_impl 'fused'; valid: auto, handwritten, reference"):
        build_model(dict(arch="mhc", mixing_impl="fused", **DEEP))
    saved = ExperimentConfig()
    resumed = dataclasses.replace(saved, model=dataclasses.replace(saved.model, mixing_impl="reference"))
    assert resume_problems(saved, resumed) == []


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rms_norm(affine, dtype):
    """Also on the strided inputs the depth loops hand it (views of MUDD's (B, T, 4, d) aggregates), and in fp32,
    where the hand-written function runs in training."""
    base = randn(3, 5, 4, 24).to(dtype).detach().requires_grad_()
    weight = (1 + 0.3 * randn(24, seed=1, grad=False)).to(dtype).requires_grad_() if affine else None
    inputs = [base] + ([weight] if affine else [])
    x = base[:, :, 1]
    assert not x.is_contiguous()
    got, want = (values_and_grads(lambda impl=impl: rms_norm(x, weight, 1e-5, impl), inputs) for impl in IMPLS[::-1])
    assert_same(got, want, **(TIGHT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rms_linear(dtype):
    base = randn(3, 5, 4, 24).to(dtype).detach().requires_grad_()
    weight = randn(7, 24, seed=1).to(dtype).detach().requires_grad_()
    x = base[:, :, 2]
    got, want = (values_and_grads(lambda impl=impl: rms_linear(x, weight, 1e-5, impl), [base, weight])
                 for impl in IMPLS[::-1])
    assert_same(got, want, **(TIGHT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)))


def test_stream_read_and_write():
    """Read Σ_i w_i H_i and write A_rᵀH + β ⊗ o, with a non-contiguous weight column as the read gets it."""
    coeffs, H, o = randn(10, 3, 5, seed=1), randn(10, 3, 16, seed=2), randn(10, 16, seed=3)
    a_r, beta = randn(10, 3, 3, seed=4), randn(10, 3, seed=5)

    def mixing(impl):
        return stream_read(coeffs[..., 0], H, impl), stream_write(o, H, a_r, beta, impl)

    got, want = (values_and_grads(lambda impl=impl: mixing(impl), [coeffs, H, o, a_r, beta]) for impl in IMPLS[::-1])
    assert_same(got, want)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "stored"])
def test_hyperconnection_read_and_write(recompute):
    """The hand-written read (RMSNorm(H) never materialised, backward written out) gives the reference's h = A_mᵀH,
    A_r and β from RMSNorm(H), and the write H' = A_rᵀH + β ⊗ o, for H, o and every parameter."""
    torch.manual_seed(0)
    hc = HyperConnection(d_model=16, n=3, k=1, eps=1e-6).double()
    with torch.no_grad():
        for param in hc.parameters():
            param.add_(0.3 * torch.randn_like(param))
    H, o = randn(10, 3, 16, seed=1), randn(10, 16, seed=2)

    def mixing(impl):
        hc.impl = impl
        h, a_r, beta = hc.read(H, recompute)
        return h, a_r, beta, hc.write(o * h, H, a_r, beta)

    got, want = (values_and_grads(lambda impl=impl: mixing(impl), [H, o, *hc.parameters()]) for impl in IMPLS[::-1])
    assert_same(got, want)


def test_sinkhorn():
    logits = (3 * randn(5, 7, 4, 4, grad=False)).requires_grad_()
    for iters in (1, 3, 20):
        got, want = (values_and_grads(lambda impl=impl, iters=iters: sinkhorn(logits, iters, impl), [logits])
                     for impl in IMPLS[::-1])
        assert_same(got, want)
        assert torch.allclose(got[0][0].sum(-1), torch.ones((), dtype=torch.float64))  # rows last: exactly 1


@pytest.mark.parametrize("per_token", [False, True], ids=["shared-weights", "per-token-weights"])
def test_depth_buffer_and_list(per_token):
    """A depth loop over the preallocated buffer (each sum feeding the next entry, one entry without a sum, a
    strided subset of entries) gives the values and gradients of the same loop over the reference's list, twice in
    a row on one graph."""
    B, T, d, depth = 2, 5, 3, 5
    xs = [randn(B, T, d, seed=i) for i in range(depth)]
    steps = [1, 1, 2, None, 1]  # entry 3 is written without a sum; the sum after entry 2 takes entries 0 and 2
    weights = [None if steps[i] is None else randn(B, T, 2, i // steps[i] + 1, seed=10 + i) if per_token
               else randn(i // steps[i] + 1, seed=10 + i) for i in range(depth)]
    inputs = xs + [w for w in weights if w is not None]

    def loop(impl: str) -> torch.Tensor:
        buffer = depth_buffer(xs[0], depth, dim=-2 if per_token else 0, impl=impl)
        assert isinstance(buffer, DepthBuffer if impl == "handwritten" else DepthList)
        y = xs[0]
        for i in range(depth):
            step = steps[i] or 1
            y = buffer.append(torch.tanh(y * xs[i]), weights[i], start=i % step, step=step)
            if per_token and steps[i] is not None:
                y = y[..., 0, :] + 0.5 * y[..., 1, :]
        return (y * torch.arange(d, dtype=y.dtype)).sin().sum()

    want = torch.autograd.grad(loop("reference"), inputs)
    result = loop("handwritten")
    for _ in range(2):  # retain_graph: the second backward must not see the first one's sums
        got = torch.autograd.grad(result, inputs, retain_graph=True)
        assert_same(([], got), ([], want))
    for impl in IMPLS:
        buffer = depth_buffer(xs[0], 1, impl=impl)
        buffer.append(xs[0])
        with pytest.raises(IndexError, match="room for 1 block output"):
            buffer.append(xs[0])


def model_values_and_grads(variant: dict, impl: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model({**DEEP, **variant, "mixing_impl": impl}).double()
    with torch.no_grad():  # away from the exact start, so that every mixing weight gets a gradient
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    tokens = torch.randint(0, DEEP["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_every_architecture_has_the_same_loss_and_gradients_with_either_mixing(variant):
    (loss, grads), (want_loss, want_grads) = (model_values_and_grads(variant, impl) for impl in IMPLS[::-1])
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert grad is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], grad, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")
