"""μP and CompleteP: how each parameter's init, learning rate, weight decay and AdamW epsilon, and a few forward
multipliers, follow the model's width and depth (``model.parametrization``, ``docs/parametrization.md``).

Every module that owns parameters declares their class in a ``param_classes`` mapping (local name ->
:class:`ParamDecl`), next to its implementation: the backbone's in :mod:`satlab.models.layers` and
:mod:`satlab.models.model`, each architecture's in its module. A class says which of a parameter's dimensions grow
with the width (``d_model``, with the head dim fixed, so the head count grows with it):

- ``input``: only the fan-out grows (embeddings, norm gains, vectors over the width, biases);
- ``hidden``: both grow (q/k/v/o, the MLP);
- ``output``: only the fan-in grows (the LM head, SATFormer's gate width -> heads, the hyper-connection, mHC and
  MUDDFormer dynamic weights width -> a few, AttnRes's depth queries, which are read out against the width);
- ``scalar``: neither grows (mixing scalars, static mixing weights, the per-head QK-norm gains).

A parameter sits in a residual branch (``in_block``) when it is inside a block, or when its module says so (the
ResFormer weights, computed once per forward but used only inside the branches). :func:`parameter_table` derives a
:class:`ParamRule` per named parameter from these and refuses a parameter no module declares. With the width
multiplier m_w = d_model / base_width and the depth multiplier m_L = n_layers / base_depth:

==========  ==========================  ==================  =========================================
class       init std (vs. base)         Adam LR             AdamW eps (completep only)
==========  ==========================  ==================  =========================================
input       unchanged                   x 1                 x 1/m_w
hidden      x 1/sqrt(m_w)               x 1/m_w             x 1/m_w
output      x 1/m_w (the LM head: the   x 1/m_w (the LM     x 1/m_w
            logits x 1/m_w instead)     head: x 1)
scalar      unchanged                   x 1                 x 1
==========  ==========================  ==================  =========================================

Under ``completep`` a parameter in a residual branch also gets LR x m_L^(alpha-1) and eps x m_L^(-alpha), and
every branch's output is multiplied by m_L^(-alpha). Weight decay is in the independent form: lr x wd stays what it
is at the base shape (wd x 1/lr_mult). Under ``mup`` and ``completep`` attention logits follow 1/d_head relative to
``base_head_dim`` (:func:`attention_scale`: sp's scale at the base head dim). Under ``sp`` every factor is 1 and no
init is touched: the spec's model and optimizer exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch import nn

from satlab.config.errors import ConfigError


class ParamClass(str, Enum):
    """Which of a parameter's dimensions grow with the width (see the module docstring)."""

    INPUT = "input"
    HIDDEN = "hidden"
    OUTPUT = "output"
    SCALAR = "scalar"


InitStd = Callable[[Any, Any], float]
"""``(model, cfg) -> float``: a module's own (``sp``) init std of a parameter at the config ``cfg``."""


@dataclass(frozen=True)
class ParamDecl:
    """What a module declares of one of its parameters. ``in_block``: None, inside a block (its name starts with
    ``blocks.``), else as given. ``std``: the module's own init std as a function of the config (evaluated at the
    base width to derive μP's), None for a parameter initialised to zeros or constants (left alone: μP's init rules
    scale a random init). ``logits``: the LM head (or the embedding tied to it), which takes the output-logit
    multiplier instead of the output class's init and LR rules."""

    cls: ParamClass
    in_block: bool | None = None
    std: InitStd | None = None
    logits: bool = False


def own_std(model: Any, cfg: Any) -> float:
    """The backbone's init std for its matrices (``model.init_std``)."""
    return cfg.init_std


def branch_output_std(model: Any, cfg: Any) -> float:
    """The init std of a branch's output projection (o_proj, down_proj): the depth loop's, where it has one."""
    stream = getattr(model, "stream", None)
    return stream.output_init_std(cfg.init_std) if hasattr(stream, "output_init_std") else cfg.init_std


INPUT = ParamDecl(ParamClass.INPUT)
SCALAR = ParamDecl(ParamClass.SCALAR)
HIDDEN = ParamDecl(ParamClass.HIDDEN, std=own_std)
OUTPUT_ZERO = ParamDecl(ParamClass.OUTPUT)
"""A width -> few projection initialised to zero (hyper-connection, mHC weights): its LR rule applies, no init."""


@dataclass(frozen=True)
class ParamRule:
    """What the parametrisation derives for one parameter: ``init_std`` (None: the module's own init), and
    multipliers of ``optim.lr``, ``optim.weight_decay`` and ``optim.eps``."""

    cls: ParamClass
    in_block: bool
    init_std: float | None
    lr_mult: float
    wd_mult: float
    eps_mult: float


@dataclass(frozen=True)
class Multipliers:
    """The forward multipliers: ``branch`` on every residual branch's output, ``logits`` on the output logits,
    ``attention`` the attention-logit scale (None: SDPA's 1/sqrt(d_head))."""

    branch: float = 1.0
    logits: float = 1.0
    attention: float | None = None


def width_multiplier(cfg: Any) -> float:
    return cfg.d_model / cfg.base_width


def depth_multiplier(cfg: Any) -> float:
    return cfg.n_layers / cfg.base_depth


def depth_rules(cfg: Any, architecture: Any = None) -> bool:
    """Whether CompleteP's depth rules apply: under ``completep``, to an architecture whose blocks add their output
    to a residual (not AttnRes, whose softmax read over depth already weights each branch by its share)."""
    return cfg.parametrization == "completep" and getattr(architecture, "residual_branches", True)


