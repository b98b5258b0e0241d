"""Sweeps: spec validation, and real `satlab sweep` runs of a very small model in a temporary folder (own sqlite
storage and MLflow store): trials complete, prune on gate saturation, fail with a reason when killed, resume, run
two at a time without duplicates, and survive a killed worker through heartbeats."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import optuna
import pytest
import yaml

from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.studies.attrs import LOG, PID, REASON
from satlab.studies.loader import load_sweep
from satlab.studies.storage import open_storage
from satlab.studies.workers import TrialRunner, trial_command
from satlab.training.launch import ProcessGroup, worker_env

MICRO = {
    "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.mlp_hidden": 64,
    "data.source": "kjv", "data.tokenizer.kind": "byte", "data.seq_len": 64,
    "train.micro_batch_size": 8, "train.global_batch_tokens": 512, "train.max_tokens": 10240,
    "train.val_every_tokens": 2560, "train.val_tokens": 1024, "train.ckpt_every_tokens": 10_000_000,
    "model.satformer.gate_bias": -10.0,  # relu(W h - 10) = 0: every gate pinned at 0, i.e. saturated
}
TERMINAL = {"COMPLETE", "PRUNED", "FAIL"}


def write_spec(folder: Path, name: str = "micro", fixed: dict | None = None, **sections) -> Path:
    spec = {
        "name": name, "base": "default",
        "overrides": {**MICRO, **(fixed or {}), "data.cache_dir": str(folder / "cache"),
                      "tracking.uri": f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}"},
        "space": {"model.arch": {"choices": ["transformer", "satformer"]},
                  "optim.lr": {"low": 1e-4, "high": 10, "log": True}},
        "n_trials": 3, "pruner": {"name": "none"}, "saturation": {"threshold": 0.0, "patience": 1, "action": "prune"},
        "out_dir": str(folder / "study"), **sections,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_sweep(spec: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "satlab.cli.main", "sweep", str(spec), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def study_of(folder: Path, name: str = "micro") -> optuna.Study:
    url = f"sqlite:///{folder / 'study' / 'optuna.db'}"
    return optuna.load_study(study_name=name, storage=open_storage(url, create_tables=False))


def outcome(trial: optuna.trial.FrozenTrial) -> str:
    """A trial's state, reason and the end of its log: what an assertion on a sweep shows when it fails."""
    log = Path(trial.user_attrs.get(LOG) or "")
    tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no log)"
    return f"trial {trial.number} {trial.state.name}, reason {trial.user_attrs.get(REASON)!r}, log:\n{tail}"


