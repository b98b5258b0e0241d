"""Ablations: spec validation and grid expansion, the statistics and verdicts, and a micro ablation end to end
(parent and child runs, report, resuming without rerunning, rerunning only a cell whose record is gone)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import mlflow
import numpy as np
import optuna
import pytest
import yaml
from scipy import stats

from satlab.cli.main import main as satlab_main
from satlab.config.errors import ConfigError
from satlab.studies.ablation_plots import tile_images
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.attrs import CELL, PARENT_RUN, REASON
from satlab.studies.engine import run_study, set_up_study
from satlab.studies.loader import apply_items, list_specs, load_ablation, load_spec, spec_from_dict
from satlab.studies.plans import GridPlan
from satlab.studies.runs import CELL_TAG, PARENT_TAG, child_runs
from satlab.studies.spec import SweepSpec
from satlab.studies.stats import (
    best_verdict,
    compare,
    comparison_text,
    decide_all,
    holm,
    mean_std,
    ordering_verdict,
    paired_p,
    welch_p,
)
from satlab.studies.storage import open_storage
from satlab.studies.workers import StaleTrialRetry
from satlab.training.tracking import open_store, resolve_tracking

MICRO = {  # a model that trains in seconds on a CPU
    "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.mlp_hidden": 64,
    "data.source": "kjv", "data.tokenizer.kind": "byte", "data.seq_len": 64,
    "train.micro_batch_size": 4, "train.global_batch_tokens": 256, "train.max_tokens": 1024,
    "train.val_every_tokens": 512, "train.val_tokens": 256, "train.accelerator": "cpu", "eval.at_end": False,
}


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(excinfo.value.problems)


def test_grid_expansion_order_keys_slugs_and_groups() -> None:
    spec = spec_from_dict(
        AblationSpec, {"name": "g", "axes": {"model": {"arch": ["transformer", "satformer"]},
                                                 "train.seed": [0, 1, 2]},
                           "baseline": {"model.arch": "satformer"}})
    cells = spec.cells()
    assert [c.slug for c in cells[:4]] == ["arch=transformer,seed=0", "arch=transformer,seed=1",
                                           "arch=transformer,seed=2", "arch=satformer,seed=0"]
    assert len(cells) == 6 and len({c.key for c in cells}) == 6
    assert cells[3].key == "model.arch=satformer train.seed=0" and cells[3].group == "model.arch=satformer"
    assert cells[3].overrides() == ["model.arch=satformer", "train.seed=0"] and cells[3].seed == 0
    assert spec.baseline_values() == {"model.arch": "satformer"}
    assert spec.out_path().as_posix().endswith("reports/ablations/g")
    same_leaf = spec_from_dict(
        AblationSpec, {"name": "l", "axes": {"model.satformer.last_k": [None, 2], "data.last_k": [1]}})
    assert same_leaf.cells()[0].slug == "model.satformer.last_k=null,data.last_k=1"
    assert spec_from_dict(
        AblationSpec, {"name": "d", "axes": {"optim.lr": [1e-3, 3e-3]}}).baseline_values() == {"optim.lr": 1e-3}


def test_spec_problems_are_all_reported_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as excinfo:
        spec_from_dict(
        AblationSpec, {"name": "bad/name", "axis": {}, "axes": {"model.arch": [], "train.seed": 3,
                                                                  "optim.lr": [1e-3, 1e-3], "model.size": ["tiny"]},
                        "overrides": {"model.size": "tiny"}, "baseline": {"train.seed": 0, "model.arh": "x"},
                        "timeout_minutes": -1})
    text = problems(excinfo)
    assert "unknown key 'axis' (did you mean 'axes'?)" in text
    assert "'name' must be" in text and "'timeout_minutes' must be" in text
    assert "axis 'model.arch' is empty" in text and "axis 'train.seed' must be a list" in text
    assert "axis 'optim.lr' repeats a value" in text and "'model.size' is both a fixed override and an axis" in text
    assert "baseline cannot fix the seed axis" in text and "(did you mean 'model.arch'?)" in text
    with pytest.raises(ConfigError, match="'axes' is empty"):
        spec_from_dict(
        AblationSpec, {"name": "e", "axes": {}})
    with pytest.raises(ConfigError, match="not among the axis values"):
        spec_from_dict(
        AblationSpec, {"name": "b", "axes": {"model.arch": ["transformer"]}, "baseline": {"model.arch": "mudd"}})


def test_axis_keys_and_values_are_checked_against_the_config(tmp_path: Path) -> None:
    path = tmp_path / "typo.yml"
    path.write_text(yaml.safe_dump({"base": "default", "axes": {"model.archh": ["transformer"],
                                                                "model.satformer.gate_fn": ["relu", "sigmoidd"]}}))
    with pytest.raises(ConfigError) as excinfo:
        load_ablation(path)
    text = problems(excinfo)
    assert "unknown key 'model.archh' (did you mean 'arch'?)" in text
    assert "gate_fn 'sigmoidd' (did you mean 'sigmoid'?)" in text
    with pytest.raises(ConfigError, match="unknown ablation spec 'arch_tiy'.*did you mean 'arch_tiny'"):
        load_ablation("arch_tiy")


def test_sub_grid_values_are_checked_together(tmp_path: Path) -> None:
    """Under CompleteP with base width 64, 3 heads suit width 48 (head dim 16) but not the base config's width
    128: a sub-grid's values are loaded together, so the grid that pairs them is valid, and one that pairs width 48
    with 4 heads (head dim 12, which 64 is not a multiple of) is refused, naming the grid."""
    def spec(heads_at_48: int) -> Path:
        path = tmp_path / f"grid{heads_at_48}.yml"
        path.write_text(yaml.safe_dump({
            "base": "default", "overrides": {"model.parametrization": "completep", "model.base_width": 64},
            "axes": {"model.d_model": [48, 64], "model.n_heads": [3, 4]},
            "grids": [{"model.d_model": [48], "model.n_heads": [heads_at_48]},
                      {"model.d_model": [64], "model.n_heads": [4]}]}))
        return path

    assert len(load_ablation(spec(3)).cells()) == 2
    with pytest.raises(ConfigError) as excinfo:
        load_ablation(spec(4))
    text = problems(excinfo)
    assert "grids[0] (model.d_model=48 model.n_heads=4): model.base_width=64 is not a whole number of heads" in text
    assert "grids[1]" not in text
    path = tmp_path / "left_out.yml"  # an axis a grid leaves out takes all its values there: 4 heads beside 48
    path.write_text(yaml.safe_dump({
        "base": "default", "overrides": {"model.parametrization": "completep", "model.base_width": 64},
        "axes": {"model.d_model": [48, 64], "model.n_heads": [3, 4]},
        "grids": [{"model.d_model": [64], "model.n_heads": [4]}, {"model.d_model": [48]}]}))
    with pytest.raises(ConfigError, match=r"grids\[1\] \(model.d_model=48 model.n_heads=4\)"):
        load_ablation(path)


def test_command_line_items_set_the_spec_or_override_the_config() -> None:
    data = apply_items(AblationSpec, {"name": "x", "axes": {"model": {"arch": ["transformer"]}}},
                       ["axes.train.seed=[0,1]", "baseline.model.arch=transformer", "train.max_tokens=1e5",
                        "out_dir=/tmp/x"])
    assert data["axes"] == {"model.arch": ["transformer"], "train.seed": [0, 1]}
    assert data["overrides"] == {"train.max_tokens": 100000.0} and data["out_dir"] == "/tmp/x"
    with pytest.raises(ConfigError, match="malformed item"):
        apply_items(AblationSpec, {}, ["axes.model.arch"])


def test_shipped_ablations_expand_and_load() -> None:
    names = list_specs(AblationSpec)
    assert {"arch_tiny", "granularity", "gate_fn", "arch_small", "arch_xl"} <= set(names)
    arch = load_ablation("arch_tiny")
    assert len(arch.cells()) == 60 and arch.axes["data.source"] == ["shakespeare", "kjv"]
    assert arch.baseline_values() == {"model.arch": "transformer", "data.source": "shakespeare"}
    assert sorted(arch.axes["model.arch"]) == sorted(["transformer", "resformer", "satformer", "denseformer",
                                                      "hyperconnections", "muddformer", "mhc", "attnres",
                                                      "block_attnres", "value_embed"])
    base = arch.base_config()
    assert (base.model.size, base.train.precision, base.train.compile) == ("tiny", "32-true", False)
    assert len(load_ablation("granularity").cells()) == 15 and len(load_ablation("gate_fn").cells()) == 18
    assert load_ablation("arch_small").base_config().data.seq_len == 4096
    short, long = load_ablation("paper_corpora"), load_ablation("paper_long")
    assert long.axes == short.axes and len(long.cells()) == 18  # the same grid at four times the budget
    assert [s.base_config().train.max_tokens for s in (short, long)] == [262_144, 1_048_576]
    assert long.overrides["train.ckpt_every_tokens"] < 1_048_576


@pytest.mark.parametrize(("kind", "names"), [
    (AblationSpec, ["arch_tiny", "lr_transfer", "mqar_layouts", "ladder_cpu"]),  # plain, grids, sequential, ladder
    (SweepSpec, ["lr_tiny", "lr_paper_small"])])
def test_shipped_specs_of_every_block_survive_the_round_trip_through_their_study(kind, names) -> None:
    """A trial process rebuilds its spec from the dict stored on the study (StudySpec.to_dict): a spec of each kind
    of block must come back equal, with the defaults of the blocks it does not use (a ladder's lr, None)."""
    assert set(names) <= set(list_specs(kind))
    for name in names:
        spec = load_spec(kind, name)
        back = spec_from_dict(kind, replace(spec, storage=None).to_dict(), f"the spec stored for {name}")
        assert back.fingerprint() == spec.fingerprint(), name
        if kind is AblationSpec:
            assert [c.key for c in back.cells()] == [c.key for c in spec.cells()], name


def test_welch_p_matches_scipy_and_the_formula() -> None:
    a, b = [3.1, 3.4, 2.9, 3.3], [3.6, 3.9, 3.5]
    t = (np.mean(a) - np.mean(b)) / math.sqrt(np.var(a, ddof=1) / 4 + np.var(b, ddof=1) / 3)
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 3
    dof = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 2)
    assert welch_p(a, b) == pytest.approx(2 * stats.t.sf(abs(t), dof), rel=1e-9)
    assert welch_p(a, b) == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert welch_p([1.0], b) is None and welch_p([2.0, 2.0], [2.0, 2.0]) is None
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2))) and mean_std([5.0]) == (5.0, None)


