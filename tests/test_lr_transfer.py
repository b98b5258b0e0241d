"""The learning-rate transfer analysis: the quadratic fit against NIST's certified Pontius values, the bootstrap
interval's coverage on synthetic curves of a known optimum (and two controls where it must not cover), the report
section on synthetic finished results, the spec's ``grids`` and ``lr_transfer`` validation, and the simulation of
the verdict's pass rate (its null passes, its drifts and a noise as large as the curves fail)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from satlab.cli.main import main
from satlab.cli.transfer import default_out
from satlab.config.errors import ConfigError
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import spec_from_dict
from satlab.studies.lookup import with_analysis_of
from satlab.studies.lr_transfer import (
    ABOVE,
    BELOW,
    INTERIOR,
    NO_MINIMUM,
    fit_quadratic,
    local_optimum,
    optimum,
    series_verdict,
)
from satlab.studies.lr_transfer_report import lr_transfer_section, wider_is_better, wider_text
from satlab.studies.lr_transfer_sim import (
    ALIGNED,
    IDENTICAL,
    MEASURED,
    Curve,
    noise_free_optimum,
    pass_rate,
    true_means,
    truths,
)
from satlab.studies.results import CellResult, GroupResult

PONTIUS = Path(__file__).parent / "data" / "pontius.dat"
# NIST StRD certified values (tests/data/pontius.dat's header)
CERTIFIED = {"b": (0.673565789473684e-03, 0.732059160401003e-06, -0.316081871345029e-14),
             "sd": (0.107938612033077e-03, 0.157817399981659e-09, 0.486652849992036e-16),
             "residual_sd": 0.205177424076185e-03, "r_squared": 0.999999900178537}


def test_quadratic_fit_matches_nist_pontius() -> None:
    data = np.loadtxt(PONTIUS)
    fit = fit_quadratic(data[:, 1], data[:, 0])
    for got, want in zip((fit.a, fit.b, fit.c), CERTIFIED["b"], strict=True):
        assert got == pytest.approx(want, rel=1e-9)
    for got, want in zip(fit.std_errors, CERTIFIED["sd"], strict=True):
        assert got == pytest.approx(want, rel=1e-8)
    assert fit.residual_sd == pytest.approx(CERTIFIED["residual_sd"], rel=1e-9)
    assert fit.r_squared == pytest.approx(CERTIFIED["r_squared"], abs=1e-12)
    assert fit.n == 40


LRS = [2.0 ** k for k in range(-13, -5)]  # 8 learning rates 2x apart, as the shipped study


def coverage(seeds: int, adjust: bool = True, shift: float = 0.0, curves: int = 200, estimate=optimum) -> float:
    """The share of ``curves`` synthetic curves (a parabola in log2 lr with its minimum drawn in [-11, -8], noise
    0.05 per seed) whose 90 % interval by ``estimate`` covers the true optimum (+ ``shift``)."""
    rng = np.random.default_rng(1)
    covered = 0
    for i in range(curves):
        x0 = rng.uniform(-11, -8)
        points = {lr: list(0.15 * (math.log2(lr) - x0) ** 2 + 3 + rng.normal(0, 0.05, seeds)) for lr in LRS}
        o = estimate(points, 0.9, 500, seed=i, adjust=adjust)
        covered += o.interval is not None and o.interval[0] <= x0 + shift <= o.interval[1]
    return covered / curves


def test_bootstrap_interval_covers_near_nominal_with_controls() -> None:
    """At the study's design (2 seeds a point; 3 at the base shape) the interval covers the true optimum near the
    nominal 0.9 (measured 0.82 and 0.88); the plain resampling of two seeds, and the interval judged against an
    optimum half an octave off, do not."""
    two, three = coverage(2), coverage(3)
    assert 0.76 <= two <= 0.95 and 0.82 <= three <= 0.96, (two, three)
    assert coverage(2, adjust=False) < 0.7  # negative control: plain resampling understates the spread
    assert coverage(3, shift=0.5) < 0.2  # negative control: a wrong optimum is not covered


def test_local_interval_covers_near_nominal_with_controls() -> None:
    """The local fit's interval, the best learning rate picked again in each resample: near the nominal 0.9 on
    parabolas (measured 0.83 at two seeds a point and 0.85 at three), and not around an optimum half an octave off."""
    two, three = coverage(2, estimate=local_optimum), coverage(3, estimate=local_optimum)
    assert 0.76 <= two <= 0.95 and 0.78 <= three <= 0.96, (two, three)
    assert coverage(3, shift=0.5, estimate=local_optimum) < 0.2  # negative control


def asymmetric(x0: float, steepness: float, rng: np.random.Generator, seeds: int = 2, noise: float = 0.02) \
        -> dict[float, list[float]]:
    """A short run's curve: ``steepness`` times as steep below the optimum x0 (log2 lr) as above it; 7 rates."""
    def loss(x: float) -> float:
        return 0.1 * (steepness if x < x0 else 1.0) * (x - x0) ** 2 + 3
    return {2.0 ** k: list(loss(k) + rng.normal(0, noise, seeds)) for k in range(-11, -4)}


