"""Where a finished learning-rate transfer study's results are read from: its report's summary.json (the
``lr_transfer`` entry the report's section writes). ``satlab transfer`` reads it to write a preset, and a later
study's report reads an earlier one's to compare their optima (``lr_transfer.compare_with``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from satlab.config.errors import ConfigError, shown


def summary_path(study: str) -> Path:
    """summary.json of ``study``: the file, a folder holding it, or the report folder of an ablation spec."""
    path = Path(study)
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir():
        return path / "summary.json"
    from satlab.studies.loader import load_ablation

    return load_ablation(study).out_path() / "summary.json"


def read_summary(study: str) -> dict[str, Any]:
    """The report summary of a finished LR-transfer study; ConfigError when there is none or it has no
    learning-rate transfer results."""
    path = summary_path(study)
    if not path.is_file():
        raise ConfigError(f"no report of study {shown(study)} at {path}: give a finished LR-transfer ablation (its "
                          "spec name, report folder or summary.json); `satlab report <name>` writes the report")
    summary = json.loads(path.read_text())
    if not summary.get("lr_transfer"):
        raise ConfigError(f"{path} has no learning-rate transfer results: the ablation needs an lr_transfer: block "
                          "(experiments/ablations/lr_transfer.yml) and a report written with it")
    return summary
