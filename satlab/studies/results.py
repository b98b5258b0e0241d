"""An ablation's results read back from MLflow: per cell its final metrics, learning curve and gate heatmap, grouped
over seeds. Only FINISHED child runs count (the newest per cell); a metric a run never logged stays None, shown as
missing rather than as zero (for ``recall/steps_to_<t>``: not reached). ``recall/steps_to_bind`` is logged by every
recall run (censored at its last step when it never bound, ``recall/bound`` 0): :mod:`satlab.studies.bind_report`."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.entities import Run

from satlab.studies.ablation_spec import AblationSpec, Cell
from satlab.studies.runs import CELL_TAG, CPU_METRIC, child_runs


@dataclass(frozen=True)
class Column:
    """A reported measure: its MLflow key and how a run's history becomes one number (last, mean or max)."""

    name: str
    header: str
    key: str
    reduce: str
    fmt: str


@dataclass(frozen=True)
class Measures:
    """What a report reads from each cell: its columns and the metric of its curve."""

    columns: tuple[Column, ...]
    curve_key: str
    curve_label: str


LM_MEASURES = Measures((
    Column("val_loss", "final val loss", "val/loss", "last", "{:.4f}"),
    Column("zero_shot", "zero-shot avg", "zero_shot/offline_zero_shot_avg", "last", "{:.3f}"),
    Column("retrieval", "retrieval avg", "zero_shot/offline_retrieval_avg", "last", "{:.3f}"),
    Column("tokens_per_sec", "tokens/s", "system/tokens_per_sec", "mean", "{:,.0f}"),
    Column("peak_mem_gb", "peak mem (GB)", "system/peak_mem_gb", "max", "{:.2f}"),
    Column("gate_sparsity", "gate sparsity", "val/gates/sparsity", "last", "{:.2f}"),
), "val/loss", "validation loss")
RECALL_MEASURES = Measures((  # an ablation of a synthetic recall task (data.source=synthetic:mqar)
    Column("recall_acc", "held-out acc", "recall/acc", "last", "{:.3f}"),
    Column("recall_best", "best acc", "recall/acc", "max", "{:.3f}"),
    Column("steps_to_0.9", "steps to 0.9", "recall/steps_to_0.9", "last", "{:,.0f}"),
    Column("steps_to_0.99", "steps to 0.99", "recall/steps_to_0.99", "last", "{:,.0f}"),
    Column("steps_to_bind", "steps to bind", "recall/steps_to_bind", "last", "{:,.0f}"),
    Column("bound", "bound", "recall/bound", "last", "{:.2f}"),
    Column("val_loss", "answer loss", "val/loss", "last", "{:.3f}"),
    Column("tokens_per_sec", "tokens/s", "system/tokens_per_sec", "mean", "{:,.0f}"),
), "recall/acc", "held-out recall accuracy")


def measures_for(spec: AblationSpec) -> Measures:
    return RECALL_MEASURES if spec.base_config().data.synthetic_task else LM_MEASURES


@dataclass
class CellResult:
    cell: Cell
    run_id: str
    metrics: dict[str, float | None]
    params: int | None
    curve: list[tuple[float, float]]  # (tokens seen, the curve metric)
    budget: int | None = None  # the run's optimizer steps at most (derived.max_steps)


@dataclass
class GroupResult:
    """The cells of one group (same values on every axis but the seed)."""

    label: str
    values: dict
    expected: int
    cells: list[CellResult] = field(default_factory=list)

    def samples(self, column: str) -> list[float]:
        return [c.metrics[column] for c in self.cells if c.metrics.get(column) is not None]

    @property
    def params(self) -> int | None:
        return next((c.params for c in self.cells if c.params is not None), None)

    def shared_curve(self) -> tuple[list[float], list[list[float]]]:
        """The token counts at which every cell with a curve was validated, and per such cell its values there."""
        curves = [dict(c.curve) for c in self.cells if c.curve]
        tokens = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        return tokens, [[c[t] for t in tokens] for c in curves]


