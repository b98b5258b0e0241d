"""What optuna-dashboard and satlab show of a sweep agree: the best trial (the dashboard's own server code, called as
a WSGI app, against satlab's summary and Optuna's ``study.best_trial``), infeasible trials, each trial's
architecture, intermediate values at tokens seen (and the pruner on that scale), and the study's results on its
MLflow parent run, logged once however often the report is rewritten. A study built in seconds: no training."""

from __future__ import annotations

import io
import json
import wsgiref.util
from pathlib import Path
from types import SimpleNamespace

import mlflow
import optuna
import pytest
import torch
import yaml
from lightning.pytorch.trainer.states import TrainerFn
from optuna.trial import TrialState
from optuna_dashboard import get_note, save_note, wsgi
from rich.console import Console

from satlab.studies.attrs import SATURATION
from satlab.studies.callbacks import TrialCallback
from satlab.studies.dashboard import dashboard_storage, write_note
from satlab.studies.engine import open_study
from satlab.studies.loader import load_sweep
from satlab.studies.plans import SearchPlan, make_pruner
from satlab.studies.spec import SaturationGuard
from satlab.studies.storage import open_storage
from satlab.studies.sweep_report import best_trials, write_report

VAL = 49_152  # lr_tiny's train.val_every_tokens
# (arch, lr, val/loss, saturated fraction, state): trial 0 has the lowest loss but 90 % of its gates saturated, above
# lr_tiny's threshold of 50 %: infeasible. The best trial is 1.
TRIALS = [("satformer", 1e-3, 3.313, 0.9, TrialState.COMPLETE), ("transformer", 3e-3, 3.40, None, TrialState.COMPLETE),
          ("satformer", 3e-4, 3.45, 0.1, TrialState.COMPLETE), ("transformer", 0.2, 5.0, None, TrialState.PRUNED)]


def run_trial(study: optuna.Study, plan: SearchPlan, params: dict, value: float, saturation: float | None,
              state: TrialState = TrialState.COMPLETE) -> optuna.trial.FrozenTrial:
    """One trial through the driver's calls (suggest, the child's reports at tokens seen, record_constraint), without
    training: the values are given."""
    study.enqueue_trial(params)
    trial = study.ask()
    plan.suggest(trial)
    if saturation is not None:
        trial.set_user_attr(SATURATION, saturation)
    for tokens in (VAL, 2 * VAL)[: 1 if state == TrialState.PRUNED else 2]:
        trial.report(value + 0.5 * (tokens == VAL), tokens)
    plan.record_constraint(trial, saturation)
    return study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)


def make_study(folder: Path, spec_file: str | Path = "lr_tiny", trials=TRIALS) -> tuple[optuna.Study, SearchPlan, str]:
    spec = load_sweep(spec_file, [f"out_dir={folder}", "saturation.action=prune"])  # infeasible trials to show
    plan = SearchPlan(spec, spec.base_config().model.arch, len(trials))
    url = f"sqlite:///{folder / 'optuna.db'}"
    study, _ = open_study(spec, plan, open_storage(url))
    for arch, lr, value, saturation, state in trials:
        params = {"optim.lr": lr} if "model.arch" not in spec.space else {"model.arch": arch, "optim.lr": lr}
        run_trial(study, plan, params, value, saturation, state)
    return study, plan, url


def api(app, path: str) -> dict:
    """GET ``path`` from a WSGI app, as the dashboard's frontend does."""
    environ: dict = {}
    wsgiref.util.setup_testing_defaults(environ)
    environ.update(PATH_INFO=path, REQUEST_METHOD="GET")
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
    assert status[0].startswith("200"), body
    return json.loads(body)


def study_detail(storage, study: optuna.Study) -> dict:
    """The study's page, found by its name in the dashboard's list of studies (as its frontend does)."""
    app = wsgi(storage)
    (study_id,) = [s["study_id"] for s in api(app, "/api/studies")["study_summaries"]
                   if s["study_name"] == study.study_name]
    return api(app, f"/api/studies/{study_id}")


@pytest.fixture
def study(tmp_path):
    return make_study(tmp_path)


