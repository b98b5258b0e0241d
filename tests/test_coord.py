"""The coordinate check (`satlab coord`): slope fitting, probes, a planted width-scaled module that must fail, the
command end to end with its files and MLflow run, and bad input refused with nothing written."""

from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pytest
import torch

from satlab.bench.coord import (
    Measurement,
    coord_check,
    fit_slope,
    measure,
    seed_mean,
    series_slopes,
    shape_config,
    token_batch,
    verdict,
    worst,
)
from satlab.bench.coord_settings import FIRST_CHECKED_STEP, SP_SLOPE_SIGNAL, TRANSFER_SLOPE_LIMIT, CoordSettings, Shape
from satlab.cli.main import main

TINY = dict(widths=[32, 64], depths=[1, 2], steps=3, seeds=[0])


def test_slopes_of_synthetic_rms_are_the_exponents_they_were_made_with():
    widths = [64, 128, 256, 512, 1024]
    exponents = {"flat": 0.0, "grows": 0.5, "shrinks": -1.0, "blows_up": 2.0}
    # per width, per probe: RMS over three steps, c_step * width ** exponent (the constant differs per step)
    rms = [{p: [(1 + s) * 0.3 * w ** a for s in range(5)] for p, a in exponents.items()} for w in widths]
    slopes = series_slopes(widths, rms)
    for probe, exponent in exponents.items():
        assert slopes[probe] == pytest.approx([exponent] * 5, abs=1e-9)
    found = worst(slopes)
    assert (found["slope"], found["probe"]) == (pytest.approx(2.0), "blows_up") and found["step"] >= FIRST_CHECKED_STEP
    # points without a positive, finite RMS are left out; fewer than two points give no slope
    assert fit_slope([2, 4, 8], [1.0, 0.0, 4.0]) == pytest.approx(1.0)  # through (2, 1) and (8, 4)
    assert fit_slope([2, 4, 8], [0.0, math.nan, 4.0]) != fit_slope([2, 4, 8], [0.0, math.nan, 4.0])  # NaN


def test_seeds_combine_by_the_geometric_mean_so_slopes_average_and_the_verdict_reads_from_step_3():
    def made(exponent: float, seed_scale: float) -> Measurement:
        return Measurement({"p": [seed_scale * 2.0 ** exponent] * 5}, [1.0] * 5, 1.0, 10)

    widths = [128, 256, 512]
    per_seed = [[made(a * math.log2(w), c) for w in widths] for a, c in ((0.1, 1.0), (0.3, 5.0))]
    combined = [seed_mean([per_seed[0][i], per_seed[1][i]]) for i in range(len(widths))]
    assert series_slopes(widths, [m.rms for m in combined])["p"] == pytest.approx([0.2] * 5)  # the seeds' mean
    assert combined[0].seconds == 2.0 and combined[0].params == 10
    broken = Measurement({"p": [1.0, math.nan, 1.0, 1.0, 1.0]}, [1.0] * 5, 1.0, 10)
    assert math.isnan(seed_mean([broken, made(0.0, 1.0)]).rms["p"][1])  # a missing value is not averaged away
    early = {"p": [0.0, 9.0, 9.0, 0.02, 0.01, -0.01]}  # a transient before step 3 is recorded but not judged
    assert worst(early) == {"slope": 0.02, "probe": "p", "step": 3}


def test_the_depth_verdict_leaves_out_the_first_blocks_stream_and_nothing_else():
    """block_out[first] sits at relative depth 1/L (a different place in each model of the depth series): its slope
    is kept in the data but not judged against depth; it is judged against width, as every other probe is."""
    slopes = {"block_out[first]": [0.0] * 3 + [-1.0], "block_out[mid]": [0.0] * 3 + [0.05],
              "mlp_out[last]": [0.0] * 3 + [0.3]}
    assert worst(slopes, "depth")["probe"] == "mlp_out[last]"
    assert worst(slopes, "width")["probe"] == "block_out[first]"
    del slopes["mlp_out[last]"]
    assert worst(slopes, "depth")["slope"] == pytest.approx(0.05)


