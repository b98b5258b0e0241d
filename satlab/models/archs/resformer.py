"""ResFormer: the static value residual, V'_n = λ_{n,1}·V_1 + λ_{n,2}·V_n for layers n >= 1."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from satlab.models.architecture import MixingWeight, register
from satlab.models.parametrization import ParamClass, ParamDecl

IN_BRANCH_SCALAR = ParamDecl(ParamClass.SCALAR, in_block=True)


class ResFormerLambdas(nn.Module):
    """The model-level part of the learnable ResFormer: λ_{n,1} = λ_scale · softmax(λ')_n over layers 1..L-1.

    The softmax couples the layers, so these weights are computed once per forward pass by the model and handed to
    each layer's :class:`ResFormerValue` as ``v1_weight``: no module reads another's state. Its weights act only
    inside the attention branches, so they count as in a branch for CompleteP's depth rules.
    """

    param_classes = {"logits": IN_BRANCH_SCALAR, "scale": IN_BRANCH_SCALAR}

    def __init__(self, n_layers: int):
        super().__init__()
        self.n_layers = n_layers
        self.logits = nn.Parameter(torch.zeros(max(n_layers - 1, 1)))
        self.scale = nn.Parameter(torch.tensor([float(n_layers)]))  # (1,): FSDP2 refuses 0-dim parameters

    def init_weights(self) -> None:
        nn.init.zeros_(self.logits)
        nn.init.constant_(self.scale, float(self.n_layers))

    def forward(self) -> Tensor:
        """λ_{n,1} for layers n = 1..L-1, as a tensor of L-1 scalars."""
        return self.scale * torch.softmax(self.logits, dim=0)


class ResFormerValue(nn.Module):
    """V'_n = λ_{n,1}·V_1 + λ_{n,2}·V_n, λ_{n,2} learnable (init 0.5); ``fixed`` mode: 0.5·V_1 + 0.5·V_n."""

    no_weight_decay_params = ("lambda2",)
    param_classes = {"lambda2": IN_BRANCH_SCALAR}

    def __init__(self, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.lambda2 = None if fixed else nn.Parameter(torch.tensor([0.5]))  # (1,), as above

    def init_weights(self) -> None:
        if self.lambda2 is not None:
            nn.init.constant_(self.lambda2, 0.5)

    def forward(self, v: Tensor, v1: Tensor, h: Tensor, v1_weight: Tensor | None,
                tokens: Tensor | None = None) -> tuple[Tensor, None]:
        if self.fixed:
            return 0.5 * v1 + 0.5 * v, None
        return v1_weight * v1 + self.lambda2 * v, None


def mixing_weights(model: Any) -> dict[str, MixingWeight]:
    """λ1 (the weight on V_1) and λ2 per layer 1..L-1; 0.5 and 0.5 in fixed mode."""
    layers = model.cfg.n_layers - 1
    with torch.no_grad():
        if model.value_shared is None:
            lambda1 = lambda2 = torch.full((layers,), 0.5)
        else:
            lambda1 = model.value_shared().detach().float().cpu()
            lambda2 = torch.cat([b.attn.value_path.lambda2.detach().float().cpu() for b in model.blocks[1:]])
    return {"resformer/lambda1": MixingWeight(lambda1, v1_coefficient=True), "resformer/lambda2": MixingWeight(lambda2)}


register(
    "resformer",
    value_path=lambda cfg, layer: ResFormerValue(fixed=cfg.resformer.mode == "fixed") if layer >= 1 else None,
    value_shared=lambda cfg: ResFormerLambdas(cfg.n_layers) if cfg.resformer.mode == "learnable" and cfg.n_layers > 1
    else None,
    mixing_weights=mixing_weights,
)
