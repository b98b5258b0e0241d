"""Gate functions, one table: how gate logits (..., G, C) become gates, and the values a gate can be pinned at
(its bounds, given G gate heads), which the gate analysis reads to call a gate saturated. A function without bounds
(identity) never saturates."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class GateFunction:
    apply: Callable[[Tensor], Tensor]
    bounds: Callable[[int], tuple[float, ...]]

    @property
    def can_saturate(self) -> bool:
        return bool(self.bounds(1))


def _softmax(logits: Tensor) -> Tensor:
    """Over the head axis G, times G, so the mean gate is 1 (with G = 1 the constant 1)."""
    return torch.softmax(logits, dim=-2) * logits.shape[-2]


GATE_FUNCTIONS: dict[str, GateFunction] = {
    "relu": GateFunction(F.relu, lambda heads: (0.0,)),
    "sigmoid": GateFunction(torch.sigmoid, lambda heads: (0.0, 1.0)),
    "tanh": GateFunction(torch.tanh, lambda heads: (-1.0, 1.0)),
    "identity": GateFunction(lambda x: x, lambda heads: ()),
    "softmax": GateFunction(_softmax, lambda heads: (0.0, float(heads))),
    "softmax_sigmoid": GateFunction(lambda x: _softmax(x) * torch.sigmoid(x), lambda heads: (0.0, float(heads))),
    "2sigmoid": GateFunction(lambda x: 2 * torch.sigmoid(x), lambda heads: (0.0, 2.0)),  # modded-nanogpt's VE gate
}


def apply_gate_fn(name: str, logits: Tensor) -> Tensor:
    return GATE_FUNCTIONS[name].apply(logits)