def test_lack_of_fit_holds_its_level_and_catches_an_asymmetric_curve() -> None:
    """The pure-error F test rejects about 5 % of true parabolas at p < 0.05 (measured 4.7 % of 300) and most
    curves twice as steep on one side (measured 96 %)."""
    rng = np.random.default_rng(2)
    null = [optimum(asymmetric(rng.uniform(-10, -6), 1.0, rng), 0.9, 100).lack_of_fit_p for _ in range(300)]
    skew = [optimum(asymmetric(rng.uniform(-10, -6), 2.0, rng), 0.9, 100).lack_of_fit_p for _ in range(100)]
    assert 0.02 <= np.mean([p < 0.05 for p in null]) <= 0.09
    assert np.mean([p < 0.05 for p in skew]) >= 0.85
    one_seed = {lr: ys[:1] for lr, ys in asymmetric(-8, 1.0, rng).items()}
    assert optimum(one_seed).lack_of_fit_p is None  # no pure error to test against


def test_local_fit_is_less_biased_on_asymmetric_curves() -> None:
    """Where one parabola over the sweep is wrong, the local fit's optimum is nearer the truth (measured mean error
    0.30 against 0.14 octaves at twice the steepness below the optimum), and both are unbiased on a parabola."""
    def mean_error(steepness: float, estimate) -> float:
        rng = np.random.default_rng(3)
        errors = []
        for _ in range(150):
            x0 = rng.uniform(-10, -6)
            o = estimate(asymmetric(x0, steepness, rng), 0.9, 100)
            errors.append(o.log2_lr - x0)
        return float(np.mean(errors))
    everywhere, local = mean_error(2.0, optimum), mean_error(2.0, local_optimum)
    assert everywhere > 0.2 and 0 < local < 0.6 * everywhere, (everywhere, local)
    assert abs(mean_error(1.0, optimum)) < 0.05 and abs(mean_error(1.0, local_optimum)) < 0.05


def test_local_optimum_at_the_edge_of_the_sweep_is_not_located() -> None:
    falling = {lr: [0.1 * (math.log2(lr) + 3) ** 2, 0.1 * (math.log2(lr) + 3) ** 2 + 0.01] for lr in LRS}
    o = local_optimum(falling)
    assert o.status == ABOVE and o.log2_lr is None and o.interval is not None and o.interval[1] == math.inf
    rising = {lr: [0.1 * (math.log2(lr) + 20) ** 2, 0.1 * (math.log2(lr) + 20) ** 2 + 0.01] for lr in LRS}
    assert local_optimum(rising).status == BELOW
    inside = local_optimum({lr: [(math.log2(lr) + 9.25) ** 2 + d for d in (0, 0.01)] for lr in LRS})
    assert inside.status == INTERIOR and inside.log2_lr == pytest.approx(-9.25)  # a parabola's own vertex, exactly
    assert inside.window == (-10.0, -8.0)