def test_the_dashboard_the_summary_and_optuna_agree_on_the_best_trial(study, tmp_path):
    study, plan, url = study
    detail = study_detail(dashboard_storage(url), study)
    assert [t["number"] for t in detail["best_trials"]] == [1]
    assert best_trials(study, plan.spec, plan.base_arch)[""].number == study.best_trial.number == 1
    console = Console(file=io.StringIO(), width=200)
    write_report(study, plan.spec, plan.base_arch, console=console)
    out = console.file.getvalue()
    assert "best: trial 1, val/loss 3.4000" in out
    assert "trial 0 (satformer) has a better val/loss, 3.3130, but is infeasible: 90% of gates saturated > 50%" in out
    assert "best satformer: trial 2" in out


def test_satlab_sweep_dashboard_serves_that_storage(study, monkeypatch):
    import optuna_dashboard

    from satlab.cli.sweep import serve_dashboard

    study, plan, url = study
    served = []
    monkeypatch.setattr(optuna_dashboard, "run_server", lambda storage, host, port: served.append(storage))
    assert serve_dashboard(url, "127.0.0.1", 8080) == 0
    assert [t["number"] for t in study_detail(served[0], study)["best_trials"]] == [1]


@pytest.mark.parametrize("served_with", [[], ["saturation.constraint=false"], ["pruner.warmup_tokens=98304"]])
def test_serving_the_dashboard_leaves_the_note_the_sweep_wrote(study, monkeypatch, served_with):
    """The sweep ran with a constraint (an override); serving it by name, with or without other overrides, must not
    rewrite its note from the serving command line (it said "no constraint" beside trials marked infeasible)."""
    import optuna_dashboard

    from satlab.cli.main import main

    study, plan, url = study
    note = get_note(study)
    assert "breaks the" in note and "no constraint" not in note
    monkeypatch.setattr(optuna_dashboard, "run_server", lambda storage, host, port: None)
    assert main(["sweep", "lr_tiny", "--dashboard", "--storage", url, *served_with]) == 0
    assert get_note(optuna.load_study(study_name=study.study_name, storage=url)) == note


def test_a_plain_optuna_dashboard_marks_the_best_value_infeasible_or_not(study):
    """Why ``satlab sweep --dashboard`` serves its own storage: the dashboard's best trial is the storage's, which
    ignores constraints. Should a later optuna-dashboard agree by itself, this fails: FeasibleBestStorage can go."""
    study, _, url = study
    assert [t["number"] for t in study_detail(url, study)["best_trials"]] == [0]


def test_the_dashboard_marks_infeasible_trials_and_shows_each_architecture(study):
    study, _, url = study
    detail = study_detail(dashboard_storage(url), study)
    trials = {t["number"]: t for t in detail["trials"]}
    # the frontend's test for infeasible: some constraint > 0 (``constraints.every(c => c <= 0)`` fails)
    assert [any(c > 0 for c in trials[n]["constraints"]) for n in range(4)] == [True, False, False, False]
    attrs = {n: {a["key"]: a["value"] for a in t["user_attrs"]} for n, t in trials.items()}
    assert [attrs[n]["arch"] for n in range(4)] == ["satformer", "transformer", "satformer", "transformer"]
    assert attrs[0]["feasible"] == "False" and attrs[1]["feasible"] == "True"
    assert {"arch", "feasible"} <= {a["key"] for a in detail["union_user_attrs"]}  # the trial table's columns
    assert all(study.trials[n].constraints for n in range(4))  # and Optuna's own record (TPE, study.best_trial)


def test_a_fixed_architecture_is_shown_too(tmp_path):
    data = yaml.safe_load(Path("sweeps/lr_tiny.yaml").read_text())
    del data["space"]["model.arch"]
    data["overrides"]["model.arch"] = "satformer"
    (tmp_path / "fixed.yaml").write_text(yaml.safe_dump(data))
    study, plan, url = make_study(tmp_path, tmp_path / "fixed.yaml", trials=TRIALS[1:3])
    detail = study_detail(dashboard_storage(url), study)
    assert all(p["name"] != "model.arch" for t in detail["trials"] for p in t["params"])
    assert [{a["key"]: a["value"] for a in t["user_attrs"]}["arch"] for t in detail["trials"]] == ["satformer"] * 2


