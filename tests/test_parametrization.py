"""μP and CompleteP (``model.parametrization``): the declared table covers every parameter of every architecture and
agrees with the shapes, an undeclared parameter fails the build, the derived numbers match hand-computed ones at two
shapes, the forward multipliers are folded where they should be, and ``sp`` changes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ConfigError
from satlab.config.schema import OptimConfig
from satlab.models import ARCHITECTURES, build_model
from satlab.models.layers import Attention, Block
from satlab.models.parametrization import ParamClass, declarations, parameter_table
from satlab.training.module import parameter_groups

SMALL = dict(n_heads=4, mlp_hidden=512, vocab_size=64, max_seq_len=32)
BASE = dict(base_width=128, base_depth=6)


def variants() -> list[tuple[str, dict]]:
    """Every architecture, and every named variant of its options (SATFormer's gate granularities among them)."""
    out = [(arch, {}) for arch in ARCHITECTURES]
    for arch, spec in ARCH_SPECS.items():
        out.extend((arch, {arch: dict(options)}) for _, options in spec.variants)
    return out


def shape_class(small: torch.Size, large: torch.Size, embedding: bool) -> ParamClass:
    """μP's class from a base and a wider model's shapes (mup's comparison): which of (fan-out, fan-in) grew."""
    grown = [a != b for a, b in zip(small, large, strict=True)]
    if len(grown) == 1:
        return ParamClass.INPUT if grown[0] else ParamClass.SCALAR
    out, fan_in = (grown[1], grown[0]) if embedding else (grown[0], grown[1])  # an embedding stores (vocab, d)
    return {(True, True): ParamClass.HIDDEN, (True, False): ParamClass.INPUT, (False, True): ParamClass.OUTPUT,
            (False, False): ParamClass.SCALAR}[(out, fan_in)]


READOUT_VECTORS = (".query",)
"""Parameters stored as a vector over the width but used as a readout of it (AttnRes's depth queries, a score
w_sᵀ RMSNorm(v)): output-like, though their shape says input-like."""


@pytest.mark.parametrize(("arch", "options"), variants(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_table_covers_every_parameter_and_agrees_with_the_shapes_at_two_widths(arch, options):
    def model(width: int):
        return build_model(dict(arch=arch, d_model=width, n_heads=width // 32, mlp_hidden=4 * width, n_layers=3,
                                vocab_size=64, max_seq_len=32, tie_embeddings=False, **options), device="meta")

    small, large = model(128), model(256)
    table = parameter_table(small)
    assert list(table) == [name for name, _ in small.named_parameters()]
    embeddings = {f"{prefix}.weight" for prefix, m in small.named_modules() if isinstance(m, nn.Embedding)}
    wide = dict(large.named_parameters())
    for name, param in small.named_parameters():
        expected = shape_class(param.shape, wide[name].shape, name in embeddings)
        if name.endswith(READOUT_VECTORS):
            expected = ParamClass.OUTPUT
        assert table[name].cls is expected, f"{arch} {options}: {name} {tuple(param.shape)} declared " \
                                            f"{table[name].cls.value}, its shapes say {expected.value}"


def test_an_undeclared_parameter_fails_the_build_and_the_table(monkeypatch):
    model = build_model(dict(arch="satformer", d_model=64, n_layers=2, **SMALL))
    model.blocks[1].attn.value_path.extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"blocks\.1\.attn\.value_path\.extra .*param_classes"):
        parameter_table(model)
    monkeypatch.setattr(Attention, "param_classes", {"q_proj.weight": Attention.param_classes["q_proj.weight"]})
    with pytest.raises(ConfigError, match=r"blocks\.0\.attn\.k_proj\.weight.*'transformer'"):
        build_model(dict(arch="transformer", d_model=64, n_layers=2, **SMALL))


def rules(**cfg):
    model = build_model(dict(arch="satformer", tie_embeddings=False, init_std=0.02, **SMALL, **BASE, **cfg))
    return model, parameter_table(model)


# (width, depth, alpha) -> hand-computed (init std, lr, eps) per parameter, with m_w = width/128, m_L = depth/6
SHAPES = {
    # m_w = 2, m_L = 2, alpha = 1: hidden std 0.02/sqrt(2), LR 1/2 · 2^0, eps 1/2 · 1/2
    (256, 12, 1.0): {"blocks.3.attn.q_proj.weight": (0.02 / math.sqrt(2), 0.5, 0.25),
                     "blocks.3.mlp.down_proj.weight": (0.02 / math.sqrt(2), 0.5, 0.25),
                     # the gate per KV head: the head count grows with the width, so hidden
                     "blocks.3.attn.value_path.proj.weight": (0.02 / math.sqrt(2), 0.5, 0.25),
                     "blocks.3.attn_norm.weight": (None, 1.0, 0.25),
                     "blocks.3.attn.q_norm.weight": (None, 1.0, 0.5),  # scalar: eps only the depth factor
                     "embed.weight": (None, 1.0, 0.5), "lm_head.weight": (None, 1.0, 0.5),
                     "norm.weight": (None, 1.0, 0.5),
                     # branch 2^-1, logits 1/2; attention sp's (None): the head dim (64) is the base's
                     "multipliers": (0.5, 0.5, None)},
    # m_w = 1/2, m_L = 1/2, alpha = 1/2: LR x m_L^(-1/2) = sqrt(2) in the branches, eps x m_L^(-1/2)
    (64, 3, 0.5): {"blocks.1.attn.q_proj.weight": (0.02 * math.sqrt(2), 2 * math.sqrt(2), 2 * math.sqrt(2)),
                   # one gate per token (gate_granularity=token): output-like, std 0.02 / m_w
                   "blocks.1.attn.value_path.proj.weight": (0.04, 2 * math.sqrt(2), 2 * math.sqrt(2)),
                   "blocks.1.mlp_norm.weight": (None, math.sqrt(2), 2 * math.sqrt(2)),
                   "embed.weight": (None, 1.0, 2.0), "lm_head.weight": (None, 1.0, 2.0),
                   "multipliers": (math.sqrt(2), 2.0, None)},
}


@pytest.mark.parametrize(("width", "depth", "alpha"), list(SHAPES))
def test_derived_init_lr_eps_wd_and_multipliers_match_hand_computed_values(width, depth, alpha):
    options = {} if width > 128 else dict(satformer=dict(gate_granularity="token"))
    model, table = rules(d_model=width, n_layers=depth, depth_alpha=alpha, parametrization="completep", **options)
    expected = dict(SHAPES[(width, depth, alpha)])
    branch, logits, attention = expected.pop("multipliers")
    assert model.multipliers.branch == pytest.approx(branch) and model.multipliers.logits == pytest.approx(logits)
    assert model.multipliers.attention == attention
    assert all(float(b.branch_scale) == pytest.approx(branch) for b in model.blocks)
    params = dict(model.named_parameters())
    for name, (std, lr, eps) in expected.items():
        rule = table[name]
        assert (rule.lr_mult, rule.eps_mult, rule.wd_mult) == pytest.approx((lr, eps, 1 / lr)), name
        assert rule.init_std == (None if std is None else pytest.approx(std)), name
        if std is not None and params[name].numel() >= 4096:  # the init was applied
            assert params[name].std().item() == pytest.approx(std, rel=0.05), name
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, eps=1e-8, gate_lr_multiplier=3.0)
    groups = parameter_groups(model, optim)
    for name, (_, lr, eps) in expected.items():
        group = next(g for g in groups if any(p is params[name] for p in g["params"]))
        gate = 3.0 if "value_path" in name else 1.0  # the override, on top of the derived rate
        assert group["lr"] == pytest.approx(1e-3 * lr * gate) and group["eps"] == pytest.approx(1e-8 * eps), name
        if group["weight_decay"]:
            assert group["weight_decay"] * group["lr"] / gate == pytest.approx(0.1 * 1e-3), name  # lr·wd constant


def test_mup_has_the_width_rules_and_no_depth_rules():
    model, table = rules(d_model=256, n_layers=12, parametrization="mup")
    hidden, norm = table["blocks.3.attn.q_proj.weight"], table["blocks.3.attn_norm.weight"]
    assert (hidden.lr_mult, hidden.eps_mult, norm.lr_mult, norm.eps_mult) == (0.5, 1.0, 1.0, 1.0)
    assert model.multipliers.branch == 1.0 and all(b.branch_scale is None for b in model.blocks)


def test_attnres_gets_the_width_rules_but_no_branch_multiplier():
    model = build_model(dict(arch="attnres", d_model=256, n_layers=12, parametrization="completep", **SMALL, **BASE))
    rule = parameter_table(model)["blocks.3.attn.q_proj.weight"]
    assert model.multipliers.branch == 1.0 and (rule.lr_mult, rule.eps_mult) == (0.5, 0.5)


def test_sp_ignores_the_bases_and_changes_nothing():
    """Under sp the bases change no weight, no logit and no optimizer group: the models and groups of before."""
    idx = torch.randint(0, 64, (2, 16))
    outputs, groups = [], []
    for bases in ({}, dict(base_width=32, base_depth=2, depth_alpha=0.5)):
        torch.manual_seed(0)
        model = build_model(dict(arch="hyperconnections", d_model=64, n_layers=3, **SMALL, **bases))
        assert set(parameter_table(model).values()) <= {r for r in parameter_table(model).values()
                                                        if (r.init_std, r.lr_mult, r.wd_mult, r.eps_mult)
                                                        == (None, 1.0, 1.0, 1.0)}
        outputs.append(model(idx).logits)
        groups.append([(g["lr"], g["weight_decay"], g["eps"], len(g["params"]))
                       for g in parameter_groups(model, OptimConfig())])
    assert torch.equal(outputs[0], outputs[1]) and groups[0] == groups[1]
    assert [(lr, wd) for lr, wd, _, _ in groups[0]] == [(3e-3, 0.0), (3e-3, 0.1)]  # no decay, decay: as before


def test_the_branch_multiplier_is_folded_into_the_output_projections():
    """A block with multiplier s computes what the same block computes with o_proj and down_proj scaled by s."""
    cfg = build_model(dict(arch="transformer", d_model=64, n_layers=2, **SMALL)).cfg
    torch.manual_seed(0)
    scaled, plain = Block(cfg, 1, None, 128), Block(cfg, 1, None, 128)
    plain.load_state_dict(scaled.state_dict())
    scaled.set_branch_multiplier(0.25)
    with torch.no_grad():
        plain.attn.o_proj.weight.mul_(0.25)
        plain.mlp.down_proj.weight.mul_(0.25)
    x, rope = torch.randn(2, 8, 64), (torch.ones(8, 1, 16), torch.zeros(8, 1, 16))
    x_v1 = torch.randn(2, 8, 64)
    assert torch.allclose(scaled(x, rope, x_v1)[0], plain(x, rope, x_v1)[0], atol=1e-6)
    assert torch.allclose(scaled(x, part="feedforward"), plain(x, part="feedforward"), atol=1e-6)


def test_the_logit_multiplier_scales_the_logits():
    model = build_model(dict(arch="transformer", d_model=256, n_layers=2, parametrization="mup", **SMALL, **BASE))
    idx = torch.randint(0, 64, (2, 8))
    scaled = model(idx).logits
    model.multipliers = type(model.multipliers)(branch=1.0, logits=1.0, attention=model.multipliers.attention)
    assert torch.allclose(scaled, model(idx).logits * 0.5, atol=1e-6)


@pytest.mark.parametrize("parametrization", ["mup", "completep"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_at_the_base_shape_mup_and_completep_are_the_sp_model(arch, parametrization):
    """The point of tuning at the base shape: there every factor is 1 and the model is sp's, the attention scale
    included (a literal 1/d_head made it another model, lr_transfer v1), so the same weights give the same logits,
    every derived init std is sp's, and the optimizer gets the same groups."""
    idx = torch.randint(0, 64, (2, 16))
    outputs, groups, weights = [], [], None
    for name in ("sp", parametrization):
        model = build_model(dict(arch=arch, d_model=64, n_layers=3, parametrization=name, base_width=64,
                                 base_depth=3, **SMALL))
        assert model.multipliers.attention is None
        decls = declarations(model)
        assert all(rule.init_std is None or rule.init_std == decls[n].std(model, model.cfg)
                   for n, rule in model.param_rules.items())
        weights = model.state_dict() if weights is None else weights
        model.load_state_dict(weights)
        outputs.append(model(idx).logits)
        groups.append([(g["lr"], g["weight_decay"], g["eps"], len(g["params"]))
                       for g in parameter_groups(model, OptimConfig())])
    assert torch.equal(outputs[0], outputs[1]) and groups[0] == groups[1]


def test_the_attention_scale_falls_as_one_over_the_head_dim_from_the_base_head_dim():
    """sqrt(d_base) / d_head: heads of 64 tuned at heads of 16 get 4/64 = 1/16 (sp's 1/8 times 16/64 over sp's
    1/4 at the base), and SDPA is called with it; under sp the base head dim is ignored."""
    model = build_model(dict(arch="transformer", d_model=256, n_layers=2, parametrization="completep",
                             base_head_dim=16, **SMALL, **BASE))
    assert model.multipliers.attention == pytest.approx(1 / 16)
    assert all(b.attn.attn_scale == pytest.approx(1 / 16) for b in model.blocks)
    assert build_model(dict(arch="transformer", d_model=256, n_layers=2, parametrization="completep",
                            base_head_dim=64, **SMALL, **BASE)).multipliers.attention is None
    assert build_model(dict(arch="transformer", d_model=256, n_layers=2, base_head_dim=16,
                            **SMALL, **BASE)).multipliers.attention is None