def seeded(*values: float) -> dict[int, float]:
    return dict(enumerate(values))


ORDER = ["satformer", "resformer", "transformer"]
NAMES = {"satformer": "SATFormer", "resformer": "ResFormer", "transformer": "Transformer"}


def decided(samples, **kwargs):
    return decide_all([ordering_verdict(samples, ORDER, "loss", labels=NAMES, **kwargs)])[0]


def test_a_claim_is_held_contradicted_not_resolved_or_not_measurable_on_synthetic_numbers() -> None:
    win = decided({"satformer": seeded(3.00, 3.01, 2.99), "resformer": seeded(3.10, 3.12, 3.09),
                   "transformer": seeded(3.20, 3.23, 3.19)})
    assert win.outcome == "held" and "Observed order: SATFormer < ResFormer < Transformer" in win.detail
    loss = decided({"satformer": seeded(3.15, 3.16, 3.17), "resformer": seeded(3.10, 3.12, 3.11),
                    "transformer": seeded(3.20, 3.30, 3.25)})
    assert loss.outcome == "contradicted" and "**contradicted**" in loss.sentence()
    tie = decided({"satformer": seeded(3.00, 3.06, 2.95), "resformer": seeded(3.02, 3.01, 3.00),
                   "transformer": seeded(3.20, 3.22, 3.19)})
    first = tie.comparisons[0]
    assert tie.outcome == "not resolved" and first.mdd > abs(first.gain) and first.seeds_needed > 3
    assert f"about {first.seeds_needed} seeds a side would resolve" in tie.detail
    chance = decided({"satformer": seeded(0.26, 0.24, 0.25), "resformer": seeded(0.25, 0.26, 0.24),
                      "transformer": seeded(0.24, 0.25, 0.27)}, lower_is_better=False, chance=0.25)
    assert chance.outcome == "not measurable at this scale" and not chance.comparisons
    above = decided({"satformer": seeded(0.61, 0.60, 0.62), "resformer": seeded(0.45, 0.44, 0.46),
                     "transformer": seeded(0.30, 0.31, 0.29)}, lower_is_better=False, chance=0.25)
    assert above.outcome == "held"  # far above chance: measured, and the order holds
    lucky = {f"arch{i}": seeded(0.25 + 0.01 * (i % 3 - 1), 0.26, 0.24) for i in range(9)}
    lucky["satformer"] = seeded(0.260, 0.263, 0.266)  # one-sample p 0.016 alone; Holm over ten: 0.16
    assert stats.ttest_1samp([0.260, 0.263, 0.266], 0.25).pvalue < 0.05
    assert decide_all([best_verdict(lucky, "satformer", "retrieval", chance=0.25)])[0].outcome \
        == "not measurable at this scale"
    assert decided({"satformer": seeded(3.0)}).outcome == "could not be checked"
    best = decide_all([best_verdict({"satformer": seeded(0.5, 0.52), "resformer": seeded(0.4, 0.41),
                                     "transformer": seeded(0.3, 0.32)}, "satformer", "retrieval", labels=NAMES)])[0]
    assert best.comparisons[0].worse == "ResFormer"  # against the strongest other


