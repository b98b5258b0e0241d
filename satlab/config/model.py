"""Model configuration: one typed dataclass per architecture family, named size presets, validation.

Sizes follow ``shared/spec/architectures.md`` (the paper's presets, head dim 64, SwiGLU width as in the
reference code). ``tiny`` is satlab's own CPU size. Any of ``d_model``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``mlp_hidden``, ``vocab_size`` and ``max_seq_len`` left at ``None`` is filled from the preset
by :func:`resolve_model_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from satlab.config.errors import ConfigError, did_you_mean, unknown_name

ARCHITECTURE_NAMES = (
    "transformer",
    "resformer",
    "satformer",
    "denseformer",
    "hyperconnections",
    "muddformer",
)
GATE_GRANULARITIES = ("static_layer", "static_head", "token", "token_head", "token_channel")
GATE_FUNCTIONS = ("relu", "sigmoid", "tanh", "identity", "softmax", "softmax_sigmoid")
RESFORMER_MODES = ("learnable", "fixed")

# d, L, H (d_h = 64), SwiGLU width, vocab, RoPE length. The paper sizes are the spec's table.
SIZE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, n_layers=6, n_heads=4, mlp_hidden=512, vocab_size=4096, max_seq_len=1024),
    "small": dict(d_model=768, n_layers=11, n_heads=12, mlp_hidden=3072, vocab_size=32000, max_seq_len=4096),
    "medium": dict(d_model=1024, n_layers=18, n_heads=16, mlp_hidden=4096, vocab_size=32000, max_seq_len=4096),
    "large": dict(d_model=1536, n_layers=19, n_heads=24, mlp_hidden=6144, vocab_size=32000, max_seq_len=4096),
    "xl": dict(d_model=2048, n_layers=24, n_heads=32, mlp_hidden=5632, vocab_size=32000, max_seq_len=4096),
    # Synthetic recall (data.source=synthetic:mqar): Zoology's smallest attention models, one head of 64, no MLP.
    "recall-2l": dict(d_model=64, n_layers=2, n_heads=1, mlp_hidden=0, vocab_size=8192, max_seq_len=1024),
    "recall-4l": dict(d_model=64, n_layers=4, n_heads=1, mlp_hidden=0, vocab_size=8192, max_seq_len=1024),
}
# The spec's parameter counts (tied embeddings), used by the preset tests.
PAPER_PARAM_COUNTS = {"small": 128e6, "medium": 335e6, "large": 766e6, "xl": 1.30e9}


@dataclass
class ResFormerOptions:
    """``learnable``: λ1 = λ_scale·softmax(λ'), λ2 per layer (the paper's "plus" form); ``fixed``: 0.5/0.5."""

    mode: str = "learnable"


@dataclass
class SATFormerOptions:
    """The gate ``g_n(h_n)`` that adds V_1 back in layer n: granularity, function and where it applies.

    ``static_init`` is satlab's choice for the initial value of static gates (the spec leaves it open):
    0.5 keeps a relu gate alive (relu has zero gradient at 0).
    """

    gate_granularity: str = "token_head"
    gate_fn: str = "relu"
    last_k: int | None = None
    gate_bias: float | None = None
    static_init: float = 0.5
    detach_v1: bool = False


@dataclass
class DenseFormerOptions:
    """Depth-weighted average after every ``period``-th block, over blocks j with j ≡ i (mod ``dilation``)."""

    dilation: int = 1
    period: int = 1


@dataclass
class HyperConnectionOptions:
    """Dynamic hyper-connections with ``expansion`` residual copies."""

    expansion: int = 4


@dataclass
class MUDDFormerOptions:
    """``ffn_realloc``: SwiGLU width grows linearly with depth from 0.5x to 1.5x (same total)."""

    ffn_realloc: bool = False


@dataclass
class ModelConfig:
    """The backbone and its variant options. Sizes left at ``None`` come from the ``size`` preset.

    ``embed_init_std`` (``None``: ``init_std``) and ``tie_embeddings`` are the two ways off the spec's backbone
    (tied head, every weight N(0, 0.02)). At width 128 the spec's init keeps each token's identity small next to
    what the blocks add to the residual stream: on token-level associative recall the tiny preset was still near
    chance after 800 steps, while with an untied head and N(0, 1) embeddings it retrieved every value by step 300
    (64 token ids, ``tests/test_models.py``, slow; with 4,096 ids it had not started by step 300: each value's row
    of an untied head is learned on its own). In language-model training with recall documents mixed in, the same
    change did not bring copying earlier (``experiments/recall/``).
    """

    arch: str = "satformer"
    size: str = "tiny"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    mlp_hidden: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    embed_init_std: float | None = None
    tie_embeddings: bool = True
    resformer: ResFormerOptions = field(default_factory=ResFormerOptions)
    satformer: SATFormerOptions = field(default_factory=SATFormerOptions)
    denseformer: DenseFormerOptions = field(default_factory=DenseFormerOptions)
    hyperconnections: HyperConnectionOptions = field(default_factory=HyperConnectionOptions)
    muddformer: MUDDFormerOptions = field(default_factory=MUDDFormerOptions)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _from_mapping(cls: type, data: dict[str, Any], where: str, problems: list[str]) -> Any:
    """Build a (nested) dataclass from a plain mapping, collecting unknown keys as problems."""
    names = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            problems.append(f"unknown key '{where}{key}'{did_you_mean(key, names)}; valid: {', '.join(names)}")
            continue
        default = names[key].default_factory() if callable(names[key].default_factory) else None
        if default is not None and hasattr(default, "__dataclass_fields__") and isinstance(value, dict):
            kwargs[key] = _from_mapping(type(default), value, f"{where}{key}.", problems)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from a plain dict (for example a YAML section), resolved and validated."""
    problems: list[str] = []
    cfg = _from_mapping(ModelConfig, dict(data), "model.", problems)
    if problems:
        raise ConfigError(problems)
    return resolve_model_config(cfg)


