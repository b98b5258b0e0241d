"""The report's scaling-ladder section on synthetic finished ladders: losses drawn from a known law for the
Transformer and from the same law with a known compute multiplier for SATFormer (satlab.studies.scaling_sim's
construction), through the same functions the report uses. The fitting code itself is tests/test_scaling_fit.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from test_ladder import ladder_spec, write

from satlab.studies import ladder as L
from satlab.studies.ladder_report import ladder_runs, ladder_section, seed_spread
from satlab.studies.loader import load_ablation
from satlab.studies.results import CellResult, GroupResult
from satlab.studies.scaling_fit import GRIDS, RunPoints, ScalingLaw, fit_law
from satlab.studies.scaling_sim import law_with_multiplier

TRUE = ScalingLaw(E=1.5, A=30.0, B=60.0, alpha=0.35, beta=0.3)
RUNGS = [{"d_model": 16, "n_layers": 1, "n_heads": 1, "mlp_hidden": 32},
         {"d_model": 24, "n_layers": 2, "n_heads": 2, "mlp_hidden": 48},
         {"d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_hidden": 64},
         {"d_model": 48, "n_layers": 3, "n_heads": 3, "mlp_hidden": 96}]


def finished(tmp_path: Path, multiplier: float, noise: float = 0.002, seeds: tuple[int, ...] = (2, 2, 1, 1),
             top_shift: float = 0.0, **fit: object):
    """A 4-rung ladder (3 budgets, 2 seeds on the first two rungs) with every cell finished: the Transformer's loss
    from TRUE, SATFormer's from TRUE with a compute multiplier, times exp(N(0, noise)) per run; the top rung's runs
    of its last seed times exp(top_shift) (a top rung off the law)."""
    spec = load_ablation(write(tmp_path, ladder_spec(tmp_path, rungs=RUNGS, budgets=[0.25, 0.5, 1.0],
                                                     seeds=list(seeds), lr=[4e-3] * 4,
                                                     fit={"resamples": 60, "seed": 0, "grid": "coarse", **fit})))
    rungs = L.plan(spec)
    laws = {"transformer": TRUE, "satformer": law_with_multiplier(TRUE, multiplier)}
    rng = np.random.default_rng(1)
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        values = cell.group_values
        rung = next(r for r in rungs if all(values[k] == v for k, v in r.values.items()))
        arch = values["model.arch"]
        n = rung.sizes[arch].count(spec.ladder.per)
        loss = float(laws[arch].loss(n, values["train.max_tokens"])) * math.exp(rng.normal(0, noise))
        if rung.index == len(rungs) - 1 and cell.seed == seeds[-1] - 1:
            loss *= math.exp(top_shift)
        group = groups.setdefault(cell.group, GroupResult(cell.group, values, 0))
        group.cells.append(CellResult(cell, f"run-{cell.slug}", {"val_loss": loss}, n, []))
    return spec, list(groups.values())


def test_a_known_multiplier_is_recovered_claimed_and_backtested(tmp_path: Path) -> None:
    spec, groups = finished(tmp_path, multiplier=2.0)
    lines, summary, figure = ladder_section(spec, groups, tmp_path)
    text = "\n".join(lines)
    assert "## Scaling ladder" in text and "model-based extrapolation" in text
    assert figure is not None and figure.stat().st_size > 0
    fit = summary["fits"]["transformer"]
    assert fit["runs"] == 3 * (2 + 2 + 1 + 1) and fit["rungs"] == 4
    assert fit["law"]["E"] == pytest.approx(TRUE.E, rel=0.1) and fit["se"]["E"] > 0
    m = summary["multipliers"]["satformer"]
    assert set(summary["multipliers"]) == {"satformer"}  # the reference has none
    assert m["top_compute"]["point"] == pytest.approx(2.0, rel=0.15) and m["top_compute"]["claim"] == "gain"
    assert set(m["targets"]) == {"1e+09", "1e+10", "1e+11"} and set(m["trend"]) == {"measured", "extrapolated"}
    for arch in ("transformer", "satformer"):  # fitted on rungs 0-2, the top rung's runs predicted
        backtest = summary["fits"][arch]["backtest"]
        assert backtest["rung"] == 3 and len(backtest["runs"]) == 3 and backtest["fitted_runs"] == 3 * (2 + 2 + 1)
        assert backtest["inside"] == sum(r["lower"] <= r["loss"] <= r["upper"] for r in backtest["runs"])
        for run in backtest["runs"]:  # extrapolated from three sizes: the law's value to ~1 % (measured 0.0-1.4 %)
            assert run["predicted"] == pytest.approx(run["loss"], rel=0.03) and run["lower"] < run["predicted"] \
                < run["upper"]


def test_a_simultaneous_band_judges_the_named_top_rung_seeds_and_fails_a_top_rung_off_the_law(tmp_path: Path) \
        -> None:
    """Seeds 0 and 1 at the top rung, seed 1 judged: its three runs, each at 1 - 0.1/3. On the law it passes, and
    its intervals contain the pointwise ones; with seed 1's top-rung losses 10 % above the law (the negative
    control) it fails, every run above its interval."""
    band = {"band": "simultaneous", "backtest_seeds": [1]}
    lines, summary, _ = ladder_section(*finished(tmp_path, 1.0, seeds=(2, 2, 1, 2), **band), tmp_path)
    test = summary["fits"]["transformer"]["backtest"]
    assert (test["band"], test["seeds"], test["run_level"]) == ("simultaneous", [1], pytest.approx(1 - 0.1 / 3))
    assert [r["seed"] for r in test["runs"]] == [1, 1, 1] and test["passed"] and test["inside"] == 3
    text = " ".join(" ".join(lines).split())
    assert "the top rung's runs of seed 1 judged with a simultaneous 90 % band" in text
    assert "Transformer passed: 3 of 3 top-rung runs inside" in text
    _, plain, _ = ladder_section(*finished(tmp_path, 1.0, seeds=(2, 2, 1, 2), backtest_seeds=[1]), tmp_path)
    for wide, narrow in zip(test["runs"], plain["fits"]["transformer"]["backtest"]["runs"], strict=True):
        assert wide["lower"] < narrow["lower"] and narrow["upper"] < wide["upper"]
    lines, off, _ = ladder_section(*finished(tmp_path, 1.0, seeds=(2, 2, 1, 2), top_shift=0.1, **band), tmp_path)
    test = off["fits"]["transformer"]["backtest"]
    assert not test["passed"] and {r["side"] for r in test["runs"]} == {"above"}
    assert "Transformer failed: 0 of 3 top-rung runs inside" in " ".join(" ".join(lines).split())


def test_without_a_true_gain_no_gain_is_claimed_at_the_ladders_compute(tmp_path: Path) -> None:
    """The negative control: the same ladder with multiplier 1 claims nothing (the gain above is the data's)."""
    _, summary, _ = ladder_section(*finished(tmp_path, multiplier=1.0), tmp_path)
    top = summary["multipliers"]["satformer"]["top_compute"]
    assert top["claim"] == "not resolved" and top["lower"] < 1.0 < top["upper"]


def test_the_seed_spread_pools_log_loss_over_seeds_of_one_rung_and_budget(tmp_path: Path) -> None:
    spec, _ = finished(tmp_path, multiplier=1.0)
    small, large = L.plan(spec)[:2]

    def run(rung: L.Rung, tokens: float, loss: float) -> tuple[L.Rung, RunPoints]:
        return rung, RunPoints("r", 1e4 * (rung.index + 1), (tokens,), (loss,))  # a rung is a size

    # two seeds at (small, 100) differing by 0.2 in log loss, three at (large, 100) at -0.1, 0, +0.1, one alone:
    # squares 0.02 (1 dof) and 0.02 (2 dof): sqrt(0.04 / 3)
    runs = [run(small, 100, math.exp(1.0)), run(small, 100, math.exp(1.2)), run(large, 100, math.exp(0.9)),
            run(large, 100, math.exp(1.0)), run(large, 100, math.exp(1.1)), run(large, 200, 5.0)]
    assert seed_spread(runs) == pytest.approx(math.sqrt(0.04 / 3))
    assert seed_spread(runs[-1:]) == 0.0  # one seed: no spread to measure


def test_a_simulated_ladder_of_one_run_per_budget_draws_each_runs_seed_noise_on_its_own() -> None:
    from satlab.studies.scaling_sim import Ladder, simulate_runs

    shape = Ladder(sizes=(1e4, 2e4, 4e4), tokens_per_param=(10.0, 20.0), seeds=(2, 1, 1), runs_per_budget=True)
    runs = simulate_runs(TRUE, shape, np.random.default_rng(0), run_sd=0.1)
    assert len(runs) == (2 + 1 + 1) * 2 and all(len(r.D) == 1 for r in runs)
    offsets = [math.log(r.L[0] / float(TRUE.loss(r.N, r.D[0]))) for r in runs]
    assert len(set(np.round(offsets, 12))) == len(runs)  # no two runs share an offset, even at one seed
    shared = simulate_runs(TRUE, Ladder(sizes=(1e4, 2e4, 4e4), tokens_per_param=(10.0, 20.0), seeds=(2, 1, 1)),
                           np.random.default_rng(0), run_sd=0.1)
    assert len(shared) == 4 and all(len(r.D) == 2 for r in shared)  # one run decayed at both budgets


def test_the_pooled_seed_spread_compares_each_architecture_only_with_its_own_seeds(tmp_path: Path) -> None:
    from satlab.studies.ladder_report import pooled_seed_spread

    spec, _ = finished(tmp_path, multiplier=1.0)
    rung = L.plan(spec)[0]

    def runs(*logs: float) -> list[tuple[L.Rung, RunPoints]]:
        return [(rung, RunPoints("r", 1e4, (100.0,), (math.exp(x),))) for x in logs]

    # one arch's seeds 0.2 apart (0.02, 1 dof), the other's 0.1 around 2.0 (0.02, 2 dof); the archs 1 nat apart
    spread, dof = pooled_seed_spread({"transformer": runs(1.0, 1.2), "satformer": runs(1.9, 2.0, 2.1)})
    assert (spread, dof) == (pytest.approx(math.sqrt(0.04 / 3)), 3)
    assert pooled_seed_spread({"transformer": runs(1.0), "satformer": runs(2.0)}) == (0.0, 0)


def test_the_simulation_can_take_its_law_and_noise_from_the_ladders_finished_runs(tmp_path: Path, monkeypatch,
                                                                                   capsys) -> None:
    """--law fitted --run-sd measured: the reference's law fitted to the finished runs (TRUE here), and their seed
    spread; refused, exit 2, where the runs cannot give them."""
    import satlab.studies.lookup as lookup
    import satlab.studies.results as results
    import satlab.studies.scaling_sim as scaling_sim
    from satlab.cli.main import main

    spec, groups = finished(tmp_path, multiplier=1.0, noise=0.01)
    monkeypatch.setattr(lookup, "open_ablation", lambda target: (spec, None, "parent"))
    monkeypatch.setattr(results, "collect", lambda *a, **k: groups)
    target = str(tmp_path / f"{spec.name}.yml")
    simulate = ["ladder", target, "--simulate", "--replicates", "2", "--sim-resamples", "3"]
    real, used = scaling_sim.simulate_fits, []
    monkeypatch.setattr(scaling_sim, "simulate_fits", lambda *a, **k: used.append(k) or real(*a, **k))
    assert main([*simulate, "--law", "fitted", "--run-sd", "measured"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    reference = [run for _, run in ladder_runs(spec, groups, L.plan(spec))["transformer"]]
    law = fit_law(reference, spec.ladder.fit.huber_delta, GRIDS[spec.ladder.fit.grid])
    assert f"the true law fitted to the 18 finished transformer runs (E {law.E:.3g}, A {law.A:.3g}" in printed
    spread = float(printed.split("seed noise ")[1].split()[0])
    assert 0.004 < spread < 0.02 and "seed noise measured on the finished runs (12 degrees of freedom)" in printed
    assert printed.count("N* = 1e+10") == 2
    assert [k["reference"] for k in used] == [law, law] and [k["run_sd"] for k in used] == [pytest.approx(spread,
                                                                                                        rel=1e-2)] * 2
    two_rungs = [g for g in groups if g.values["model.d_model"] in (16, 24)]
    monkeypatch.setattr(results, "collect", lambda *a, **k: two_rungs)
    assert main([*simulate, "--law", "fitted"]) == 2
    assert "at 3 or more rungs" in capsys.readouterr().err
    one_seed = [g for g in groups if g.values["model.d_model"] in (32, 48)]
    monkeypatch.setattr(results, "collect", lambda *a, **k: one_seed)
    assert main([*simulate, "--run-sd", "measured"]) == 2
    assert "needs two finished seeds of one rung and budget" in capsys.readouterr().err


def test_an_unbounded_trend_prints_as_infinity() -> None:
    from satlab.studies.ladder_report import _signed

    assert [_signed(x) for x in (0.1234, -0.5, math.inf, -math.inf)] == ["+0.123", "-0.500", "+∞", "−∞"]
