"""The group-sequential statistics (satlab.studies.sequential): published boundaries reproduced to 3 decimals, the
family-wise error held on simulated null studies through the same function the report uses, the naive re-test's
inflation detected, and the verdicts, intervals and alpha sharing of the look function."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from satlab.config.sequential import SequentialPlan
from satlab.studies import sequential_sim as sim
from satlab.studies.sequential import (
    boundaries,
    constant_boundary,
    crossing,
    differences,
    evaluate,
    pairs,
    sign_flip_p,
    spent,
)
from satlab.studies.stats import holm, paired_p

FIVE = (1, 2, 3, 4, 5)


def test_lan_demets_obrien_fleming_five_equal_looks():
    """Lan-DeMets O'Brien-Fleming-type spending, K = 5 equal looks, two-sided alpha 0.05 (0.025 a side), z = 4.877,
    3.357, 2.680, 2.290, 2.031: ldbounds' ``bounds(seq(0.2, 1, 0.2), iuse=c(1, 1), alpha=c(0.025, 0.025))`` and
    gsDesign's ``gsDesign(k=5, test.type=2, sfu=sfLDOF)`` (the spending function as gsDesign's sfLDOF page writes it,
    https://search.r-project.org/CRAN/refmans/gsDesign/html/sfLDOF.html). And the one-sided example of SeqBounds.jl's
    README (github.com/PharmCat/SeqBounds.jl: ``bounds([0.25, 0.5, 0.75, 1.0], 0.05)``, O'Brien-Fleming spending,
    one-sided alpha 0.05): z = 3.74955, 2.53993, 2.01604, 1.72014 (a coarse grid there, so 3 decimals)."""
    design = boundaries(FIVE, 0.025, "obrien_fleming", 2)
    assert [round(z, 3) for z in design.z] == [4.877, 3.357, 2.680, 2.290, 2.031]
    one_sided = boundaries((1, 2, 3, 4), 0.05, "obrien_fleming", 1)
    assert [round(z, 3) for z in one_sided.z] == [3.750, 2.540, 2.016, 1.720]


def test_classical_pocock_and_obrien_fleming_constants():
    """Jennison & Turnbull (2000), Table 2.1: C_P(5, 0.05) = 2.413; Table 2.3: C_B(5, 0.05) = 2.040 (two-sided
    alpha 0.05, 5 equal groups). Wang-Tsiatis final boundaries from gsDesign's tests, which cite J&T
    (github.com/keaven/gsDesign tests/testthat/test-outputs.R, test.JT.WT): Delta 0.1, K 9: 2.113; Delta 0.25, K 6:
    2.154; Delta 0.4, K 7: 2.313 (two-sided, 0.025 a side; the final boundary is C)."""
    fractions = [k / 5 for k in FIVE]
    assert round(constant_boundary(fractions, 0.05, 2, delta=0.5), 3) == 2.413
    assert round(constant_boundary(fractions, 0.05, 2, delta=0.0), 3) == 2.040
    for delta, looks, final in ((0.1, 9, 2.113), (0.25, 6, 2.154), (0.4, 7, 2.313)):
        assert round(constant_boundary([k / looks for k in range(1, looks + 1)], 0.05, 2, delta), 3) == final


def test_repeated_testing_at_the_fixed_level_crosses_as_published():
    """gsDesign's test.Deming.gsProb (same file): testing 2, 4 and 10 times at 1.96 (two-sided, equal increments)
    crosses the upper boundary with probability 0.042, 0.063 and 0.097: the inflation the spending functions undo."""
    for looks, published in ((2, 0.042), (4, 0.063), (10, 0.097)):
        fractions = [k / looks for k in range(1, looks + 1)]
        assert round(sum(crossing([stats.norm.isf(0.025)] * looks, fractions, 2)), 3) == published


@pytest.mark.parametrize("spending", ["obrien_fleming", "pocock"])
@pytest.mark.parametrize("sides", [1, 2])
def test_each_boundary_spends_exactly_its_increment(spending, sides):
    """Pocock-type spending too: the first boundary is the normal quantile of the first spend (no integration), and
    the crossing probabilities of the solved boundaries are the spending function's increments."""
    looks = (3, 5, 8, 12, 20)
    design = boundaries(looks, 0.025, spending, sides)
    assert design.z[0] == pytest.approx(stats.norm.isf(spent(spending, 3 / 20, 0.025)), abs=1e-8)
    increments = np.diff([0.0, *design.spent])
    assert crossing(design.z, design.fractions, sides) == pytest.approx(list(increments), abs=2e-6)
    assert design.spent[-1] == 0.025
    assert design.critical(0) > design.z[0]  # t at 2 degrees of freedom needs more than z for the same tail


