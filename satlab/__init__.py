"""satlab: a lab bench for Transformers that reuse early representations (SATFormer and its baselines)."""

__version__ = "0.1.0"
