"""Every way a run can stop resumes into one MLflow run with exactly the points of a run never stopped.

One uninterrupted reference run (80 steps of the tiny config of test_resilience) is trained once for the module;
each test stops a run of the same config in one way, continues it the way a user would (the same command), and
compares the run's whole MLflow history with the reference's as a multiset of points: every metric key, every
(step, value), timings (``system/*``) by step only. None of the comparisons names a metric, so they hold whatever
keys a run logs. Each test also checks that the name has exactly one MLflow run, that no run of the store is left
RUNNING, and that the run's ``end_reason`` says it finished while its ``end_history`` keeps the stop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import lightning as L
import mlflow
import pytest
import yaml
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_ablate import write_micro_spec
from test_resilience import STEPS, args_for, finish, metric_histories, run_named, start

from satlab.config.loader import load_experiment
from satlab.evaluation.callback import EvaluationCallback
from satlab.studies.engine import run_study
from satlab.studies.loader import load_ablation
from satlab.studies.runs import CELL_TAG, PARENT_TAG, REASON_TAG
from satlab.training.run import train
from satlab.training.stops import TimeLimitReached
from satlab.training.tracking import END_HISTORY_TAG, END_TAG

HALF = STEPS // 2


def train_like_the_cli(tmp_path: Path, name: str, *extra: str, callbacks=()) -> None:
    """``satlab train`` in this process, with the CLI's evaluation callback (gate statistics, end-of-run suite)."""
    cfg = load_experiment("default", args_for(tmp_path, name, *extra))
    train(cfg, progress=False, callbacks=[EvaluationCallback(cfg, progress=False), *callbacks])


