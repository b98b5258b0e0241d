"""An ablation's results where people look at them: on the MLflow parent run (metrics, params, verdict tags that a
later report replaces), in a report.html that shows its figures inside MLflow's sandboxed artifact viewer, and in a
report and plots without empty orders, clipped curves or claims about architectures the ablation does not have.
Ablations of recorded runs (no training): seconds each."""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import mlflow
import numpy as np
import pytest
from test_ablate import TWO_CORPORA, assert_results_on_parent

from satlab.studies.ablation_claims import paper_verdicts
from satlab.studies.ablation_plots import draw_curves
from satlab.studies.ablation_report import write_report
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import spec_from_dict
from satlab.studies.results import LM_MEASURES, RECALL_MEASURES, CellResult, GroupResult
from satlab.studies.runs import CELL_TAG, PARENT_TAG, create_parent_run

PNG = b"\x89PNG\r\n\x1a\n"
FINAL = {"satformer": 5.5, "resformer": 5.6, "transformer": 5.7}
Loss = Callable[[dict, int, int], float]


def paper_loss(values: dict, seed: int, step: int) -> float:
    """9.0 untrained, then down to the paper's order at the end (KJV 0.5 lower), a seed effect on top (and a little
    noise on ResFormer's, so that no paired difference is constant)."""
    arch = values["model.arch"]
    end = FINAL[arch] - 0.5 * (values.get("data.source") == "kjv") + (0.0, 0.03, -0.02)[seed] + \
        0.002 * seed * (arch == "resformer")
    return 9.0 if step == 0 else end + 2.0 * (128 - step) / 128


def recorded_ablation(tmp_path: Path, spec_fields: dict[str, Any], loss: Loss = paper_loss,
                      steps: tuple[int, ...] = (0, 31, 63, 128)) -> tuple[AblationSpec, mlflow.MlflowClient, str]:
    """A parent run and one finished child run per cell of the spec, as a trained cell would log them: the
    validation loss ``loss(values, seed, step)`` at ``steps`` (before training, inside it, at the end; 2,048 tokens
    a step) and a retrieval average at the end."""
    spec = spec_from_dict(AblationSpec, {"base": "ablations/tiny_cell", "out_dir": str(tmp_path / "out")} | spec_fields)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_parent_run(client, spec, str(tmp_path / "artifacts"))
    experiment = client.get_run(parent).info.experiment_id
    for cell in spec.cells():
        run = client.create_run(experiment, tags={PARENT_TAG: parent, CELL_TAG: cell.key}).info.run_id
        record_cell(client, run, dict(cell.values), cell.seed, loss, steps)
    return spec, client, parent


def record_cell(client: mlflow.MlflowClient, run: str, values: dict, seed: int, loss: Loss,
                steps: tuple[int, ...]) -> None:
    client.log_param(run, "derived.tokens_per_step", 2048)
    client.log_param(run, "derived.max_steps", steps[-1])
    client.log_param(run, "model.params", 1000 + len(values["model.arch"]))
    for step in steps:
        client.log_metric(run, "val/loss", loss(values, seed, step), step=step)
    client.log_metric(run, "zero_shot/offline_retrieval_avg", 0.25 + 0.01 * (seed - 1), step=steps[-1])
    client.set_terminated(run)


@pytest.fixture(scope="module")
def paper_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[AblationSpec, mlflow.MlflowClient, str, dict]:
    """T/R/S x two corpora x 3 seeds, one cell with a gate heatmap: the report's files."""
    tmp_path = tmp_path_factory.mktemp("paper")
    spec, client, parent = recorded_ablation(tmp_path, TWO_CORPORA | {"name": "views"})
    heatmap = tmp_path / "heatmap.png"
    plt.imsave(heatmap, np.random.default_rng(0).random((10, 10)))
    child = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'")[0]
    client.log_artifact(child.info.run_id, str(heatmap), "gates/step_4")
    return spec, client, parent, write_report(spec, client, parent)


