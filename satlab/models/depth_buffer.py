"""Preallocated buffers of block outputs X_0..X_L, and of their gradients, for the dense depth loops.

DenseFormer and MUDDFormer form, after every block, weighted sums over all earlier block outputs. Done with
autograd's ordinary ops this either stacks a growing list (copying O(L²) hidden states per pass) or chains
``i + 1`` multiply-adds per layer, and in backward every term allocates a gradient of its own that is then summed
into X_j's: allocations and memory traffic beyond what the sums need.

Autograd forbids the obvious fix, writing X_{i+1} into a preallocated tensor, because a matmul of layer i saved
that tensor for its backward and the in-place write bumps its version. :class:`_DepthSum` is the custom autograd
function that makes it legal: the values are written once into :attr:`DepthBuffer.values` and read through views
that autograd never sees; each sum's backward adds its part of every X_j's gradient in place into one
:attr:`DepthBuffer.grads` tensor (one rank-1 update, or one batched matmul and an add), and hands X_i its gradient
when X_i's own node runs. The graph's order makes that total: the sum of layer i feeds block i+1, so every later
sum (the only other readers of X_i) has run its backward before layer i's does.

:class:`DepthList` is the same interface as the formula reads, Σ_j w_j X_j over a list of block outputs, autograd
doing the backward: the reference, and what torch.compile traces (the sums fuse into one kernel each there).
:func:`depth_buffer` picks one of the two by ``model.mixing_impl`` (see :data:`~satlab.config.model.MIXING_IMPLS`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from satlab.models.layers import handwritten


def exact_sum(x: Tensor) -> torch.autocast:
    """A context in which the depth sums run in the stream's own dtype: under ``bf16-mixed`` autocast would turn
    their matmuls into bf16 ones and round the (fp32) residual stream."""
    return torch.autocast(x.device.type, enabled=False)


class DepthBuffer:
    """Block outputs written once, in order, into one tensor, with weighted sums over what has been written.

    ``dim=0``: a (depth, B, T, d) buffer for weights shared by all tokens (DenseFormer's DWA, a (J,) vector over
    entries ``start, start + step, ..., i``). ``dim=-2``: a (B, T, depth, d) buffer for per-token weights
    (MUDDFormer's (B, T, C, J) over entries ``0..i``), giving C sums per token.
    """

    def __init__(self, first: Tensor, depth: int, dim: int = 0):
        if dim not in (0, -2):
            raise ValueError(f"a depth buffer stacks along dim 0 or -2, not {dim}")
        self.per_token = dim == -2
        shape = list(first.shape)
        shape.insert(first.dim() - 1 if self.per_token else 0, depth)
        self.values = first.new_empty(shape, requires_grad=False)
        self.grads: Tensor | None = None
        self.count = 0

    @property
    def capacity(self) -> int:
        return self.values.shape[-2 if self.per_token else 0]

    def entries(self, start: int, stop: int, step: int = 1, source: Tensor | None = None) -> Tensor:
        """Entries ``start:stop:step`` of the values (or of ``source``, the gradients) along the depth axis."""
        source = self.values if source is None else source
        return source[..., start:stop:step, :] if self.per_token else source[start:stop:step]

    def append(self, x: Tensor, weights: Tensor | None = None, start: int = 0, step: int = 1) -> Tensor:
        """Write ``x`` as the next entry. Without ``weights`` returns ``x``; with them, the weighted sum over entries
        ``start, start + step, ..., x`` (weights last dimension: one per entry)."""
        if self.count == self.capacity:
            raise IndexError(f"the depth buffer has room for {self.capacity} block output(s), all written")
        return _DepthSum.apply(x, weights, self, self.count, start, step)


def depth_sum(weights: Tensor, sources: list[Tensor], per_token: bool) -> Tensor:
    """Σ_j w_j X_j, the formula of the dense depth loops, over the block outputs ``sources`` (each (B, T, d)):
    ``weights`` (J,) shared by all tokens gives (B, T, d); per token (B, T, C, J) gives C sums (B, T, C, d)."""
    if len(sources) != weights.shape[-1]:
        raise ValueError(f"{weights.shape[-1]} weights for {len(sources)} block outputs")
    weights = weights.to(sources[0].dtype)
    if per_token:
        terms = [weights[..., j, None] * x.unsqueeze(-2) for j, x in enumerate(sources)]
    else:
        terms = [weights[j] * x for j, x in enumerate(sources)]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


class DepthList:
    """The reference of :class:`DepthBuffer`: the same interface over a list of block outputs, each sum the
    formula (:func:`depth_sum`), autograd doing the backward."""

    def __init__(self, first: Tensor, depth: int, dim: int = 0):
        if dim not in (0, -2):
            raise ValueError(f"a depth buffer stacks along dim 0 or -2, not {dim}")
        self.per_token = dim == -2
        self.capacity = depth
        self.outputs: list[Tensor] = []

    @property
    def count(self) -> int:
        return len(self.outputs)

    def append(self, x: Tensor, weights: Tensor | None = None, start: int = 0, step: int = 1) -> Tensor:
        """As :meth:`DepthBuffer.append`."""
        if self.count == self.capacity:
            raise IndexError(f"the depth buffer has room for {self.capacity} block output(s), all written")
        self.outputs.append(x)
        if weights is None:
            return x
        with exact_sum(x):
            return depth_sum(weights, self.outputs[start::step], self.per_token)


def depth_buffer(first: Tensor, depth: int, dim: int = 0, impl: str = "auto") -> DepthBuffer | DepthList:
    """The block-output store for ``model.mixing_impl``: the preallocated :class:`DepthBuffer` hand-written, the
    :class:`DepthList` reference. Chosen per forward from ``first``'s device."""
    return (DepthBuffer if handwritten(impl, first) else DepthList)(first, depth, dim)


def _flat(t: Tensor) -> Tensor:
    """(J, B, T, d) entries as a (J, B·T·d) matrix (a view: only the depth axis may be strided)."""
    return t.reshape(t.shape[0], -1)


def _per_token(t: Tensor) -> Tensor:
    """(B, T, ..., d) as (B·T, ..., d), a view."""
    return t.reshape(-1, *t.shape[2:])


class _DepthSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor | None, buffer: DepthBuffer, index: int, start: int,
                step: int) -> Tensor:
        ctx.buffer, ctx.index, ctx.start, ctx.step, ctx.x_dtype = buffer, index, start, step, x.dtype
        buffer.entries(index, index + 1).copy_(x.unsqueeze(-2 if buffer.per_token else 0))
        buffer.count += 1
        if weights is None:
            return x.view_as(x)
        ctx.save_for_backward(weights)
        sources = buffer.entries(start, index + 1, step)
        with exact_sum(x):
            weights = weights.to(sources.dtype)
            if buffer.per_token:  # (B, T, C, J) @ (B, T, J, d) -> (B, T, C, d)
                return torch.matmul(weights, sources)
            return (weights @ _flat(sources)).view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor | None):
        buffer, index = ctx.buffer, ctx.index
        if index == buffer.count - 1:  # the newest entry's node runs first: a backward (re)starts from zeros
            buffer.grads = None
        grad_weights = None
        if ctx.saved_tensors and grad is not None:
            (weights,) = ctx.saved_tensors
            if buffer.grads is None:
                buffer.grads = torch.zeros_like(buffer.values)
            sources = buffer.entries(ctx.start, index + 1, ctx.step)
            sums = buffer.entries(ctx.start, index + 1, ctx.step, buffer.grads)
            with exact_sum(grad):
                grad, w = grad.to(sources.dtype), weights.to(sources.dtype)
                if buffer.per_token:
                    # bmm then add: an in-place baddbmm_ into the strided view runs one small matmul per token on CPU
                    _per_token(sums).add_(torch.bmm(_per_token(w).transpose(1, 2), _per_token(grad)))
                    if ctx.needs_input_grad[1]:
                        grad_weights = torch.matmul(grad, sources.transpose(-1, -2)).to(weights.dtype)
                else:
                    _flat(sums).addr_(w, grad.reshape(-1))
                    if ctx.needs_input_grad[1]:
                        grad_weights = (_flat(sources) @ grad.reshape(-1)).to(weights.dtype)
            grad = None  # this sum's gradient is now in the buffer, X_i's share included
        if buffer.grads is not None:
            mine = buffer.entries(index, index + 1, source=buffer.grads).squeeze(-2 if buffer.per_token else 0)
            grad = (mine if grad is None else grad + mine).to(ctx.x_dtype)
        return grad, grad_weights, None, None, None, None
