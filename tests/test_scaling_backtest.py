"""The ladder's backtest and its calibration (satlab/studies/scaling_backtest.py): how often it passes when the law
holds, simulated through the same prediction the report uses, and a negative control (a top rung off the law) that
shows it can fail."""

from __future__ import annotations

import math

import pytest

from satlab.studies.scaling_backtest import (
    BacktestCalibration,
    judged_runs,
    predict_held_out,
    run_level,
    simulate_backtest,
)
from satlab.studies.scaling_fit import RunPoints, loss_interval
from satlab.studies.scaling_sim import EPOCH_LAW, SIM_GRID, Ladder, simulate_runs

# ladder_cpu's shape: its rung sizes, budgets and seeds, one run per budget
SHAPE = Ladder(sizes=(12464, 41248, 57936, 131232, 279360), tokens_per_param=(10, 20, 40), seeds=(3, 3, 3, 2, 2),
               runs_per_budget=True)
FAST = dict(grid=SIM_GRID, resamples=50)


def test_noiseless_lower_rungs_predict_the_top_rung_near_the_law() -> None:
    import numpy as np

    runs = simulate_runs(EPOCH_LAW, SHAPE, np.random.default_rng(0), run_sd=0.0)
    top = SHAPE.sizes[-1]
    lower, held = [r for r in runs if top != r.N], [r for r in runs if top == r.N]
    for run, interval in zip(held, predict_held_out(lower, held, 0.0, **FAST), strict=True):
        assert interval.point == pytest.approx(run.L[0], rel=2e-3)
        assert interval.lower * (1 - 1e-9) <= run.L[0] <= interval.upper * (1 + 1e-9)  # no noise: no width
    # a new run's seed noise (sd 0.05 on log loss) widens each interval to about +-1.645 sd around the point
    for interval in predict_held_out(lower, held, 0.05, **FAST):
        assert math.log(interval.upper / interval.lower) == pytest.approx(2 * 1.645 * 0.05, rel=0.25)


def test_the_calibration_counts_misses_per_ladder() -> None:
    calibration = BacktestCalibration(runs_per_replicate=6, misses=(0, 1, 2, 0))
    assert calibration.replicates == 4
    assert calibration.coverage == pytest.approx(1 - 3 / 24)
    assert calibration.all_inside == 0.5 and calibration.at_most(1) == 0.75
    assert calibration.mc_se(0.5) == pytest.approx(0.25)


def test_the_backtest_passes_near_its_level_when_the_law_holds_and_fails_when_the_top_rung_breaks() -> None:
    """The null: every ladder follows the law, so the runs' coverage is near the nominal 0.9 (measured 0.94 at
    20 ladders) and most ladders pass. The negative control: the top rung 5 % above the law (log loss + 0.05, five
    times the seed noise) is caught: most of its runs fall outside and almost no ladder passes."""
    held = simulate_backtest(EPOCH_LAW, SHAPE, run_sd=0.01, replicates=16, **FAST)
    broken = simulate_backtest(EPOCH_LAW, SHAPE, run_sd=0.01, replicates=16, top_shift=0.05, **FAST)
    assert held.runs_per_replicate == 6 and held.replicates == 16
    assert held.coverage >= 0.8 and held.all_inside >= 0.5
    assert broken.coverage <= 0.3 and broken.all_inside <= 0.1


def test_a_backtest_simulation_needs_four_rungs() -> None:
    with pytest.raises(ValueError, match="4 rungs or more"):
        simulate_backtest(EPOCH_LAW, Ladder(sizes=(1e4, 2e4, 4e4), seeds=(1, 1, 1)), 0.01, replicates=2)
    with pytest.raises(ValueError, match="replicates >= 1"):
        simulate_backtest(EPOCH_LAW, SHAPE, 0.01, replicates=0)


def test_the_seed_spread_of_a_simulated_ladder_is_its_run_noise() -> None:
    import numpy as np

    from satlab.studies.scaling_backtest import seed_spread

    runs = simulate_runs(EPOCH_LAW, SHAPE, np.random.default_rng(1), run_sd=0.02)
    assert seed_spread(runs) == pytest.approx(0.02, rel=0.3)
    assert seed_spread([RunPoints("a", 1.0, (1.0,), (math.e,))]) == 0.0


def test_a_simultaneous_band_gives_each_of_k_runs_the_bonferroni_level() -> None:
    assert run_level(0.9, 6) == 0.9 and run_level(0.9, 6, "pointwise") == 0.9
    assert run_level(0.9, 6, "simultaneous") == pytest.approx(1 - 0.1 / 6)
    assert run_level(0.9, 1, "simultaneous") == pytest.approx(0.9)
    for bad in ((0.9, 0, "simultaneous"), (0.9, 6, "joint")):
        with pytest.raises(ValueError, match="one of pointwise, simultaneous"):
            run_level(*bad)


def test_the_backtest_judges_only_the_named_seeds() -> None:
    runs = [RunPoints(f"s{s}", 1.0, (1.0,), (2.0,), seed=s) for s in (0, 1, 2, 3)]
    assert [r.seed for r in judged_runs(runs, [2, 3])] == [2, 3]
    assert judged_runs(runs) == runs and judged_runs(runs, []) == runs


def test_noise_draws_place_the_ends_of_a_high_level_interval() -> None:
    """No fit uncertainty (50 identical fits), seed noise 0.05: the 99.9 % interval is exp(+-3.29 x 0.05) around the
    law. From 50 values (one draw each) its ends are the extremes of 50 normals (about +-2.3 sd), far too narrow."""
    laws = [EPOCH_LAW] * 50
    wide = loss_interval(EPOCH_LAW, laws, 1e8, 2e9, 0.999, noise_sd=0.05, draws=2000)
    assert math.log(wide.upper / wide.lower) == pytest.approx(2 * 3.2905 * 0.05, rel=0.04)
    narrow = loss_interval(EPOCH_LAW, laws, 1e8, 2e9, 0.999, noise_sd=0.05)
    assert math.log(narrow.upper / narrow.lower) < 0.85 * math.log(wide.upper / wide.lower)


def test_a_simultaneous_band_passes_a_correct_law_at_its_level_and_still_catches_a_broken_top_rung() -> None:
    """The same ladders judged both ways: the band's wider intervals miss no run the pointwise ones keep, and it
    passes a correct law at least about 90 % of the time (measured 20 of 20; the Monte Carlo error of 20 ladders
    allows 0.8). The negative control: the top rung 5 % above the law fails the band in nearly every ladder
    (measured 20 of 20)."""
    pointwise = simulate_backtest(EPOCH_LAW, SHAPE, run_sd=0.01, replicates=20, seed=3, **FAST)
    band = simulate_backtest(EPOCH_LAW, SHAPE, run_sd=0.01, replicates=20, seed=3, band="simultaneous", **FAST)
    broken = simulate_backtest(EPOCH_LAW, SHAPE, run_sd=0.01, replicates=20, seed=3, band="simultaneous",
                               top_shift=0.05, **FAST)
    assert band.all_inside >= 0.8 and band.all_inside >= pointwise.all_inside
    assert all(b <= p for b, p in zip(band.misses, pointwise.misses, strict=True))  # wider intervals, same ladders
    assert broken.all_inside <= 0.15
    judged = simulate_backtest(EPOCH_LAW, SHAPE, run_sd=0.01, replicates=2, band="simultaneous", seeds=[1], **FAST)
    assert judged.runs_per_replicate == 3  # seed 1 of the top rung at three budgets
