"""A training run evaluates itself: gate statistics at every validation, and at the end the offline suite, the gate
heatmap and the mixing plots, all in the run's own MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from satlab.config.loader import load_experiment
from satlab.evaluation.callback import EvaluationCallback
from satlab.training.run import train


def artifact_paths(client, run_id, path=None) -> list[str]:
    found = []
    for item in client.list_artifacts(run_id, path):
        found += artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return found


def test_a_run_logs_suite_results_gate_statistics_and_heatmaps(tmp_path):
    cfg = load_experiment("default", [
        "model.d_model=32", "model.n_layers=3", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
        "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_tokens=256",
        "train.max_tokens=2048", "train.val_every_tokens=1024", "train.val_tokens=256", "eval.limit=4",
        "eval.tasks=[satlab_cloze_choice,satlab_mqar]", "name=evaluated", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.out_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ])
    evaluation = EvaluationCallback(cfg)
    result = train(cfg, progress=False, callbacks=[evaluation])
    client = mlflow.MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    local = client.download_artifacts(run.info.run_id, "eval/step_8/results.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    values = {(row[0], row[1]): row[2] for row in table["data"]}
    assert 0.0 <= values[("satlab_cloze_choice", "acc")] <= 1.0 and 0.0 <= values[("satlab_mqar", "acc")] <= 1.0
    assert not [k for k in run.data.metrics if k.count("/") > 1 and k.startswith("zero_shot/")]  # no per-task series
    assert not [k for k in run.data.metrics if k.startswith("val/gates/by_")]
    sparsity_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/gates/sparsity")]
    assert len(sparsity_steps) >= 2  # every validation during fit, and the end
    artifacts = artifact_paths(client, run.info.run_id)
    assert "gates/step_8/heatmap.png" in artifacts and "gates/step_8/gates.json" in artifacts
    assert round(evaluation.last_results["zero_shot/satlab_mqar/acc"], 4) == values[("satlab_mqar", "acc")]
    averages = [k for k in evaluation.last_results if k.startswith("zero_shot/") and k.count("/") == 1]
    assert all(run.data.metrics[k] == pytest.approx(evaluation.last_results[k]) for k in averages)  # suite averages
    assert all(round(v, 4) == v for v in values.values())
    local = client.download_artifacts(run.info.run_id, "eval/step_8/seconds.json", str(tmp_path))
    seconds = {(row[0], row[1]): row[2] for row in json.loads(Path(local).read_text())["data"]}
    assert seconds[("satlab_mqar", "seconds")] > 0 and not any("seconds" in k[1] for k in values)  # apart
    assert 0 < result.eval_seconds == pytest.approx(run.data.metrics["system/eval_wall_seconds"])
    assert result.eval_seconds < result.fit_seconds
    assert "gates/layer_means.png" in artifacts and len(evaluation.layer_history) >= 2
    assert evaluation.state_dict()["layer_history"] == evaluation.layer_history  # into checkpoints, for a resume
    assert {"gates/saturation.png", "gates/saturation_history.json"} <= set(artifacts)
    assert len(evaluation.saturation_history) == len(evaluation.layer_history)  # one entry per analysis
    assert evaluation.state_dict()["saturation_history"] == evaluation.saturation_history


def test_a_run_page_leads_with_what_matters(tmp_path):
    """What a researcher sees on a run's page and in the comparison: the architecture's own options only, readable
    values, no constant or Lightning-internal series, the run in its architecture's colour, and the experiment's
    comparison view (loss curves first) with its URL in the result."""
    from satlab.models import ARCHITECTURES
    from satlab.training.views import COLOUR_TAG, FAMILY_VIEW, SHARE_TAG, arch_colour

    cfg = load_experiment("default", [
        "model.arch=resformer", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64",
        "data.source=kjv", "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4",
        "train.global_batch_tokens=256", "train.max_tokens=1024", "train.val_every_tokens=512",
        "train.val_tokens=256", "train.log_every_n_steps=1", "eval.at_end=false", "name=page",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'runs'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ])
    result = train(cfg, progress=False)
    client = mlflow.MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    params, metrics = run.data.params, run.data.metrics
    options = {k.split(".")[1] for k in params if k.count(".") == 2 and k.split(".")[1] in ARCHITECTURES}
    assert options == {"resformer"}, options
    assert not any(v.startswith("{") for v in params.values()) and params["data.source"].startswith("embedded")
    assert {"epoch", "train/skipped_steps", "system/peak_tflops_used_for_mfu",
            "system/tokens_per_sec_per_device"}.isdisjoint(metrics)
    assert len(client.get_metric_history(run.info.run_id, "val/loss")) >= 2
    assert run.data.tags[COLOUR_TAG] == arch_colour("resformer") != arch_colour("transformer")
    experiment = client.get_experiment(run.info.experiment_id)
    state = json.loads(experiment.tags[SHARE_TAG + FAMILY_VIEW])
    first = [c["metricKey"] for c in state["compareRunCharts"] if c["metricSectionId"] == "satlab-curves"]
    assert first == ["val/loss", "train/loss"] and state["compareRunSections"][0]["uuid"] == "satlab-curves"
    assert "tags.`arch`" in state["selectedColumns"] and "metrics.`val/loss`" in state["selectedColumns"]
    assert result.view_url.endswith(f"/#/experiments/{experiment.experiment_id}/runs?compareRunsMode=CHART"
                                    f"&viewStateShareKey={FAMILY_VIEW}&workflowType=machine_learning")


def test_the_run_summary_gives_the_evaluation_time_against_the_training_before_it():
    from types import SimpleNamespace

    from satlab.training.summary import evaluation_time_rows

    assert evaluation_time_rows(SimpleNamespace(eval_seconds=None, fit_seconds=100.0)) == []
    rows = dict(evaluation_time_rows(SimpleNamespace(eval_seconds=20.0, fit_seconds=220.0)))
    assert rows == {"end-of-run evaluation": "20.0 s = 10.0 % of training (3.3 min)"}


def test_a_run_stopped_in_its_end_of_run_evaluation_gets_it_when_resumed_and_only_once(tmp_path, monkeypatch):
    """Its last step's checkpoint is on disk when the evaluation at the end is cut short (`make reproduce` met it: a
    trial killed in its evaluation resumed with no step left, Lightning skipped that fit and its ``on_train_end``, and
    the cell finished without zero-shot metrics). The resumed run evaluates; a finished run started again does not."""
    cfg = load_experiment("default", [
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
        "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_tokens=256",
        "train.max_tokens=2048", "train.val_every_tokens=1024", "train.ckpt_every_tokens=1024", "train.val_tokens=256",
        "eval.limit=4", "eval.tasks=[satlab_cloze_choice]", "name=cut", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.out_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ])
    real = EvaluationCallback.end_of_run

    def cut_short(self, trainer, pl_module):
        raise RuntimeError("killed in the end-of-run evaluation")

    monkeypatch.setattr(EvaluationCallback, "end_of_run", cut_short)
    with pytest.raises(RuntimeError, match="killed in the end-of-run"):
        train(cfg, progress=False, callbacks=[EvaluationCallback(cfg)])
    assert (tmp_path / "runs" / "cut" / "checkpoints" / "step0000008.ckpt").exists()
    monkeypatch.setattr(EvaluationCallback, "end_of_run", real)
    resumed = EvaluationCallback(cfg)
    result = train(cfg, progress=False, callbacks=[resumed])
    client = mlflow.MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and resumed.end_eval_seconds is not None
    assert "zero_shot/satlab_cloze_choice/acc" in resumed.last_results
    assert run.data.metrics["system/eval_wall_seconds"] == pytest.approx(resumed.end_eval_seconds)
    assert "eval/step_8/results.json" in artifact_paths(client, run.info.run_id)
    again = EvaluationCallback(cfg)
    train(cfg, progress=False, callbacks=[again])
    assert again.end_eval_seconds is None  # recorded by the attempt before: not run again
    assert [m.step for m in client.get_metric_history(run.info.run_id, "system/eval_wall_seconds")] == [8]
    validated = [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")]
    assert sorted(validated) == sorted(set(validated)), validated  # the final validation, redone, logged once