def test_intermediate_values_are_at_tokens_seen_and_the_note_says_so(study):
    study, _, url = study
    detail = study_detail(dashboard_storage(url), study)
    assert [v["step"] for v in detail["trials"][1]["intermediate_values"]] == [VAL, 2 * VAL]
    assert "Step is the number of training tokens seen" in detail["note"]["body"]
    assert "best feasible trial" in detail["note"]["body"] and detail["objective_names"] == ["val/loss"]


def test_a_note_someone_edited_is_kept(study):
    study, plan, _ = study
    assert not write_note(study, plan.spec)  # up to date
    changed = load_sweep("lr_tiny", ["pruner.warmup_tokens=98304"])
    assert write_note(study, changed) and "98,304 tokens" in get_note(study)  # satlab's own note follows the spec
    save_note(study, "lr 3e-3 looks best; rerun with 3 seeds")
    assert not write_note(study, plan.spec) and get_note(study) == "lr 3e-3 looks best; rerun with 3 seeds"


def test_the_trial_callback_reports_at_tokens_seen_not_steps(tmp_path):
    study = optuna.create_study()
    trial = study.ask()
    callback = TrialCallback(trial, SaturationGuard(threshold=None), SimpleNamespace(last_gate_scalars={}))
    trainer = SimpleNamespace(callback_metrics={}, state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False,
                              is_global_zero=True, strategy=SimpleNamespace(broadcast=lambda obj, src: obj))
    for step, loss in ((24, 4.0), (48, 3.5)):
        trainer.callback_metrics = {"val/loss": torch.tensor(loss)}
        callback.on_validation_end(trainer, SimpleNamespace(tokens_seen=step * 2048, global_step=step))
    assert study.trials[0].intermediate_values == {VAL: 4.0, 2 * VAL: 3.5}


