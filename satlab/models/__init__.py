"""The model zoo: plain PyTorch (no Lightning, MLflow or Optuna here)."""

from satlab.config.model import ModelConfig
from satlab.models.model import DecoderLM, ModelOutput
from satlab.models.registry import ARCHITECTURES, build_model
from satlab.models.stats import count_params, flops_per_token, non_embedding_params

__all__ = [
    "ARCHITECTURES",
    "DecoderLM",
    "ModelConfig",
    "ModelOutput",
    "build_model",
    "count_params",
    "flops_per_token",
    "non_embedding_params",
]