def test_optimum_states_no_minimum_and_never_extrapolates() -> None:
    down = {lr: [-(math.log2(lr) + 9) ** 2, -(math.log2(lr) + 9) ** 2 + 0.01] for lr in LRS}
    assert optimum(down).status == NO_MINIMUM and optimum(down).log2_lr is None
    beyond = {lr: [0.1 * (math.log2(lr) + 3) ** 2, 0.1 * (math.log2(lr) + 3) ** 2 + 0.01] for lr in LRS}
    o = optimum(beyond)
    assert o.status == ABOVE and o.log2_lr is None and o.lr is None
    assert o.interval is not None and o.interval[1] == math.inf  # not a number beyond the sweep


def test_series_verdict() -> None:
    def shape(x0: float) -> dict[float, list[float]]:
        return {lr: [(math.log2(lr) - x0) ** 2 * 0.2 + d for d in (0.0, 0.01)] for lr in LRS}
    optima = {s: optimum(shape(x0)) for s, x0 in (("w32", -9.1), ("w64", -9.0), ("w128", -8.9), ("w256", -7.0))}
    assert optima["w64"].status == INTERIOR
    v = series_verdict(optima, "w64", ["w32", "w64", "w128", "w256"], [], 0.5)
    assert v.outcome == "does not transfer" and v.outside == ("w256",)
    assert v.width_shift == pytest.approx(2.1, abs=0.05) and v.depth_shift is None
    ok = series_verdict({k: optima[k] for k in ("w32", "w64", "w128")}, "w64", ["w32", "w64", "w128"], [], 0.5)
    assert ok.outcome == "transfers" and ok.outside == ()
    assert series_verdict(optima, "w16", [], [], 0.5).outcome == "not measurable"


def transfer_spec(**extra: object) -> AblationSpec:
    data = {"name": "t", "axes": {"model.arch": ["transformer"], "model.d_model": [32, 64, 128],
                                  "model.n_layers": [2, 4], "optim.lr": LRS, "train.seed": [0, 1, 2]},
            "grids": [{"model.n_layers": [2], "train.seed": [0, 1]},
                      {"model.d_model": [32], "train.seed": [0, 1]}, {"model.d_model": [32], "model.n_layers": [2]}],
            "lr_transfer": {"lr_key": "optim.lr", "width_keys": ["model.d_model"], "depth_keys": ["model.n_layers"],
                            "base": {"model": {"d_model": 32, "n_layers": 2}}}}
    return spec_from_dict(AblationSpec, {**data, **extra})


def test_grids_select_a_union_of_sub_grids() -> None:
    spec = transfer_spec()
    cells = spec.cells()
    shapes = {(c.group_values["model.d_model"], c.group_values["model.n_layers"]) for c in cells}
    assert shapes == {(32, 2), (64, 2), (128, 2), (32, 4)}  # (64, 4) and (128, 4) in no sub-grid
    seeds = {s: sum(1 for c in cells if (c.group_values["model.d_model"], c.group_values["model.n_layers"]) == s)
             for s in shapes}
    assert seeds == {(32, 2): 24, (64, 2): 16, (128, 2): 16, (32, 4): 16}  # 3 seeds at the base, 2 elsewhere
    assert len({c.key for c in cells}) == len(cells)


