"""Gate functions, one table: how gate logits (..., G, C) become gates, the values a gate can sit at (its bounds,
given G gate heads) and when the gate analysis calls a (layer, head) of that function saturated (its rule,
:attr:`GateFunction.saturates`). A function without bounds (identity) never saturates.

Torch-free (each function is written with tensor methods), so the config can offer the names as choices without
importing torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

SaturationRule = Literal["pinned", "dead", "never"]


@dataclass(frozen=True)
class GateFunction:
    """``apply`` maps logits to gates; ``bounds(G)`` are the values a gate over G gate heads can sit at.

    ``saturates`` is the rule by which the gate analysis (:mod:`satlab.evaluation.gates`) calls a (layer, head)
    saturated on the fixed validation windows ("elements": its gate values, tokens or tokens × channels; ``tol``,
    ``share`` and ``dead_share`` are the analysis's ``bound_tol``, ``saturation_share`` and ``dead_share``):

    - ``pinned`` (bounded gates: sigmoid, 2sigmoid, tanh, softmax, softmax_sigmoid): at least ``share`` (0.99) of
      its elements lie within ``tol`` of one and the same bound, at either end. A gate there has a vanishing
      gradient: it is stuck open or shut. A head that switches between two bounds is not saturated.
    - ``dead`` (ReLU-type gates: relu): closed, ``|g| < tol``, on at least ``dead_share`` of its elements; the
      default 1.0 means exactly all of them, not the bounded gates' ``share``. A ReLU gate open on even a few tokens
      is selective (sparsity, a feature, reported as ``sparsity``) and still gets a gradient through those tokens;
      one closed on every token gets none and does not reopen.
    - ``never`` (identity): unbounded, never saturated (a closed identity gate shows up as a dead head).
    """

    apply: Callable[[Tensor], Tensor]
    bounds: Callable[[int], tuple[float, ...]]
    saturates: SaturationRule

    def __post_init__(self) -> None:
        bounds = self.bounds(1)
        if (self.saturates == "never") != (not bounds) or (self.saturates == "dead" and bounds != (0.0,)):
            raise ValueError(f"saturation rule {self.saturates!r} does not fit the bounds {bounds}: 'never' is for "
                             f"unbounded gates, 'dead' for gates bounded below by 0 only")

    @property
    def can_saturate(self) -> bool:
        return self.saturates != "never"


def _softmax(logits: Tensor) -> Tensor:
    """Over the head axis G, times G, so the mean gate is 1 (with G = 1 the constant 1)."""
    return logits.softmax(dim=-2) * logits.shape[-2]


GATE_FUNCTIONS: dict[str, GateFunction] = {
    "relu": GateFunction(lambda x: x.relu(), lambda heads: (0.0,), "dead"),
    "sigmoid": GateFunction(lambda x: x.sigmoid(), lambda heads: (0.0, 1.0), "pinned"),
    "tanh": GateFunction(lambda x: x.tanh(), lambda heads: (-1.0, 1.0), "pinned"),
    # a copy, not the logits' view: gates leave a model's blocks, which FSDP2 wants free of views
    "identity": GateFunction(lambda x: x.clone(), lambda heads: (), "never"),
    "softmax": GateFunction(_softmax, lambda heads: (0.0, float(heads)), "pinned"),
    "softmax_sigmoid": GateFunction(lambda x: _softmax(x) * x.sigmoid(), lambda heads: (0.0, float(heads)), "pinned"),
    # modded-nanogpt's VE gate
    "2sigmoid": GateFunction(lambda x: 2 * x.sigmoid(), lambda heads: (0.0, 2.0), "pinned"),
}


def apply_gate_fn(name: str, logits: Tensor) -> Tensor:
    return GATE_FUNCTIONS[name].apply(logits)
