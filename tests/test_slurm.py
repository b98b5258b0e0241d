"""The SLURM scripts against a real scheduler: a one-node cluster (tests/slurm_cluster.py) runs
scripts/slurm_study.sbatch as a job array of study workers on a PostgreSQL study (tests/test_postgres.py's server)
with a sqlite MLflow store on the shared filesystem, and scripts/slurm_train.sbatch as two srun tasks (gloo). Each
script is submitted unchanged, with only the options a CPU partition needs given to sbatch. Pre-emption is
``scancel --signal=TERM``: the job checkpoints, exits 75, requeues itself and resumes; a full disk exits 74 and holds
the job until ``scontrol release``. ``SATLAB_SLURM_EVIDENCE=<file>`` appends each job's scheduler record to a file."""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from pathlib import Path

import mlflow
import optuna
import pytest
import yaml
from slurm_cluster import Cluster, slurm  # noqa: F401  (the session's cluster)
from test_faults import WIDER, disk_size_for, small_disk  # noqa: F401
from test_postgres import MICRO, cell_losses, make_store, postgres  # noqa: F401

from satlab.config.loader import load_experiment
from satlab.studies.attrs import CELL, LOG, REASON, WORKER
from satlab.studies.engine import run_study
from satlab.studies.loader import load_ablation
from satlab.studies.plans import GridPlan
from satlab.studies.runs import CELL_TAG
from satlab.studies.storage import open_storage
from satlab.training.run import train
from satlab.training.tracking import END_HISTORY_TAG

pytestmark = pytest.mark.process

CPU_STUDY = ["--partition=debug", "--gres=none", "--cpus-per-task=1", "--time=20"]
"""What a CPU partition needs instead of slurm_study.sbatch's GPU defaults."""
CPU_TRAIN = ["--partition=debug", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
             "--time=20"]
"""And instead of slurm_train.sbatch's: two tasks on the one node."""
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
STUDY_STEPS = 120
"""Of a pre-empted study's cells, 256 tokens a step (tests/test_postgres.py's MICRO): seconds of training after
the first checkpoint, so that the pre-emption lands inside the fit (at 16 steps it landed after it about one time
in two, which hid a trial process killed on its way out)."""


def record(cluster: Cluster, title: str, job_id: str) -> None:
    if path := os.environ.get("SATLAB_SLURM_EVIDENCE"):
        with open(path, "a") as f:
            f.write(cluster.evidence(title, job_id))


def grid_spec(folder: Path, name: str, store: str, archs: list[str], tokens: int) -> Path:
    """A micro grid (one cell per arch), its checkpoints every 2 steps so a pre-emption mid-cell has one to resume."""
    spec = {"name": name, "base": "default", "axes": {"model.arch": archs, "train.seed": [0]},
            "overrides": {**MICRO, "train.max_tokens": tokens, "train.ckpt_every_tokens": 512,
                          "train.log_every_n_steps": 1, "tracking.uri": store},
            "trial": {"heartbeat_seconds": 1, "grace_seconds": 4, "threads": 1}}
    path = folder / f"{name}.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def array_trials(url: str, spec: Path) -> tuple[list[optuna.trial.FrozenTrial], dict[str, list]]:
    """The launched trials of the study the array's tasks made (with the script's shared run folder), and those
    that count for each cell."""
    plan = GridPlan(load_ablation(spec, [f"train.out_dir={spec.parent / 'runs'}"]))
    study = optuna.load_study(study_name=plan.study_name(), storage=open_storage(url, create_tables=False))
    launched = [t for t in study.trials if t.user_attrs.get(LOG)]
    return launched, {key: [t for t in trials if t.user_attrs.get(LOG)]
                      for key, trials in plan.trials_by_cell(study).items()}


def assert_resumed(logged: dict[int, list[float]], run: mlflow.entities.Run, steps: int, once: bool = True) -> None:
    """The run (step -> its logged train/loss values) was stopped by SIGTERM (``once``: exactly once), which wrote
    a checkpoint at the step it had reached, and resumed from there: every step logged, those before the first stop
    once (not trained again from step 0), any step logged twice to the same loss, the run FINISHED."""
    ends = run.data.tags[END_HISTORY_TAG]
    stops = [int(s) for s in re.findall(r"KILLED at step (\d+)", ends)]
    assert run.info.status == "FINISHED" and stops and (len(stops) == 1 or not once), ends
    assert all(0 < stop < steps for stop in stops), ends
    assert sorted(logged) == list(range(steps))
    assert all(len(logged[step]) == 1 for step in range(min(stops) - 1)), logged
    assert all(len(set(values)) == 1 for values in logged.values()), logged