@pytest.mark.parametrize("spending", ["obrien_fleming", "pocock"])
def test_looks_that_cannot_reject_spend_nothing_and_carry_their_alpha(spending):
    """The sign-flip check's floor: a look whose nominal level is below 2^-n spends nothing; the next spends what it
    left, so the whole level is still spent (crossing probabilities sum to it) and no look is alive but unreachable.
    Pocock-type spending over 3 comparisons: 3 and 5 seeds cannot reject, 8 can with their alpha carried over."""
    looks, level = (3, 5, 8, 12, 20), 0.025 / 3
    design = boundaries(looks, level, spending, 2, floor=True)
    assert sum(crossing(design.z, design.fractions, 2)) == pytest.approx(level, abs=2e-6)
    assert all(p == 0.0 or p >= 2.0 ** -n for n, p in zip(looks, design.nominal, strict=True))
    assert design.spent[-1] == level and design.z[:2] == (math.inf, math.inf)
    assert math.isfinite(design.z[2]) == (spending == "pocock")


# Type-I error: 2,000 null studies keep the suite fast; their Monte Carlo standard error at 0.05 is 0.0049, so the
# bound alpha + 2 MCSE is about 0.060 (the full 10,000-study run is in docs/results/2026-12-04-sequential.md).
STUDIES = 2000
ARMS = ["transformer", "resformer", "satformer", "muddformer"]


REAL_DIFFERENCES = [0.0030, 0.0688, 0.0153, -0.0584, -0.0443, 0.0375]
"""SATFormer minus Transformer final validation loss, seeds 0-5 of a micro-budget pair (d 32, 2 layers, byte KJV,
8,192 tokens; docs/results/2026-12-04-sequential.md)."""


@pytest.mark.parametrize("sharing,comparisons", [  # the two the shipped studies use; Bonferroni in make test-full
    ("holm", "baseline"), pytest.param("bonferroni", "baseline", marks=pytest.mark.slow), ("holm", "all_pairs")])
def test_the_plan_holds_its_family_wise_error_on_null_studies(sharing, comparisons):
    plan = SequentialPlan(looks=[3, 5, 8, 12, 20], sharing=sharing, comparisons=comparisons)
    estimate = sim.null_studies(plan, ARMS, "transformer", STUDIES, sigma=0.0975, seed=7)["plan, normal"]
    assert estimate.rate <= plan.alpha + 2 * estimate.mcse, estimate.text()


def test_sign_flips_of_one_real_difference_hold_the_error():
    plan = SequentialPlan(looks=[3, 5, 8, 12, 20])
    estimate = sim.null_studies(plan, ["satformer", "transformer"], "transformer", STUDIES, sigma=1.0,
                                observed=REAL_DIFFERENCES, seed=7)["plan, sign-flips"]
    assert estimate.rate <= plan.alpha + 2 * estimate.mcse, estimate.text()


@pytest.mark.parametrize("sharing", ["holm", "bonferroni"])
def test_sign_flips_of_six_real_differences_hold_the_error_over_three_comparisons(sharing):
    """Six values resampled give ties and two-valued samples: the t test alone rejected at 3-5 seeds on rounding
    (three equal draws have a standard deviation of 1e-19, not 0), and its critical values assume normal
    differences, so at 8-20 seeds it crossed 7, 2.2 and 1.1 times the nominal levels (the results page). It reached
    0.067 ± 0.005 here; the exact sign-flip check brings it within alpha."""
    plan = SequentialPlan(looks=[3, 5, 8, 12, 20], sharing=sharing)
    rule = sim.sequential_rule(plan, pairs(ARMS, "transformer", plan.comparisons))  # as null_studies, this rule only
    estimate = sim.simulate(rule, sim.sign_flip_draw(ARMS, "transformer", REAL_DIFFERENCES), 20, STUDIES, seed=6)
    assert estimate.rate <= plan.alpha + 2 * estimate.mcse, estimate.text()