@pytest.mark.parametrize(("change", "message"), [
    ({"grids": [{"model.d_modl": [32]}]}, "not an axis"),
    ({"grids": [{"model.d_model": [48]}]}, "not among the axis values"),
    ({"lr_transfer": {"lr_key": "optim.lrr", "base": {"model.d_model": 32, "model.n_layers": 2}}}, "not an axis"),
    ({"lr_transfer": {"lr_key": "optim.lr", "base": {"model.d_model": 32}}}, "missing model.n_layers"),
    ({"lr_transfer": {"lr_key": "optim.lr", "base": {"model.d_model": 48, "model.n_layers": 2}}},
     "not among the axis values"),
    ({"lr_transfer": {"lr_key": "optim.lr", "bse": {}}}, "unknown key"),
    ({"lr_transfer": {"lr_key": "optim.lr", "base": {"model.d_model": 32, "model.n_layers": 2}, "fit": "loacl"}},
     "not one of all, local"),
    ({"lr_transfer": {"lr_key": "optim.lr", "base": {"model.d_model": 32, "model.n_layers": 2}, "level": 1.5}},
     "level"),
])
def test_spec_validation(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        transfer_spec(**change)
    assert message in "\n".join(excinfo.value.problems)


def finished_groups(spec: AblationSpec, optimum_of: dict[tuple[int, int], float]) -> list[GroupResult]:
    """Synthetic finished results: every cell of the grid with a final loss on a parabola around its shape's
    optimum (log2 lr), seed noise fixed."""
    rng = np.random.default_rng(0)
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        values = cell.group_values
        shape = (values["model.d_model"], values["model.n_layers"])
        loss = 0.2 * (math.log2(values["optim.lr"]) - optimum_of[shape]) ** 2 + 4 + rng.normal(0, 0.01)
        group = groups.setdefault(cell.group, GroupResult(cell.group, values, 0))
        curve = [(100.0 * k, loss + 0.5 / k) for k in (1, 2, 3)]
        group.cells.append(CellResult(cell, f"run-{cell.slug}", {"val_loss": loss}, 1000 * shape[0], curve))
    return list(groups.values())


def test_report_section_on_synthetic_results(tmp_path: Path) -> None:
    spec = transfer_spec()
    groups = finished_groups(spec, {(32, 2): -9.0, (64, 2): -9.1, (128, 2): -8.9, (32, 4): -7.5})
    lines, summary, figure = lr_transfer_section(spec, groups, tmp_path)
    text = "\n".join(lines)
    assert "## Learning-rate transfer" in text and "### Transformer" in text
    assert "**does not transfer** (outside: d_model=32 n_layers=4)" in text
    assert figure is not None and figure.stat().st_size > 0
    series = summary["series"][0]
    assert series["base_log2_lr"] == pytest.approx(-9.0, abs=0.1)
    assert [s["seeds"] for s in series["shapes"].values()] == [3, 2, 2, 2]  # every seed of every point fitted
    assert series["shapes"]["d_model=32 n_layers=4"]["log2_lr"] == pytest.approx(-7.5, abs=0.1)
    assert series["width_shift"] == pytest.approx(0.1, abs=0.15)
    assert series["depth_shift"] == pytest.approx(1.5, abs=0.15)
    assert summary["sweep"]["base_params"] == 32000
    assert summary["sweep"]["tokens_per_param"] == pytest.approx(summary["sweep"]["max_tokens"] / 32000)
    wider = series["wider_is_better"]  # the width series at the base depth, every learning rate checked
    assert wider["widths"] == ["d_model=32 n_layers=2", "d_model=64 n_layers=2", "d_model=128 n_layers=2"]
    assert len(wider["holds_at"]) + len(wider["broken"]) == len(spec.axes["optim.lr"])
    assert "Wider is better (mean validation loss strictly lower" in text
    good = finished_groups(spec, {(32, 2): -9.0, (64, 2): -9.1, (128, 2): -8.9, (32, 4): -9.05})
    assert "**transfers**" in "\n".join(lr_transfer_section(spec, good, tmp_path)[0])
    off = transfer_spec(lr_transfer={})
    assert lr_transfer_section(off, groups, tmp_path) == ([], None, None)


def rung_spec(**plan: object) -> AblationSpec:
    """A ladder-like sweep: each shape with its own token budget (a rung at a fixed number of tokens per
    parameter), the budget a tied key of the shape."""
    data = {"name": "rungs", "axes": {"model.arch": ["transformer"], "model.d_model": [32, 64],
                                      "model.n_layers": [2, 4], "train.max_tokens": [2048, 8192], "optim.lr": LRS,
                                      "train.seed": [0, 1]},
            "grids": [{"model.d_model": [32], "model.n_layers": [2], "train.max_tokens": [2048]},
                      {"model.d_model": [64], "model.n_layers": [4], "train.max_tokens": [8192]}],
            "lr_transfer": {"lr_key": "optim.lr", "width_keys": ["model.d_model"], "depth_keys": ["model.n_layers"],
                            "tied_keys": ["train.max_tokens"],
                            "base": {"model.d_model": 64, "model.n_layers": 4, "train.max_tokens": 8192}, **plan}}
    return spec_from_dict(AblationSpec, data)


def test_a_tied_key_labels_the_shape_and_sets_the_base_horizon(tmp_path: Path) -> None:
    """The shapes of a ladder-like sweep change width, depth and budget together: each is its own shape, judged
    against the base; the sweep's recorded horizon is the base shape's budget, not the base config's."""
    spec = rung_spec()
    groups = finished_groups(spec, {(32, 2): -9.0, (64, 4): -8.0})
    lines, summary, _ = lr_transfer_section(spec, groups, tmp_path)
    series = summary["series"][0]
    assert set(series["shapes"]) == {"d_model=32 n_layers=2 max_tokens=2048", "d_model=64 n_layers=4 max_tokens=8192"}
    assert series["outcome"] == "does not transfer" and series["width_shift"] is None
    assert summary["sweep"]["max_tokens"] == 8192 and summary["sweep"]["per_shape_tokens"]
    assert summary["sweep"]["tokens_per_param"] == pytest.approx(8192 / 64000)
    assert "Each shape trains on its own token budget (in its label); the base shape's runs: 8,192 tokens" in (
        "\n".join(lines))
    with pytest.raises(ConfigError, match="missing train.max_tokens"):
        rung_spec(base={"model.d_model": 64, "model.n_layers": 4})
    with pytest.raises(ConfigError, match="given twice"):
        rung_spec(tied_keys=["model.d_model"])


def test_report_section_with_the_local_fit(tmp_path: Path) -> None:
    """``fit: local``: the table and verdict from the local fit, the all-points verdict stated beside it, the
    lack-of-fit column, and summary.json saying which fit it used."""
    plan = {"lr_key": "optim.lr", "width_keys": ["model.d_model"], "depth_keys": ["model.n_layers"],
            "base": {"model": {"d_model": 32, "n_layers": 2}}, "fit": "local"}
    spec = transfer_spec(lr_transfer=plan)
    groups = finished_groups(spec, {(32, 2): -9.0, (64, 2): -9.1, (128, 2): -8.9, (32, 4): -7.5})
    lines, summary, _ = lr_transfer_section(spec, groups, tmp_path)
    text = "\n".join(lines)
    assert "the parabola through the mean final validation loss at the best" in text
    assert "With a quadratic over every learning rate instead: does not transfer" in text
    assert "lack of fit p" in text
    series = summary["series"][0]
    assert series["fit"] == "local" and series["all_points"]["outcome"] == "does not transfer"
    assert series["outcome"] == "does not transfer" and series["base_log2_lr"] == pytest.approx(-9.0, abs=0.2)
    assert series["shapes"]["d_model=32 n_layers=2"]["window"] == [-10.0, -8.0]


def test_the_report_takes_the_fit_from_the_spec_file_of_the_same_study() -> None:
    """`satlab report` writes from the spec saved with the study, but its analysis block from the spec file now, as
    long as the file is the same study (same fingerprint); another study's file changes nothing."""
    local = {"lr_key": "optim.lr", "width_keys": ["model.d_model"], "depth_keys": ["model.n_layers"],
             "base": {"model": {"d_model": 32, "n_layers": 2}}, "fit": "local"}
    stored, now = transfer_spec(), transfer_spec(lr_transfer=local)
    assert stored.lr_transfer.fit == "all"
    merged = with_analysis_of(stored, now)
    assert merged.lr_transfer.fit == "local" and merged.axes == stored.axes
    other = transfer_spec(lr_transfer=local, overrides={"train.max_tokens": 4096})
    assert other.fingerprint() != stored.fingerprint()
    assert with_analysis_of(stored, other).lr_transfer.fit == "all"


def test_wider_is_better_holds_only_where_every_wider_model_is_lower_at_every_step() -> None:
    """Every validation after training began; the untrained one (0 tokens), near ln(vocabulary) at every width (here
    the narrow model's a hair lower), is not one of them."""
    narrow = {1e-3: {0.0: 5.5450, 100.0: 5.0, 200.0: 4.0}, 2e-3: {100.0: 5.0, 200.0: 4.0}, 4e-3: {100.0: 5.0}}
    middle = {1e-3: {0.0: 5.5452, 100.0: 4.9, 200.0: 3.9}, 2e-3: {100.0: 4.9, 200.0: 4.0}, 4e-3: {100.0: 4.0}}
    wide = {1e-3: {0.0: 5.5452, 100.0: 4.8, 200.0: 3.8}, 2e-3: {100.0: 4.8, 200.0: 3.7}}  # 4e-3 not run at this width
    wider = wider_is_better([narrow, middle, wide], ["d=32", "d=64", "d=128"])
    assert wider["holds_at"] == [1e-3]
    assert wider["broken"] == [{"lr": 2e-3, "tokens": 200.0, "losses": "d=32 4.0000, d=64 4.0000, d=128 3.7000"}]
    assert "holds at 1 of 2 learning rates; broken at lr 0.002 (first at lr 0.002, 200 tokens" in wider_text(wider)
    assert "not checked" in wider_text(wider_is_better([narrow], ["d=32"]))


def write_summary(tmp_path: Path) -> Path:
    """A finished study's summary.json, its lr_transfer entry from the report section on synthetic results."""
    spec = transfer_spec(overrides={"train.max_tokens": 4096})
    groups = finished_groups(spec, {(32, 2): -9.0, (64, 2): -9.1, (128, 2): -8.9, (32, 4): -9.05})
    _, transfer, _ = lr_transfer_section(spec, groups, tmp_path)
    transfer["sweep"]["commit"] = "abc123"
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"name": "t", "parent_run_id": "run42", "lr_transfer": transfer}))
    return path


