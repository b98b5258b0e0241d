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
import subprocess
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

GRACE_SECONDS = 30.0


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
        self._procs: set[subprocess.Popen] = set()
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
            self._stop_all()
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
        env = cell_env(slot, self.workers, self.threads, plan.cfg)
        timeout = self.spec.timeout_minutes * 60 if self.spec.timeout_minutes else None
        with open(log_file, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        with self._lock:
            self._procs.add(proc)
        try:
            proc.wait(timeout=timeout)
            return proc.returncode, False
        except subprocess.TimeoutExpired:
            stop_process(proc)
            return proc.returncode, True
        finally:
            with self._lock:
                self._procs.discard(proc)

    def _stop_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            stop_process(proc)


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


def cell_env(slot: int, workers: int, threads: int, cfg: ExperimentConfig) -> dict[str, str]:
    """The cell's environment: ``threads`` CPU threads, the driver's pid, and with several workers on a GPU host its
    own ``train.devices`` GPUs (worker slot k gets the k-th group of the visible devices)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env[DRIVER_PID] = str(os.getpid())
    if workers > 1 and cfg.train.accelerator != "cpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(workers * cfg.train.devices)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[slot * cfg.train.devices:(slot + 1) * cfg.train.devices])
    return env


def describe_exit(returncode: int, log_file: Path) -> str:
    """Why a cell failed: the signal that killed it, or its exit code and the last line of its log."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()] \
        if log_file.exists() else []
    return f"exit code {returncode}" + (f": {lines[-1].strip()[:300]}" if lines else "")


def stop_process(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