def resolve_model_config(cfg: ModelConfig) -> ModelConfig:
    """Fill the size fields left at ``None`` from ``cfg.size`` and validate; returns a new config."""
    if cfg.size not in SIZE_PRESETS:
        raise ConfigError(unknown_name("model size", cfg.size, SIZE_PRESETS))
    preset = SIZE_PRESETS[cfg.size]
    filled = {k: v for k, v in preset.items() if getattr(cfg, k) is None}
    cfg = replace(cfg, **filled)
    if cfg.n_kv_heads is None:
        cfg = replace(cfg, n_kv_heads=cfg.n_heads)
    problems = model_config_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


_SIZE_RANGES = {"d_model": (1, 65_536), "n_layers": (1, 4096), "n_heads": (1, 4096), "n_kv_heads": (1, 4096),
                "mlp_hidden": (0, 1_048_576), "vocab_size": (1, 10_000_000), "max_seq_len": (1, 4_194_304)}
_SCALE_RANGES = {"rope_theta": (0, 1e12), "norm_eps": (0, 0.1), "init_std": (0, 10), "embed_init_std": (0, 100)}


def model_config_problems(cfg: ModelConfig) -> list[str]:
    """Every problem with a resolved model config, as one line each."""
    problems = []
    if cfg.arch not in ARCHITECTURE_NAMES:
        problems.append(unknown_name("architecture (model.arch)", cfg.arch, ARCHITECTURE_NAMES))
    for name, (least, most) in _SIZE_RANGES.items():
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
            note = " (0: no MLP sublayer)" if least == 0 else ""
            problems.append(f"model.{name} must be an integer in [{least}, {most:,}]{note}, got {value!r}")
    if problems:
        return problems
    if cfg.d_model % cfg.n_heads:
        problems.append(
            f"model.n_heads={cfg.n_heads} does not divide model.d_model={cfg.d_model}; "
            f"valid head counts: {', '.join(str(h) for h in _divisors(cfg.d_model) if h <= 128)}"
        )
    elif cfg.n_heads % cfg.n_kv_heads:
        problems.append(
            f"model.n_kv_heads={cfg.n_kv_heads} does not divide model.n_heads={cfg.n_heads} (GQA); "
            f"valid: {', '.join(str(h) for h in _divisors(cfg.n_heads))}"
        )
    elif cfg.head_dim % 2:
        problems.append(f"head dim d_model/n_heads = {cfg.head_dim} must be even for RoPE")
    for name, (low, high) in _SCALE_RANGES.items():
        value = getattr(cfg, name)
        if value is not None and not low < value <= high:
            problems.append(f"model.{name} must be in ({low:g}, {high:g}], got {value!r}"
                            + ("; null means model.init_std" if name == "embed_init_std" else ""))
    sat_scalars = {"static_init": cfg.satformer.static_init, "gate_bias": cfg.satformer.gate_bias}
    for name, value in sat_scalars.items():
        if value is not None and not -100 <= value <= 100:
            problems.append(f"model.satformer.{name} must be in [-100, 100], got {value!r}")
    sat = cfg.satformer
    if sat.gate_granularity not in GATE_GRANULARITIES:
        problems.append(unknown_name("model.satformer.gate_granularity", sat.gate_granularity, GATE_GRANULARITIES))
    if sat.gate_fn not in GATE_FUNCTIONS:
        problems.append(unknown_name("model.satformer.gate_fn", sat.gate_fn, GATE_FUNCTIONS))
    if sat.last_k is not None and not 1 <= sat.last_k <= max(cfg.n_layers - 1, 1):
        problems.append(
            f"model.satformer.last_k={sat.last_k} must be null or between 1 and n_layers-1={cfg.n_layers - 1}"
        )
    if cfg.resformer.mode not in RESFORMER_MODES:
        problems.append(unknown_name("model.resformer.mode", cfg.resformer.mode, RESFORMER_MODES))
    dense = cfg.denseformer
    if dense.dilation < 1 or dense.period < 1:
        problems.append("model.denseformer.dilation and model.denseformer.period must be >= 1")
    if not 1 <= cfg.hyperconnections.expansion <= 64:
        problems.append(f"model.hyperconnections.expansion must be in [1, 64], got {cfg.hyperconnections.expansion}")
    return problems


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