def test_the_verdict_pairs_by_seed_and_reports_welch_beside_it() -> None:
    a, b = seeded(3.00, 3.10, 2.90), seeded(3.02, 3.12, 2.93)  # a seed effect larger than the difference
    paired = compare("a", "b", {"a": a, "b": b})
    assert paired.paired and paired.p == paired.paired_p < 0.05 < paired.welch_p
    assert paired.paired_p == pytest.approx(stats.ttest_rel(list(a.values()), list(b.values())).pvalue)
    unpaired = compare("a", "b", {"a": a, "b": {5: 3.02, 6: 3.12, 7: 2.93}})
    assert not unpaired.paired and unpaired.p == unpaired.welch_p and unpaired.paired_p is None
    assert paired_p([1.0, 2.0], [1.0]) is None
    nil = compare("a", "b", {"a": seeded(3.0, 3.1, 2.9), "b": seeded(3.03, 3.07, 2.901)})
    assert nil.seeds_needed > 1000 and "more than 1,000 seeds a side would resolve" in comparison_text(nil)
    assert holm([0.01, 0.04, None, 0.03]) == [pytest.approx(0.03), pytest.approx(0.06), None, pytest.approx(0.06)]


@pytest.mark.parametrize("paired", [True, False])
def test_the_minimum_detectable_difference_has_80_percent_power_by_the_noncentral_t(paired) -> None:
    """At the reported MDD, the power of the two-sided 5 % t-test computed from scipy's noncentral t is 0.8."""
    n = 5
    a = seeded(1.0, 1.3, 0.8, 1.1, 0.9)
    b = seeded(1.2, 1.1, 1.4, 1.0, 1.3) if paired else {k + 10: v for k, v in seeded(1.2, 1.1, 1.4, 1.0, 1.3).items()}
    c = compare("a", "b", {"a": a, "b": b})
    if paired:
        spread, df, scale = np.std([b[k] - a[k] for k in a], ddof=1), n - 1, math.sqrt(n)
    else:
        spread = math.sqrt((np.var(list(a.values()), ddof=1) + np.var(list(b.values()), ddof=1)) / 2)
        df, scale = 2 * n - 2, math.sqrt(n / 2)
    critical = stats.t.ppf(0.975, df)
    noncentrality = c.mdd / spread * scale
    power = stats.nct.sf(critical, df, noncentrality) + stats.nct.cdf(-critical, df, noncentrality)
    assert power == pytest.approx(0.8, abs=1e-4)
    assert c.seeds_needed >= 2


