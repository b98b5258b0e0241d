"""Launching training processes: the drivers (sweeps, ablations) run each training run as a subprocess of its own,
in a worker slot that gets a share of the CPU threads and, on a GPU host, of the devices. A process that outlives
its timeout is stopped, an interrupt stops them all, and an exit that left no reason of its own is described from
its signal or the last line of its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from satlab.config.schema import TrainConfig

GRACE_SECONDS = 30.0
"""How long a terminated process may take to exit before it is killed."""


def worker_env(slot: int, workers: int, threads: int, train: TrainConfig,
               environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment (``environ``, default ``os.environ``) of a process in worker slot ``slot``: ``threads`` CPU
    threads, and with several workers on a GPU host its own ``train.devices`` GPUs (slot k gets the k-th group of
    the visible devices)."""
    env = dict(os.environ if environ is None else environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if workers > 1 and train.accelerator != "cpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(workers * train.devices)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[slot * train.devices:(slot + 1) * train.devices])
    return env


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie is not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except (OSError, IndexError):  # no /proc (not Linux), or not ours to signal: it exists
        return True


def describe_exit(returncode: int, log_file: Path) -> str:
    """Why a process that left no reason of its own ended: the signal that killed it, or its exit code and the last
    line of its log."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()] \
        if log_file.exists() else []
    return f"exit code {returncode}" + (f": {lines[-1].strip()[:300]}" if lines else "")


def stop_process(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """Terminate ``proc`` and wait for it; kill it if it is still running after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ProcessGroup:
    """The processes a driver has running, each waited on by a thread of its own, so an interrupt can stop them."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False  # set by terminate(): a run asked for afterwards starts nothing

    def run(self, command: list[str], env: dict[str, str], log_file: Path, timeout: float | None,
            append: bool = False) -> tuple[int, bool]:
        """Run ``command`` to its end, or to its ``timeout`` in seconds (then it is stopped): (return code, whether
        it timed out). Its output goes to ``log_file``, overwritten, or with ``append`` added after a line naming the
        command and the time. An interrupt while waiting stops the process and goes on. After :meth:`terminate` it
        starts nothing and returns what a process stopped by SIGTERM returns: a worker thread that was between its
        last check and this call when the interrupt came would otherwise start a run nobody stops."""
        with open(log_file, "a" if append else "w") as log:
            if append:
                log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n")
                log.flush()
            with self._lock:  # one step with terminate(): a process is either signalled or never started
                if self._closed:
                    log.write("not started: the driver was stopping\n")
                    return -signal.SIGTERM, False
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
                self._procs.add(proc)
        try:
            proc.wait(timeout=timeout)
            return proc.returncode, False
        except subprocess.TimeoutExpired:
            stop_process(proc)
            return proc.returncode, True
        except KeyboardInterrupt:
            stop_process(proc)
            raise
        finally:
            with self._lock:
                self._procs.discard(proc)

    def terminate(self) -> list[subprocess.Popen]:
        """Send every running process SIGTERM without waiting for it, and start no more; the processes signalled."""
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for proc in procs:
            proc.terminate()
        return procs

    def stop(self) -> None:
        """Terminate every running process, then wait for each (killing it after the grace period)."""
        for proc in self.terminate():
            stop_process(proc)
