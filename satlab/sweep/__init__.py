"""Hyper-parameter sweeps: Optuna studies over experiment configs, one subprocess per trial, tracked in MLflow.

``load_sweep`` reads a spec from ``sweeps/*.yaml``; ``run_sweep`` runs it (``satlab sweep``, ``make sweep``). Both are
imported lazily here so that ``import satlab.sweep`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SweepResult", "SweepSpec", "load_sweep", "run_sweep"]


def __getattr__(name: str) -> Any:
    if name == "load_sweep":
        from satlab.sweep.loader import load_sweep

        return load_sweep
    if name == "SweepSpec":
        from satlab.sweep.spec import SweepSpec

        return SweepSpec
    if name in ("run_sweep", "SweepResult"):
        from satlab.sweep import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'satlab.sweep' has no attribute {name!r}")
