"""Model configuration, without torch: the backbone's sizes and init, and one section per declared architecture
with options (``model.satformer``, ``model.mhc``, ...: the options dataclass of its declaration in
:mod:`satlab.config.archs`), named size presets, validation.

Sizes follow ``docs/architectures.md`` (the paper's presets, head dim 64, SwiGLU width as in the reference
code). ``tiny`` is satlab's own CPU size. Any of ``d_model``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
``mlp_hidden``, ``vocab_size`` and ``max_seq_len`` left at ``None`` is filled from the preset by
:func:`resolve_model_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ConfigError, unknown_name
from satlab.config.structured import build, field_problems, in_range

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
MIXING_IMPLS = ("auto", "reference", "handwritten")
"""How the depth mixing is computed (``model.mixing_impl``). ``reference``: the plain PyTorch formula, autograd
doing the backward: what a reader checks against the paper and what torch.compile traces and fuses. ``handwritten``:
the custom autograd functions written for a CPU (fewer passes over memory, the buffers of the dense depth loops).
``auto``: the hand-written functions on a CPU, the reference anywhere else. Each function decides per call from its
input's device, not once when the model is built: models are built on the CPU and moved to the GPU afterwards
(Lightning, the bench). ``docs/implementations.md`` lists the functions that have both forms."""
PARAMETRIZATIONS = ("sp", "mup", "completep")
"""``model.parametrization``: how initialisation, learning rates, AdamW's epsilon and weight decay, and a few forward
multipliers follow the width and depth relative to ``model.base_width`` and ``model.base_depth``. ``sp``: the standard
parametrisation (the spec's numbers, the bases ignored); ``mup``: μP (Tensor Programs V), a learning rate tuned at the
base width holds at other widths; ``completep``: μP plus CompleteP's depth rules (Dey et al. 2025, the residual
branches scaled by (base_depth / n_layers)^depth_alpha), a learning rate that holds across width and depth. The rules
and what they do not cover are in ``docs/parametrization.md``; they are derived in
:mod:`satlab.models.parametrization`."""
MAX_VOCAB = 10**7
"""The largest vocabulary (of a model, a tokenizer, a synthetic task): far inside the uint32 the token ids are stored
in."""


@dataclass
class BackboneConfig:
    """The backbone every architecture shares. Sizes left at ``None`` come from the ``size`` preset.

    ``embed_init_std`` (``None``: ``init_std``) and ``tie_embeddings`` are the two ways off the spec's backbone
    (tied head, every weight N(0, 0.02)). At width 128 the spec's init keeps each token's identity small next to
    what the blocks add to the residual stream: on token-level associative recall the tiny preset was still near
    chance after 800 steps, while with an untied head and N(0, 1) embeddings it retrieved every value by step 300
    (64 token ids, ``tests/test_models.py``, slow; with 4,096 ids it had not started by step 300: each value's row
    of an untied head is learned on its own). In language-model training with recall documents mixed in, the same
    change did not bring copying earlier (``experiments/recall/``).

    ``parametrization`` (``sp``, ``mup``, ``completep``) with ``base_width``, ``base_depth`` and ``depth_alpha``
    sets how init, learning rates and a few multipliers follow the model's shape (:data:`PARAMETRIZATIONS`,
    ``docs/parametrization.md``); under ``sp`` the three others are ignored and nothing changes.

    ``mixing_impl`` chooses how the depth loops compute their mixing (hyper-connections, mHC, MUDDFormer, DenseFormer,
    AttnRes): the plain formulas (``reference``), the CPU's hand-written autograd functions (``handwritten``), or by
    device (``auto``: hand-written on a CPU, the reference elsewhere). Both give the same numbers and weights
    (``tests/test_parity.py``), so a resumed run may change it. See ``docs/implementations.md``.
    """

    arch: str = field(default="satformer", metadata={"choices": ARCH_SPECS, "label": "architecture (model.arch)"})
    size: str = field(default="tiny", metadata={"choices": SIZE_PRESETS, "label": "model size"})
    # The sizes, None until resolve_model_config fills them from the preset.
    d_model: int | None = field(default=None, metadata=in_range(1, 65_536))
    n_layers: int | None = field(default=None, metadata=in_range(1, 4096))
    n_heads: int | None = field(default=None, metadata=in_range(1, 4096))
    n_kv_heads: int | None = field(default=None, metadata=in_range(1, 4096))
    mlp_hidden: int | None = field(default=None, metadata=in_range(0, 1_048_576, note="; 0 means no MLP sublayer"))
    vocab_size: int | None = field(default=None, metadata=in_range(1, MAX_VOCAB))
    max_seq_len: int | None = field(default=None, metadata=in_range(1, 4_194_304))
    rope_theta: float = field(default=10000.0, metadata=in_range(0, 1e12, low_excluded=True))
    # norm_eps may be 0: with every RMSNorm scale-free, AttnRes starts exactly as the Transformer (its parity test)
    norm_eps: float = field(default=1e-6, metadata=in_range(0, 0.1))
    init_std: float = field(default=0.02, metadata=in_range(0, 10, low_excluded=True))
    embed_init_std: float | None = field(default=None, metadata=in_range(0, 100, low_excluded=True,
                                                                          note="; null means model.init_std"))
    tie_embeddings: bool = True
    mixing_impl: str = field(default="auto", metadata={"choices": MIXING_IMPLS})
    parametrization: str = field(default="sp", metadata={"choices": PARAMETRIZATIONS})
    base_width: int = field(default=128, metadata=in_range(1, 65_536, note="; the d_model the learning rate is "
                                                                            "tuned at"))
    base_depth: int = field(default=6, metadata=in_range(1, 4096, note="; the n_layers the learning rate is tuned at"))
    depth_alpha: float = field(default=1.0, metadata=in_range(0.5, 1, note="; CompleteP's exponent: 1 is CompleteP, "
                                                                           "0.5 the square-root depth scaling"))
    base_head_dim: int | None = field(default=None, metadata=in_range(
        1, 65_536, note="; the head dim the learning rate is tuned at, for a model whose head dim differs (null: the "
                        "model's own, and the attention scale is sp's)"))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


ModelConfig = dataclasses.make_dataclass(
    "ModelConfig", [(a.name, a.options, field(default_factory=a.options)) for a in ARCH_SPECS.values() if a.options],
    bases=(BackboneConfig,))
ModelConfig.__module__ = __name__  # pickling and type hints find it here (make_dataclass's module= is Python 3.12+)
ModelConfig.__doc__ = ("The backbone (:class:`BackboneConfig`) and a section of options per architecture that has "
                       "them, built from the registry: " + ", ".join(a.name for a in ARCH_SPECS.values()
                                                                     if a.options) + ".")


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from a plain dict (for example a YAML section), resolved and validated."""
    problems: list[str] = []
    cfg = build(ModelConfig, [("model config", dict(data))], problems)
    if cfg is None or problems:
        raise ConfigError(problems)
    return resolve_model_config(cfg)


