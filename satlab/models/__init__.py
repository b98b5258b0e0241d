"""The model zoo: plain PyTorch (no Lightning, MLflow or Optuna here)."""

from satlab.models.architecture import ARCHITECTURES, Architecture, MixingWeight, label, register
from satlab.models.config import SIZE_PRESETS, ModelConfig
from satlab.models.gate_functions import GATE_FUNCTIONS
from satlab.models.model import DecoderLM, ModelOutput
from satlab.models.registry import build_model
from satlab.models.stats import count_params, flops_per_token, non_embedding_params

__all__ = [
    "ARCHITECTURES",
    "GATE_FUNCTIONS",
    "SIZE_PRESETS",
    "Architecture",
    "DecoderLM",
    "MixingWeight",
    "ModelConfig",
    "ModelOutput",
    "build_model",
    "count_params",
    "flops_per_token",
    "label",
    "non_embedding_params",
    "register",
]
