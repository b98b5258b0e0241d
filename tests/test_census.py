"""``satlab bench --census``: a training step counted (ops, elements written, matmul FLOPs) instead of timed. At its
base shape a parametrisation is sp, op for op; off it CompleteP adds only the multiplies that fold its multipliers
into weights, and a planted extra op is seen."""

from __future__ import annotations

import json

import pytest
import torch

from satlab.bench.census import compare_census, step_census
from satlab.cli.main import main

SMALL = dict(batch=2, seq_len=16)
OFF_BASE = {"base_width": 64, "base_depth": 3}  # the tiny size (128 wide, 6 deep) is twice the base both ways


def test_at_the_base_shape_completep_is_sp_op_for_op_and_off_it_adds_only_multiplies():
    (same_ref, same), = compare_census(["satformer"], "parametrization", ["sp", "completep"], **SMALL)
    assert (same.calls, same.elements, same.flops) == (same_ref.calls, same_ref.elements, same_ref.flops)
    assert same.added_ops(same_ref) == {}
    (ref, off), = compare_census(["satformer"], "parametrization", ["sp", "completep"], model=OFF_BASE, **SMALL)
    assert off.flops == ref.flops and set(off.added_ops(ref)) == {"mul"}
    calls, elements = off.added_ops(ref)["mul"]
    assert calls > 0 and elements > 0 and off.elements - ref.elements == elements


def test_a_planted_extra_op_is_counted():
    plain = step_census("transformer", **SMALL)
    real_silu = torch.nn.functional.silu

    def doubled(x, *args, **kwargs):  # one more elementwise op per call
        return real_silu(x, *args, **kwargs) * 1.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "silu", doubled)
        planted = step_census("transformer", **SMALL)
    assert planted.calls > plain.calls and planted.elements > plain.elements and planted.flops == plain.flops


def test_the_command_prints_and_writes_the_census_and_notes_a_base_shape(tmp_path, capsys):
    out = tmp_path / "census.json"
    assert main(["bench", "--archs", "transformer", "--compare", "parametrization=sp,completep", "--census",
                 "--batch", "2", "--seq-len", "16", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "base shape" in printed and "none" in printed  # at the base: nothing added
    report = json.loads(out.read_text())
    assert report["pairs"][0]["ratios"] == {"calls": 1.0, "elements": 1.0, "flops": 1.0}


@pytest.mark.parametrize(("args", "message"), [
    (["--census"], "--census counts what a model option adds"),
    (["--compare", "parametrization=sp,completep", "--census", "--model", "base_widht=64"], "did you mean"),
    (["--compare", "parametrization=sp,completep", "--census", "--model", "base_width"], "--model takes FIELD=VALUE"),
])
def test_bad_census_input_is_refused_and_nothing_written(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--archs", "transformer", *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