def test_tile_images(tmp_path: Path) -> None:
    images = []
    for i in range(4):
        plt.imsave(tmp_path / f"{i}.png", np.random.default_rng(i).random((20, 30)))
        images.append((f"cell {i}", tmp_path / f"{i}.png"))
    assert tile_images(images, tmp_path / "tiles.png", "t").stat().st_size > 0
    assert tile_images([], tmp_path / "none.png", "t") is None


def write_micro_spec(tmp_path: Path, name: str = "micro") -> Path:
    overrides = {**MICRO, "tracking.uri": f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
                 "train.out_dir": str(tmp_path / "runs"), "data.cache_dir": str(tmp_path.parent / "ablate-cache")}
    spec = {"name": name, "base": "default", "overrides": overrides, "out_dir": str(tmp_path / "out"),
            "axes": {"model.arch": ["transformer", "satformer"], "train.seed": [0, 1]},
            "baseline": {"model.arch": "transformer"}}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def assert_results_on_parent(client: mlflow.MlflowClient, run_id: str, summary: dict) -> None:
    """The parent run's metrics, params and verdict tags are summary.json's numbers (a metric a later report no
    longer has is NaN), and no metric holds one value twice in its history."""
    run = client.get_run(run_id)
    expected: dict[str, float | None] = {}
    for key, group in summary["groups"].items():
        assert run.data.params[f"variant.{key}"] == group["group"]
        expected |= {f"variants/{key}/cells": group["cells"], f"variants/{key}/model_params": group["model_params"]}
        for measure, numbers in group["measures"].items():
            expected |= {f"variants/{key}/{measure}_{stat}": value for stat, value in numbers.items()}
    for verdict in summary["verdicts"]:
        assert run.data.tags[f"verdict.{verdict['key']}"] == verdict["outcome"]
        for c in verdict["comparisons"]:
            pair = f"verdicts/{verdict['key']}/{c['better']}_vs_{c['worse']}"
            expected |= {f"{pair}_p": c["p"], f"{pair}_p_holm": c["p_adjusted"]}
    assert {k: v for k, v in run.data.metrics.items() if not math.isnan(v)} == \
        {k: v for k, v in expected.items() if v is not None}
    tags = {k for k in run.data.tags if k.startswith("verdict.")}
    assert tags == {f"verdict.{v['key']}" for v in summary["verdicts"]}
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        assert {m.step for m in history} == {0} and len(history) == len({repr(m.value) for m in history}), key


def finished_children(client: mlflow.MlflowClient, parent_run_id: str) -> dict[str, str]:
    runs = child_runs(client, client.get_run(parent_run_id))
    assert all(r.data.tags[PARENT_TAG] == parent_run_id for r in runs)
    return {r.data.tags[CELL_TAG]: r.info.run_id for r in runs}


@pytest.mark.process
def test_micro_ablation_runs_reports_and_resumes(tmp_path: Path) -> None:
    spec = load_ablation(write_micro_spec(tmp_path))
    result = run_study(spec, workers=2)
    assert not result.failed and not result.interrupted and len(result.finished) == 4
    client = mlflow.MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.params["axis.model.arch"] == "transformer, satformer"
    runs = finished_children(client, result.parent_run_id)
    assert set(runs) == {c.key for c in spec.cells()}

    summary = json.loads(result.report["summary"].read_text())
    header, *rows = summary["table"]
    assert header[:5] == ["cell", "seeds", "params", "final val loss", "p (loss)"]
    by_cell = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert by_cell["transformer (baseline)"]["p (loss)"] == "baseline"
    assert float(by_cell["satformer"]["p (loss)"]) >= 0 and by_cell["satformer"]["seeds"] == "2/2"
    assert by_cell["satformer"]["retrieval avg"] == "—" and "±" in by_cell["satformer"]["final val loss"]
    markdown = result.report["markdown"].read_text()
    assert "ResFormer" not in markdown and "tokens: ." not in markdown  # no claim or order about an absent one
    assert "SATFormer best on the retrieval average: **could not be checked**" in markdown  # present, not evaluated
    html = result.report["html"].read_text()
    assert result.report["loss_curves"].exists() and "<table>" in html and '<img src="data:image/png;base64,' in html
    assert set(summary["groups"]) == {"transformer", "satformer"} and summary["groups"]["satformer"]["cells"] == 2
    compute = summary["compute"]  # every trial process's CPU time is on its run, and summed in the report
    assert (compute["runs"], compute["runs_timed"]) == (4, 4) and 0 < compute["cpu_hours"] < 0.5
    assert f"Compute: {compute['cpu_hours']:.2f} CPU-hours" in markdown
    assert_results_on_parent(client, result.parent_run_id, summary)
    logged = {a.path for a in client.list_artifacts(result.parent_run_id, "report")}
    assert {"report/report.md", "report/report.html", "report/loss_curves.png"} <= logged

    again = run_study(spec, workers=2, report=False)  # nothing left to run
    assert (len(again.skipped), again.finished) == (4, [])
    assert finished_children(client, result.parent_run_id) == runs
    (spec.out_path() / "optuna.db").unlink()  # an ablation run before it had a study: MLflow's record is adopted
    adopted_all = run_study(spec, workers=2, report=False)
    assert (len(adopted_all.skipped), adopted_all.finished) == (4, [])
    assert adopted_all.parent_run_id == result.parent_run_id and finished_children(client, result.parent_run_id) == runs

    adopted, redo = spec.cells()[0].key, spec.cells()[3].key
    client.delete_run(runs[redo])  # the cell's MLflow record gone: it is rerun
    grown = load_ablation(write_micro_spec(tmp_path), ["axes.train.seed=[0, 1, 2]"])  # and the grid grows a seed
    before = GridPlan(grown)  # its dry run, before it runs: the earlier grid's cells are adopted, the new seed's not
    assert before.recorded_study() is None and adopted in before.finished_in_earlier_grids()
    assert not {c.key for c in grown.cells() if c.seed == 2} & before.finished_in_earlier_grids()
    third = run_study(grown, workers=2, report=False)  # (Optuna's choices change: a study of its own)
    assert sorted(third.finished) == sorted([redo, *(c.key for c in grown.cells() if c.seed == 2)])
    assert sorted(third.skipped) == sorted(k for k in runs if k != redo) and adopted in third.skipped
    assert third.parent_run_id == result.parent_run_id
    after = finished_children(client, result.parent_run_id)
    assert after[redo] != runs[redo] and {k: v for k, v in after.items() if k in runs and k != redo} == \
        {k: v for k, v in runs.items() if k != redo}
    plan = GridPlan(grown)  # what `satlab ablate --dry-run` shows: the new study holds the adopted cells too
    status = plan.cell_status(plan.recorded_study())
    assert status[adopted] == status[redo] == "finished" and set(status.values()) == {"finished"}

    heatmap = tmp_path / "heatmap.png"
    plt.imsave(heatmap, np.random.default_rng(0).random((10, 10)))
    for step in (2, 4):
        client.log_artifact(after[spec.cells()[2].key], str(heatmap), f"gates/step_{step}")
    assert satlab_main(["report", str(tmp_path / "micro.yml")]) == 0
    assert (spec.out_path() / "gate_heatmaps.png").exists()
    summary = json.loads((spec.out_path() / "summary.json").read_text())
    assert summary["runs"][redo] == after[redo]  # the report again: its numbers replace the first's on the parent
    assert_results_on_parent(client, result.parent_run_id, summary)
    assert satlab_main(["report", result.parent_run_id, "--tracking-uri", result.tracking_uri,
                        "--out", str(tmp_path / "by-id")]) == 0
    assert "gate_heatmaps.png" in (tmp_path / "by-id" / "report.md").read_text()