def test_the_default_preset_name_says_the_architecture_once() -> None:
    assert default_out("paper/small/satformer", "satformer", "completep").name == "paper_small_satformer-completep.yaml"
    assert default_out("default", "transformer", "mup").name == "default-transformer-mup.yaml"


def test_transfer_dry_run_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = write_summary(tmp_path)
    out = tmp_path / "preset.yaml"
    args = ["transfer", str(summary), "--target", "default", "--arch", "transformer", "--out", str(out)]
    assert main([*args, "--dry-run"]) == 0
    assert not out.exists() and "optim:" in capsys.readouterr().out
    assert main(args) == 0
    text = out.read_text()
    data = yaml.safe_load(text)
    assert data["base"] == "default" and data["optim"]["lr"] == pytest.approx(2 ** -9, rel=0.1)
    assert data["model"] == {"parametrization": "completep", "base_width": 32, "base_depth": 2, "depth_alpha": 1.0}
    swept = json.loads(summary.read_text())
    swept["lr_transfer"]["plan"]["base"]["model.n_heads"] = 2  # a study whose base shape names its heads: 16 each
    summary.write_text(json.dumps(swept))
    assert main(args) == 0
    assert yaml.safe_load(out.read_text())["model"]["base_head_dim"] == 16
    assert "parent run run42, commit abc123" in text and "4,096 tokens per run" in text
    assert "tokens per parameter" in text and "do not cover another" in text


