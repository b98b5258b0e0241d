"""Scaling ladders (docs/ladder.md): rung planning against hand-computed sizes, budgets and FLOPs; the expansion into
the ablation's cells; every bad ladder refused through the CLI with exit 2 and nothing written; the dry run; and a
micro ladder that is killed and resumes only its unfinished cells."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import optuna
import pytest
import yaml

from satlab.cli.main import main as satlab_main
from satlab.studies import ladder as L
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.engine import run_study, set_up_study
from satlab.studies.loader import load_ablation, spec_from_dict
from satlab.studies.plans import GridPlan
from satlab.studies.storage import open_storage
from satlab.studies.workers import StaleTrialRetry
from satlab.training.tracking import open_store, resolve_tracking

V = 258  # the byte tokenizer's model vocabulary (256 bytes and two specials)
BASE = {"data.source": "kjv", "data.tokenizer.kind": "byte", "data.seq_len": 64, "train.micro_batch_size": 4,
        "train.global_batch_tokens": 256, "train.val_every_tokens": 256, "train.val_tokens": 256,
        "train.ckpt_every_tokens": 512, "train.accelerator": "cpu", "eval.at_end": False}
RUNGS = [{"d_model": 16, "n_layers": 1, "n_heads": 1, "mlp_hidden": 32},
         {"d_model": 24, "n_layers": 2, "n_heads": 2, "mlp_hidden": 48},
         {"d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_hidden": 64}]


def transformer_params(d: int, layers: int, heads: int, mlp: int) -> tuple[int, int]:
    """(total, non-embedding) by hand: per block q, k, v, o (4 d^2), SwiGLU (3 d m), two RMSNorms (2 d), q and k norms
    (2 d / H); a final norm (d); the tied embedding and head (V d) once."""
    non_embedding = layers * (4 * d * d + 3 * d * mlp + 2 * d + 2 * d // heads) + d
    return non_embedding + V * d, non_embedding


def ladder_spec(tmp_path: Path, name: str = "micro_ladder", **ladder: Any) -> dict[str, Any]:
    overrides = {**BASE, "tracking.uri": f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
                 "train.out_dir": str(tmp_path / "runs"), "data.cache_dir": str(tmp_path.parent / "ladder-cache")}
    block = {"rungs": RUNGS, "budgets": [0.25, 1.0], "seeds": [2, 1, 1], "lr": [4e-3, 3e-3, 2e-3], "warmup": 0.1,
             **ladder}
    return {"name": name, "base": "default", "overrides": overrides, "out_dir": str(tmp_path / "out"),
            "axes": {"model.arch": ["transformer", "satformer"]}, "ladder": block}


def write(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / f"{spec['name']}.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_rungs_are_planned_as_computed_by_hand(tmp_path: Path) -> None:
    spec = load_ablation(write(tmp_path, ladder_spec(tmp_path)))
    rungs = L.plan(spec)
    for index, (d, layers, heads, mlp) in [(0, (16, 1, 1, 32)), (2, (32, 2, 2, 64))]:
        rung, (total, non_embedding) = rungs[index], transformer_params(d, layers, heads, mlp)
        size = rung.sizes["transformer"]
        assert (size.params, size.non_embedding_params) == (total, non_embedding)
        # 6 (N_non-emb + V d) for the matmuls and the output layer, 12 L d T for attention
        assert size.flops_per_token == 6 * (non_embedding + V * d) + 12 * layers * d * 64
        steps = [max(1, round(b * total / 256)) for b in (0.25, 1.0)]
        assert rung.steps == tuple(steps) and rung.tokens == tuple(256 * s for s in steps)
        assert rung.warmup_tokens == round(0.1 * total / 256) * 256
    # rung 0 written out: 1 * (4*16^2 + 3*16*32 + 2*16 + 2*16) + 16 = 2,640 non-embedding, + 258*16 = 6,768;
    # 0.25 * 6,768 = 1,692 tokens = 6.6 steps of 256 -> 7 steps; 6,768 -> 26.4 -> 26; warmup 676.8 -> 3 steps
    assert transformer_params(16, 1, 1, 32) == (6768, 2640)
    assert rungs[0].steps == (7, 26) and rungs[0].tokens == (1792, 6656) and rungs[0].warmup_tokens == 768
    assert rungs[0].sizes["transformer"].flops_per_token == 6 * 6768 + 12 * 16 * 64 == 52_896
    # its 1,792-token run validates 7 times (every 256 tokens) on 256 tokens, each a third of a training token:
    # 1,792 + 7 x 256 / 3 = 2,389.33 tokens' FLOPs; the 6,656-token run 6,656 + 26 x 256 / 3 = 8,874.67
    assert rungs[0].run_flops("transformer", 1792) == pytest.approx(52_896 * 2389.333, rel=1e-6)
    assert rungs[0].run_cpu_seconds("transformer", 6656) == pytest.approx(
        L.CPU_SECONDS_PER_RUN + 8874.667 * L.CPU_SECONDS_PER_TOKEN + 52_896 * 8874.667 / 1e9 * L.CPU_SECONDS_PER_GFLOP)
    # SATFormer's gates make it larger at rung 2, but its budgets are the reference's
    assert rungs[2].sizes["satformer"].params > rungs[2].counted == transformer_params(32, 2, 2, 64)[0]


def test_budgets_multiply_the_non_embedding_count_when_asked(tmp_path: Path) -> None:
    spec = load_ablation(write(tmp_path, ladder_spec(tmp_path, per="non_embedding", budgets=[1.0, 4.0])))
    rung = L.plan(spec)[2]
    assert rung.counted == transformer_params(32, 2, 2, 64)[1]
    assert rung.steps == tuple(max(1, round(b * rung.counted / 256)) for b in (1.0, 4.0))


def test_the_ladder_expands_into_exactly_its_cells(tmp_path: Path) -> None:
    spec = load_ablation(write(tmp_path, ladder_spec(tmp_path)))
    rungs = L.plan(spec)
    expected = {(r.values["model.d_model"], tokens, arch, seed) for r in rungs for tokens in r.tokens
                for arch in ("transformer", "satformer") for seed in range(r.seeds)}
    cells = spec.cells()
    got = [(dict(c.values)["model.d_model"], dict(c.values)["train.max_tokens"], dict(c.values)["model.arch"], c.seed)
           for c in cells]
    assert len(got) == len(set(got)) == len(expected) == 2 * 2 * (2 + 1 + 1)
    assert set(got) == expected
    for cell in cells:  # a cell carries its rung's shape, learning rate and warmup
        values = dict(cell.values)
        rung = next(r for r in rungs if r.values["model.d_model"] == values["model.d_model"])
        assert {k: values[k] for k in rung.values} == rung.values
        assert (values["optim.lr"], values["optim.warmup_tokens"]) == (rung.lr, rung.warmup_tokens)
    assert [c.seed for c in spec.run_order()][:8] == [0] * 8  # seed 0 of every rung first
    again = spec_from_dict(AblationSpec, spec.to_dict(), "stored")  # what a trial process rebuilds
    assert [c.key for c in again.cells()] == [c.key for c in cells]


def test_one_learning_rate_is_taken_under_a_transfer_rule(tmp_path: Path) -> None:
    data = ladder_spec(tmp_path, lr=3e-3)
    data["overrides"] |= {"model.parametrization": "completep", "model.base_width": 96}  # head dims 16, 12, 16, 32
    spec = load_ablation(write(tmp_path, data))
    assert spec.axes["optim.lr"] == [3e-3]


BAD = {
    "out of order": ({"rungs": [RUNGS[1], RUNGS[0], RUNGS[2]]}, "increasing order of parameters"),
    "two rungs": ({"rungs": RUNGS[:2], "seeds": [1, 1], "lr": [1e-3, 1e-3]}, "at least 3 rungs"),
    "little compute": ({"rungs": [RUNGS[1], {**RUNGS[1], "n_layers": 3}, {**RUNGS[1], "n_layers": 4}],
                        "budgets": [1.0]}, "fewer than the 1.5"),
    "short budget": ({"budgets": [0.01, 1.0], "warmup": 0.0}, "at least one validation interval"),
    "warmup too long": ({"warmup": 0.5}, "warmup + 1"),
    "reference": ({"reference": "resformer"}, "is not a value of the model.arch axis"),
    "unknown rung key": ({"rungs": [{**r, "mlp_hiden": 32} for r in RUNGS]}, "did you mean"),
    "unknown ladder key": ({"budget": [1, 2]}, "did you mean"),
    "lr count": ({"lr": [1e-3, 1e-3]}, "one positive learning rate per rung"),
    "one lr under sp": ({"lr": 1e-3}, "only under mup or completep"),
    "seeds": ({"seeds": [1, 1]}, "each rung's number of seeds"),
    "owned key": ({"rungs": [{**r, "optim.lr": 1e-3} for r in RUNGS]}, "is set by the ladder"),
    "budgets": ({"budgets": [20, 10]}, "positive and increasing"),
    "backtest seed": ({"fit": {"backtest_seeds": [1]}}, "must be distinct seeds of the top rung"),
    "backtest band": ({"fit": {"band": "joint"}}, "unknown backtest band 'joint'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_ladder_exits_2_with_its_message_and_writes_nothing(tmp_path: Path, case: str, capsys) -> None:
    ladder, message = BAD[case]
    spec = ladder_spec(tmp_path, **ladder)
    if case == "short budget":  # one step of 256 tokens, no warmup: only the validation interval is missed
        spec["overrides"]["train.val_every_tokens"] = 512
    path = write(tmp_path, spec)
    before = sorted(tmp_path.rglob("*"))
    assert satlab_main(["ladder", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_an_axis_the_ladder_sets_and_an_ablation_without_a_ladder_are_refused(tmp_path: Path, capsys) -> None:
    data = ladder_spec(tmp_path)
    data["axes"]["train.max_tokens"] = [1024]
    assert satlab_main(["ladder", str(write(tmp_path, data)), "--dry-run"]) == 2
    assert "is set by the ladder" in capsys.readouterr().err
    plain = {**ladder_spec(tmp_path, name="plain")}
    del plain["ladder"]
    assert satlab_main(["ladder", str(write(tmp_path, plain)), "--dry-run"]) == 2
    assert "without a ladder: block" in capsys.readouterr().err


def test_the_dry_run_prints_each_rungs_plan_and_cost(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, ladder_spec(tmp_path))
    assert satlab_main(["ladder", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    total, non_embedding = transformer_params(32, 2, 2, 64)
    assert f"{total:,}" in out and f"{non_embedding:,}" in out
    assert "CPU time" in out and "s per GFLOP" in out and "16 cells" in out and "not run" in out
    assert not (tmp_path / "out").exists()


def test_the_dry_run_prices_the_runs_left_to_run(tmp_path: Path, capsys) -> None:
    """Each cell priced alone adds up to the ladder's total; with some cells finished the dry run prices the rest
    (here seed 1, which only rung 0 runs: 2 architectures x 2 budgets)."""
    from satlab.cli.ladder import _duration, print_ladder

    spec = load_ablation(write(tmp_path, ladder_spec(tmp_path)))
    rungs = L.plan(spec)
    by_rung = {r.index: r for r in rungs}
    each = {c.key: by_rung[next(r.index for r in rungs if all(c.group_values[k] == v for k, v in r.values.items()))]
            .run_cpu_seconds(c.group_values["model.arch"], c.group_values["train.max_tokens"]) for c in spec.cells()}
    assert sum(each.values()) == pytest.approx(sum(r.cpu_seconds() for r in rungs))
    gpu = sum(L.rung_of(rungs, c.group_values).run_gpu_hours(c.group_values["model.arch"],
                                                             c.group_values["train.max_tokens"]) for c in spec.cells())
    assert gpu == pytest.approx(sum(r.gpu_hours() for r in rungs)) and gpu > 0
    left = [c for c in spec.cells() if c.seed == 1]
    print_ladder(spec, left)
    out = " ".join(capsys.readouterr().out.split())
    assert f"4 of 16 runs left to run: {_duration(sum(each[c.key] for c in left))}" in out
    print_ladder(spec, [])
    assert "every run has finished" in capsys.readouterr().out


def test_a_fit_takes_the_fit_settings_of_the_spec_file_and_the_runs_of_the_ladder_that_ran(tmp_path: Path) -> None:
    """`satlab ladder --fit` and `satlab report` read the spec saved with the ladder, but the ``fit:`` block of the
    spec file now (the same study): a changed band applies to the runs as they ran; seeds the ladder never ran are
    refused."""
    from satlab.config.errors import ConfigError
    from satlab.studies.lookup import with_analysis_of

    stored = load_ablation(write(tmp_path, ladder_spec(tmp_path)))
    now = load_ablation(write(tmp_path, ladder_spec(tmp_path, name="micro_ladder", fit={"band": "simultaneous"})))
    merged = with_analysis_of(stored, now)
    assert merged.ladder.fit.band == "simultaneous" and merged.ladder.seeds == stored.ladder.seeds == [2, 1, 1]
    grown = load_ablation(write(tmp_path, ladder_spec(tmp_path, seeds=[2, 1, 2], fit={"backtest_seeds": [1]})))
    with pytest.raises(ConfigError, match="must be distinct seeds of the top rung.*the ladder as it ran"):
        with_analysis_of(stored, grown)
    other = load_ablation(write(tmp_path, ladder_spec(tmp_path, fit={"band": "simultaneous"}, warmup=0.2)))
    merged = with_analysis_of(stored, other)  # the same study (a ladder's design is not in its fingerprint), as run
    assert merged.ladder.fit.band == "simultaneous" and merged.ladder.warmup == stored.ladder.warmup == 0.1
    moved = ladder_spec(tmp_path, fit={"band": "simultaneous"})
    moved["overrides"]["train.val_tokens"] = 512
    assert with_analysis_of(stored, load_ablation(write(tmp_path, moved))).ladder.fit.band == "pointwise"


def test_the_simulation_runs_the_ladders_shape_through_the_reports_claim_rule(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, ladder_spec(tmp_path))
    assert satlab_main(["ladder", str(path), "--simulate", "--replicates", "2", "--sim-resamples", "3"]) == 0
    printed = capsys.readouterr().out
    assert "simulated: 2 ladders per multiplier, 3 bootstrap refits" in printed
    assert printed.count("top rung") == 2 and printed.count("N* = 1e+10") == 2  # per multiplier, 1 and 2
    assert satlab_main(["ladder", str(path), "--simulate", "--replicates", "1"]) == 2
    assert "--replicates and --sim-resamples must be >= 2" in capsys.readouterr().err
    for bad in (["--run-sd", "-0.1"], ["--run-sd", "nan"], ["--run-sd", "some"]):
        assert satlab_main(["ladder", str(path), "--simulate", *bad]) == 2
        assert "--run-sd a number >= 0 or 'measured'" in capsys.readouterr().err
    assert satlab_main(["ladder", str(path), "--simulate", "--law", "fitted"]) == 2  # nothing has run
    assert "has not run yet, so it has no finished runs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlruns").exists()


def test_the_backtest_simulation_runs_the_ladders_shape_and_refuses_what_it_cannot(tmp_path: Path, capsys) -> None:
    four = [*RUNGS, {"d_model": 48, "n_layers": 2, "n_heads": 2, "mlp_hidden": 96}]
    path = write(tmp_path, ladder_spec(tmp_path, rungs=four, seeds=[2, 1, 1, 1], lr=[4e-3, 3e-3, 2e-3, 2e-3],
                                       fit={"grid": "coarse"}))
    assert satlab_main(["ladder", str(path), "--simulate-backtest", "--replicates", "2"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "its backtest on 2 simulated ladders" in printed and "2 top-rung runs judged (every seed)" in printed
    assert "ladders with all 2 inside" in printed and "0.81" in printed  # 0.9 ** 2 if runs missed independently
    assert satlab_main(["ladder", str(path), "--simulate-backtest", "--replicates", "1"]) == 2
    assert "--replicates must be >= 2" in capsys.readouterr().err
    for shift in ("1.5", "nan"):
        assert satlab_main(["ladder", str(path), "--simulate-backtest", "--top-shift", shift]) == 2
        assert "--top-shift is a shift of log loss" in capsys.readouterr().err
    banded = write(tmp_path, ladder_spec(tmp_path, name="banded", rungs=four, seeds=[2, 1, 1, 2],
                                         lr=[4e-3, 3e-3, 2e-3, 2e-3],
                                         fit={"grid": "coarse", "band": "simultaneous", "backtest_seeds": [1]}))
    assert satlab_main(["ladder", str(banded), "--simulate-backtest", "--replicates", "2", "--top-shift",
                        "0.5"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "2 top-rung runs judged (seeds 1), simultaneous band: 0.95 prediction interval" in printed  # 1 - 0.1/2
    assert "the top rung shifted by +0.5 in log loss" in printed
    three = write(tmp_path, ladder_spec(tmp_path, name="three"))
    assert satlab_main(["ladder", str(three), "--simulate-backtest"]) == 2
    assert "needs a ladder of 4 rungs or more" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("modes", [["--fit", "--simulate"], ["--dry-run", "--simulate-backtest"],
                                   ["--simulate", "--simulate-backtest"]])
def test_two_modes_at_once_are_refused(tmp_path: Path, capsys, modes: list[str]) -> None:
    path = write(tmp_path, ladder_spec(tmp_path))
    with pytest.raises(SystemExit) as stop:
        satlab_main(["ladder", str(path), *modes])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlruns").exists()


def test_the_gpu_ladder_states_its_assumed_throughput(capsys) -> None:
    assert satlab_main(["ladder", "ladder_gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "ASSUMED 40% MFU" in out and "989 TFLOP/s" in out


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning", "ignore:Heartbeat:UserWarning")
def test_a_ladder_study_queues_every_cell_and_counts_finished_ones_done(tmp_path: Path, capsys) -> None:
    """The fast sibling of the killed ladder: the study engine queues the ladder's cells (one trial each, seeds
    slowest, seed 0 of the smallest rung first); a fit is refused before the ladder ran and while cells are
    unfinished, with nothing written."""
    path = write(tmp_path, ladder_spec(tmp_path))
    spec = load_ablation(path)
    assert satlab_main(["ladder", str(path), "--fit"]) == 2
    assert "has not run yet, so there is nothing to fit" in capsys.readouterr().err
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = resolve_tracking(open_store(spec.base_config().tracking.uri), None)
    retry = StaleTrialRetry(spec.trial.max_retry)

    def driver() -> tuple[optuna.Study, str, dict[str, str]]:
        return set_up_study(spec, GridPlan(spec), open_storage(url, spec.trial, retry),
                            mlflow.MlflowClient(tracking[0]), tracking, retry)

    study, _, done = driver()
    plan = GridPlan(spec)
    assert done == {} and set(plan.cell_status(study).values()) == {"queued"} and len(study.trials) == 16
    trial = study.ask()  # what a worker pops first: seed 0 of the smallest rung
    assert plan.cell(plan.suggest(trial)).key == spec.run_order()[0].key
    assert spec.run_order()[0].key.startswith("model.d_model=16 ")
    assert satlab_main(["ladder", str(path), "--fit"]) == 2
    assert "has 16 of 16 cells unfinished" in capsys.readouterr().err
    assert not spec.out_path().exists() or not (spec.out_path() / "report.md").exists()


@pytest.mark.slow
@pytest.mark.process
def test_a_killed_ladder_resumes_only_its_unfinished_cells(tmp_path: Path) -> None:
    """SIGKILL `satlab ladder` while a cell trains after the first finished; the same ladder then runs only the
    cells not finished."""
    top = {"d_model": 48, "n_layers": 2, "n_heads": 3, "mlp_hidden": 96}  # 8.7x rung 0: 1.9 decades at one budget
    data = ladder_spec(tmp_path, name="killed", rungs=[*RUNGS[:2], top], budgets=[0.5], seeds=[1, 1, 1])
    path = write(tmp_path, data)
    spec = load_ablation(path)
    driver = subprocess.Popen([sys.executable, "-m", "satlab.cli.main", "ladder", str(path), "--no-report"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    plan = GridPlan(spec)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = list(plan.cell_status(plan.recorded_study()).values())
        if status.count("finished") >= 1 and "running" in status:
            break
        time.sleep(0.5)
    else:
        driver.kill()
        pytest.fail("the first cell did not finish in time")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    time.sleep(3)
    finished = {k for k, s in plan.cell_status(plan.recorded_study()).items() if s == "finished"}
    result = run_study(spec, workers=1, report=False)
    assert set(result.skipped) == finished and not result.failed
    assert set(result.finished) == {c.key for c in spec.cells()} - finished