def test_the_median_pruner_works_on_token_steps():
    """lr_tiny's pruner: median of the same architecture's trials at the same token count, from warmup_tokens on,
    after n_startup_trials (2) trials."""
    spec = load_sweep("lr_tiny")
    study = optuna.create_study(pruner=make_pruner(spec))
    plan = SearchPlan(spec, "transformer", 0)

    def lagging(arch: str, tokens: int, value: float) -> bool:
        study.enqueue_trial({"model.arch": arch, "optim.lr": 1e-3})
        trial = study.ask()
        plan.suggest(trial)
        trial.report(value, tokens)
        pruned = trial.should_prune()
        study.tell(trial, state=TrialState.PRUNED)
        return pruned

    for _ in range(2):
        study.enqueue_trial({"model.arch": "transformer", "optim.lr": 3e-3})
        trial = study.ask()
        plan.suggest(trial)
        for tokens in (VAL // 2, VAL, 2 * VAL):
            trial.report(3.0, tokens)
        study.tell(trial, 3.0)
    assert spec.pruner.warmup_tokens == VAL
    assert lagging("transformer", VAL, 5.0)  # worse than the median at 49,152 tokens
    assert not lagging("transformer", VAL // 2, 5.0)  # before the warm-up
    assert not lagging("transformer", VAL, 2.0)  # better than the median
    assert not lagging("satformer", VAL, 5.0)  # no satformer trials to compare with


def parent_run(folder: Path) -> tuple[mlflow.MlflowClient, str]:
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.create_experiment("sweeps", artifact_location=str(folder / "artifacts"))
    return client, client.create_run(experiment).info.run_id


def test_the_parent_run_carries_each_architectures_results_once(study, tmp_path):
    study, plan, _ = study
    client, run_id = parent_run(tmp_path)
    quiet = Console(file=io.StringIO())
    for _ in range(2):  # a re-run of the command rewrites the report: no second point
        write_report(study, plan.spec, plan.base_arch, client, run_id, quiet)
    run = client.get_run(run_id)
    assert run.data.metrics == pytest.approx({
        "variants/transformer/best_val_loss": 3.40, "variants/transformer/best_lr": 3e-3,
        "variants/transformer/n_complete": 1, "variants/transformer/n_pruned": 1, "variants/transformer/n_failed": 0,
        "variants/transformer/n_infeasible": 0,
        "variants/satformer/best_val_loss": 3.45, "variants/satformer/best_lr": 3e-4,
        "variants/satformer/n_complete": 2, "variants/satformer/n_pruned": 0, "variants/satformer/n_failed": 0,
        "variants/satformer/n_infeasible": 1})
    assert sorted([*run.data.metrics, "train/loss", "val/loss"])[:2] == ["train/loss", "val/loss"]  # charts' order
    tags = run.data.tags
    assert (tags["sweep.best_trial"], tags["sweep.best_arch"]) == ("1", "transformer")
    assert (tags["variants/satformer/best_trial"], tags["variants/satformer/best/optim.lr"]) == ("2", "0.0003")
    assert tags["variants/satformer/best_feasible"] == "true"
    assert all(len(client.get_metric_history(run_id, key)) == 1 for key in run.data.metrics)
    assert {p.step for p in client.get_metric_history(run_id, "variants/satformer/n_complete")} == {4}

    run_trial(study, plan, {"model.arch": "satformer", "optim.lr": 5e-4}, 3.35, 0.2)
    write_report(study, plan.spec, plan.base_arch, client, run_id, quiet)
    history = client.get_metric_history(run_id, "variants/satformer/best_val_loss")
    assert [(p.step, p.value) for p in history] == [(4, 3.45), (5, 3.35)]  # the study's progress, one point a run
    assert len(client.get_metric_history(run_id, "variants/transformer/n_complete")) == 2


def test_the_report_says_when_no_trial_is_feasible(tmp_path):
    study, plan, _ = make_study(tmp_path, trials=[TRIALS[0]])
    console = Console(file=io.StringIO(), width=200)
    best = write_report(study, plan.spec, plan.base_arch, console=console)
    assert "best.yaml" in best and yaml.safe_load((tmp_path / "report" / "best.yaml").read_text())
    assert "best: trial 0, val/loss 3.3130 (optim.lr=0.001) — infeasible: 90% of gates saturated > 50%; no completed " \
           "trial is feasible" in console.file.getvalue()
    detail = study_detail(dashboard_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), study)
    assert [t["number"] for t in detail["best_trials"]] == [0]  # the same stand-in; Optuna's best_trial raises
    with pytest.raises(ValueError, match="No feasible trials"):
        _ = study.best_trial


@pytest.mark.parametrize("action", ["prune", "observe"])
def test_trial_runs_carry_their_feasibility_and_the_sweep_view_puts_a_feasible_trial_on_top(tmp_path, action):
    """Each finished or pruned trial's run is tagged ``feasible``; with a constraint the sweep's view shows the
    feasible trials only, so that its order by val/loss (MLflow sorts by one key) starts at the best trial, not at
    trial 0, which has the lowest loss but saturated gates. An observing guard records no constraint: every trial is
    feasible and shown."""
    from satlab.studies.engine import publish_study_view
    from satlab.studies.runs import FEASIBLE_TAG, TRIAL_TAG, close_trial_run
    from satlab.training.views import SHARE_TAG

    spec = load_sweep("lr_tiny", [f"out_dir={tmp_path}", f"saturation.action={action}"])
    plan = SearchPlan(spec, spec.base_config().model.arch, len(TRIALS))
    study, _ = open_study(spec, plan, open_storage(f"sqlite:///{tmp_path / 'optuna.db'}"))
    client, parent = parent_run(tmp_path)
    for arch, lr, value, saturation, state in TRIALS:
        trial = run_trial(study, plan, {"model.arch": arch, "optim.lr": lr}, value, saturation, state)
        run_id = close_trial_run(client, parent, spec.name, trial, None, None, None)
        client.log_metric(run_id, "val/loss", value, step=1)
    experiment = client.get_run(parent).info.experiment_id
    trial_runs = client.search_runs([experiment], f"tags.`optuna.study` = '{spec.name}'")
    tags = [run.data.tags.get(FEASIBLE_TAG) for run in sorted(trial_runs, key=lambda r: r.data.tags[TRIAL_TAG])]
    assert tags == (["false", "true", "true", "true"] if action == "prune" else ["true"] * 4)
    publish_study_view(client, spec, parent, client.tracking_uri)
    state = json.loads(client.get_experiment(experiment).tags[f"{SHARE_TAG}satlab-study-{parent}"])
    assert "tags.`feasible`" in state["selectedColumns"]
    shown = client.search_runs([experiment], state["searchFilter"], order_by=[f"{state['orderByKey']} ASC"])
    numbers = [int(run.data.tags[TRIAL_TAG]) for run in shown]
    assert numbers[0] == (1 if action == "prune" else 0) and len(numbers) == (3 if action == "prune" else 4)