def test_per_layer_probes_are_read_at_the_first_the_middle_and_the_last_layer():
    from satlab.bench.coord_probes import Probes
    from satlab.models import build_model

    cfg = shape_config(Shape("transformer", "depth", 32, 1), CoordSettings(archs=["transformer"], **TINY))
    probes = Probes(build_model(cfg.model))
    for depth, mid in ((1, 0), (2, 0), (4, 1), (6, 2), (8, 3)):  # after ceil(L/2) of L blocks
        for layer in range(depth):
            probes.add("block_out", layer, torch.full((4,), float(layer + 1)))
        got = probes.collect()
        assert (got["block_out[first]"], got["block_out[mid]"], got["block_out[last]"]) == (1.0, mid + 1, depth)


def test_verdicts_follow_the_fixed_thresholds():
    small, large = {"slope": TRANSFER_SLOPE_LIMIT / 2, "probe": "p", "step": 1}, {"slope": -1.0, "probe": "p",
                                                                                  "step": 3}
    assert verdict("completep", small, small)["result"] == "PASS"
    assert verdict("completep", small, large)["result"] == "FAIL"
    assert verdict("mup", small, large)["result"] == "PASS"  # μP claims width only
    assert verdict("sp", small, small)["result"] == "FAIL"  # the control shows no drift: the check could not fail
    assert verdict("sp", small, {"slope": SP_SLOPE_SIGNAL * 1.5, "probe": "p", "step": 1})["result"] == "PASS"


@pytest.mark.parametrize(("arch", "own"), [
    ("transformer", {"block_out[last]"}),
    ("satformer", {"gate_logits[last]", "value_term[last]", "block_out[last]"}),
    ("hyperconnections", {"dyn_weights[last]"}),
    ("mhc", {"dyn_weights[last]"}),
    ("muddformer", {"dyn_weights[last]"}),
])
def test_every_probe_of_an_architecture_is_recorded_at_every_step(arch, own):
    settings = CoordSettings(archs=[arch], **TINY)
    cfg = shape_config(Shape(arch, "depth", 32, 2), settings)
    m = measure(cfg, [token_batch(2, 16)] * 2)  # one step, then the forward after it
    common = {"embed", "logits", "attn_logits[first]", "attn_logits[last]", "attn_out[all]", "mlp_out[all]"}
    assert common | own <= set(m.rms)
    assert all(len(values) == 2 for values in m.rms.values())
    positive = {p for p, values in m.rms.items() if values[1] > 0}
    assert positive == set(m.rms)  # after one update every probe moved off zero (the dynamic weights start at 0)


def test_the_attention_logits_probe_is_q_dot_k_at_the_modules_scale():

    from satlab.bench.coord_probes import Probes
    from satlab.models import build_model
    from satlab.models.layers import apply_rotary

    cfg = shape_config(Shape("transformer", "depth", 64, 1), CoordSettings(archs=["transformer"], **TINY))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    idx = torch.randint(0, 258, (2, 16))
    probes = Probes(model)
    with probes, torch.no_grad():
        model(idx)
    got = probes.collect()["attn_logits[first]"]
    probes.remove()
    attn, d = model.blocks[0].attn, model.cfg.head_dim
    with torch.no_grad():
        h = model.blocks[0].attn_norm(model.embed(idx))
        cos, sin = model.rotary.tables(0, 16)
        q = apply_rotary(attn.q_norm(attn.q_proj(h).view(2, 16, -1, d)), cos, sin).transpose(1, 2)
        k = apply_rotary(attn.k_norm(attn.k_proj(h).view(2, 16, -1, d)), cos, sin).transpose(1, 2)
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
    assert got == pytest.approx(float(logits[..., causal].pow(2).mean().sqrt()), rel=1e-5)


def test_a_module_whose_output_grows_with_width_fails_the_check_and_an_untouched_one_passes():
    def plant(model):  # the embedding's output times sqrt(width): a coordinate that grows as width^0.5
        model.embed.register_forward_hook(lambda m, i, o: o * math.sqrt(o.shape[-1]))

    settings = CoordSettings(archs=["transformer"], widths=[32, 64, 128], depths=[1, 2], steps=3, seeds=[0])
    honest = coord_check(settings, progress=lambda line: None)["archs"]["transformer"]["series"]
    planted = coord_check(settings, progress=lambda line: None, prepare=plant)["archs"]["transformer"]["series"]

    def judged(series):
        return verdict("completep", worst({"embed": series["width"]["slopes"]["embed"]}),
                       worst({"embed": series["depth"]["slopes"]["embed"]}))["result"]

    assert planted["width"]["slopes"]["embed"][1] == pytest.approx(0.5, abs=0.05)
    assert abs(honest["width"]["slopes"]["embed"][1]) < TRANSFER_SLOPE_LIMIT
    assert (judged(planted), judged(honest)) == ("FAIL", "PASS")