def set_up_driver(spec: AblationSpec, url: str) -> tuple[optuna.Study, str, dict[str, str]]:
    """What a driver does before its workers start (study, parent run, queue), with a storage of its own, as a host
    has."""
    tracking = resolve_tracking(open_store(spec.base_config().tracking.uri), None)
    retry = StaleTrialRetry(spec.trial.max_retry)
    return set_up_study(spec, GridPlan(spec), open_storage(url, spec.trial, retry), mlflow.MlflowClient(tracking[0]),
                        tracking, retry)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning", "ignore:Heartbeat:UserWarning")
def test_an_ablation_queues_its_cells_seeds_slowest_and_never_samples_them(tmp_path: Path) -> None:
    """Workers pop the queue first in, first out, so the cells run in run order, seeds slowest (an interrupted
    ablation leaves whole replicates). A queued cell's values are fixed parameters: the ablation's sampler, which
    fails when asked, is never asked; a trial started on an empty queue has no cell. Of two running trials of one
    cell, the later steps aside."""
    spec, url = load_ablation(write_micro_spec(tmp_path)), f"sqlite:///{tmp_path / 'optuna.db'}"
    plan = GridPlan(spec)
    assert plan.recorded_study(url) is None and set(plan.cell_status(None).values()) == {"not run"}
    study, _, done = set_up_driver(spec, url)
    assert set(plan.cell_status(plan.recorded_study(url)).values()) == {"queued"}  # what `ablate --dry-run` prints
    assert done == {} and plan.next_action(study, 0, 0) == "run" and plan.next_action(study, 0, 4) == "wait"
    trials = [study.ask() for _ in spec.cells()]
    popped = [plan.cell(plan.suggest(trial)) for trial in trials]
    assert [c.seed for c in popped] == [0, 0, 1, 1]
    assert [c.key for c in popped] == [c.key for c in spec.run_order()]
    assert plan.next_action(study, 0, 0) == "wait"  # all four running: one may die and be queued again
    study.enqueue_trial(dict(popped[0].values), user_attrs={CELL: popped[0].key})  # a cell queued twice
    twin = study.ask()
    assert plan.is_duplicate(study, twin, plan.suggest(twin))  # the later of its two trials steps aside
    assert not plan.is_duplicate(study, trials[0], plan.suggest(trials[0]))  # the earlier does not
    stray = study.ask()  # what a worker on another host gets when it finds the queue empty
    assert plan.cell_key(stray) is None
    with pytest.raises(RuntimeError, match="run queued cells"):
        plan.suggest(stray)
    assert set(plan.cell_status(study).values()) == {"running"}
    trials[1].set_user_attr(REASON, "out of memory")  # as a worker records a failure
    study.tell(trials[1].number, state=optuna.trial.TrialState.FAIL)
    for trial in study.get_trials(states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, 1.0)
    assert plan.next_action(study, 0, 0) == "done"
    assert plan.cell_status(study) == {c.key: "failed (out of memory)" if c.key == popped[1].key else "finished"
                                       for c in spec.cells()}


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_second_driver_joins_the_queue_without_queueing_the_cells_again(tmp_path: Path, monkeypatch) -> None:
    """Two drivers set up one ablation at once on one storage, as two hosts do: the one that creates the study
    queues the cells and only then records the parent run, which the other waits for; each cell is queued once. A
    driver started later (a resume) queues none either."""
    spec = load_ablation(write_micro_spec(tmp_path))
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    open_storage(url)  # the tables made once, before the drivers race to make them
    mlflow.MlflowClient(open_store(spec.base_config().tracking.uri)).search_experiments()  # and the MLflow store
    calls: list[str] = []
    enqueue, set_user_attr = optuna.Study.enqueue_trial, optuna.Study.set_user_attr
    monkeypatch.setattr(optuna.Study, "enqueue_trial",
                        lambda self, *args, **kwargs: (calls.append("enqueue"), enqueue(self, *args, **kwargs))[1])
    monkeypatch.setattr(optuna.Study, "set_user_attr",
                        lambda self, key, value: (calls.append(key), set_user_attr(self, key, value))[1])
    with ThreadPoolExecutor(2) as pool:
        drivers = list(pool.map(lambda _: set_up_driver(spec, url), range(2)))
    drivers.append(set_up_driver(spec, url))
    study = optuna.load_study(study_name=GridPlan(spec).study_name(), storage=url)
    assert {parent for _, parent, _ in drivers} == {study.user_attrs[PARENT_RUN]}
    assert {key: len(trials) for key, trials in GridPlan(spec).trials_by_cell(study).items()} == \
        {c.key: 1 for c in spec.cells()}
    assert len(study.trials) == calls.count("enqueue") == 4
    assert calls.index(PARENT_RUN) > max(i for i, call in enumerate(calls) if call == "enqueue")