def test_the_parent_run_carries_each_groups_numbers_and_each_claims_verdict(paper_report) -> None:
    spec, client, parent, files = paper_report
    summary = json.loads(files["summary"].read_text())
    assert_results_on_parent(client, parent, summary)
    metrics, tags = client.get_run(parent).data.metrics, client.get_run(parent).data.tags
    kjv_satformer = [FINAL["satformer"] - 0.5 + e for e in (0.0, 0.03, -0.02)]
    assert metrics["variants/source-kjv arch-satformer/val_loss_mean"] == pytest.approx(np.mean(kjv_satformer))
    assert metrics["variants/source-kjv arch-satformer/val_loss_std"] == pytest.approx(np.std(kjv_satformer, ddof=1))
    assert metrics["variants/source-kjv arch-satformer/val_loss_n"] == 3
    assert metrics["variants/source-kjv arch-satformer/cells"] == 3
    assert metrics["variants/source-kjv arch-satformer/retrieval_mean"] == pytest.approx(0.25)
    assert metrics["variants/source-kjv arch-satformer/val_loss_p"] < 0.05  # against the KJV Transformer
    assert "variants/source-kjv arch-transformer/val_loss_p" not in metrics  # the baseline itself
    assert client.get_run(parent).data.params["variant.source-kjv arch-satformer"] == \
        "data.source=kjv model.arch=satformer"
    assert tags["verdict.loss_order.source-kjv"] == "held" and tags["verdict.loss_order.pooled"] == "held"
    assert tags["verdict.retrieval_best.source-shakespeare"] == "not measurable at this scale"
    assert 0 < metrics["verdicts/loss_order.pooled/SATFormer_vs_ResFormer_p_holm"] < 0.05
    assert {k.split("/")[0] for k in metrics} == {"variants", "verdicts"}  # sections after train/ and val/


def test_a_second_report_replaces_the_parent_runs_results_without_duplicates(tmp_path: Path) -> None:
    axes = {"data.source": ["shakespeare", "kjv"], "model.arch": ["transformer", "resformer", "satformer"],
            "train.seed": [0, 1]}
    spec, client, parent = recorded_ablation(tmp_path, TWO_CORPORA | {"name": "again", "axes": axes})
    write_report(spec, client, parent)
    before = client.get_run(parent).data
    write_report(spec, client, parent)  # nothing new: nothing logged again
    assert client.get_run(parent).data.metrics == before.metrics
    assert_results_on_parent(client, parent, json.loads((spec.out_path() / "summary.json").read_text()))

    cell = next(c for c in spec.cells() if dict(c.values)["model.arch"] == "satformer")  # rerun: a newer run wins
    rerun = client.create_run(client.get_run(parent).info.experiment_id, tags={PARENT_TAG: parent, CELL_TAG: cell.key})
    record_cell(client, rerun.info.run_id, dict(cell.values), cell.seed, lambda v, s, t: 7.0 - t / 100, (0, 128))
    files = write_report(spec, client, parent)
    summary = json.loads(files["summary"].read_text())
    assert_results_on_parent(client, parent, summary)
    key = "variants/source-shakespeare arch-satformer/val_loss_mean"
    assert [m.value for m in client.get_metric_history(parent, key)][-1] == summary["groups"][
        "source-shakespeare arch-satformer"]["measures"]["val_loss"]["mean"] != before.metrics[key]
    assert client.get_run(parent).data.metrics[key] == summary["groups"][
        "source-shakespeare arch-satformer"]["measures"]["val_loss"]["mean"]

    fewer = spec_from_dict(AblationSpec, TWO_CORPORA | {"name": "again", "out_dir": str(tmp_path / "fewer"),
                                                        "axes": axes | {"model.arch": ["transformer", "satformer"]}})
    summary = json.loads(write_report(fewer, client, parent)["summary"].read_text())  # ResFormer out of the grid
    assert_results_on_parent(client, parent, summary)  # its claims' tags deleted, its numbers NaN
    run = client.get_run(parent).data
    assert "verdict.loss_order.pooled" not in run.tags and "verdict.retrieval_best.pooled" in run.tags
    assert math.isnan(run.metrics["variants/source-kjv arch-resformer/val_loss_mean"])