def brute_force_sign_flip_p(d: np.ndarray) -> float:
    """Every sign vector, 2^16 at a time: no halves, no sorting, no searching."""
    magnitudes, observed = np.abs(d), abs(d.sum())
    head = np.array(list(itertools.product((-1.0, 1.0), repeat=min(len(d), 16)))).reshape(-1, min(len(d), 16))
    count = 0
    for tail in itertools.product((-1.0, 1.0), repeat=len(d) - head.shape[1]):
        sums = head @ magnitudes[:head.shape[1]] + np.dot(tail, magnitudes[head.shape[1]:])
        count += int(np.sum(sums >= observed - 1e-12))
    return count / 2 ** len(d)


def test_the_sign_flip_p_is_the_share_of_sign_vectors_at_least_as_extreme():
    rng = np.random.default_rng(3)
    tied = [-0.2, 0.1, 0.1, 0.3, 0.0, 0.7, -0.6]  # 0.1 + 0.2 is not 0.3 in floating point: ties up to rounding
    for n in [*range(1, 14), 21, 23]:  # up to 20 values each half is a product of cached signs, beyond it is doubled
        for values in (rng.normal(0.1, 1.0, n), rng.choice(tied, n), rng.choice([-1.0, 0.0, 1.0], n),
                       np.full(n, 0.5)):
            assert sign_flip_p(values) == pytest.approx(brute_force_sign_flip_p(values), abs=1e-12), values
    assert sign_flip_p(np.full(12, 0.5)) == 2.0 ** -12  # all alike: only the observed signs are as extreme
    assert sign_flip_p(-np.full(12, 0.5)) == 2.0 ** -12  # the tail of the mean's side
    assert sign_flip_p(np.zeros(5)) == 1.0
    assert sign_flip_p(rng.normal(0, 1, 41)) is None  # beyond the exact count: the t test alone


def test_no_comparison_stops_while_its_seeds_cannot_reach_the_nominal_level():
    """Every seed favours the first arm by far: the t test alone would reject at the second look (5 seeds, nominal
    5.1e-4), but five signs give at best p = 1/32, so that look spends nothing (its boundary is infinite, its alpha
    carried to the third) and the verdict waits for the third (8 seeds: 1/256 under 5.9e-3). And over many plans
    and strong one-sided data: no look rejects where 2^-n is above its nominal level, and every look up to 40 seeds
    records its exact sign-flip p."""
    seen = {"a": dict.fromkeys(range(12), 0.0), "b": dict(enumerate(1.0 + 0.01 * np.arange(12)))}
    (verdict,) = evaluate(SequentialPlan(looks=[3, 5, 8, 12]), seen, [("a", "b")])
    assert [r.decision for r in verdict.records] == ["continue", "continue", "a_better"]
    second, published = verdict.records[1], boundaries((3, 5, 8, 12), 0.025, "obrien_fleming", 2)
    assert second.t >= published.critical(1) and second.sign_flip_p == 1 / 32 > published.nominal[1]
    assert second.critical == math.inf and second.nominal == 0.0
    assert verdict.records[0].sign_flip_p == 1 / 8 and verdict.records[2].sign_flip_p == 1 / 256
    assert verdict.records[2].nominal > published.nominal[2]  # the second look's alpha carried over
    rng = np.random.default_rng(8)
    checked = 0
    for spending, looks, arms in (("obrien_fleming", [3, 5, 8, 12, 20], 4), ("pocock", [3, 5, 8, 12, 20], 4),
                                  ("pocock", [3, 4, 6, 9], 2), ("obrien_fleming", [4, 8, 12], 3)):
        plan = SequentialPlan(looks=looks, spending=spending)
        names = [f"arm{i}" for i in range(arms)]
        for _ in range(30):
            seen = {arm: dict(enumerate(rng.normal(-3.0 * i, 0.5, looks[-1]))) for i, arm in enumerate(names)}
            for v in evaluate(plan, seen, pairs(names, names[0], "baseline")):
                for r in v.records:
                    assert r.sign_flip_p == pytest.approx(sign_flip_p(
                        differences(seen[v.a], seen[v.b], True)[:r.seeds]))
                    if r.decision in ("a_better", "b_better"):
                        checked += 1
                        assert 2.0 ** -r.seeds <= r.sign_flip_p <= r.nominal, (spending, r)
    assert checked > 50