def resolve_model_config(cfg: Any) -> Any:
    """Fill the size fields left at ``None`` from ``cfg.size`` and validate; returns a new config."""
    if cfg.size not in SIZE_PRESETS:
        raise ConfigError(unknown_name("model size", cfg.size, SIZE_PRESETS))
    preset = SIZE_PRESETS[cfg.size]
    cfg = replace(cfg, **{k: v for k, v in preset.items() if getattr(cfg, k) is None})
    if cfg.n_kv_heads is None:
        cfg = replace(cfg, n_kv_heads=cfg.n_heads)
    problems = model_config_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def model_config_problems(cfg: Any) -> list[str]:
    """Every problem with a resolved model config, as one line each: the declared ranges and choices of the backbone
    and of each architecture's options, then, once every one holds, what depends on several of them (heads that
    divide the width, each architecture's ``problems(cfg)``)."""
    problems = field_problems(cfg, "model.")
    if problems:
        return problems  # what follows divides by the sizes and compares with them
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
    if not problems:
        problems.extend(parametrization_problems(cfg))
    for arch in ARCH_SPECS.values():
        options = arch.options_of(cfg)
        if options is not None and hasattr(options, "problems"):
            problems.extend(options.problems(cfg))
    return problems


def parametrization_problems(cfg: Any) -> list[str]:
    """Under ``mup`` or ``completep``, a base width that is not a whole number of heads of the model's head dim: the
    width multiplier d_model / base_width then compares models no head count can give (``sp`` ignores the bases)."""
    if cfg.parametrization == "sp" or cfg.base_width % cfg.head_dim == 0:
        return []
    valid = ", ".join(str(cfg.head_dim * k) for k in (1, 2, 4, 8, 16))
    return [f"model.base_width={cfg.base_width} is not a whole number of heads of the model's head dim "
            f"d_model/n_heads = {cfg.head_dim} (model.parametrization={cfg.parametrization} compares widths in "
            f"heads of that size); valid base widths are multiples of {cfg.head_dim}, e.g. {valid}"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
