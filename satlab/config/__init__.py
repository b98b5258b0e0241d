"""Typed configuration (OmegaConf-structured dataclasses) and validation."""

from satlab.config.errors import ConfigError
from satlab.config.model import ModelConfig

__all__ = ["ConfigError", "ModelConfig"]