def test_the_command_writes_its_files_and_an_mlflow_run(tmp_path, monkeypatch, capsys):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "coord"
    assert main(["coord", "--archs", "transformer,satformer", "--widths", "32,64", "--depths", "1,2", "--steps", "3",
                 "--seeds", "0", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # the table's caption wraps
    assert "sp control" in printed and "PASS" in printed
    report = json.loads((out / "coord.json").read_text())
    worst = report["archs"]["satformer"]["series"]["width"]["worst"]
    assert f"({worst['probe']}, {worst['step']})" in printed  # probe names print whole: [last] is not markup
    assert "left out of the depth verdict: block_out[first] (" in printed and "block_out[mid] and" in printed
    assert list(report["archs"]) == ["transformer", "satformer"] and report["parametrization"] == "sp"
    satformer = report["archs"]["satformer"]["series"]
    assert satformer["width"]["x"] == [32, 64] and satformer["depth"]["x"] == [1, 2]
    assert len(satformer["width"]["slopes"]["gate_logits[last]"]) == 4  # steps 0 to 3
    rows = (out / "coord.csv").read_text().splitlines()
    assert rows[0] == "arch,series,size,probe,step,rms" and len(rows) > 100
    image = plt.imread(out / "coord_satformer.png")
    assert image[..., :3].std() > 0.05  # a drawn figure, not a blank canvas
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run, = client.search_runs([client.get_experiment_by_name("coord").experiment_id])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "coord.json", "coord.csv", "coord_slopes.csv", "coord_transformer.png", "coord_satformer.png"}
    history = client.get_metric_history(run.info.run_id, "coord/satformer/width/gate_logits.last")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    assert run.data.tags["coord.satformer.verdict"] == "PASS"


def test_a_check_killed_part_way_resumes_at_the_first_model_it_had_not_finished(tmp_path, monkeypatch, capsys):
    import satlab.bench.coord as coord

    args = ["coord", "--archs", "transformer", "--widths", "32,64", "--depths", "1,2", "--steps", "3", "--seeds", "0,1",
            "--no-mlflow"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "coord.json").read_text())
    real, calls = coord.measure, []

    def killed_after(n):
        def measure(*a, **k):
            calls.append(a[0].model.d_model)
            if len(calls) > n:
                raise KeyboardInterrupt  # as a kill would stop it
            return real(*a, **k)
        return measure

    out = tmp_path / "resumed"
    monkeypatch.setattr(coord, "measure", killed_after(3))
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(out)])
    assert len(list((out / "measurements").glob("*.json"))) == 3 and not (out / "coord.json").exists()
    calls.clear()
    monkeypatch.setattr(coord, "measure", killed_after(100))
    assert main([*args, "--out", str(out), "--dry-run"]) == 0
    assert "3 of 8 already measured in --out and reused" in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--out", str(out)]) == 0
    assert len(calls) == 5  # 8 models x seeds, 3 of them kept by the killed run
    resumed = json.loads((out / "coord.json").read_text())
    for report in (whole, resumed):
        report.pop("seconds")
        for series in report["archs"]["transformer"]["series"].values():
            series.pop("seconds")
    assert resumed == whole
    calls.clear()  # other settings measure anew: nothing kept under them is read
    assert main([*args, "--steps", "4", "--out", str(out)]) == 0  # the last --steps counts
    assert len(calls) == 8
    calls.clear()  # so does another batch
    assert main([*args, "--batch", "2", "--seq-len", "8", "--out", str(out)]) == 0
    assert len(calls) == 8
    settings = json.loads((out / "coord.json").read_text())["settings"]
    assert (settings["batch"], settings["seq_len"]) == (2, 8)


