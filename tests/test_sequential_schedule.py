"""Which cells a sequential ablation runs next, decided without training (satlab.studies.sequential_schedule): the
arms, settings and families of a plan, the seeds each arm needs after each look, the records a replay appends or
reports as changed, and the verdict tags."""

from __future__ import annotations

import math

import pytest

from satlab.config.errors import ConfigError
from satlab.studies import sequential_schedule as S
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import spec_from_dict

ARCHS = ["transformer", "satformer", "resformer"]


def make_spec(seeds: int = 8, **sequential) -> AblationSpec:
    return spec_from_dict(AblationSpec, {
        "name": "s", "axes": {"model.arch": ARCHS, "data.seq_len": [32, 64], "train.seed": list(range(seeds))},
        "baseline": {"model.arch": "transformer"}, "sequential": {"looks": [3, 5, 8], **sequential}})


def values(spec: AblationSpec, cells, effect: dict[str, float]) -> dict[str, float]:
    """A loss per cell: ``effect`` of its architecture plus a small seed-to-seed wobble, its size per architecture
    (paired differences that vary)."""
    wobble = [0.013, -0.021, 0.008, 0.017, -0.004, -0.011, 0.019, -0.002, 0.006, -0.015, 0.012, -0.007]
    return {c.key: 3.0 - effect.get(arch := c.group_values["model.arch"], 0.0) + wobble[c.seed] *
            (1 + 0.5 * ARCHS.index(arch)) for c in cells}


def test_arms_settings_and_families():
    spec = make_spec(compare="model.arch", family="setting")
    d = S.design(spec)
    assert [f.name for f in d.families] == ["data.seq_len=32", "data.seq_len=64"]
    base = "model.arch=transformer data.seq_len=32"
    assert d.families[0].comparisons == (("model.arch=satformer data.seq_len=32", base),
                                         ("model.arch=resformer data.seq_len=32", base))
    study = S.design(make_spec(compare="model.arch"))
    assert len(study.families) == 1 and len(study.comparisons) == 4  # one family: alpha shared over both settings
    groups = S.design(make_spec(comparisons="all_pairs"))  # no compare: every group is an arm, one setting
    assert len(groups.families) == 1 and len(groups.comparisons) == 15
    assert S.verdict_tag(d, *d.families[1].comparisons[0]) == \
        "verdict.sequential.data.seq_len-64.satformer_vs_transformer"
    assert S.arm_label(groups, "model.arch=satformer data.seq_len=64") == "arch=satformer, seq_len=64"
    assert S.comparison_label(d, *d.families[1].comparisons[0]) == "satformer vs transformer (data.seq_len=64)"
    assert S.comparison_label(study, *study.comparisons[3]) == "resformer vs transformer (data.seq_len=64)"  # one
    # family over both settings (make reproduce's): the setting still named, else two rows read the same
    single = S.design(spec_from_dict(AblationSpec, {"name": "one", "axes": {"model.arch": ARCHS, "train.seed": [0]},
                                                    "baseline": {"model.arch": "transformer"},
                                                    "sequential": {"looks": [3], "compare": "model.arch"}}))
    assert S.comparison_label(single, *single.comparisons[0]) == "satformer vs transformer"


def test_the_first_look_queues_n1_seeds_of_every_arm_and_nothing_more():
    spec = make_spec(compare="model.arch")
    d = S.design(spec)
    schedule = S.decide(d, S.observations(d, spec.cells(), {}))
    assert set(schedule.seeds.values()) == {3} and schedule.waiting_for == {"": 1} and not schedule.decided
    wanted = S.wanted_cells(spec, d, schedule.seeds)
    assert len(wanted) == 6 * 3 and {c.seed for c in wanted} == {0, 1, 2}
    assert [c.seed for c in wanted] == sorted(c.seed for c in wanted)  # run order: seeds slowest