@pytest.mark.parametrize("bad", [["--arch", "satformer"], ["--target", "no_such_preset"], ["--study", "missing"]])
def test_transfer_bad_input_writes_nothing(tmp_path: Path, bad: list[str], capsys: pytest.CaptureFixture[str]) \
        -> None:
    summary = write_summary(tmp_path)
    out = tmp_path / "preset.yaml"
    study = str(tmp_path / "nowhere") if bad[0] == "--study" else str(summary)
    args = {"--target": "default", "--arch": "transformer"}
    if bad[0] != "--study":
        args[bad[0]] = bad[1]
    argv = ["transfer", study, "--out", str(out)] + [x for kv in args.items() for x in kv]
    assert main(argv) == 2
    assert not out.exists() and "error" in capsys.readouterr().err


def test_the_report_sets_each_optimum_beside_an_earlier_studys(tmp_path: Path) -> None:
    """``compare_with``: the earlier study's summary.json (as its report wrote it) is read, and every shape's optimum
    is set beside the same shape's then, with the move in octaves; an earlier study that cannot be read is said so
    and the section is still written."""
    spec = transfer_spec()
    then = finished_groups(spec, {(32, 2): -9.0, (64, 2): -9.1, (128, 2): -8.9, (32, 4): -7.5})
    _, earlier, _ = lr_transfer_section(spec, then, tmp_path)
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "summary.json").write_text(json.dumps({"lr_transfer": earlier}))
    plan = {"lr_key": "optim.lr", "width_keys": ["model.d_model"], "depth_keys": ["model.n_layers"],
            "base": {"model": {"d_model": 32, "n_layers": 2}}, "compare_with": str(tmp_path / "earlier")}
    later = transfer_spec(lr_transfer=plan)
    now = finished_groups(later, {(32, 2): -8.0, (64, 2): -9.1, (128, 2): -8.9, (32, 4): -7.5})
    lines, summary, _ = lr_transfer_section(later, now, tmp_path)
    moves = summary["compared_with"]["series"]["Transformer"]
    assert moves["d_model=32 n_layers=2"]["move"] == pytest.approx(1.0, abs=0.15)  # the base moved an octave up
    assert moves["d_model=64 n_layers=2"]["move"] == pytest.approx(0.0, abs=0.15)
    assert moves["d_model=32 n_layers=4"]["then"] == pytest.approx(-7.5, abs=0.1)
    text = "\n".join(lines)
    assert f"### Compared with {tmp_path / 'earlier'}" in text and "| move (octaves)" in text
    plan["compare_with"] = str(tmp_path / "nowhere")
    lines, summary, _ = lr_transfer_section(transfer_spec(lr_transfer=plan), now, tmp_path)
    assert "Not compared: " in "\n".join(lines) and "error" in summary["compared_with"]


