"""The ladder's backtest and its calibration (satlab/studies/scaling_backtest.py): how often it passes when the law
holds, simulated through the same prediction the report uses, and a negative control (a top rung off the law) that
shows it can fail."""

from __future__ import annotations

import math

import pytest

from satlab.studies.scaling_backtest import BacktestCalibration, predict_held_out, simulate_backtest
from satlab.studies.scaling_fit import RunPoints
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