def store(tmp_path: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")


def points(histories: dict[str, list[tuple[int, float]]]) -> Counter:
    """The history as a multiset of points; a timing's value differs by nature, so it counts by its step."""
    return Counter((key, step) if key.startswith("system/") else (key, step, value)
                   for key, history in histories.items() for step, value in history)


def at_step(histories: dict[str, list[tuple[int, float]]], step: int) -> Counter:
    return points({key: [p for p in history if p[0] == step] for key, history in histories.items()})


def assert_one_finished_run_like(tmp_path: Path, name: str, reference: Counter) -> dict:
    """The run ``name`` is the only one of its name, FINISHED with an end_reason saying so, and its history is
    ``reference``, point for point; no run of the store is RUNNING. Returns its tags."""
    histories, status = metric_histories(tmp_path, name)  # asserts exactly one MLflow run of that name
    client = store(tmp_path)
    running = client.search_runs([e.experiment_id for e in client.search_experiments()], "attributes.status = "
                                 "'RUNNING'")
    assert status == "FINISHED" and not running, (status, [r.info.run_name for r in running])
    got, want = points(histories), reference
    assert got == want, {"missing": sorted(want - got)[:8], "extra": sorted(got - want)[:8]}
    tags = run_named(client, name).data.tags
    assert tags[END_TAG].startswith(f"FINISHED at step {STEPS}:"), tags[END_TAG]
    return tags


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """The uninterrupted run, trained once for the module."""
    folder = tmp_path_factory.mktemp("reference")
    train_like_the_cli(folder, "calm")
    return folder


@pytest.fixture(scope="module")
def reference(reference_dir) -> Counter:
    return points(metric_histories(reference_dir, "calm")[0])


@pytest.fixture(scope="module")
def cache(reference_dir) -> str:
    """The reference's data cache, shared (data.cache_dir may change on resume, and the data are the same)."""
    return f"data.cache_dir={reference_dir / 'cache'}"


class SigtermAt(L.Callback):
    """Sends this process SIGTERM once step ``step`` is trained, as a scheduler's pre-emption would: Lightning's
    handler lets the step finish (its validation and checkpoint too, at a checkpoint step), then stops."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def stop_with_sigterm(tmp_path: Path, name: str, step: int, *extra: str) -> None:
    with pytest.raises(SIGTERMException):
        train_like_the_cli(tmp_path, name, *extra, callbacks=[SigtermAt(step)])
    run = run_named(store(tmp_path), name)
    assert run.info.status == "KILLED" and run.data.tags[END_TAG].startswith(f"KILLED at step {step}: SIGTERM")


@pytest.mark.slow  # make test-full: the fast suite stops and resumes a run in test_resilience
@pytest.mark.parametrize("step", [20, 25], ids=["at-a-checkpoint-step", "between-checkpoints"])
def test_sigterm_then_the_same_command_gives_the_uninterrupted_history(tmp_path, reference, cache, step):
    """Step 20 has a validation and a checkpoint before the stop; the SIGTERM checkpoint (``last.ckpt``, preferred on
    the tie with ``step0000020.ckpt``) is then written after the step's loop iteration, which Lightning restores
    with its logging counter one ahead (:class:`satlab.training.resilience.AlignLoggingStep`)."""
    stop_with_sigterm(tmp_path, "preempted", step, cache)
    train_like_the_cli(tmp_path, "preempted", cache)
    tags = assert_one_finished_run_like(tmp_path, "preempted", reference)
    assert tags[END_HISTORY_TAG].splitlines()[0].startswith(f"KILLED at step {step}: SIGTERM")


@pytest.mark.slow  # make test-full: the fast suite stops and resumes a run in test_resilience
def test_a_run_moved_to_another_out_dir_continues_its_mlflow_run(tmp_path, reference, cache):
    """What the exit-74 message tells a user: the run folder moved to another disk (train.out_dir), the same
    command with that out_dir continues the same MLflow run, its run.json travelling with the folder."""
    stop_with_sigterm(tmp_path, "moved", 30, cache)
    elsewhere = tmp_path / "other-disk"
    elsewhere.mkdir()
    shutil.move(tmp_path / "runs" / "moved", elsewhere / "moved")
    train_like_the_cli(tmp_path, "moved", cache, f"train.out_dir={elsewhere}")
    tags = assert_one_finished_run_like(tmp_path, "moved", reference)
    assert tags["run_dir"] == str((elsewhere / "moved").resolve())


@pytest.mark.slow  # make test-full: the fast suite stops and resumes a run in test_resilience
def test_an_extended_budget_logs_every_step_once(tmp_path, reference, cache):
    """A finished run of HALF the steps, run again with train.max_tokens of the reference, against the reference.
    The cosine schedule (and its warmup) is stretched over the budget, so the learning rate of every step differs
    and every value after the first optimizer step does too: the comparison is of the points present, each
    (metric, step) exactly as often as in the reference (nothing missing at step HALF, nothing doubled at the end).
    The first run's end-of-run records at step HALF stay; a (metric, step) they hold is not recorded again by the
    continued run, whose training there records the same measurement (the resumable logger's rule), so they count
    as a union. The values that cannot depend on the budget must agree: everything before the first update (the
    initial validation, step 0's loss and gradient norm) and the tokens seen at every step."""
    train_like_the_cli(tmp_path, "grown", cache, f"train.max_tokens={HALF * 1024}")
    first, _ = metric_histories(tmp_path, "grown")
    train_like_the_cli(tmp_path, "grown", cache)
    histories, status = metric_histories(tmp_path, "grown")
    steps = Counter((key, step) for key, step, *_ in points(histories))
    want = Counter((key, step) for key, step, *_ in reference) | Counter(
        (key, step) for key, step, *_ in at_step(first, HALF))
    assert status == "FINISHED" and steps == want, {"missing": sorted(want - steps)[:8],
                                                    "extra": sorted(steps - want)[:8]}
    got = points(histories)
    same = [p for p in reference if len(p) == 3 and (p[1] == 0 and not p[0].endswith("/lr") or p[0] == "tokens_seen")]
    assert same and all(got[p] for p in same), [p for p in same if not got[p]][:8]


@pytest.mark.slow  # make test-full: the fast suite stops and resumes a run in test_resilience
def test_a_time_limited_run_continues_with_the_same_command(tmp_path, reference, cache):
    """train.max_time_minutes bounds one command's training: each attempt stops with its state saved (KILLED,
    exit code 75 from the CLI) and the same command goes on from there until the budget is reached."""
    stops = 0
    for _ in range(12):
        try:
            train_like_the_cli(tmp_path, "limited", cache, "train.max_time_minutes=0.03")
            break
        except TimeLimitReached:
            stops += 1
    assert stops >= 1
    tags = assert_one_finished_run_like(tmp_path, "limited", reference)
    assert tags[END_HISTORY_TAG].count("TimeLimitReached") == stops


@pytest.mark.slow  # make test-full: the fast suite stops and resumes a run in test_resilience
@pytest.mark.process
def test_kill_9_before_the_first_checkpoint_restarts_in_the_same_mlflow_run(tmp_path, reference, cache):
    """The first checkpoint is at the end (train.ckpt_every_tokens is the whole budget), so both kills land in a run
    folder with its run.json and no checkpoint: each restart redoes the run from step 0 in the MLflow run that
    run.json names, which already holds the points it redoes (and, the second time, more than the first kill's)."""
    late = [cache, f"train.ckpt_every_tokens={STEPS * 1024}"]
    folder = tmp_path / "runs" / "early"
    for logged in (5, 20):
        proc = start(tmp_path, "early", *late)
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "the run logged too little in time"
            if (folder / "run.json").exists():
                run_id = json.loads((folder / "run.json").read_text())["mlflow_run_id"]
                if len(store(tmp_path).get_metric_history(run_id, "train/loss")) >= logged:
                    break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not list((folder / "checkpoints").glob("*.ckpt")), "the kill came after a checkpoint"
    finish(start(tmp_path, "early", *late))
    assert_one_finished_run_like(tmp_path, "early", reference)


@pytest.mark.slow  # make test-full: the fast suite stops and resumes a run in test_resilience
@pytest.mark.process
def test_an_interrupted_ablation_cell_rerun_leaves_one_finished_child_run(tmp_path):
    """Ctrl-C to the driver while the first cell trains, then the same command: every cell has one child run,
    FINISHED, with no reason or end of the interrupted attempt left on it as its end."""
    path = write_micro_spec(tmp_path, "ctrlc")
    data = yaml.safe_load(path.read_text())
    data["axes"] = {"model.arch": ["transformer", "satformer"]}
    data["overrides"] |= {"train.max_tokens": 16384, "train.val_every_tokens": 4096}
    path.write_text(yaml.safe_dump(data))
    driver = subprocess.Popen([sys.executable, "-m", "satlab.cli.main", "ablate", str(path), "--no-report"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 240
    while not list((tmp_path / "runs").glob("ablations/*/*/run.json")):
        assert driver.poll() is None, driver.stderr.read()[-3000:]
        assert time.time() < deadline, "no cell opened its run in time"
        time.sleep(0.05)
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 75, err[-3000:]
    spec = load_ablation(path)
    result = run_study(spec, workers=1, report=False)
    assert not result.failed and not result.interrupted
    client = store(tmp_path)
    children = client.search_runs([client.get_run(result.parent_run_id).info.experiment_id],
                                  f"tags.`{PARENT_TAG}` = '{result.parent_run_id}'")
    cells = Counter(run.data.tags.get(CELL_TAG) for run in children)
    assert cells == Counter(c.key for c in spec.cells()), cells
    for run in children:
        assert run.info.status == "FINISHED", (run.data.tags.get(CELL_TAG), run.info.status)
        assert run.data.tags[END_TAG].startswith("FINISHED") and REASON_TAG not in run.data.tags, run.data.tags


def test_a_restart_before_the_first_checkpoint_is_refused_with_other_settings(tmp_path):
    """A run folder with no checkpoint yet still names its MLflow run: it is continued only by the same experiment
    (its config.yaml against the new config, as a checkpoint's config is), and train.out_dir may differ."""
    from satlab.config.display import to_yaml
    from satlab.config.errors import ConfigError
    from satlab.training.run import restart_step

    cfg = load_experiment("default", args_for(tmp_path, "early"))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    info = {"mlflow_run_id": "0" * 32}
    assert restart_step(tmp_path, None, info, cfg, None) == 0
    moved = load_experiment("default", args_for(tmp_path, "early", f"train.out_dir={tmp_path / 'elsewhere'}"))
    assert restart_step(tmp_path, None, info, moved, None) == 0
    assert restart_step(tmp_path, None, {}, cfg, None) is None
    other = load_experiment("default", args_for(tmp_path, "early", "model.n_layers=3"))
    with pytest.raises(ConfigError, match=r"no checkpoint yet.*model.n_layers: 2 -> 3"):
        restart_step(tmp_path, None, info, other, None)