def test_a_curve_runs_through_the_means_and_straight_beyond_them() -> None:
    curve = Curve.through([0.0, 1.0, 2.0, 3.0], [3.0, 1.0, 0.0, 1.0])
    assert curve(np.array([0.0, 1.0, 2.0, 3.0])) == pytest.approx([3.0, 1.0, 0.0, 1.0])
    above, below = curve(np.array([3.0, 4.0, 5.0])), curve(np.array([-2.0, -1.0, 0.0]))
    assert above[2] - above[1] == pytest.approx(above[1] - above[0]) and above[1] > above[0]
    assert below[1] - below[0] == pytest.approx(below[2] - below[1]) and below[0] > below[2]


def simulated_study(optimum_of: dict[tuple[int, int], float]) -> tuple[AblationSpec, list[GroupResult]]:
    spec = transfer_spec(lr_transfer={"lr_key": "optim.lr", "width_keys": ["model.d_model"],
                                      "depth_keys": ["model.n_layers"], "fit": "local",
                                      "base": {"model.d_model": 32, "model.n_layers": 2}})
    return spec, finished_groups(spec, optimum_of)


def test_a_finished_study_becomes_the_simulations_truth() -> None:
    spec, groups = simulated_study({(32, 2): -9.0, (64, 2): -8.5, (128, 2): -9.0, (32, 4): -9.0})
    [truth] = truths(spec, groups)
    assert truth.base == "d_model=32 n_layers=2"
    assert truth.steps == {"d_model=32 n_layers=2": 0.0, "d_model=64 n_layers=2": 1.0,
                           "d_model=128 n_layers=2": 2.0, "d_model=32 n_layers=4": 1.0}
    assert all(0.003 < sd < 0.02 for sd in truth.noise.values())  # the study's seed noise is 0.01
    levels = np.log2(LRS)
    moved = "d_model=64 n_layers=2"
    assert truth.alignment[moved] == pytest.approx(0.5, abs=0.06)  # its optimum 0.5 octave above the base's
    base = noise_free_optimum("local", levels, true_means(truth, IDENTICAL, truth.base, levels))
    for scenario, expected in ((ALIGNED, base), (MEASURED, base + 0.5), ("drift 1.5", base + 0.5)):
        assert noise_free_optimum("local", levels, true_means(truth, scenario, moved, levels)) == pytest.approx(
            expected, abs=0.06), scenario
    for group in groups:  # one seed left at the smallest learning rate of every shape: its noise is unknown
        if group.values["optim.lr"] == LRS[0]:
            del group.cells[1:]
    with pytest.raises(ConfigError, match=r"one finished seed per shape at learning rate\(s\) 0.00012207"):
        truths(spec, groups)


