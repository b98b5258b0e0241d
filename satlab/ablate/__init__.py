"""Ablation studies: a grid of experiment cells (axes × seeds) run as one MLflow parent run with a child per cell,
resumable, and a report with mean ± std over seeds, Welch p-values and the paper's claims checked.

``load_ablation`` reads a spec from ``experiments/ablations/*.yml``; ``run_ablation`` runs it (``satlab ablate``,
``make ablate``, ``make reproduce``); ``write_report`` writes the report (``satlab report``). They are imported
lazily here so that ``import satlab.ablate`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AblationResult", "AblationSpec", "load_ablation", "run_ablation", "write_report"]

_HOMES = {"load_ablation": "loader", "AblationSpec": "spec", "run_ablation": "driver", "AblationResult": "driver",
          "write_report": "report"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        from importlib import import_module

        return getattr(import_module(f"satlab.ablate.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'satlab.ablate' has no attribute {name!r}")
