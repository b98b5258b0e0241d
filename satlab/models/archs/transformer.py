"""The Llama-style pre-norm Transformer (Transformer++), the baseline every other architecture starts from."""

from satlab.models.architecture import Architecture, register

register(Architecture("transformer", "Transformer", "Llama-style pre-norm Transformer (Transformer++)",
                      extra_params=lambda cfg: 0, exact_start={}, order=0))