def wait_for_running(folder: Path, accept, timeout: float = 120) -> optuna.trial.FrozenTrial:
    """The first RUNNING trial that ``accept`` takes and whose process recorded its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (folder / "study" / "optuna.db").exists():
            try:
                for trial in study_of(folder).get_trials(states=(optuna.trial.TrialState.RUNNING,)):
                    if trial.user_attrs.get(PID) and accept(trial):
                        return trial
            except (KeyError, ConfigError):  # the driver has not created the tables or the study yet
                pass
        time.sleep(0.5)
    raise AssertionError("no running trial appeared")


def children(folder: Path, parent_run_id: str):
    mlflow.set_tracking_uri(f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}")
    return mlflow.search_runs(search_all_experiments=True,
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")


def test_shipped_specs_load_and_validate():
    tiny, paper = load_sweep("lr_tiny"), load_sweep("lr_paper_small")
    assert set(tiny.space["model.arch"].choices) == {"transformer", "satformer"} and tiny.space["optim.lr"].log
    assert paper.base_config().model.d_model == 768 and paper.base_config().train.precision == "bf16-mixed"
    assert load_sweep("lr_tiny", ["n_trials=2", "space.optim.lr.high=1e-2"]).space["optim.lr"].high == 1e-2


@pytest.mark.parametrize(("overrides", "message"), [
    (["space=null"], "search space is empty"),
    (["space.optim.lrr.low=1e-3", "space.optim.lrr.high=1e-2"], "did you mean 'optim.lr'"),
    (["n_trails=3"], "did you mean 'n_trials'"),
    (["space.optim.lr.hihg=1"], "did you mean 'high'"),
    (["sampler.name=tpee"], "unknown sampler 'tpee' (did you mean 'tpe'?)"),
    (["pruner.name=asha"], "unknown pruner 'asha'"),
    (["space.optim.lr.low=0.1", "space.optim.lr.high=0.01"], "low must be < high"),
    (["space.optim.lr.low=0"], "a log range needs low > 0"),
    (["space.model.arch.choices=[transformer, satfromer]"], "did you mean 'satformer'"),
    (["space.optim.warmup_fraction.low=0.1", "space.optim.warmup_fraction.high=1.5"], "warmup_fraction must be"),
])
def test_spec_errors_name_the_problem(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_sweep("lr_tiny", overrides)
    assert message in str(error.value)


@pytest.mark.process
def test_the_cli_reports_spec_errors_with_exit_code_2():
    proc = subprocess.run([sys.executable, "-m", "satlab.cli.main", "sweep", "lr_tiny", "sampler.name=tpee"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "did you mean 'tpe'" in proc.stderr


@pytest.mark.process
def test_multi_gpu_trials_go_through_torchrun_and_get_their_own_gpus():
    cfg = load_experiment("default", ["train.accelerator=gpu", "train.devices=2", "train.micro_batch_size=16"]).train
    assert trial_command(Path("t.yaml"), 2, "gpu")[1:6] == ["-m", "torch.distributed.run", "--standalone",
                                                            "--nproc-per-node=2", "-m"]
    assert trial_command(Path("t.yaml"), 1, "gpu")[1:] == ["-m", "satlab.studies.child", "experiment=t.yaml"]
    env = worker_env(1, 2, 4, cfg, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["OMP_NUM_THREADS"] == "4"


@pytest.fixture(scope="module")
def micro_sweep(tmp_path_factory):
    """Three trials on two workers: a transformer that completes, a SATFormer whose gates are all 0 (pruned by the
    saturation guard with threshold 0), and a transformer whose process the test kills with SIGKILL."""
    folder = tmp_path_factory.mktemp("sweep")
    spec = write_spec(folder, enqueue=[{"model.arch": "transformer", "optim.lr": 3e-3},
                                       {"model.arch": "satformer", "optim.lr": 1e-3},
                                       {"model.arch": "transformer", "optim.lr": 1e-2}])
    proc = start_sweep(spec, "--workers", "2")
    try:
        victim = wait_for_running(folder, lambda t: t.params.get("optim.lr") == 1e-2)
        os.kill(victim.user_attrs[PID], signal.SIGKILL)
        out = finish(proc)
    finally:
        proc.kill()
    return folder, spec, out


@pytest.mark.process
def test_micro_sweep_records_complete_pruned_and_killed_trials(micro_sweep):
    folder, _, out = micro_sweep
    trials = {t.params["optim.lr"]: t for t in study_of(folder).trials}
    assert trials[3e-3].state.name == "COMPLETE" and trials[3e-3].value > 0, outcome(trials[3e-3])
    assert trials[1e-3].state.name == "PRUNED" and trials[1e-3].user_attrs[REASON] == "gate_saturation", \
        outcome(trials[1e-3])
    assert trials[1e-2].state.name == "FAIL" and trials[1e-2].user_attrs[REASON] == "killed by SIGKILL", \
        outcome(trials[1e-2])
    assert "best transformer" in out


@pytest.mark.process
def test_micro_sweep_has_a_parent_run_with_one_child_per_trial(micro_sweep):
    folder, _, _ = micro_sweep
    parent_id = study_of(folder).user_attrs["mlflow_parent_run_id"]
    runs = children(folder, parent_id)
    assert sorted(runs["tags.optuna.trial_number"].astype(int)) == [0, 1, 2]
    by_state = dict(zip(runs["tags.optuna.state"], runs["status"], strict=True))
    assert by_state == {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
    pruned = runs[runs["tags.optuna.state"] == "PRUNED"].iloc[0]
    assert pruned["tags.sweep.reason"] == "gate_saturation" and pruned["metrics.val/gates/saturated_frac"] == 1.0
    parent = mlflow.MlflowClient().get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["git_revision"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent_id, "report")}
    assert {"report/trials.csv", "report/trials.md", "report/best.yaml", "report/lr_vs_loss.png",
            "report/optimization_history.png"} <= artifacts


@pytest.mark.process
def test_the_best_config_is_a_ready_to_run_experiment(micro_sweep):
    folder, _, _ = micro_sweep
    cfg = load_experiment(folder / "study" / "report" / "best.yaml")
    assert cfg.model.arch == "transformer" and cfg.optim.lr == pytest.approx(3e-3) and cfg.model.d_model == 32


@pytest.mark.process
def test_micro_sweep_trials_name_their_architecture_and_report_at_tokens_seen(micro_sweep):
    folder, _, _ = micro_sweep
    trials = {t.params["optim.lr"]: t for t in study_of(folder).trials}
    assert all(t.user_attrs["arch"] == t.params["model.arch"] for t in trials.values())
    every = MICRO["train.val_every_tokens"]
    assert sorted(trials[3e-3].intermediate_values) == [every, 2 * every, 3 * every, 4 * every], outcome(trials[3e-3])
    assert list(trials[1e-3].intermediate_values) == [every]  # pruned at its first validation
    assert trials[1e-3].constraints["gate_saturation"] == 1.0 and trials[1e-3].user_attrs["feasible"] is False


@pytest.mark.slow  # make test-full: it runs the sweep again
@pytest.mark.process
def test_micro_sweep_parent_run_carries_the_results_once_per_rerun(micro_sweep):
    folder, spec, _ = micro_sweep
    study = study_of(folder)
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}")
    parent_id = study.user_attrs["mlflow_parent_run_id"]
    finish(start_sweep(spec, "--n-trials", "0"))  # rewrites the report: the same points again, not new ones
    run = client.get_run(parent_id)
    complete = next(t for t in study.trials if t.state.name == "COMPLETE")
    assert run.data.metrics["variants/transformer/best_val_loss"] == pytest.approx(complete.value)
    assert run.data.metrics["variants/transformer/best_lr"] == pytest.approx(3e-3)
    counts = {k.split("/", 1)[1]: v for k, v in run.data.metrics.items() if "/n_" in k}
    assert counts == {"transformer/n_complete": 1, "transformer/n_pruned": 0, "transformer/n_failed": 1,
                      "transformer/n_infeasible": 0, "satformer/n_complete": 0, "satformer/n_pruned": 1,
                      "satformer/n_failed": 0, "satformer/n_infeasible": 0}
    assert run.data.tags["sweep.best_trial"] == str(complete.number) == run.data.tags["variants/transformer/best_trial"]
    assert not any(k.startswith("best") for k in run.data.metrics)
    for key in run.data.metrics:
        assert [p.step for p in client.get_metric_history(parent_id, key)] == [3], key


@pytest.mark.slow
@pytest.mark.process
def test_rerunning_the_command_resumes_the_study_and_its_parent_run(micro_sweep):
    folder, spec, _ = micro_sweep
    parent_before = study_of(folder).user_attrs["mlflow_parent_run_id"]
    finish(start_sweep(spec, "n_trials=1"))
    study = study_of(folder)
    assert len(study.trials) == 4 and study.user_attrs["mlflow_parent_run_id"] == parent_before
    assert len(children(folder, parent_before)) == 4


@pytest.mark.slow
@pytest.mark.process
def test_two_workers_share_a_study_without_duplicated_or_lost_trials(tmp_path):
    spec = write_spec(tmp_path, fixed={"model.arch": "transformer"}, n_trials=4,
                      space={"optim.lr": {"low": 1e-3, "high": 1e-2, "log": True}})
    finish(start_sweep(spec, "--workers", "2"))
    trials = study_of(tmp_path).trials
    assert [t.number for t in trials] == [0, 1, 2, 3] and {t.state.name for t in trials} <= TERMINAL
    assert all(t.state.name == "COMPLETE" or t.user_attrs.get(REASON) for t in trials)
    runs = children(tmp_path, study_of(tmp_path).user_attrs["mlflow_parent_run_id"])
    assert sorted(runs["tags.optuna.trial_number"].astype(int)) == [0, 1, 2, 3]
    first, second = sorted(trials, key=lambda t: t.datetime_start)[:2]
    assert second.datetime_start < first.datetime_complete  # they ran side by side


@pytest.mark.slow
@pytest.mark.process
def test_a_killed_worker_is_restarted_and_every_trial_ends_with_a_reason(tmp_path):
    spec = write_spec(tmp_path, fixed={"model.arch": "transformer"}, n_trials=2,
                      trial={"heartbeat_seconds": 1, "grace_seconds": 3},
                      space={"optim.lr": {"low": 1e-3, "high": 1e-2, "log": True}})
    worker = start_sweep(spec)
    try:
        wait_for_running(tmp_path, lambda t: True)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        worker.kill()
    time.sleep(5)  # past the grace period: the restarted worker fails the stale trial and retries it
    finish(start_sweep(spec))
    trials = study_of(tmp_path).trials
    assert {t.state.name for t in trials} <= TERMINAL
    lost = [t for t in trials if t.state.name == "FAIL"]
    assert [t.user_attrs.get(REASON) for t in lost] == ["worker_lost"]
    retry = [t for t in trials if t.user_attrs.get("retry_of") == lost[0].number]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE" and retry[0].params == lost[0].params
    statuses = set(children(tmp_path, study_of(tmp_path).user_attrs["mlflow_parent_run_id"])["status"])
    assert "RUNNING" not in statuses


@pytest.mark.slow
@pytest.mark.process
def test_a_huge_learning_rate_is_pruned_for_nan(tmp_path):
    # the largest learning rate and weight decay the config accepts: AdamW's decay multiplies the weights by
    # 1 - lr * wd = -99 a step, and they overflow within a few steps
    spec = write_spec(tmp_path, n_trials=1, space={"optim.lr": {"low": 1e-4, "high": 10, "log": True}},
                      enqueue=[{"optim.lr": 10.0}], fixed={"model.arch": "transformer", "optim.weight_decay": 10})
    finish(start_sweep(spec))
    (trial,) = study_of(tmp_path).trials
    assert trial.state.name == "PRUNED" and trial.user_attrs[REASON] == "nan"


def test_a_changed_spec_does_not_join_a_study_of_another_space(tmp_path):
    """More trials or another pruner join the study; another search space would mix trials that do not compare."""
    from satlab.studies.engine import open_study
    from satlab.studies.plans import SearchPlan

    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    spec = load_sweep("lr_tiny")
    assert open_study(spec, SearchPlan(spec, "transformer", 1), storage)[1] is True
    more = load_sweep("lr_tiny", ["n_trials=40", "pruner.name=none"])
    assert open_study(more, SearchPlan(more, "transformer", 1), storage)[1] is False
    narrower = load_sweep("lr_tiny", ["space.optim.lr.high=1e-2"])
    with pytest.raises(ConfigError, match="another base, overrides, objective or search space"):
        open_study(narrower, SearchPlan(narrower, "transformer", 1), storage)


def test_a_process_group_stopped_before_a_run_starts_it_not(tmp_path: Path) -> None:
    """The race an interrupted ablation met: a worker thread asked for a trial just after SIGTERM stopped the group.
    That run must not start (it would run to its end with nobody to stop it); it returns as if stopped."""
    group = ProcessGroup()
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    assert group.run(command, dict(os.environ), tmp_path / "first.log", None) == (0, False) and marker.exists()
    marker.unlink()
    group.terminate()
    assert group.run(command, dict(os.environ), tmp_path / "late.log", None) == (-signal.SIGTERM, False)
    assert not marker.exists() and "not started" in (tmp_path / "late.log").read_text()


def test_a_second_signal_during_the_stop_is_ignored_not_raised_inside_it() -> None:
    """Stopping lr_transfer by SIGTERM to its process group: make passed a second SIGTERM on while the driver waited
    for its trials to stop, and the handler's KeyboardInterrupt broke that wait with a traceback."""
    runner = object.__new__(TrialRunner)  # only what the handler touches
    runner.stopping, runner.procs = threading.Event(), ProcessGroup()
    with pytest.raises(KeyboardInterrupt):
        runner.interrupt(signal.SIGTERM, None)
    assert runner.stopping.is_set()
    try:
        runner.interrupt(signal.SIGTERM, None)  # the second: no exception
    except KeyboardInterrupt:
        pytest.fail("a second signal raised KeyboardInterrupt inside the stop under way")