def test_the_verdicts_pass_rate_under_the_null_and_its_negative_controls() -> None:
    spec, groups = simulated_study({(32, 2): -9.0, (64, 2): -8.0, (128, 2): -9.0, (32, 4): -9.0})
    [truth] = truths(spec, groups)
    assert pass_rate(spec, truth, IDENTICAL, 3, 30).rate >= 0.9  # steep curves, little noise: the null passes
    assert pass_rate(spec, truth, ALIGNED, 3, 30).rate >= 0.9
    assert pass_rate(spec, truth, "drift 3", 3, 30).rate == 0  # the widest 2 octaves off: never "transfers"
    assert pass_rate(spec, truth, MEASURED, 3, 30).rate == 0  # d 64 is 1 octave off in the study itself
    noisy = dataclasses.replace(truth, noise={lr: 0.5 for lr in truth.noise})
    assert pass_rate(spec, noisy, IDENTICAL, 3, 30).rate <= 0.2  # noise as large as the curve: the null fails too
    rate = pass_rate(spec, truth, IDENTICAL, 3, 30)
    assert rate.text() == f"{rate.rate:.2f} ± {rate.mc_se:.2f}"


def test_the_transfer_simulation_command(tmp_path: Path, monkeypatch, capsys) -> None:
    spec, groups = simulated_study({(32, 2): -9.0, (64, 2): -9.0, (128, 2): -9.0, (32, 4): -9.0})
    monkeypatch.setattr("satlab.studies.lookup.open_ablation", lambda target: (spec, None, "parent"))
    monkeypatch.setattr("satlab.studies.results.collect", lambda *args: groups)
    monkeypatch.setattr("satlab.cli.ablate.load_ablation", lambda *args: spec)
    assert main(["ablate", "t", "--simulate-transfer", "4", "--seeds-per-point", "2,3", "--drifts", "1"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "share of 4 simulated studies whose verdict is \"transfers\"" in printed
    for row in ("identical", "aligned", "drift 1", "measured", "2 seeds a point", "3 seeds a point"):
        assert row in printed
    monkeypatch.setattr("satlab.studies.results.collect", lambda *args: [])
    assert main(["ablate", "t", "--simulate-transfer", "4"]) == 2
    assert "no series with a base-shape optimum among its finished runs" in capsys.readouterr().err


def test_the_transfer_simulation_of_a_study_that_never_ran_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "out_dir": str(tmp_path / "out"),
                                    "overrides": {"tracking.uri": f"sqlite:///{tmp_path / 'mlruns' / 'x.db'}"},
                                    "axes": {"optim.lr": LRS[:4], "model.d_model": [32, 64], "train.seed": [0, 1]},
                                    "lr_transfer": {"lr_key": "optim.lr", "depth_keys": [],
                                                    "base": {"model.d_model": 32}}}))
    assert main(["ablate", str(path), "--simulate-transfer", "5"]) == 2
    assert "no runs of ablation 't'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml"]
    with pytest.raises(SystemExit) as stop:
        main(["ablate", str(path), "--dry-run", "--simulate-transfer", "5"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
