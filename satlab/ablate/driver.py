"""Running an ablation: :func:`run_ablation` is ``satlab ablate`` (and ``make ablate``, ``make reproduce``).

The driver expands the grid, writes one experiment YAML per cell (``<out_dir>/cells/<slug>.yaml``: the base, the
fixed overrides, the cell's values and its MLflow parent tags), prepares the data once, then runs every unfinished
cell as ``satlab train experiment=<cell.yaml>`` in a subprocess of its own, ``workers`` at a time, each with its
share of the CPU threads (and on a GPU host its own devices). A cell is finished when its FINISHED child run exists;
a cell killed midway resumes from its last checkpoint in the same MLflow run (``train.resume: auto``), and one
killed before its first checkpoint starts over. So the same command, after any interruption, runs only what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import yaml
from rich.console import Console

from satlab.ablate.launcher import CellLauncher, CellPlan
from satlab.ablate.runs import ABLATION_TAG, CELL_TAG, GROUP_TAG, PARENT_TAG, ensure_parent_run, finished_cells
from satlab.ablate.spec import AblationSpec, Cell, format_value
from satlab.ablate.state import STATE_FILE, AblationState
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment, safe_run_name
from satlab.config.schema import ExperimentConfig
from satlab.config.specs import nest
from satlab.training.tracking import ensure_reachable, open_store, resolve_tracking


@dataclass
class AblationResult:
    name: str
    tracking_uri: str
    parent_run_id: str
    cells: int
    skipped: list[str]
    finished: list[str]
    failed: dict[str, str]
    interrupted: bool
    report: dict[str, Path] | None


def run_ablation(spec: AblationSpec, workers: int = 1, console: Console | None = None,
                 report: bool = True) -> AblationResult:
    """Run (or resume) every unfinished cell, close the parent run, and write the report when nothing was
    interrupted. The MLflow store, its experiment and the parent run are created here, before any cell process
    opens them (two processes creating one sqlite database race)."""
    console = console or Console()
    out = spec.out_path()
    out.mkdir(parents=True, exist_ok=True)
    base = spec.base_config()
    if not base.tracking.enabled:
        raise ConfigError(f"ablation '{spec.name}': tracking.enabled is false, but the cells' MLflow runs are the "
                          "ablation's record (what resuming skips, what the report reads); remove the override")
    uri, artifacts = resolve_tracking(base.tracking.uri, base.tracking.artifact_dir)
    uri = open_store(ensure_reachable(uri, base.tracking.fallback_local))
    client = mlflow.MlflowClient(uri)
    state = AblationState(out / STATE_FILE)
    parent_id = ensure_parent_run(client, spec, state.parent_run_id if state.tracking_uri == uri else None, artifacts)
    state.set_parent(spec.name, parent_id, uri, spec.experiment_name)
    plans = [write_cell_config(spec, cell, base, parent_id, uri, out) for cell in spec.cells()]
    done = finished_cells(client, parent_id)
    for plan in plans:
        if plan.cell.key in done:
            state.update(plan.cell.key, slug=plan.cell.slug, status="finished", run_id=done[plan.cell.key])
    seeds = [format_value(s) for s in spec.axes.get(spec.seed_key, [])]
    # seed by seed, so that an interrupted ablation leaves whole replicates of the grid
    todo = sorted((p for p in plans if p.cell.key not in done),
                  key=lambda p: seeds.index(format_value(p.cell.seed)) if seeds else 0)
    console.print(f"[bold]ablation[/] [cyan]{spec.name}[/]: {len(plans)} cells, {len(plans) - len(todo)} finished "
                  f"before, {len(todo)} to run with {workers} worker(s); MLflow {uri}, experiment "
                  f"'{spec.experiment_name}', parent run {parent_id}; logs in {out / 'logs'}", soft_wrap=True)
    if todo:
        prepare_data_once([p.cfg for p in todo], console)
    launcher = CellLauncher(spec, client, state, workers, console)
    interrupted = launcher.run_all(todo)
    finished = finished_cells(client, parent_id)
    keys = [p.cell.key for p in plans]
    complete = all(k in finished for k in keys)
    client.set_terminated(parent_id, "FINISHED" if complete else "KILLED" if interrupted else "FAILED")
    written = None
    if report and not interrupted and any(k in finished for k in keys):
        from satlab.ablate.report import write_report

        written = write_report(spec, client, parent_id, console=console)
    return AblationResult(spec.name, uri, parent_id, len(plans), [k for k in keys if k in done],
                          [k for k in keys if k in finished and k not in done], launcher.failures, interrupted,
                          written)


def write_cell_config(spec: AblationSpec, cell: Cell, base: ExperimentConfig, parent_run_id: str,
                      tracking_uri: str, out: Path) -> CellPlan:
    """The cell's experiment YAML (``satlab train experiment=<it>`` reruns the cell by hand), validated.

    Tags go in through the file: dotted tag keys such as ``mlflow.parentRunId`` cannot be written as overrides."""
    tags = {**base.tracking.tags, PARENT_TAG: parent_run_id, ABLATION_TAG: spec.name, CELL_TAG: cell.key,
            GROUP_TAG: cell.group}
    flat: dict[str, Any] = {k: v for k, v in spec.overrides.items() if not k.startswith("tracking.tags")}
    flat.update(dict(cell.values))
    flat.update({"name": safe_run_name(f"{spec.name}-{cell.slug}"), "description": f"ablation {spec.name}: {cell.key}",
                 "train.out_dir": str((Path(base.train.out_dir) / "ablations" / spec.name).resolve()),
                 "train.resume": "auto", "tracking.uri": tracking_uri, "tracking.experiment": spec.experiment_name})
    data = {"base": str(spec.base_path()), **nest(flat)}
    data["tracking"]["tags"] = tags
    path = out / "cells" / f"{cell.slug}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Cell '{cell.key}' of ablation '{spec.name}', written by satlab ablate (rewritten on every run).\n"
              f"# Rerun it alone with: satlab train experiment={path}\n")
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return CellPlan(cell, path, load_experiment(path))


def prepare_data_once(configs: list[ExperimentConfig], console: Console) -> None:
    """Tokenize and pack each distinct data config once, here, rather than in every parallel cell."""
    from satlab.data.prepare import prepare_data

    distinct = {repr(cfg.data): cfg.data for cfg in configs if not cfg.data.synthetic_task}  # generated per step
    for data in distinct.values():
        console.print(f"preparing data: {data.source} ({data.tokenizer.kind} tokenizer, seq_len {data.seq_len})")
        prepare_data(data)