@pytest.mark.parametrize(("args", "message"), [
    (["--archs", "transfomer"], "did you mean 'transformer'"),
    (["--widths", "64"], "--widths takes at least 2 distinct comma-separated integers"),
    (["--widths", "48,64"], "multiples of 32 (two for a slope, whole heads of --head-dim)"),
    (["--depths", "0,2"], "--depths takes at least 2 distinct comma-separated integers >= 1"),
    (["--depths", "2,x"], "--depths takes at least 2 distinct"),
    (["--steps", "2"], "--steps must be in [3, 1000]"),
    (["--seeds", "0,0"], "--seeds takes comma-separated integers >= 0, none repeated"),
    (["--seeds", "1,x"], "--seeds takes comma-separated integers >= 0"),
    (["--head-dim", "3"], "--head-dim must be an even integer"),
    (["--batch", "0"], "--batch must be >= 1 and --seq-len in [2, 1024]"),
    (["--seq-len", "1"], "--batch must be >= 1 and --seq-len in [2, 1024]"),
    (["--seq-len", "1025"], "--batch must be >= 1 and --seq-len in [2, 1024]"),
    (["--parametrization", "completepp"], "parametrization"),
    (["optim.lr=-1"], "optim.lr"),
])
def test_bad_input_is_refused_with_what_is_valid_and_nothing_written(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    assert main(["coord", "--archs", "transformer", "--widths", "32,64", "--depths", "1,2", *args,
                 "--out", str(tmp_path / "coord")]) == 2
    err = capsys.readouterr().err
    assert message in err and "satlab coord: error" in err
    assert list(tmp_path.iterdir()) == []


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    assert main(["coord", "--archs", "transformer", "--no-mlflow", "--out", str(tmp_path / "taken")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_the_dry_run_prints_the_plan_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["coord", "--archs", "transformer", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "10 models" in printed and "100.94M" in printed and "estimated" in printed
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arch", ["transformer", "satformer"])
def test_completep_flattens_the_slopes_that_sp_shows(arch):
    """At three small widths and depths and three steps, completep takes the width slope of the sublayer outputs and
    the depth slope of the last residual stream to under a third of sp's (measured: 2.1 -> 0.25 and 1.26 -> 0.19
    for the Transformer). Whether the full grid meets the 0.1 threshold is a result (docs/results/), not a test."""
    series = {p: coord_check(CoordSettings(archs=[arch], widths=[64, 128, 256], depths=[2, 4, 8], steps=3, seeds=[0],
                                           overrides=[f"model.parametrization={p}"]),
                             progress=lambda line: None)["archs"][arch]["series"] for p in ("sp", "completep")}

    def worst(parametrization: str, kind: str, probes: tuple[str, ...]) -> float:
        slopes = series[parametrization][kind]["slopes"]
        return max(abs(v) for p in probes for step, v in enumerate(slopes[p]) if step >= 1 and v is not None)

    width = ("mlp_out[all]", "attn_out[all]", "block_out[all]")
    assert worst("completep", "width", width) < worst("sp", "width", width) / 3
    assert worst("completep", "depth", ("block_out[last]",)) < worst("sp", "depth", ("block_out[last]",)) / 3


@pytest.mark.parametrize("scale", [None, 0.125])
def test_the_attention_logits_probe_takes_the_scale_the_call_passes(scale):
    """A parametrisation that scales the logits by 1/d_head passes its own scale: the probe must use it."""
    import torch.nn.functional as F

    from satlab.bench.coord_probes import Probes
    from satlab.models import build_model

    cfg = shape_config(Shape("transformer", "depth", 32, 1), CoordSettings(archs=["transformer"], **TINY))
    probes = Probes(build_model(cfg.model))
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    with probes, torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    probes.remove()
    logits = (q @ k.transpose(-2, -1)) * (scale or 16 ** -0.5)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert probes.collect()["attn_logits[first]"] == pytest.approx(float(logits[..., causal].pow(2).mean().sqrt()))


def test_fresh_batches_give_each_step_the_next_text_and_are_stored_apart(tmp_path):
    from satlab.bench.coord import check_batches, stored_path

    fixed = CoordSettings(archs=["transformer"], steps=3, batch=2, seq_len=8)
    fresh = CoordSettings(archs=["transformer"], steps=3, batch=2, seq_len=8, fresh_batches=True)
    same, new = check_batches(fixed), check_batches(fresh)
    assert len(same) == len(new) == 4 and all(x.shape == (2, 8) and y.shape == (2, 8) for x, y in new)
    assert all(torch.equal(x, same[0][0]) for x, _ in same)
    assert torch.equal(new[0][0], same[0][0])  # the first fresh batch is the fixed one ...
    assert not any(torch.equal(new[i][0], new[j][0]) for i in range(4) for j in range(i))  # ... then new text
    whole = token_batch(8, 8)[0]  # the corpus's first 8 windows, consecutive
    assert torch.equal(torch.cat([x for x, _ in new]), whole)
    shape = Shape("transformer", "width", 32, 2)
    assert stored_path(tmp_path, shape, 0, fixed) != stored_path(tmp_path, shape, 0, fresh)
