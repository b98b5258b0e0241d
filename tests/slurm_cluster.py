"""A one-node SLURM cluster for the tests: ``scripts/slurm_local.sh up`` in a temp folder of its own (its daemons on
free ports, a private munge), brought down by PID when the session ends. Tests that need it skip, saying why, where
SLURM is not installed and cannot be (not root, no apt-get, no network)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CANNOT_INSTALL = 3  # scripts/slurm_local.sh's exit code when SLURM is missing and cannot be installed


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]  # what a job gets: SLURM_CONF, this checkout's satlab first, one thread per process

    def run(self, *command: str, check: bool = True) -> str:
        proc = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check:
            assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr}"
        return proc.stdout

    def submit_dir(self, folder: Path) -> Path:
        """A submit directory as a user has one: the scripts run ``.venv/bin/satlab`` from it."""
        folder.mkdir(parents=True, exist_ok=True)
        venv = Path(sys.prefix)
        if not (venv / "bin" / "satlab").exists():
            pytest.skip(f"the sbatch scripts run .venv/bin/satlab, and {venv} (this Python) has no bin/satlab")
        (folder / ".venv").symlink_to(venv)
        return folder

    def sbatch(self, script: str, options: list[str], args: list[str], cwd: Path, **env: str) -> str:
        """The job id of ``sbatch <options> scripts/<script> <args>`` submitted from ``cwd``."""
        proc = subprocess.run(["sbatch", "--parsable", *options, str(SCRIPTS / script), *args], cwd=cwd,
                              env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); of an array, its first task's."""
        text = self.run("scontrol", "-o", "show", "job", job_id).splitlines()[0]
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """Every task of an array (or the one job), from ``scontrol -o show job``."""
        lines = self.run("scontrol", "-o", "show", "job", job_id).splitlines()
        return [dict(item.split("=", 1) for item in line.split() if "=" in item) for line in lines]

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"SLURM: {what} did not happen within {timeout:.0f} s\n{self.run('squeue')}")
            time.sleep(0.5)

    def wait_done(self, job_id: str, timeout: float = 300) -> list[dict[str, str]]:
        """Waits until no task of ``job_id`` is pending or running; returns them."""
        def done() -> bool:
            return not self.run("squeue", "-h", "-j", job_id, check=False).strip()
        self.wait(done, f"job {job_id} ending", timeout)
        return self.jobs(job_id)

    def evidence(self, title: str, job_id: str) -> str:
        """What the closing note of a run shows: each task's id, state, exit code and restart count."""
        fields = ("JobId", "ArrayJobId", "ArrayTaskId", "JobState", "Reason", "ExitCode", "Restarts")
        rows = [" ".join(f"{k}={job[k]}" for k in fields if k in job) for job in self.jobs(job_id)]
        ids = ",".join(sorted({job["JobId"] for job in self.jobs(job_id)}, key=int))
        # a line per ended attempt, a requeue included: plain sacct needs slurmdbd, -c reads the completion log
        ended = self.run("sacct", "-c", "-j", ids, "-o", "JobID,JobName,State,ExitCode,Start,End", check=False)
        return f"## {title}\nscontrol:\n" + "\n".join(rows) + "\nsacct -c:\n" + ended


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    return {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def slurm() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("a one-node SLURM runs its daemons as root (scripts/slurm_local.sh); these tests are not root")
    folder = Path(tempfile.mkdtemp(prefix="satlab-slurm-"))
    env = {**job_env(), "SLURM_LOCAL_DIR": str(folder), "SLURM_CONF": str(folder / "slurm.conf")}
    script = ["bash", str(SCRIPTS / "slurm_local.sh")]
    proc = subprocess.run([*script, "up"], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode == CANNOT_INSTALL:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"no SLURM here: {proc.stderr.strip()}")
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield Cluster(folder, env)
    finally:
        subprocess.run([*script, "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)
