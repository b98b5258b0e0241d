"""The architecture registry: each entry names its value path and its depth loop; the backbone is shared.

A new variant is a small class (a value path or a depth loop) plus an entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from satlab.config.errors import ConfigError, unknown_name
from satlab.config.model import ModelConfig, model_config_from_dict, resolve_model_config
from satlab.models.denseformer import DenseFormerStream
from satlab.models.hyperconnections import HyperConnectionStream
from satlab.models.model import DecoderLM
from satlab.models.muddformer import MUDDStream
from satlab.models.streams import ResidualStream
from satlab.models.value_paths import ResFormerLambdas, ResFormerValue, SATFormerGate


def _no_value_path(cfg: ModelConfig, layer: int) -> nn.Module | None:
    return None


def _resformer_value_path(cfg: ModelConfig, layer: int) -> nn.Module | None:
    return ResFormerValue(fixed=cfg.resformer.mode == "fixed") if layer >= 1 else None


def _resformer_shared(cfg: ModelConfig) -> nn.Module | None:
    return ResFormerLambdas(cfg.n_layers) if cfg.resformer.mode == "learnable" and cfg.n_layers > 1 else None


def _satformer_value_path(cfg: ModelConfig, layer: int) -> nn.Module | None:
    last_k = cfg.satformer.last_k
    if layer == 0 or (last_k is not None and layer < cfg.n_layers - last_k):
        return None
    return SATFormerGate(cfg.d_model, cfg.n_kv_heads, cfg.head_dim, cfg.satformer, cfg.init_std)


@dataclass(frozen=True)
class Architecture:
    name: str
    description: str
    stream: type[ResidualStream] = ResidualStream
    value_path: Callable[[ModelConfig, int], nn.Module | None] = _no_value_path
    value_shared: Callable[[ModelConfig], nn.Module | None] = lambda cfg: None


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("transformer", "Llama-style pre-norm Transformer (Transformer++)"),
        Architecture("resformer", "static value residual: λ1·V_1 + λ2·V_n",
                     value_path=_resformer_value_path, value_shared=_resformer_shared),
        Architecture("satformer", "selective access: V_n + g_n(h_n)·V_1, gate per token and head",
                     value_path=_satformer_value_path),
        Architecture("denseformer", "depth-weighted average of all earlier block outputs", stream=DenseFormerStream),
        Architecture("hyperconnections", "dynamic hyper-connections, n residual copies",
                     stream=HyperConnectionStream),
        Architecture("muddformer", "multiway dynamic dense connections (Q, K, V, R)", stream=MUDDStream),
    )
}


def build_model(cfg: ModelConfig | dict[str, Any], device: torch.device | str | None = None) -> DecoderLM:
    """Build any registered architecture from a :class:`ModelConfig` (or a plain dict of its fields).

    ``device="meta"`` builds without allocating memory (for parameter counts of the paper sizes).
    """
    cfg = model_config_from_dict(cfg) if isinstance(cfg, dict) else resolve_model_config(cfg)
    if cfg.arch not in ARCHITECTURES:
        raise ConfigError(unknown_name("architecture (model.arch)", cfg.arch, ARCHITECTURES))
    arch = ARCHITECTURES[cfg.arch]
    with torch.device(device) if device is not None else nullcontext():
        stream = arch.stream(cfg)
        value_paths = [arch.value_path(cfg, i) for i in range(cfg.n_layers)]
        return DecoderLM(cfg, stream, value_paths, arch.value_shared(cfg))