def test_after_a_look_only_arms_of_open_comparisons_get_seeds():
    """SATFormer is clearly better at look 1 (8 seeds, all agreeing: sign-flip p 1/256 under Pocock's first level);
    ResFormer is not: it and the Transformer (its baseline) go on to 12 seeds, SATFormer never runs a ninth seed.
    Then ResFormer decides too and nothing more is wanted."""
    spec = make_spec(12, looks=[8, 12], spending="pocock", compare="model.arch", family="setting")
    d = S.design(spec)
    first = S.wanted_cells(spec, d, S.decide(d, S.observations(d, spec.cells(), {})).seeds)
    schedule = S.decide(d, S.observations(d, spec.cells(), values(spec, first, {"satformer": 1.0})))
    assert schedule.waiting_for == {"data.seq_len=32": 2, "data.seq_len=64": 2}
    needs = {(v["model.arch"], v["data.seq_len"]): schedule.seeds[g] for g, v in d.arms.items()}
    assert needs == {("satformer", 32): 8, ("satformer", 64): 8, ("transformer", 32): 12, ("transformer", 64): 12,
                     ("resformer", 32): 12, ("resformer", 64): 12}
    second = S.wanted_cells(spec, d, schedule.seeds)
    assert not [c for c in second if c.group_values["model.arch"] == "satformer" and c.seed >= 8]
    assert {c.key for c in first} < {c.key for c in second}
    tags = S.verdict_tags(d, schedule)
    assert tags["verdict.sequential.data.seq_len-32.satformer_vs_transformer"] == "a_better"
    assert tags["verdict.sequential.data.seq_len-32.resformer_vs_transformer"] == "open"
    done = S.decide(d, S.observations(d, spec.cells(), values(spec, spec.cells(), {"satformer": 1.0})))
    assert done.decided and done.waiting_for == {"data.seq_len=32": None, "data.seq_len=64": None}
    assert {v.outcome for _, vs in done.verdicts for v in vs} == {"a_better", "undecided"}
    assert S.decide(d, S.observations(d, spec.cells(), values(spec, spec.cells(), {"satformer": 1.0}))).seeds == \
        done.seeds  # pure: the same values give the same decisions


def test_a_look_reads_the_first_seeds_of_the_axis_without_a_gap():
    """A missing cell (failed, its run deleted) stops an arm's seeds there: a later seed does not stand in for it."""
    spec = make_spec()
    d = S.design(spec)
    cells = [c for c in spec.cells()
             if c.seed < 4 and not (c.seed == 1 and c.group_values["model.arch"] == "satformer")]
    observed = S.observations(d, spec.cells(), values(spec, cells, {}))
    assert {arm: sorted(seen) for arm, seen in observed.items() if "satformer" in arm} == \
        {"model.arch=satformer data.seq_len=32": [0], "model.arch=satformer data.seq_len=64": [0]}
    assert sorted(observed["model.arch=transformer data.seq_len=32"]) == [0, 1, 2, 3]
    reordered = spec_from_dict(AblationSpec, {**spec.to_dict(),
                                              "axes": {**spec.axes, "train.seed": [7, 6, 5, 4, 3, 2, 1, 0]}})
    first = S.wanted_cells(reordered, S.design(reordered), {g: 3 for g in d.arms})
    assert {c.seed for c in first} == {7, 6, 5}  # the axis' order, not the seeds' values


def test_replay_appends_new_rows_and_reports_changed_and_missing_ones():
    spec = make_spec()
    d = S.design(spec)
    rows = S.look_rows(S.decide(d, S.observations(d, spec.cells(), values(spec, spec.cells(), {"satformer": 0.5}))))
    assert rows and all({"family", "entry", "pair", "look", "seeds", "mean", "t", "critical", "z_boundary", "nominal",
                         "alpha", "rci", "decision"} <= r.keys() for r in rows)
    assert S.replay(rows, rows).new == [] and S.replay([], rows).new == rows
    again = S.replay(rows[:2], rows)
    assert again.new == rows[2:] and not again.changed and not again.missing
    nan = [dict(r, t=math.nan) for r in rows]
    assert not S.replay(nan, nan).changed  # NaN (seeds that agree exactly) equals itself
    i = next(i for i, r in enumerate(rows) if math.isfinite(r["t"]))
    edited = [*rows[:i], dict(rows[i], t=rows[i]["t"] + 1.0), *rows[i + 1:]]  # as if a cell's value had changed
    replay = S.replay(edited, rows)
    assert len(replay.changed) == 1 and replay.new == [] and f"t {edited[i]['t']}" in S.differences(replay.changed[0])
    fewer = S.look_rows(S.decide(d, S.observations(d, spec.cells(), {})))
    assert S.replay(rows, fewer).missing == rows