class Links(HTMLParser):
    """Every ``src`` and ``href`` of a page, and the ``src`` of its images."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value is not None:
                self.targets.append(value)
                if tag == "img":
                    self.images.append(value)


def test_report_html_is_self_contained_with_its_figures_as_png_data_uris(paper_report) -> None:
    _, client, parent, files = paper_report
    page = Links()
    page.feed(files["html"].read_text())
    markdown = files["markdown"].read_text()
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert shown == ["loss_curves.png", "gate_heatmaps.png"]  # the Markdown keeps its relative links
    assert all(re.match(r"(data|https?):|#", target) for target in page.targets), page.targets
    assert len(page.images) == len(shown)
    for src, name in zip(page.images, shown, strict=True):
        assert src.startswith("data:image/png;base64,")
        image = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert image.startswith(PNG) and image == (files["markdown"].parent / name).read_bytes()
    logged = {a.path for a in client.list_artifacts(parent, "report")}
    assert "report/report.html" in logged


def test_inline_images_inlines_local_files_only_and_refuses_a_missing_one(tmp_path: Path) -> None:
    from satlab.studies.report_html import inline_images

    plt.imsave(tmp_path / "a b.png", np.zeros((4, 4)))
    page = ('<p><img src="a%20b.png" alt="x"><img src="https://example.org/c.png">'
            '<img src="data:image/png;base64,AAAA"></p>')
    inlined = inline_images(page, tmp_path)
    assert inlined.count("data:image/png;base64,") == 2 and 'src="https://example.org/c.png"' in inlined
    assert base64.b64decode(inlined.split('src="')[1].split('"')[0].split(",", 1)[1]).startswith(PNG)
    with pytest.raises(FileNotFoundError, match="missing.png"):
        inline_images('<img alt="m" src="missing.png">', tmp_path)


@pytest.fixture(scope="module")
def two_arch_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Transformer and SATFormer only, 2 seeds: no ResFormer, so no order of the paper's three."""
    tmp_path = tmp_path_factory.mktemp("two")
    spec, client, parent = recorded_ablation(
        tmp_path, {"name": "two", "axes": {"model.arch": ["transformer", "satformer"], "train.seed": [0, 1]}})
    return write_report(spec, client, parent)


def test_no_bullet_renders_an_empty_list(two_arch_report) -> None:
    markdown = two_arch_report["markdown"].read_text()
    bullets = [line for line in markdown.splitlines() if line.startswith("- ")]
    assert not [b for b in bullets if re.search(r":\s*\.?$", b)], bullets  # "tokens: ." and the like
    assert json.loads(two_arch_report["summary"].read_text())["loss_orders"] == {}
    assert "## Validation loss at matched tokens" in markdown  # the table is still there


def test_claims_about_an_architecture_the_ablation_does_not_have_are_left_out(two_arch_report) -> None:
    markdown = two_arch_report["markdown"].read_text()
    verdicts = json.loads(two_arch_report["summary"].read_text())["verdicts"]
    assert "ResFormer" not in markdown and [v["key"] for v in verdicts] == ["retrieval_best"]
    assert verdicts[0]["outcome"] == "not measurable at this scale"  # one it can check is still checked


def test_a_recall_ablation_without_resformer_claims_only_against_the_transformer() -> None:
    spec = spec_from_dict(AblationSpec, {"name": "recall-two", "base": "recall/mqar",
                                         "axes": {"model.arch": ["transformer", "satformer"], "train.seed": [0, 1]}})
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        accuracy = (0.9 if dict(cell.values)["model.arch"] == "satformer" else 0.5) + 0.01 * cell.seed
        group = groups.setdefault(cell.group, GroupResult(cell.group, cell.group_values, 2))
        group.cells.append(CellResult(cell, cell.slug, {"recall_acc": accuracy}, None, []))
    verdicts = paper_verdicts(spec, list(groups.values()), RECALL_MEASURES)
    assert [v.key for v in verdicts] == ["recall_vs_transformer"]
    assert verdicts[0].claim.startswith("SATFormer retrieves better than Transformer")


