"""Logging the gate analysis into an MLflow run through ``MlflowClient`` (Lightning's MLFlowLogger creates its run
with the client, so there is no active fluent run to log to).

Layout of one analysis at training step ``s``: metrics ``val/gates/...`` (see :meth:`GateReport.scalars`) at step s,
and artifacts ``gates/step_<s>/``
``heatmap.png``, ``categories.png``, ``gates.json`` (the raw tables), ``value_access.png`` (SATFormer or ResFormer)
and ``mixing/<family>.png`` for the static mixing weights. A model without gates gets only the figures that apply.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlflow
from mlflow.entities import Metric
from torch import nn

from satlab.evaluation.gates import GateReport
from satlab.evaluation.plots import gate_figures


def log_gate_analysis(client: mlflow.MlflowClient, run_id: str, report: GateReport | None, model: nn.Module,
                      step: int,
                      log_metrics: Callable[[dict[str, float], int], None] | None = None) -> dict[str, float]:
    """Log ``report``'s scalars as metrics at ``step`` (through ``log_metrics`` when given: a training run's logger)
    and its figures and JSON as artifacts; returns the metrics."""
    metrics = report.scalars() if report is not None else {}
    if metrics and log_metrics is not None:
        log_metrics(metrics, step)
    elif metrics:
        timestamp = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, timestamp, step) for k, v in metrics.items()])
    folder = f"gates/step_{step}"
    if report is not None:
        client.log_dict(run_id, report.to_json(), f"{folder}/gates.json")
    for name, fig in gate_figures(report, model).items():
        client.log_figure(run_id, fig, f"{folder}/{name}.png", save_kwargs={"dpi": 120})
        fig.clear()
    return metrics