def multipliers(cfg: Any, architecture: Any = None) -> Multipliers:
    """The forward multipliers of a model config and its architecture (plain floats, folded into existing ops by the
    model: the branch multiplier into the branch's output projection, the logit multiplier into the final norm's
    gain, the attention scale into SDPA)."""
    if cfg.parametrization == "sp":
        return Multipliers()
    branch = 1.0
    if depth_rules(cfg, architecture):
        branch = depth_multiplier(cfg) ** -cfg.depth_alpha  # CompleteP: each residual branch x m_L^-alpha
    return Multipliers(branch=branch,
                       logits=1.0 / width_multiplier(cfg),  # μP: output logits x 1/m_w (the head's LR stays)
                       attention=attention_scale(cfg))


def attention_scale(cfg: Any) -> float | None:
    """μP's attention rule, anchored at the base: q·k x sqrt(d_base) / d_head, which is sp's 1 / sqrt(d_head) at the
    base head dim and falls as 1 / d_head away from it. None (SDPA's own 1 / sqrt(d_head)) when the head dim is the
    base's, as in every satlab series, which widens by adding heads. The literal 1 / d_head would change the base
    model itself: with QK-norm it caps each logit at the product of the two norm gains (4x lower than sp's at heads
    of 16) and cost 0.13-0.30 nats at the lr_transfer base shape (docs/results/2026-12-06-lr-transfer-v1.md)."""
    base = cfg.base_head_dim or cfg.head_dim
    return None if base == cfg.head_dim else math.sqrt(base) / cfg.head_dim  # μP: 1/d_head relative to the base


def declarations(model: nn.Module) -> dict[str, ParamDecl]:
    """Parameter name -> its declaration, from every module's ``param_classes``. A module's declaration of a
    parameter of one of its children overrides the child's own (it knows how it uses it: the per-head QK-norm gains
    are scalars to the attention, while RMSNorm's gain is an input-like vector). Declared names that name no
    parameter (an optional bias left out) are skipped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    found: dict[str, ParamDecl] = {}
    for prefix, module in model.named_modules():
        for local, decl in getattr(module, "param_classes", {}).items():
            name = f"{prefix}.{local}" if prefix else local
            if name in params and name not in found:
                found[name] = decl
    return found


def parameter_table(model: nn.Module, cfg: Any = None) -> dict[str, ParamRule]:
    """One :class:`ParamRule` per named parameter of ``model`` (a tied weight under its first name), for the model
    config ``cfg`` (default ``model.cfg``). Raises :class:`ConfigError` naming any parameter no module declares."""
    cfg = model.cfg if cfg is None else cfg
    decls = declarations(model)
    names = [name for name, _ in model.named_parameters()]
    missing = [name for name in names if name not in decls]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(
            f"parameter(s) {shown} of architecture {cfg.arch!r} have no parametrisation class: the module that owns "
            "a parameter declares it in its param_classes mapping (local name -> ParamDecl of "
            "satlab.models.parametrization: input, hidden, output or scalar by which of its dimensions grow with "
            "the width), so that model.parametrization can derive its init, learning rate and epsilon")
    base_cfg = dataclasses.replace(cfg, d_model=cfg.base_width)
    depth = depth_rules(cfg, getattr(model, "architecture", None))
    table = {}
    for name in names:
        decl = decls[name]
        in_block = name.startswith("blocks.") if decl.in_block is None else decl.in_block
        table[name] = derive(decl, cfg, in_block, depth, lambda std: std(model, base_cfg))
    return table


def derive(decl: ParamDecl, cfg: Any, in_block: bool, depth: bool,
           base_std: Callable[[InitStd], float]) -> ParamRule:
    """The rule of one declared parameter (see the module docstring's table)."""
    if cfg.parametrization == "sp":
        return ParamRule(decl.cls, in_block, None, 1.0, 1.0, 1.0)
    m_w, cls = width_multiplier(cfg), decl.cls
    init_factor, lr = None, 1.0
    if cls is ParamClass.HIDDEN:
        init_factor, lr = 1.0 / math.sqrt(m_w), 1.0 / m_w  # μP: hidden init var / m_w, Adam LR / m_w
    elif cls is ParamClass.OUTPUT and not decl.logits:
        init_factor, lr = 1.0 / m_w, 1.0 / m_w  # μP (Table 3, no multiplier): output init var / m_w², LR / m_w
    init_std = None if init_factor is None or decl.std is None else base_std(decl.std) * init_factor
    eps = 1.0
    if cfg.parametrization == "completep":
        eps = 1.0 if cls is ParamClass.SCALAR else 1.0 / m_w  # CompleteP: eps follows the gradient's scale, 1/m_w
        if depth and in_block:
            m_l, alpha = depth_multiplier(cfg), cfg.depth_alpha
            lr *= m_l ** (alpha - 1)  # CompleteP: in-branch LR x m_L^(alpha-1)
            eps *= m_l ** -alpha  # CompleteP: the branch's gradients are x m_L^-alpha, and so its eps
    return ParamRule(cls, in_block, init_std, lr, 1.0 / lr, eps)  # wd x 1/lr_mult: lr·wd independent of the shape


__all__ = ["HIDDEN", "INPUT", "OUTPUT_ZERO", "SCALAR", "Multipliers", "ParamClass", "ParamDecl", "ParamRule",
           "attention_scale", "branch_output_std", "declarations", "depth_multiplier", "depth_rules", "multipliers",
           "own_std", "parameter_table", "width_multiplier"]
