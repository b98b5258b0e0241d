"""Typed configuration (OmegaConf-structured dataclasses) and validation: the experiment (``schema``, ``loader``)
above the model zoo, whose model config it contains; the generic validator and errors below it."""