def test_seeds_that_agree_are_decided_by_the_sign_flip_p_alone():
    """A measure with no spread between seeds: every seed of one arm bound and none of the other's (recall/bound),
    or the same difference everywhere. The standard deviation of equal values is rounding (3 x 0.003 gives 3e-19):
    no spread, the same records as an exact zero; t is infinite, the sign-flip p (2^-n) decides, and the
    repeated interval is unbounded, so never "equivalent" within a margin."""
    plan = SequentialPlan(looks=[3, 5, 8, 12, 20], margin=0.02)
    base = dict.fromkeys(range(20), 0.0)
    rounded = evaluate(plan, {"a": base, "b": dict.fromkeys(range(20), 0.003)}, [("a", "b")])[0]
    exact = evaluate(plan, {"a": base, "b": dict.fromkeys(range(20), 0.5)}, [("a", "b")])[0]
    for verdict in (rounded, exact):
        assert verdict.outcome == "a_better" and verdict.seeds == 12  # 2^-8 is above 8 seeds' level, 2^-12 below
        assert all(r.se == 0 and r.t == math.inf and r.rci == (-math.inf, math.inf) for r in verdict.records)
    bound = {"resformer": dict.fromkeys(range(20), 1.0), "transformer": dict.fromkeys(range(20), 0.0)}
    (verdict,) = evaluate(SequentialPlan(looks=[3, 5, 8, 12, 20]), bound, [("transformer", "resformer")],
                          lower_is_better=False)
    assert verdict.outcome == "b_better" and verdict.records[-1].sign_flip_p == 2.0 ** -12
    same = {"a": base, "b": base}
    assert evaluate(plan, same, [("a", "b")])[0].outcome == "undecided"  # no difference at all: t undefined


def test_the_naive_re_test_inflates_the_error_and_the_harness_sees_it():
    plan = SequentialPlan(looks=[3, 5, 8, 12, 20])
    naive = sim.null_studies(plan, ["a", "b"], "b", STUDIES, sigma=1.0, seed=3)["naive re-test at 0.05, normal"]
    assert naive.rate > plan.alpha + 3 * naive.mcse, naive.text()


def test_the_simulations_fast_paired_test_and_holm_match_the_reports():
    rng = np.random.default_rng(0)
    d = rng.normal(0.1, 1.0, 7)
    assert sim.two_sided_p(d) == pytest.approx(paired_p(list(d), [0.0] * 7), rel=1e-10)
    from statsmodels.stats.multitest import multipletests

    ps = list(rng.uniform(0, 0.2, 6))
    assert holm([*ps, None]) == pytest.approx([*multipletests(ps, method="holm")[1], None])


def arms_with(shift: dict[str, float], n: int, sigma: float = 0.05, seed: int = 0) -> dict[str, dict[int, float]]:
    rng = np.random.default_rng(seed)
    return {arm: dict(enumerate(5.0 + mu + rng.normal(0, sigma, n))) for arm, mu in shift.items()}


def test_a_clear_difference_stops_early_with_its_look_record_and_bias_note():
    plan = SequentialPlan(looks=[3, 5, 8, 12, 20])
    seen = arms_with({"satformer": -0.3, "transformer": 0.0}, 20)  # losses: satformer lower, better
    (verdict,) = evaluate(plan, seen, [("satformer", "transformer")])
    assert verdict.outcome == "a_better" and verdict.stopped_at < 5 and verdict.seeds == plan.looks[
        verdict.stopped_at - 1]
    last = verdict.records[-1]
    assert last.t >= last.critical and last.rci[0] > 0 and "biased away from zero" in last.note
    flipped = evaluate(plan, seen, [("transformer", "satformer")])[0]
    assert flipped.outcome == "b_better"
    one_sided = evaluate(SequentialPlan(looks=[3, 5, 8, 12, 20], sides=1), seen, [("transformer", "satformer")])[0]
    assert one_sided.outcome == "undecided"  # only "the first arm is better" is tested
    higher = evaluate(plan, seen, [("transformer", "satformer")], lower_is_better=False)[0]
    assert higher.outcome == "a_better"  # an accuracy: higher is better


