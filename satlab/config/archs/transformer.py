"""The Llama-style pre-norm Transformer (Transformer++), the baseline every other architecture starts from."""

from satlab.config.archs import ArchSpec, declare

declare(ArchSpec("transformer", "Transformer", "Llama-style pre-norm Transformer (Transformer++)",
                 extra_params=lambda cfg: 0, exact_start={}, order=0))