@pytest.mark.slow
@pytest.mark.process
def test_a_killed_ablation_resumes_only_the_unfinished_cells(tmp_path: Path) -> None:
    """SIGKILL the driver while its second cell trains: that cell's process ends with it, and the same command
    then runs the second and later cells only."""
    path = write_micro_spec(tmp_path, "killed")
    spec = load_ablation(path, ["train.max_tokens=16384", "train.val_every_tokens=4096"])
    command = [sys.executable, "-m", "satlab.cli.main", "ablate", str(path), "train.max_tokens=16384",
               "train.val_every_tokens=4096", "--no-report"]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    plan = GridPlan(spec)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = list(plan.cell_status(plan.recorded_study()).values())
        if status.count("finished") == 1 and "running" in status:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the first cell did not finish in time")
    time.sleep(8)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    time.sleep(5)
    leftovers = subprocess.run(["pgrep", "-f", f"satlab.studies.child experiment={spec.out_path().resolve()}"],
                               capture_output=True, text=True).stdout.split()
    assert leftovers == []
    result = run_study(spec, workers=1, report=False)
    first = [c.key for c in spec.cells() if c.seed == 0][0]
    assert result.skipped == [first] and len(result.finished) == 3 and not result.failed


def test_a_recall_ablations_report_compares_with_transformer_and_resformer_at_each_difficulty(tmp_path: Path) -> None:
    from satlab.studies.ablation_report import write_report
    from satlab.studies.runs import create_parent_run

    spec = spec_from_dict(
        AblationSpec, {"name": "recall-report", "base": "recall/mqar", "out_dir": str(tmp_path / "out"),
                           "axes": {"data.mqar.num_pairs": [2, 4],
                                    "model.arch": ["transformer", "resformer", "satformer"], "train.seed": [0, 1, 2]}})
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_parent_run(client, spec, str(tmp_path / "artifacts"))
    experiment = client.get_run(parent).info.experiment_id
    accuracy = {("transformer", 2): [0.50, 0.51, 0.49], ("resformer", 2): [0.50, 0.52, 0.50],
                ("satformer", 2): [0.95, 0.97, 0.96],  # a clear win where the others plateau
                ("transformer", 4): [0.99, 0.99, 0.992], ("resformer", 4): [0.99, 0.991, 0.99],
                ("satformer", 4): [0.80, 0.82, 0.81]}  # a clear loss
    reached = {("satformer", 2): [900, 1000, 1100], ("transformer", 4): [1000, 1100, 1200],
               ("resformer", 4): [1000, 1200, 1100], ("satformer", 4): [1500, 1600, None]}
    for cell in spec.cells():
        values = dict(cell.values)
        point = (values["model.arch"], values["data.mqar.num_pairs"])
        run = client.create_run(experiment, tags={PARENT_TAG: parent, CELL_TAG: cell.key})
        final = accuracy[point][cell.seed]
        for step, acc in ((0, 0.0), (500, final / 2), (1000, final)):
            client.log_metric(run.info.run_id, "recall/acc", acc, step=step)
            client.log_metric(run.info.run_id, "val/loss", 2 - acc, step=step)
        steps = reached.get(point, [None] * 3)[cell.seed]
        if steps is not None:
            client.log_metric(run.info.run_id, "recall/steps_to_0.9", steps, step=1000)
        # the time-to-bind at 0.9 here: the step reached, or censored at the budget, 2,000
        client.log_metric(run.info.run_id, "recall/steps_to_bind", steps or 2000, step=1000)
        client.log_metric(run.info.run_id, "recall/bound", float(steps is not None), step=1000)
        client.log_param(run.info.run_id, "derived.tokens_per_step", 4096)
        client.log_param(run.info.run_id, "derived.max_steps", 2000)
        client.set_terminated(run.info.run_id)
    files = write_report(spec, client, parent)
    header, *rows = json.loads(files["summary"].read_text())["table"]
    assert header[:6] == ["cell", "seeds", "params", "held-out acc", "p acc vs Transformer", "p acc vs ResFormer"]
    by_cell = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    win = by_cell["num_pairs=2, arch=satformer"]
    assert win["held-out acc"].startswith("0.960 ± 0.010") and float(win["p acc vs Transformer"]) < 1e-3
    assert by_cell["num_pairs=2, arch=transformer"]["p acc vs Transformer"] == "reference"
    assert by_cell["num_pairs=2, arch=transformer"]["steps to 0.9"] == "— (0/3)"
    partial = by_cell["num_pairs=4, arch=satformer"]
    assert partial["steps to 0.9"] == "1,550 ± 71 (2/3)" and partial["p steps 0.9 vs Transformer"] == "—"
    assert by_cell["num_pairs=4, arch=resformer"]["p steps 0.9 vs Transformer"] != "—"
    markdown = files["markdown"].read_text()
    assert "SATFormer retrieves better than Transformer (held-out accuracy, num_pairs=2): **held**" in markdown
    assert "SATFormer retrieves better than ResFormer (held-out accuracy, num_pairs=4): **contradicted**" in markdown
    assert files["accuracy_vs_difficulty"].exists() and files["loss_curves"].exists()
    assert partial["steps to bind"] == "1,700 ± 265" and partial["bound"] == "0.67 ± 0.58"
    assert "## Time to bind" in markdown and files["bind_curves"].exists()
    bind = {(a["setting"], a["arm"]): a for a in json.loads(files["summary"].read_text())["time_to_bind"]}
    censored = bind[("num_pairs=4", "SATFormer")]
    assert (censored["bound"], censored["n"], censored["tau"], censored["median_steps_to_bind"]) == (2, 3, 2000, 1600)
    assert censored["restricted_mean_steps_to_bind"] == pytest.approx(1700)
    from satlab.studies.results import RECALL_MEASURES, collect
    assert {c.budget for g in collect(spec, client, parent, RECALL_MEASURES) for c in g.cells} == {2000}