def test_the_loss_curves_keep_every_point_they_draw_in_the_frame() -> None:
    """An untrained point far above the rest (9.0, then 6.5 down to 5.5): it is left out, and the first trained
    points, the highest drawn, are inside the y-range with the rest."""
    spec = spec_from_dict(AblationSpec, {"name": "curves", "axes": {"model.arch": ["transformer", "satformer"],
                                                                    "train.seed": [0, 1]}})
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        shift = 0.2 * (dict(cell.values)["model.arch"] == "satformer") + 0.05 * cell.seed
        curve = [(0.0, 9.0), (2048.0, 6.5 + shift), (4096.0, 6.0 + shift), (8192.0, 5.5 + shift)]
        groups.setdefault(cell.group, GroupResult(cell.group, cell.group_values, 2)).cells.append(
            CellResult(cell, cell.slug, {}, None, curve))
    figure, axes = plt.subplots()
    assert draw_curves(axes, list(groups.values()), {g: g for g in groups})
    low, high = axes.get_ylim()
    drawn = [line.get_xydata() for line in axes.lines] + \
        [path.vertices for c in axes.collections for path in c.get_paths()]
    points = np.concatenate(drawn)
    assert points[:, 0].min() == 2048  # the untrained point left out
    assert low <= points[:, 1].min() and points[:, 1].max() <= high  # nothing clipped
    assert points[:, 1].max() == pytest.approx(6.5 + 0.2 + 0.05)  # the first trained point of the highest seed
    plt.close(figure)


def recall_groups(spec: AblationSpec, accuracy: Callable[[dict], float]) -> list[GroupResult]:
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        group = groups.setdefault(cell.group, GroupResult(cell.group, cell.group_values, 3))
        group.cells.append(CellResult(cell, cell.slug, {"recall_acc": accuracy(dict(cell.values))}, None, []))
    return list(groups.values())


def plan_verdict(layout: str, a: str, b: str, outcome: str, stopped_at: int | None = 1) -> dict[str, Any]:
    """One verdict of a sequential summary as the report's summary.json has it."""
    return {"arms": [{"data.mqar.layout": layout, "model.arch": a}, {"data.mqar.layout": layout, "model.arch": b}],
            "a": a, "b": b, "outcome": outcome, "stopped_at": stopped_at, "seeds": 8, "mean": 0.3, "rci": [0.1, 0.5]}