def collect(spec: AblationSpec, client: mlflow.MlflowClient, parent_run_id: str,
            measures: Measures = LM_MEASURES) -> list[GroupResult]:
    """Every group of the grid in grid order, those with no finished cell included (empty)."""
    runs = cell_runs(client, parent_run_id)
    groups: dict[str, GroupResult] = {}
    cells = spec.cells()
    seeds = {c.group: sum(d.group == c.group for d in cells) for c in cells}  # sub-grids may differ in seeds
    for cell in cells:
        group = groups.setdefault(cell.group, GroupResult(cell.group, cell.group_values, seeds[cell.group]))
        if cell.key in runs:
            group.cells.append(cell_result(client, cell, runs[cell.key], measures))
    return list(groups.values())


def cell_runs(client: mlflow.MlflowClient, parent_run_id: str) -> dict[str, Run]:
    """Cell key -> its newest FINISHED child run: the cell's record."""
    runs: dict[str, Run] = {}
    for run in child_runs(client, client.get_run(parent_run_id)):  # oldest first: a rerun cell's newer run wins
        if CELL_TAG in run.data.tags:
            runs[run.data.tags[CELL_TAG]] = run
    return runs


def compute_used(runs: dict[str, Run]) -> dict[str, float | int]:
    """CPU time of the cells' trial processes (``trial/cpu_seconds``, user + system, every attempt of a cell), and how
    many cell runs have no record of it (run before satlab recorded it, or killed before they could)."""
    seconds = [run.data.metrics[CPU_METRIC] for run in runs.values() if CPU_METRIC in run.data.metrics]
    return {"runs": len(runs), "runs_timed": len(seconds), "cpu_hours": round(sum(seconds) / 3600, 3)}


def final_values(runs: dict[str, Run], key: str) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Per cell the last value of metric ``key`` (as the report's ``last`` columns read it), and the cells whose
    run never logged it, with the metrics it did log."""
    values = {cell: run.data.metrics[key] for cell, run in runs.items() if key in run.data.metrics}
    lacking = {cell: sorted(run.data.metrics) for cell, run in runs.items() if key not in run.data.metrics}
    return values, lacking


def cell_result(client: mlflow.MlflowClient, cell: Cell, run: Run, measures: Measures = LM_MEASURES) -> CellResult:
    run_id, logged, params = run.info.run_id, run.data.metrics, run.data.params
    metrics: dict[str, float | None] = {}
    for column in measures.columns:
        if column.key not in logged or column.reduce == "last":
            metrics[column.name] = logged.get(column.key)
        else:
            history = [m.value for m in client.get_metric_history(run_id, column.key)]
            metrics[column.name] = sum(history) / len(history) if column.reduce == "mean" else max(history)
    curve = loss_curve(client, run_id, float(params.get("derived.tokens_per_step") or 0),
                       int(params.get("derived.max_steps") or 0), measures.curve_key)
    count = params.get("model.params")
    budget = int(params.get("derived.max_steps") or 0) or None
    return CellResult(cell, run_id, metrics, int(count) if count else None, curve, budget)


def loss_curve(client: mlflow.MlflowClient, run_id: str, tokens_per_step: float,
               max_steps: int, key: str = "val/loss") -> list[tuple[float, float]]:
    """A validation metric against tokens seen. Lightning logs a validation inside training at the index of the step
    it follows (after s + 1 optimizer steps), the one before training at step 0 and the one after it at
    ``max_steps`` (or at the step a run stopped early at, which repeats the last point)."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    points = []
    for i, metric in enumerate(history):
        done = 0 if i == 0 and metric.step == 0 else max_steps if 0 < max_steps <= metric.step else metric.step + 1
        points.append((done * tokens_per_step, metric.value))
    return points


def download_heatmap(client: mlflow.MlflowClient, run_id: str, target: Path) -> Path | None:
    """The run's newest gate heatmap (``gates/step_<n>/heatmap.png``, highest n) copied to ``target``; None when the
    run logged none."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file: no bar per download
    steps = []
    for entry in client.list_artifacts(run_id, "gates"):
        name = entry.path.rsplit("/", 1)[-1]
        if entry.is_dir and name.startswith("step_") and name[5:].isdigit():
            steps.append((int(name[5:]), entry.path))
    for _, folder in sorted(steps, reverse=True):
        if any(f.path.endswith("/heatmap.png") for f in client.list_artifacts(run_id, folder)):
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                shutil.move(client.download_artifacts(run_id, f"{folder}/heatmap.png", tmp), target)
            return target
    return None
