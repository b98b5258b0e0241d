"""The bench's ratios: paired per round, with a 95 % interval that is the t-interval of the log ratios."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from satlab.bench.throughput import PairedRatio
from satlab.cli.main import main


def test_a_paired_ratio_is_the_geometric_mean_with_the_t_interval_of_the_log_ratios():
    ratios = [0.97, 1.01, 0.99, 0.95, 1.00, 0.98]
    paired = PairedRatio("transformer", ratios)
    logs = np.log(ratios)
    low, high = stats.t.interval(0.95, len(logs) - 1, loc=logs.mean(), scale=stats.sem(logs))
    assert paired.mean == pytest.approx(math.exp(logs.mean()))
    assert (paired.low, paired.high) == (pytest.approx(math.exp(low)), pytest.approx(math.exp(high)))
    assert paired.half_width == pytest.approx((math.exp(high) - math.exp(low)) / 2 / math.exp(logs.mean()))
    assert PairedRatio("transformer", [1.0]).half_width == math.inf  # one round bounds nothing


def test_the_bench_goes_on_until_the_interval_is_narrow_enough_or_says_it_is_not(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--archs", "transformer,satformer", "--batch", "2", "--seq-len", "32", "--warmup", "1",
            "--no-overhead", "--no-mlflow", "--out", str(out)]
    assert main([*args, "--rounds", "2", "--max-rounds", "4", "--ci-target", "1e-9"]) == 0
    report = json.loads(out.read_text())
    ratio = report["results"][1]["ratio"]
    assert ratio["rounds"] == 4 and ratio["low"] <= ratio["mean"] <= ratio["high"]
    assert report["results"][0]["ratio"] is None and report["ci"]["reached"] is False
    assert "not the ± 1e-07 % asked for" in capsys.readouterr().out
    assert main([*args, "--rounds", "3", "--ci-target", "0"]) == 0  # off: exactly the rounds asked for
    assert json.loads(out.read_text())["results"][1]["ratio"]["rounds"] == 3
    assert main([*args, "--ci-target", "-1"]) == 2