@pytest.mark.slow  # make test-full
@pytest.mark.process
def test_a_micro_recall_ablation_runs_its_cells_and_reports_recall_columns(tmp_path: Path) -> None:
    overrides = {"data.mqar.vocab_size": 64, "data.seq_len": 16, "data.mqar.num_pairs": 2,
                 "data.mqar.eval_sequences": 64, "train.micro_batch_size": 16, "train.global_batch_tokens": 256,
                 "train.max_tokens": 5120, "train.val_every_tokens": 2560, "train.ckpt_every_tokens": 5120,
                 "train.accelerator": "cpu", "tracking.uri": f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
                 "train.out_dir": str(tmp_path / "runs")}
    path = tmp_path / "recall.yml"
    path.write_text(yaml.safe_dump({"name": "micro-recall", "base": "recall/mqar", "overrides": overrides,
                                    "out_dir": str(tmp_path / "out"),
                                    "axes": {"model.arch": ["transformer", "satformer"]}}))
    result = run_study(load_ablation(path), workers=2)
    assert not result.failed and len(result.finished) == 2
    header, *rows = json.loads(result.report["summary"].read_text())["table"]
    assert header[3] == "held-out acc" and "p acc vs Transformer" in header
    assert all(0 <= float(row[3]) <= 1 for row in rows)
    assert "SATFormer retrieves better than Transformer" in result.report["markdown"].read_text()


TWO_CORPORA = {"base": "ablations/tiny_cell", "baseline": {"model.arch": "transformer", "data.source": "shakespeare"},
               "axes": {"data.source": ["shakespeare", "kjv"], "model.arch": ["transformer", "resformer", "satformer"],
                        "train.seed": [0, 1, 2]}}


def synthetic_two_corpus_report(tmp_path: Path, loss: Callable[[str, str, int, int], float], name: str = "two-corpora",
                                steps: tuple[int, ...] = (0, 31, 63, 128), **fields: Any) -> dict[str, Path]:
    """The report of a T/R/S x two corpora x 3 seeds grid of recorded runs whose validation loss after ``step`` of
    the tiny cell's steps (2,048 tokens each, the last of ``steps`` the end) is ``loss(corpus, arch, seed, step)``."""
    from satlab.studies.ablation_report import write_report
    from satlab.studies.runs import create_parent_run

    spec = spec_from_dict(AblationSpec, TWO_CORPORA | {"name": name, "out_dir": str(tmp_path / name)} | fields)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_parent_run(client, spec, str(tmp_path / "artifacts"))
    experiment = client.get_run(parent).info.experiment_id
    for cell in spec.cells():
        values = dict(cell.values)
        run = client.create_run(experiment, tags={PARENT_TAG: parent, CELL_TAG: cell.key})
        client.log_param(run.info.run_id, "derived.tokens_per_step", 2048)
        client.log_param(run.info.run_id, "derived.max_steps", steps[-1])
        for step in steps:  # a validation before training, inside it (after step + 1 steps), at the end
            client.log_metric(run.info.run_id, "val/loss",
                              loss(values["data.source"], values["model.arch"], cell.seed, step), step=step)
        client.log_metric(run.info.run_id, "zero_shot/offline_retrieval_avg", 0.25 + 0.01 * (cell.seed - 1),
                          step=steps[-1])
        client.set_terminated(run.info.run_id)
    return write_report(spec, client, parent)