@pytest.mark.parametrize("measure", ["recall/acc", "recall/steps_to_bind"])
def test_with_a_sequential_plan_the_claims_follow_its_verdicts_not_a_fixed_number_test(measure) -> None:
    """The data say SATFormer wins everywhere by far (a fixed-number test would call every claim held); the plan's
    verdicts say otherwise, and the claims follow them: on the plan's measure a step decided against SATFormer
    contradicts, an open step leaves it not resolved, and a claim on another measure is not resolved by any test."""
    spec = spec_from_dict(AblationSpec, {
        "name": "recall-seq", "base": "recall/mqar", "baseline": {"model.arch": "satformer"},
        "axes": {"data.mqar.layout": ["adjacent", "separated"],
                 "model.arch": ["transformer", "resformer", "satformer"], "train.seed": [0, 1, 2]},
        "sequential": {"looks": [3], "measure": measure, "better": "higher" if measure == "recall/acc" else "lower",
                       "compare": "model.arch"}})
    groups = recall_groups(spec, lambda v: (0.95 if v["model.arch"] == "satformer" else 0.1) + 0.001 * v["train.seed"])
    assert {v.outcome for v in paper_verdicts(spec, groups, RECALL_MEASURES)} == {"held"}  # without the plan
    plan = {"verdicts": [plan_verdict("adjacent", "resformer", "satformer", "a_better"),
                         plan_verdict("adjacent", "transformer", "satformer", "b_better"),
                         plan_verdict("separated", "resformer", "satformer", "undecided", 3),
                         plan_verdict("separated", "transformer", "satformer", "open", None)]}
    verdicts = {v.key: v for v in paper_verdicts(spec, groups, RECALL_MEASURES, plan)}
    assert set(verdicts) == {f"recall_vs_{a}.layout-{layout}" for a in ("transformer", "resformer")
                             for layout in ("adjacent", "separated")}
    if measure != "recall/acc":
        assert {v.outcome for v in verdicts.values()} == {"not resolved"}
        assert all("this claim is on another measure" in v.detail for v in verdicts.values())
        return
    outcomes = {key: v.outcome for key, v in verdicts.items()}
    assert outcomes == {"recall_vs_resformer.layout-adjacent": "contradicted",
                        "recall_vs_transformer.layout-adjacent": "held",
                        "recall_vs_resformer.layout-separated": "not resolved",
                        "recall_vs_transformer.layout-separated": "not resolved"}
    assert "ResFormer vs SATFormer: ResFormer better (8 seeds, look 1, mean difference +0.3, positive when ResFormer " \
           "is better, repeated CI [0.1, 0.5])" in verdicts["recall_vs_resformer.layout-adjacent"].detail
    assert "Transformer vs SATFormer: open (8 seeds," in verdicts["recall_vs_transformer.layout-separated"].detail


def test_an_ablation_over_many_points_without_retrieval_states_that_claim_once_and_names_its_pooled_axes() -> None:
    """Five widths, evaluation off: the loss order is claimed at each width and pooled ("over 5 settings of
    d_model", not five labels run together); the retrieval claim, which no run could check, appears once."""
    spec = spec_from_dict(AblationSpec, {"name": "widths", "axes": {
        "model.arch": ["transformer", "resformer", "satformer"], "model.d_model": [32, 64, 128, 256, 512],
        "train.seed": [0, 1]}})
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        loss = {"satformer": 5.5, "resformer": 5.6, "transformer": 5.7}[dict(cell.values)["model.arch"]]
        groups.setdefault(cell.group, GroupResult(cell.group, cell.group_values, 2)).cells.append(
            CellResult(cell, cell.slug, {"val_loss": loss + 0.01 * cell.seed}, None, []))
    verdicts = paper_verdicts(spec, list(groups.values()), LM_MEASURES)
    claims = [v.claim for v in verdicts]
    retrieval = [c for c in claims if c.startswith("SATFormer best on the retrieval average")]
    assert retrieval == ["SATFormer best on the retrieval average"]
    assert next(v for v in verdicts if v.claim in retrieval).outcome == "could not be checked"
    order = "SATFormer < ResFormer < Transformer in final validation loss"
    assert sorted(c for c in claims if c.startswith(order)) == sorted(
        [f"{order} (d_model={d})" for d in (32, 64, 128, 256, 512)] + [f"{order} (pooled over 5 settings of d_model)"])


def test_a_title_wider_than_its_figure_is_wrapped_not_cut(tmp_path: Path) -> None:
    from satlab.studies.ablation_plots import save_figure

    titles: list[str] = []
    figure = plt.figure(figsize=(8, 4))
    figure.suptitle = lambda text, **_: titles.append(text)  # type: ignore[method-assign]
    long = ("ladder_cpu_tuned: loss against compute, fitted compute-optimal frontiers with 90 % bands "
            "(dashed: extrapolated)")
    save_figure(figure, tmp_path / "f.png", long)
    assert "\n" in titles[0] and max(len(line) for line in titles[0].splitlines()) <= 88
    assert titles[0].replace("\n", " ") == long