@pytest.mark.parametrize("items, fragment", [
    ({"compare": "data.source"}, "sequential.compare must be an axis of the grid"),
    ({"compare": "train.seed"}, "sequential.compare must be an axis of the grid"),
    ({"family": "setting"}, "family: setting makes each setting"),
    ({"measure": "val loss"}, "sequential.measure must name an MLflow metric"),
    ({"measure": "/val"}, "sequential.measure must name an MLflow metric"),
    ({"better": "smaller"}, "unknown sequential.better 'smaller'"),
    ({"family": "global"}, "unknown sequential.family 'global'"),
])
def test_bad_plan_fields_are_refused(items, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make_spec(**items)


def test_the_seed_axis_must_list_n_max_seeds():
    spec = make_spec()
    assert spec.sequential.seed_problems(spec.axes, spec.seed_key) == []
    short = make_spec(looks=[3, 5, 8, 12])
    assert "lists 8 seed(s), but the plan may run up to n_max = 12" in \
        short.sequential.seed_problems(short.axes, short.seed_key)[0]


def test_the_runs_table_says_which_missing_cells_the_plan_did_not_need():
    from satlab.studies.ablation_report import render_markdown
    from satlab.studies.results import measures_for

    spec = make_spec(compare="model.arch")
    d = S.design(spec)
    wanted = {c.key for c in S.wanted_cells(spec, d, S.decide(d, S.observations(d, spec.cells(), {})).seeds)}
    text = render_markdown(spec, [], [["cell"]], [], {}, "run", "sqlite://", measures_for(spec), [], {}, None,
                           wanted=wanted)
    rows = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("| `")}
    assert len(rows) == len(spec.cells()) and len(wanted) == 18
    assert all(("not finished" in rows[k]) == (k in wanted) for k in rows)
    assert all(("not needed by the sequential plan" in rows[k]) == (k not in wanted) for k in rows)


def test_the_looks_table_shows_the_comparison_and_its_decision_first():
    from satlab.studies.sequential_looks import rows_csv

    rows = [{"family": "f", "entry": 1, "pair": "a vs b", "look": 1, "seeds": 3, "mean": 0.1, "se": 0.05, "t": 2.0,
             "critical": 3.0, "z_boundary": 2.4, "nominal": 0.01, "alpha": 0.05, "rci": [-0.1, 0.3],
             "decision": "continue", "note": "", "sign_flip_p": 0.25}]
    header, row = rows_csv(rows).splitlines()
    assert header == ("pair,look,seeds,decision,t,critical,mean,rci,family,entry,se,z_boundary,nominal,alpha,note,"
                      "sign_flip_p")
    assert row.startswith('a vs b,1,3,continue,2.0,3.0,0.1,"[-0.1, 0.3]",f,1,')


def test_the_claims_legend_names_the_test_that_decided_them():
    """Under a sequential plan the claims are the plan's verdicts, so the legend must not describe the fixed-number
    t-test and Holm correction that were not made; without a plan it must."""
    from satlab.studies.ablation_report import render_markdown
    from satlab.studies.results import measures_for
    from satlab.studies.stats import Verdict

    spec = make_spec(compare="model.arch")
    claim = [Verdict("SATFormer beats the Transformer", "not resolved", "open at look 1.")]

    def legend(wanted: set[str] | None) -> str:
        text = render_markdown(spec, [], [["cell"]], claim, {}, "run", "sqlite://", measures_for(spec), [], {}, None,
                               wanted=wanted)
        section = text.split("## The paper's claims at this scale", 1)[1]
        assert "- SATFormer beats the Transformer: **not resolved**. open at look 1." in section
        return section.split("\n\n")[2]

    sequential, fixed = legend(set()), legend(None)
    assert sequential.startswith("Decided by the sequential plan's verdicts") and "Holm" not in sequential
    assert fixed.startswith("**held**: the claimed order") and "after Holm's correction" in fixed
    for text in (sequential, fixed):
        assert "**not measurable at this scale**" in text
        assert text.endswith("They hold for this ablation's model size and token budget only.")
