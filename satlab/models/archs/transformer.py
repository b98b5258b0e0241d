"""The Llama-style pre-norm Transformer (Transformer++), the baseline every other architecture starts from: the
backbone's own blocks and residual stream, nothing added (:mod:`satlab.config.archs.transformer` declares it)."""

from satlab.models.architecture import register

register("transformer")