def study_array(slurm: Cluster, url: str, spec: Path, tasks: int) -> str:  # noqa: F811
    return slurm.sbatch("slurm_study.sbatch", [f"--array=0-{tasks - 1}", *CPU_STUDY], [], spec.parent,
                        STUDY=f"ablate {spec.name}", STORAGE=url)


def assert_completed(jobs: list[dict[str, str]], folder: Path) -> None:
    logs = "\n".join(p.read_text()[-3000:] for p in folder.glob("slurm-*.out"))
    assert all(j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" for j in jobs), (jobs, logs)


def one_host(spec: Path, monkeypatch) -> dict[str, float]:
    """The grid run by one driver alone (its own name, its own folder), as the comparison."""
    text = spec.read_text().replace(f"name: {spec.stem}", f"name: {spec.stem}-alone")
    alone = spec.with_name(f"{spec.stem}-alone.yml")
    alone.write_text(text)
    (spec.parent / "alone").mkdir()
    monkeypatch.chdir(spec.parent / "alone")
    assert not run_study(load_ablation(alone), workers=1, report=False).failed
    return cell_losses(yaml.safe_load(text)["overrides"]["tracking.uri"], alone)


@pytest.mark.slow  # ~4 min on two loaded cores; the fast suite runs the array with a pre-empted task below
def test_an_array_of_four_study_workers_runs_every_cell_once_and_matches_one_host(slurm, postgres, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    folder = slurm.submit_dir(tmp_path / "submit")
    archs = ["transformer", "satformer", "resformer", "denseformer"]
    spec = grid_spec(folder, "array4", make_store(folder), archs, 2048)
    job = study_array(slurm, postgres("array4"), spec, 4)
    jobs = slurm.wait_done(job, timeout=900)
    record(slurm, "array of 4 study workers, 4 cells", job)
    assert_completed(jobs, folder)
    url = postgres("array4")
    trials, by_cell = array_trials(url, spec)
    assert all(len(ts) == 1 for ts in by_cell.values()) and len(trials) == 4  # each cell launched once
    assert {t.state.name for t in trials} == {"COMPLETE"}
    assert len({t.user_attrs[WORKER] for t in trials}) > 1  # the tasks shared the cells
    assert sorted(p.name for p in (folder / "studies" / "array4").iterdir()) == [f"task-{job}-{i}" for i in range(4)]
    assert cell_losses(yaml.safe_load(spec.read_text())["overrides"]["tracking.uri"], spec) == \
        pytest.approx(one_host(spec, monkeypatch), rel=1e-6)


def test_a_study_task_pre_empted_mid_cell_is_requeued_and_its_cell_resumes_from_the_checkpoint(
        slurm, postgres, tmp_path, monkeypatch, capsys):  # noqa: F811
    """``--array=0-1`` over two cells; once task 0's cell has written a checkpoint, ``scancel --batch --signal=TERM``
    (what ``--signal=B:TERM@300`` sends before the time limit): the batch shell's trap passes it to the driver,
    which stops the cell with a checkpoint and exits 75; the script requeues the task (Restarts=1), the requeued
    task resumes the cell from that checkpoint, and every cell ends with one FINISHED MLflow run, the interrupted
    one's history continuing without a gap."""
    folder = slurm.submit_dir(tmp_path / "submit")
    store = make_store(folder)
    spec = grid_spec(folder, "preempt", store, ["transformer", "satformer"], STUDY_STEPS * 256)
    url = postgres("preempt")
    job = study_array(slurm, url, spec, 2)
    trials_of_task_0 = folder / "studies" / "preempt" / f"task-{job}-0" / "trials"

    def task_0_checkpointed() -> bool:  # its cell's first checkpoint: something to resume from, most steps to go
        cell = next(trials_of_task_0.glob("*.yaml"), None)
        run = folder / "runs" / "ablations" / "preempt" / yaml.safe_load(cell.read_text())["name"] if cell else None
        return run is not None and any((run / "checkpoints").glob("step*.ckpt"))

    slurm.wait(task_0_checkpointed, "a checkpoint in task 0's cell", 300)
    assert slurm.job(f"{job}_0")["JobState"] == "RUNNING"
    slurm.run("scancel", "--batch", "--signal=TERM", f"{job}_0")
    jobs = slurm.wait_done(job, timeout=600)
    record(slurm, "array of 2 study workers, task 0 pre-empted mid-cell", job)
    assert_completed(jobs, folder)
    restarts = {j["ArrayTaskId"]: int(j["Restarts"]) for j in jobs}
    assert restarts == {"0": 1, "1": 0}, jobs
    log0 = (folder / f"slurm-satlab-study-{job}_0.out").read_text()
    assert "interrupted" in log0 and "resumed" in log0, log0[-3000:]
    trials, by_cell = array_trials(url, spec)
    stopped = [t for t in trials if t.user_attrs.get(REASON) == "interrupted"]
    assert len(stopped) == 1 and len(trials) == 3, trials  # the cell stopped once, taken again once
    assert all(len(ts) == 1 and ts[0].state.name == "COMPLETE" for ts in by_cell.values()), by_cell
    assert stopped[0].user_attrs[CELL] in by_cell
    losses = cell_losses(store, spec)  # one FINISHED run per cell, no other run
    assert len(losses) == 2
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name(load_ablation(spec).experiment_name)
    resumed = [r for r in client.search_runs([experiment.experiment_id], f"tags.`{CELL_TAG}` != ''")
               if "KILLED" in r.data.tags.get(END_HISTORY_TAG, "")]
    assert len(resumed) == 1 and resumed[0].data.tags[CELL_TAG] == stopped[0].user_attrs[CELL]
    logged = defaultdict(list)
    for m in client.get_metric_history(resumed[0].info.run_id, "train/loss"):
        logged[m.step].append(m.value)
    assert_resumed(logged, resumed[0], STUDY_STEPS)
    with capsys.disabled():
        print(f"\n{slurm.evidence('pre-empted study task', job)}{len(trials)} trials: "
              + ", ".join(f"{t.number} {t.state.name} {t.user_attrs.get(REASON, '')}" for t in trials))


LIMITED_CELL_STEPS = 600
"""A study cell of 256-token steps that outlasts the warning's 30-60 s (below) on these cores."""


@pytest.mark.slow  # 4-7 min: two to five attempts of the task, then the same grid on one host
def test_a_study_task_warned_of_its_time_limit_is_requeued_until_its_cell_finishes_exactly(
        slurm, postgres, tmp_path, monkeypatch):  # noqa: F811
    """The study script's own warning, ``--time=2 --signal=B:TERM@60``: SLURM signals the batch shell 30-60 s into
    each attempt, the trap passes SIGTERM to the driver, the cell stops with a checkpoint, the task exits 75 and is
    requeued, and the next attempt resumes the cell, until it finishes. The cell's MLflow history is that of a cell
    never stopped, and its loss that of the same grid run by one driver alone."""
    folder = slurm.submit_dir(tmp_path / "submit")
    store = make_store(folder)
    spec = grid_spec(folder, "limited", store, ["satformer"], LIMITED_CELL_STEPS * 256)
    data = yaml.safe_load(spec.read_text())
    data["overrides"]["train.ckpt_every_tokens"] = 256 * 100
    spec.write_text(yaml.safe_dump(data))
    url = postgres("limited")
    job = slurm.sbatch("slurm_study.sbatch", ["--array=0-0", *CPU_STUDY, "--time=2", "--signal=B:TERM@60"], [],
                       folder, STUDY=f"ablate {spec.name}", STORAGE=url)
    jobs = slurm.wait_done(job, timeout=900)
    record(slurm, "array of 1 study worker, --time=2 --signal=B:TERM@60", job)
    assert_completed(jobs, folder)
    assert int(jobs[0]["Restarts"]) >= 1, jobs
    trials, by_cell = array_trials(url, spec)
    assert all(len(ts) == 1 and ts[0].state.name == "COMPLETE" for ts in by_cell.values()), by_cell
    assert any(t.user_attrs.get(REASON) == "interrupted" for t in trials), trials
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name(load_ablation(spec).experiment_name)
    run, = client.search_runs([experiment.experiment_id], f"tags.`{CELL_TAG}` != ''")
    logged = defaultdict(list)
    for m in client.get_metric_history(run.info.run_id, "train/loss"):
        logged[m.step].append(m.value)
    assert_resumed(logged, run, LIMITED_CELL_STEPS, once=False)
    assert cell_losses(store, spec) == pytest.approx(one_host(spec, monkeypatch), rel=1e-6)


TRAIN_STEPS = 12
TRAIN = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64",
    "data.source=kjv", "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4",
    "train.global_batch_tokens=512", f"train.max_tokens={TRAIN_STEPS * 512}", "train.val_every_tokens=4096",
    "train.val_tokens=512", "train.ckpt_every_tokens=1024", "train.log_every_n_steps=1", "train.deterministic=true",
    "optim.warmup_fraction=0", "eval.at_end=false",
]
"""Two ranks of 4 sequences make the global batch of 512 tokens; a checkpoint every 2 steps."""


def train_args(folder: Path, name: str) -> list[str]:
    return [*TRAIN, f"name={name}", f"data.cache_dir={folder / 'cache'}", f"train.out_dir={folder / 'runs'}",
            f"tracking.uri=sqlite:///{folder / 'mlflow.db'}"]


def train_history(folder: Path, name: str) -> tuple[dict[int, list[float]], mlflow.entities.Run]:
    """step -> every train/loss logged at it (a resumed run logs the steps after its checkpoint again), the run."""
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`mlflow.runName` = '{name}'")
    assert len(runs) == 1, "one MLflow run per training run, whatever the ranks and attempts"
    logged: dict[int, list[float]] = defaultdict(list)
    for m in sorted(client.get_metric_history(runs[0].info.run_id, "train/loss"), key=lambda m: m.timestamp):
        logged[m.step].append(m.value)
    return logged, runs[0]


def train_job(slurm: Cluster, folder: Path, name: str, strategy: str, *extra: str) -> str:  # noqa: F811
    return slurm.sbatch("slurm_train.sbatch", CPU_TRAIN, [*train_args(folder, name), *extra], folder,
                        ACCELERATOR="cpu", STRATEGY=strategy)


def wait_for_checkpoint(slurm: Cluster, folder: Path, name: str) -> None:  # noqa: F811
    checkpoints = folder / "runs" / name / "checkpoints"
    slurm.wait(lambda: any(checkpoints.glob("step*.ckpt")) or any(checkpoints.glob("step*/.metadata")),
               f"a step checkpoint of {name}", 300)


@pytest.mark.slow  # ~2.5 min each; the fast suite's ~3 min go to the pre-empted study task above (the same requeue)
@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_training_under_srun_pre_empted_is_requeued_and_resumes_exactly(slurm, tmp_path, strategy):  # noqa: F811
    """slurm_train.sbatch with two tasks on the node: Lightning takes SLURM's ranks (gloo), so the run matches one
    process with the same global batch; ``scancel --signal=TERM`` (what ``--signal=SIGTERM@120`` sends the
    tasks before the time limit) after the first step checkpoint: exit 75, the script requeues the job
    (Restarts=1), and the requeued job resumes from the checkpoint to the same losses."""
    folder = slurm.submit_dir(tmp_path / "submit")
    job = train_job(slurm, folder, "pre-empted", strategy)
    wait_for_checkpoint(slurm, folder, "pre-empted")
    slurm.run("scancel", "--signal=TERM", job)
    slurm.wait(lambda: int(slurm.job(job)["Restarts"]) > 0 or slurm.job(job)["JobState"] in ENDED,
               "the requeue", 300)
    requeued = slurm.job(job)
    assert requeued["Restarts"] == "1" and "held" not in requeued["Reason"].lower(), requeued  # requeued, not held
    jobs = slurm.wait_done(job, timeout=600)
    record(slurm, f"training, {strategy}, 2 tasks, pre-empted by scancel --signal=TERM", job)
    assert_completed(jobs, folder)
    assert jobs[0]["Restarts"] == "1"
    log = (folder / f"slurm-satlab-{job}.out").read_text()
    assert "stopped by SIGTERM with its state checkpointed" in log, log[-3000:]
    assert "rank 1:" in log, log[-3000:]  # satlab saw SLURM's second task as rank 1
    logged, run = train_history(folder, "pre-empted")
    assert_resumed(logged, run, TRAIN_STEPS)
    reference = tmp_path / "one"  # one process, the same global batch (tests/test_distributed.py: equal to torchrun's)
    train(load_experiment("default", [*train_args(reference, "one"), "train.devices=1", "train.accelerator=cpu"]),
          progress=False)
    one, _ = train_history(reference, "one")
    assert [v[-1] for _, v in sorted(logged.items())] == pytest.approx([v[0] for _, v in sorted(one.items())],
                                                                       abs=1e-5)


LIMITED_STEPS = 800
"""Longer than the warning's 30-60 s (below) on this machine even when quiet (200 steps ended before it; about six
steps a second with two studies beside it), so the first attempt is stopped mid-training."""


@pytest.mark.slow  # 5-7 min: two to five attempts, then the run never stopped
def test_training_under_srun_warned_of_its_time_limit_is_requeued_until_it_finishes_exactly(slurm, tmp_path):  # noqa: F811
    """A real time limit: ``--time=2 --signal=SIGTERM@60``. slurmctld checks limits every 30 s and sends the
    warning at the first check within 60 + 30 s of the limit, so 30-60 s into each attempt: the run checkpoints and
    exits 75, the script requeues the job, whose next attempt (a new 2-minute limit) continues from the checkpoint.
    An attempt whose training ended before its warning must still end 0: before satlab watched SIGTERM to the end
    of the process (satlab/training/sigterm.py) the warning killed such a finished run on its way out (143, FAILED,
    not requeued). Every step's loss equals that of the same two tasks never stopped (one process with the same
    global batch drifts from two by float rounding after some 30 steps, so it is no reference for 800)."""
    folder = slurm.submit_dir(tmp_path / "submit")
    limited = [f"train.max_tokens={LIMITED_STEPS * 512}", "train.ckpt_every_tokens=51200",
               "train.val_every_tokens=1000000"]
    job = slurm.sbatch("slurm_train.sbatch", [*CPU_TRAIN, "--time=2", "--signal=SIGTERM@60"],
                       [*train_args(folder, "limited"), *limited], folder, ACCELERATOR="cpu", STRATEGY="ddp")
    jobs = slurm.wait_done(job, timeout=900)
    record(slurm, "training, ddp, 2 tasks, --time=2 --signal=SIGTERM@60", job)
    assert_completed(jobs, folder)
    assert int(jobs[0]["Restarts"]) >= 1, jobs
    log = (folder / f"slurm-satlab-{job}.out").read_text()
    assert "stopped by SIGTERM with its state checkpointed" in log, log[-3000:]
    logged, run = train_history(folder, "limited")
    assert_resumed(logged, run, LIMITED_STEPS, once=False)
    calm = train_job(slurm, folder, "calm", "ddp", *limited)
    assert_completed(slurm.wait_done(calm, timeout=600), folder)
    never_stopped, _ = train_history(folder, "calm")
    assert [v[-1] for _, v in sorted(logged.items())] == pytest.approx(
        [v[0] for _, v in sorted(never_stopped.items())], abs=1e-6)


@pytest.mark.slow  # ~2.5 min
def test_training_under_srun_out_of_disk_is_held_until_released_then_finishes(slurm, tmp_path, small_disk):  # noqa: F811
    """The run's folder on a disk with room for one checkpoint and a half: rank 0 cannot write the next, so the
    run exits 74 and the script requeues the job held; it waits (Restarts=1, held) until ``scontrol release``,
    after space is freed, and then finishes from the checkpoint it kept."""
    folder = slurm.submit_dir(tmp_path / "submit")
    wider = [*train_args(folder, "full"), *WIDER]  # checkpoints large beside the margin (tests/test_faults.py)
    disk = small_disk(disk_size_for(1.6, wider))
    job = train_job(slurm, folder, "full", "ddp", *WIDER, f"train.out_dir={disk}")
    slurm.wait(lambda: slurm.job(job)["JobState"] == "PENDING" and slurm.job(job)["Restarts"] == "1",
               "the job requeued", 300)
    time.sleep(15)  # longer than a requeued job waits (cred_expire): held, it stays pending
    held = slurm.job(job)
    record(slurm, "training out of disk: exit 74, requeued held", job)
    assert held["JobState"] == "PENDING" and "held" in held["Reason"].lower(), held
    log = (folder / f"slurm-satlab-{job}.out").read_text()
    assert f"no space left on {disk / 'full' / 'checkpoints'}" in log, log[-3000:]
    small_disk(disk_size_for(12, wider))  # space freed
    slurm.run("scontrol", "release", job)
    jobs = slurm.wait_done(job, timeout=600)
    record(slurm, "training out of disk, released", job)
    assert_completed(jobs, folder)
    logged, run = train_history(folder, "full")
    assert run.info.status == "FINISHED" and sorted(logged) == list(range(TRAIN_STEPS))
