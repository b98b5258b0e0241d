"""Running cells: :class:`CellLauncher` runs each planned cell as ``satlab train experiment=<cell.yaml>`` in a
subprocess of its own (``python -m satlab.ablate.cell``), in worker slots that share out the CPU threads and, on a
GPU host, the devices. Before a cell starts, the leftovers of an earlier attempt are either resumed (a checkpoint
and an unfinished MLflow run) or cleared.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from rich.console import Console

from satlab.ablate.cell import DRIVER_PID
from satlab.ablate.runs import close_runs, usable_run
from satlab.ablate.spec import AblationSpec, Cell
from satlab.ablate.state import AblationState
from satlab.config.schema import ExperimentConfig
from satlab.training.launch import ProcessGroup, describe_exit, worker_env


@dataclass
class CellPlan:
    cell: Cell
    config_path: Path
    cfg: ExperimentConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.out_dir) / self.cfg.name


class CellLauncher:
    """Runs cells in worker slots: a thread per slot waits on its cell's subprocess."""

    def __init__(self, spec: AblationSpec, client: mlflow.MlflowClient, state: AblationState, workers: int,
                 console: Console):
        self.spec, self.client, self.state, self.workers, self.console = spec, client, state, workers, console
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self.logs = spec.out_path() / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.slots: queue.Queue[int] = queue.Queue()
        for slot in range(workers):
            self.slots.put(slot)
        self.failures: dict[str, str] = {}
        self.stopping = threading.Event()
        self.procs = ProcessGroup()
        self._lock = threading.Lock()
        self._count = 0
        self.total = 0

    def run_all(self, plans: list[CellPlan]) -> bool:
        """Run the plans; True when interrupted (Ctrl-C or SIGTERM: running cells are stopped, none is started)."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None
        self.total = len(plans)
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="satlab-cell")
        try:
            futures = [pool.submit(self.run_cell, plan) for plan in plans]
            for future in as_completed(futures):
                future.result()
        except KeyboardInterrupt:
            self.stopping.set()
            self.console.print("[yellow]interrupted[/]: stopping the running cells; the same command resumes")
            self.procs.stop()
            pool.shutdown(wait=True, cancel_futures=True)
            return True
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            pool.shutdown(wait=True)
        return False

    def run_cell(self, plan: CellPlan) -> None:
        slot = self.slots.get()
        try:
            if not self.stopping.is_set():
                self._run(plan, slot)
        finally:
            self.slots.put(slot)

    def _run(self, plan: CellPlan, slot: int) -> None:
        cell, log_file = plan.cell, self.logs / f"{plan.cell.slug}.log"
        resumed = prepare_run_dir(self.client, plan.run_dir)
        self.state.update(cell.key, slug=cell.slug, status="running", log=str(log_file), run_dir=str(plan.run_dir))
        self.console.print(f"cell [cyan]{cell.slug}[/] {'resumed' if resumed else 'started'}  [dim]{log_file}[/]",
                           soft_wrap=True)
        started = time.perf_counter()
        returncode, timed_out = self._execute(plan, slot, log_file)
        minutes = (time.perf_counter() - started) / 60
        run_id = read_run_id(plan.run_dir)
        run = usable_run(self.client, run_id)
        with self._lock:
            self._count += 1
            progress = f"{self._count}/{self.total}"
        if returncode == 0 and run is not None and run.info.status == "FINISHED":
            loss = run.data.metrics.get("val/loss")
            self.state.update(cell.key, status="finished", run_id=run_id, minutes=round(minutes, 2))
            self.console.print(f"cell {progress} [green]finished[/] in {minutes:.1f} min: {cell.slug}"
                               + (f"  val/loss {loss:.4f}" if loss is not None else ""), soft_wrap=True)
            return
        stopped = self.stopping.is_set()
        if stopped:
            reason = "interrupted"
        elif timed_out:
            reason = f"timeout after {self.spec.timeout_minutes:g} min"
        else:
            reason = describe_exit(returncode, log_file)
        if not stopped:
            self.failures[cell.key] = reason
        close_runs(self.client, [run_id] if run_id else [], "KILLED" if stopped or timed_out else "FAILED")
        self.state.update(cell.key, status="interrupted" if stopped else "failed", run_id=run_id, reason=reason,
                          minutes=round(minutes, 2))
        self.console.print(f"cell {progress} [red]{'stopped' if stopped else 'failed'}[/] after {minutes:.1f} min: "
                           f"{cell.slug} ({reason})", soft_wrap=True)

    def _execute(self, plan: CellPlan, slot: int, log_file: Path) -> tuple[int, bool]:
        command = [sys.executable, "-m", "satlab.ablate.cell", f"experiment={plan.config_path}", "--no-progress"]
        env = worker_env(slot, self.workers, self.threads, plan.cfg.train)
        env[DRIVER_PID] = str(os.getpid())  # the cell ends with its driver (satlab.ablate.cell)
        timeout = self.spec.timeout_minutes * 60 if self.spec.timeout_minutes else None
        return self.procs.run(command, env, log_file, timeout, append=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def prepare_run_dir(client: mlflow.MlflowClient, run_dir: Path) -> bool:
    """True when the cell can resume: a checkpoint and an unfinished MLflow run to continue. Otherwise the
    leftovers of an earlier attempt (killed before its first checkpoint, or a run deleted from MLflow to redo the
    cell) are removed, and a RUNNING run they name is closed as KILLED, so the cell starts clean."""
    if not run_dir.exists():
        return False
    run_id = read_run_id(run_dir)
    run = usable_run(client, run_id)
    if (run_dir / "checkpoints" / "last.ckpt").exists() and run is not None and run.info.status != "FINISHED":
        return True
    close_runs(client, [run_id] if run_id else [], "KILLED")
    shutil.rmtree(run_dir)
    return False


def read_run_id(run_dir: Path) -> str | None:
    info = run_dir / "run.json"
    try:
        return json.loads(info.read_text()).get("mlflow_run_id") if info.exists() else None
    except (OSError, ValueError):
        return None
