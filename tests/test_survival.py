"""Censored time-to-bind: the Kaplan-Meier estimate, its median and restricted mean with their intervals, the Wilson
interval (satlab.studies.survival), against a hand-computed example and the published 6-MP remission data, and the
time-to-bind section of a recall ablation's report (satlab.studies.bind_report)."""

from __future__ import annotations

import numpy as np
import pytest

from satlab.studies.ablation_report import cell_text
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.bind_report import arm_estimates, bind_section
from satlab.studies.loader import spec_from_dict
from satlab.studies.results import RECALL_MEASURES, CellResult, GroupResult
from satlab.studies.survival import kaplan_meier, median_time, restricted_mean, wilson

# Freireich et al. (1963), 6-MP arm: weeks in remission, + censored. Published Kaplan-Meier values (Kleinbaum and
# Klein, Survival Analysis, table 2.x; Klein and Moeschberger, example 4.1): S and Greenwood's standard error at each
# relapse time, median 23 weeks.
SIX_MP = [6, 6, 6, 7, 10, 13, 16, 22, 23, 6, 9, 10, 11, 17, 19, 20, 25, 32, 32, 34, 35]
SIX_MP_RELAPSED = [1] * 9 + [0] * 12
SIX_MP_S = {6: 0.857, 7: 0.807, 10: 0.753, 13: 0.690, 16: 0.627, 22: 0.538, 23: 0.448}
SIX_MP_SE = {6: 0.076, 7: 0.087, 10: 0.096, 13: 0.107, 16: 0.114, 22: 0.128, 23: 0.135}


def test_kaplan_meier_by_hand_with_ties_and_censoring():
    """Bind steps 100, 200, 200, 400; 300 and 500 censored. S: 5/6 after 100, 5/6 * 3/5 = 1/2 after 200 (the run
    censored at 300 leaves the risk set), 1/2 * 1/2 = 1/4 after 400. Greenwood at 200: 1/(6*5) + 2/(5*3) = 1/6."""
    km = kaplan_meier([100, 200, 200, 300, 400, 500], [1, 1, 1, 0, 1, 0])
    assert km.times.tolist() == [100, 200, 400]
    assert km.at_risk.tolist() == [6, 5, 2] and km.events.tolist() == [1, 2, 1]
    np.testing.assert_allclose(km.survival, [5 / 6, 1 / 2, 1 / 4])
    assert km.at(99) == 1.0 and km.at(250) == 0.5 and km.at(10_000) == 0.25
    assert km.std_error()[1] == pytest.approx(0.5 * np.sqrt(1 / 6))
    assert median_time(km)[0] == 200
    # area under S to 500: 100 * 1 + 100 * 5/6 + 200 * 1/2 + 100 * 1/4
    assert restricted_mean(km, 500)[0] == pytest.approx(100 + 500 / 6 + 100 + 25)
    # an event and a censoring at the same step: the event first (the censored run was at risk then)
    tied = kaplan_meier([100, 100, 200], [1, 0, 1])
    assert tied.at_risk.tolist() == [3, 1] and tied.survival.tolist() == pytest.approx([2 / 3, 0])


def test_the_6mp_remission_data_give_the_published_kaplan_meier_values():
    km = kaplan_meier(SIX_MP, SIX_MP_RELAPSED)
    assert km.times.tolist() == list(SIX_MP_S)
    np.testing.assert_allclose(km.survival, list(SIX_MP_S.values()), atol=5e-4)
    np.testing.assert_allclose(km.std_error(), list(SIX_MP_SE.values()), atol=5e-4)
    median, lower, upper = median_time(km)
    # the log-log interval of S first holds 0.5 at 13 (at 10 its lower end is 0.503: by hand from S and the SE
    # above) and its upper end never comes down to 0.5: the interval is [13, not reached]
    assert (median, lower, upper) == (23, 13, None)
    s_lower, _ = km.interval()
    assert s_lower[list(SIX_MP_S).index(10)] == pytest.approx(0.503, abs=1e-3)


def test_the_restricted_mean_is_the_mean_of_min_time_tau_when_every_censoring_is_at_tau():
    """A recall study's case: runs that never bound are censored at the budget. Then the area under S to the budget
    equals the plain mean of the steps (the censored counted at the budget); without censoring its variance is the
    sample variance / n (ddof 0)."""
    rng = np.random.default_rng(0)
    steps = rng.integers(3, 30, 40) * 100.0
    tau = 2000.0
    bound = steps < tau
    km = kaplan_meier(np.minimum(steps, tau), bound)
    mean, lower, upper = restricted_mean(km, tau)
    assert mean == pytest.approx(np.minimum(steps, tau).mean())
    assert lower < mean < upper
    everything = np.arange(1, 21) * 100.0
    mean, lower, upper = restricted_mean(kaplan_meier(everything, np.ones(20)), 5000.0)
    assert mean == pytest.approx(everything.mean())
    assert (upper - mean) / 1.959964 == pytest.approx(everything.std() / np.sqrt(20), rel=1e-6)


