"""Building a model from its config: the registered architecture's depth loop and value paths around the shared
backbone (:class:`~satlab.models.model.DecoderLM`)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

import satlab.models.archs  # noqa: F401  (registers every implementation)
from satlab.config.errors import ConfigError, unknown_name
from satlab.config.model import ModelConfig, model_config_from_dict, resolve_model_config
from satlab.models.architecture import ARCHITECTURES
from satlab.models.model import DecoderLM


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
        return DecoderLM(cfg, stream, value_paths, arch.value_shared(cfg), arch)