def test_an_architecture_ablation_over_two_corpora_gives_verdicts_per_corpus_and_pooled(tmp_path: Path) -> None:
    final = {"shakespeare": {"satformer": 5.50, "resformer": 5.60, "transformer": 5.70},  # the paper's order
             "kjv": {"satformer": 4.70, "resformer": 4.60, "transformer": 4.50}}  # the opposite

    def loss(corpus: str, arch: str, seed: int, step: int) -> float:
        seed_effect = (0.0, 0.03, -0.02)[seed] + 0.002 * (arch == "resformer") * seed
        return final[corpus][arch] + seed_effect + 3.0 * (128 - step) / 128

    files = synthetic_two_corpus_report(tmp_path, loss)
    verdicts = {v["claim"]: v for v in json.loads(files["summary"].read_text())["verdicts"]}
    claim = "SATFormer < ResFormer < Transformer in final validation loss"
    assert verdicts[f"{claim} (source=shakespeare)"]["outcome"] == "held"
    assert verdicts[f"{claim} (source=kjv)"]["outcome"] == "contradicted"
    pooled = verdicts[f"{claim} (pooled over source=shakespeare; source=kjv)"]
    assert pooled["outcome"] == "not resolved"  # a result that depends on the corpus
    assert all(c["paired"] for c in pooled["comparisons"]) and len(pooled["comparisons"]) == 2
    retrieval = verdicts["SATFormer best on the retrieval average (source=kjv)"]
    assert retrieval["outcome"] == "not measurable at this scale"
    assert "Holm" in files["markdown"].read_text()
    header, *rows = json.loads(files["summary"].read_text())["table"]
    by_cell = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert by_cell["source=kjv, arch=transformer (baseline)"]["p (loss)"] == "baseline"  # each corpus its own
    assert float(by_cell["source=kjv, arch=satformer"]["p (loss)"]) < 0.05


def test_the_report_gives_the_loss_of_every_cell_at_matched_tokens_and_the_order_at_each(tmp_path: Path) -> None:
    """An order that changes along the curve: the Transformer leads early on Shakespeare, SATFormer at the end."""
    early = {"transformer": 6.0, "resformer": 6.1, "satformer": 6.2}
    late = {"satformer": 5.5, "resformer": 5.6, "transformer": 5.7}

    def loss(corpus: str, arch: str, seed: int, step: int) -> float:
        shift = 0.5 * (corpus == "kjv") + 0.01 * seed
        return 9.0 + shift if step == 0 else (early if step < 64 else late)[arch] + shift

    files = synthetic_two_corpus_report(tmp_path, loss)
    summary = json.loads(files["summary"].read_text())
    header, *rows = summary["matched_tokens"]
    assert header == ["cell", "65,536", "131,072", "262,144"]  # every shared validation but the untrained one
    by_cell = {row[0]: row[1:] for row in rows}
    assert by_cell["source=kjv, arch=satformer"] == ["6.7100 ± 0.0100", "6.7100 ± 0.0100", "6.0100 ± 0.0100"]
    orders = summary["loss_orders"]
    assert orders["source=shakespeare"]["65536"] == ["transformer", "resformer", "satformer"]
    assert orders["source=shakespeare"]["262144"] == ["satformer", "resformer", "transformer"]
    assert set(orders) == {"source=shakespeare", "source=kjv"}
    text = files["markdown"].read_text()
    assert "## Validation loss at matched tokens" in text
    assert ("(source=shakespeare), tokens: 65,536: Transformer < ResFormer < SATFormer; 131,072: Transformer < "
            "ResFormer < SATFormer; 262,144: SATFormer < ResFormer < Transformer.") in text


@pytest.mark.slow  # make test-full
def test_a_longer_budget_report_says_whether_the_shorter_ablations_order_persists(tmp_path: Path) -> None:
    """Shakespeare: the short run ends with SATFormer best and the long one keeps it; KJV: the order at the short
    budget turns round by the end of the long one."""
    def loss(corpus: str, arch: str, seed: int, step: int) -> float:
        if step == 0:
            return 9.0
        flipped = corpus == "kjv" and step > 200
        rank = ["satformer", "resformer", "transformer"].index(arch)
        return 5.0 + 0.1 * (2 - rank if flipped else rank) + 0.01 * seed - 0.001 * step

    short = tmp_path / "short.yml"
    short.write_text(yaml.safe_dump(TWO_CORPORA | {"name": "short", "out_dir": str(tmp_path / "short")}))
    missing = synthetic_two_corpus_report(tmp_path, loss, "long", (0, 63, 127, 512), compare_with=str(short))
    assert f"`{short}` has no runs in this store" in missing["markdown"].read_text()
    synthetic_two_corpus_report(tmp_path, loss, "short", (0, 63, 128))
    files = synthetic_two_corpus_report(tmp_path, loss, "long", (0, 63, 127, 512), compare_with=str(short))
    budgets = json.loads(files["summary"].read_text())["budget_comparison"]
    assert budgets["source=shakespeare"] == {
        "there_tokens": 262_144, "there": ["satformer", "resformer", "transformer"], "here_tokens": 1_048_576,
        "here_same_tokens": ["satformer", "resformer", "transformer"],
        "here": ["satformer", "resformer", "transformer"], "persists": True}
    assert budgets["source=kjv"]["here"] == ["transformer", "resformer", "satformer"]
    assert not budgets["source=kjv"]["persists"]
    text = files["markdown"].read_text()
    assert ("- source=kjv: `" + str(short) + "` at its end (262,144 tokens) SATFormer < ResFormer < Transformer; "
            "here at 262,144 tokens SATFormer < ResFormer < Transformer; here at the end (1,048,576 tokens) "
            "Transformer < ResFormer < SATFormer: the order **changes**.") in text
    with pytest.raises(ConfigError, match="compare_with: .*arch_tiy.*did you mean 'arch_tiny'"):
        load_ablation("paper_long", ["compare_with=arch_tiy"])