def test_waiting_continue_equivalent_and_undecided():
    plan = SequentialPlan(looks=[3, 5, 8])
    same = arms_with({"a": 0.0, "b": 0.0}, 8, sigma=0.01, seed=1)
    few = {arm: {s: v for s, v in values.items() if s < 2} for arm, values in same.items()}
    assert evaluate(plan, few, [("a", "b")])[0].outcome == "waiting"
    partial = {arm: {s: v for s, v in values.items() if s < 4} for arm, values in same.items()}
    verdict = evaluate(plan, partial, [("a", "b")])[0]
    assert verdict.outcome == "continue" and [r.seeds for r in verdict.records] == [3]
    assert evaluate(plan, same, [("a", "b")])[0].outcome == "undecided"
    exact = {"a": dict.fromkeys(range(8), 1.0), "b": dict.fromkeys(range(8), 1.0)}  # no difference: t undefined
    assert evaluate(plan, exact, [("a", "b")])[0].outcome == "undecided"
    margin = SequentialPlan(looks=[3, 5, 8], margin=0.1)
    equivalent = evaluate(margin, same, [("a", "b")])[0]
    low, high = equivalent.records[-1].rci
    assert equivalent.outcome == "equivalent" and -0.1 < low < high < 0.1


def test_holm_passes_the_alpha_of_a_rejected_comparison_on():
    """A comparison that misses its Bonferroni boundary is rejected once the other comparison's alpha passes to it."""
    plan = SequentialPlan(looks=[3, 5, 8], spending="pocock")
    rng = np.random.default_rng(11)
    diffs = {"clear": np.full(8, 0.5) + rng.normal(0, 0.01, 8), "near": None}
    for seed in range(2000):  # a difference between the Bonferroni and the full-alpha boundary at the last look
        d = np.random.default_rng(seed).normal(0.0, 1.0, 8)
        d = d - d.mean() + 3.2 * d.std(ddof=1) / math.sqrt(8)
        alone = {"x": dict(enumerate(-d)), "base": dict.fromkeys(range(8), 0.0)}
        half = evaluate(SequentialPlan(looks=[3, 5, 8], spending="pocock", alpha=0.025), alone, [("x", "base")])[0]
        full = evaluate(SequentialPlan(looks=[3, 5, 8], spending="pocock"), alone, [("x", "base")])[0]
        if half.outcome == "undecided" and full.outcome == "a_better" and full.stopped_at == 3:
            diffs["near"] = d
            break
    assert diffs["near"] is not None
    seen = {"base": dict.fromkeys(range(8), 0.0), **{arm: dict(enumerate(-d)) for arm, d in diffs.items()}}
    comparisons = pairs(["clear", "near", "base"], "base", "baseline")
    holm_verdicts = evaluate(plan, seen, comparisons)
    bonferroni = evaluate(SequentialPlan(looks=[3, 5, 8], spending="pocock", sharing="bonferroni"), seen, comparisons)
    assert [v.outcome for v in bonferroni] == ["a_better", "undecided"]
    assert [v.outcome for v in holm_verdicts] == ["a_better", "a_better"]
    assert holm_verdicts[1].records[-1].alpha == pytest.approx(0.05)


def test_comparisons_of_a_plan():
    assert pairs(["t", "r", "s"], "t", "baseline") == [("r", "t"), ("s", "t")]
    assert pairs(["t", "r", "s"], None, "all_pairs") == [("t", "r"), ("t", "s"), ("r", "s")]
    with pytest.raises(ValueError, match="baseline"):
        pairs(["t", "r"], "x", "baseline")
