"""The model zoo: plain PyTorch (no Lightning, MLflow or Optuna here). What each architecture is without torch (its
options, variants, formulas) is declared in :mod:`satlab.config.archs`; the model config in
:mod:`satlab.config.model`."""

from satlab.models.architecture import ARCHITECTURES, Architecture, MixingWeight, label, register
from satlab.models.model import DecoderLM, ModelOutput
from satlab.models.registry import build_model
from satlab.models.stats import count_params, flops_per_token, non_embedding_params

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "DecoderLM",
    "MixingWeight",
    "ModelOutput",
    "build_model",
    "count_params",
    "flops_per_token",
    "label",
    "non_embedding_params",
    "register",
]