def test_wilson_interval_known_values():
    assert wilson(0, 10) == pytest.approx((0.0, 0.0, 1.959964 ** 2 / (10 + 1.959964 ** 2)), abs=1e-6)  # 0.2775
    p, lower, upper = wilson(9, 21)
    assert p == pytest.approx(9 / 21) and (lower, upper) == pytest.approx((0.2447, 0.6345), abs=1e-4)
    assert wilson(12, 12)[1:] == pytest.approx((0.7575, 1.0), abs=1e-4)
    with pytest.raises(ValueError):
        wilson(0, 0)


def recall_groups(spec: AblationSpec, bind: dict[tuple[str, int], tuple[float, float]],
                  budget: int = 1000) -> list[GroupResult]:
    groups: dict[str, GroupResult] = {}
    for cell in spec.cells():
        values = dict(cell.values)
        steps, bound = bind[(values["model.arch"], values["data.mqar.num_pairs"])]
        steps = steps + 100 * cell.seed if bound else steps
        group = groups.setdefault(cell.group, GroupResult(cell.group, cell.group_values, 4))
        group.cells.append(CellResult(cell, cell.slug, {"steps_to_bind": steps, "bound": bound}, None, [], budget))
    return list(groups.values())


def test_the_report_section_gives_each_setting_and_arm_its_bind_estimates(tmp_path):
    spec = spec_from_dict(AblationSpec, {"name": "bind", "base": "recall/mqar", "axes": {
        "data.mqar.num_pairs": [4, 8], "model.arch": ["transformer", "resformer"], "train.seed": [0, 1, 2, 3]}})
    # transformer binds at 200 + 100 * seed; resformer at 4 pairs never (censored at the budget, 1,000)
    groups = recall_groups(spec, {("transformer", 4): (200, 1), ("resformer", 4): (1000, 0),
                                  ("transformer", 8): (500, 1), ("resformer", 8): (300, 1)})
    arms = {(a.setting, a.arm): a for a in arm_estimates(groups, {}, by_arch=True)}
    assert set(arms) == {("num_pairs=4", "Transformer"), ("num_pairs=4", "ResFormer"),
                         ("num_pairs=8", "Transformer"), ("num_pairs=8", "ResFormer")}
    t4, r4 = arms[("num_pairs=4", "Transformer")], arms[("num_pairs=4", "ResFormer")]
    assert (t4.bound, t4.n, t4.tau) == (4, 4, 1000) and t4.median[0] == 300  # 200, 300, 400, 500: S = 0.5 at 300
    assert t4.restricted[0] == pytest.approx(350)
    assert (r4.bound, r4.median[0], r4.restricted[0]) == (0, None, 1000)
    assert r4.fraction == pytest.approx((0.0, 0.0, 0.4899), abs=1e-4)
    assert arms[("num_pairs=8", "ResFormer")].tau == 1000  # the budget, though every run there bound by step 600
    lines, summary, figure = bind_section(spec, groups, {}, tmp_path)
    text = "\n".join(lines)
    assert "## Time to bind" in text and "![bind curves](bind_curves.png)" in text
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line for line in lines[4].splitlines()}
    assert "| 0/4 " in rows[("num_pairs=4", "ResFormer")] and "not reached" in rows[("num_pairs=4", "ResFormer")]
    assert "| 300 [200, 500]" in rows[("num_pairs=4", "Transformer")]
    assert figure is not None and figure.exists() and len(summary) == 4
    assert summary[0]["curve"]["fraction_bound"] == [0.25, 0.5, 0.75, 1.0]
    steps_column = next(c for c in RECALL_MEASURES.columns if c.name == "steps_to_bind")
    assert cell_text(groups[1], steps_column) == "1,000 ± 0"  # every cell has a value: no (k/n) count


def test_no_section_without_the_measure(tmp_path):
    spec = spec_from_dict(AblationSpec, {"name": "old", "base": "recall/mqar",
                                         "axes": {"model.arch": ["transformer"], "train.seed": [0, 1]}})
    groups = [GroupResult(c.group, c.group_values, 2, [CellResult(c, c.slug, {"recall_acc": 0.5}, None, [])])
              for c in spec.cells()]
    assert bind_section(spec, groups, {g.label: g.label for g in groups}, tmp_path) == ([], [], None)
