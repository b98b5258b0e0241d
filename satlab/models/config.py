"""Model configuration: the backbone's sizes and init, and one section per registered architecture with options
(``model.satformer``, ``model.mhc``, ...: the architecture's own options dataclass), named size presets, validation.

Sizes follow ``docs/architectures.md`` (the paper's presets, head dim 64, SwiGLU width as in the reference
code). ``tiny`` is satlab's own CPU size. Any of ``d_model``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
``mlp_hidden``, ``vocab_size`` and ``max_seq_len`` left at ``None`` is filled from the preset by
:func:`resolve_model_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

import satlab.models.archs  # noqa: F401  (registers every architecture)
from satlab.config.errors import ConfigError, unknown_name
from satlab.config.structured import build, field_problems
from satlab.models.architecture import ARCHITECTURES
from satlab.models.layers import MIXING_IMPLS

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
class BackboneConfig:
    """The backbone every architecture shares. Sizes left at ``None`` come from the ``size`` preset.

    ``embed_init_std`` (``None``: ``init_std``) and ``tie_embeddings`` are the two ways off the spec's backbone
    (tied head, every weight N(0, 0.02)). At width 128 the spec's init keeps each token's identity small next to
    what the blocks add to the residual stream: on token-level associative recall the tiny preset was still near
    chance after 800 steps, while with an untied head and N(0, 1) embeddings it retrieved every value by step 300
    (64 token ids, ``tests/test_models.py``, slow; with 4,096 ids it had not started by step 300: each value's row
    of an untied head is learned on its own). In language-model training with recall documents mixed in, the same
    change did not bring copying earlier (``experiments/recall/``).

    ``mixing_impl`` chooses how the depth loops compute their mixing (hyper-connections, mHC, MUDDFormer, DenseFormer,
    AttnRes): the plain formulas (``reference``), the CPU's hand-written autograd functions (``handwritten``), or by
    device (``auto``: hand-written on a CPU, the reference elsewhere). Both give the same numbers and weights
    (``tests/test_parity.py``), so a resumed run may change it. See ``docs/implementations.md``.
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
    mixing_impl: str = field(default="auto", metadata={"choices": MIXING_IMPLS})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


ModelConfig = dataclasses.make_dataclass(
    "ModelConfig", [(a.name, a.options, field(default_factory=a.options)) for a in ARCHITECTURES.values() if a.options],
    bases=(BackboneConfig,))
ModelConfig.__module__ = __name__  # pickling and type hints find it here (make_dataclass's module= is Python 3.12+)
ModelConfig.__doc__ = ("The backbone (:class:`BackboneConfig`) and a section of options per architecture that has "
                       "them, built from the registry: " + ", ".join(a.name for a in ARCHITECTURES.values()
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


_SIZE_RANGES = {"d_model": (1, 65_536), "n_layers": (1, 4096), "n_heads": (1, 4096), "n_kv_heads": (1, 4096),
                "mlp_hidden": (0, 1_048_576), "vocab_size": (1, 10_000_000), "max_seq_len": (1, 4_194_304)}
# (low, high, low excluded). norm_eps may be 0: with every RMSNorm scale-free, AttnRes starts exactly as the
# Transformer (its parity test).
_SCALE_RANGES = {"rope_theta": (0, 1e12, True), "norm_eps": (0, 0.1, False), "init_std": (0, 10, True),
                 "embed_init_std": (0, 100, True)}


def model_config_problems(cfg: Any) -> list[str]:
    """Every problem with a resolved model config, as one line each: the backbone's, then each architecture's
    options (their declared ranges and choices, and their ``problems(cfg)``)."""
    problems = []
    if cfg.arch not in ARCHITECTURES:
        problems.append(unknown_name("architecture (model.arch)", cfg.arch, ARCHITECTURES))
    for f in dataclasses.fields(BackboneConfig):  # the backbone's declared choices (its sections are checked below)
        if "choices" in f.metadata and getattr(cfg, f.name) not in f.metadata["choices"]:
            problems.append(unknown_name(f"model.{f.name}", getattr(cfg, f.name), f.metadata["choices"]))
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
    for name, (low, high, low_excluded) in _SCALE_RANGES.items():
        value = getattr(cfg, name)
        if value is not None and not ((low < value if low_excluded else low <= value) and value <= high):
            problems.append(f"model.{name} must be in {'(' if low_excluded else '['}{low:g}, {high:g}], got {value!r}"
                            + ("; null means model.init_std" if name == "embed_init_std" else ""))
    for arch in ARCHITECTURES.values():
        options = arch.options_of(cfg)
        if options is not None:
            problems.extend(field_problems(options, f"model.{arch.name}."))
            problems.extend(options.problems(cfg) if hasattr(options, "problems") else [])
    return problems


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
