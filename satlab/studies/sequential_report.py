"""The sequential section of an ablation's report: the plan, each comparison's verdict with the look it stopped at and
its final repeated confidence interval, the table of every recorded look, and the early-stopping bias note.

The verdicts are replayed from the finished cells as the scheduler replays them
(:mod:`satlab.studies.sequential_schedule`); the look table is the one recorded on the parent run
(``sequential/looks.json``), which a reviewer replays decision by decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlflow
import pandas as pd

from satlab.studies import sequential_schedule as S
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.results import cell_runs, final_values
from satlab.studies.sequential import EARLY_STOP_NOTE, EQUIVALENCE_NOTE
from satlab.studies.sequential_looks import REPLAY_TAG, recorded_looks

OUTCOME_TEXT = {"a_better": "{a} better", "b_better": "{b} better", "equivalent": "equivalent within ±{margin:g}",
                "undecided": "undecided at n_max", "continue": "open", "waiting": "open (first look not reached)"}
LOOK_COLUMNS = ("pair", "look", "seeds", "mean", "t", "critical", "z_boundary", "nominal", "alpha", "rci", "decision")


def sequential_summary(spec: AblationSpec, client: mlflow.MlflowClient, parent_run_id: str) -> dict[str, Any]:
    """The plan, the verdicts (with their tag on the parent run) and the recorded looks, for summary.json."""
    design = S.design(spec)
    values, _ = final_values(cell_runs(client, parent_run_id), spec.sequential.measure)
    schedule = S.decide(design, S.observations(design, spec.cells(), values))
    verdicts = []
    for family, found in schedule.verdicts:
        for v in found:
            last = v.records[-1] if v.records else None
            verdicts.append({"tag": S.verdict_tag(design, v.a, v.b), "outcome": S.TAG_OUTCOME[v.outcome],
                             "label": S.comparison_label(design, v.a, v.b),
                             "family": family.name, "a": S.arm_label(design, v.a), "b": S.arm_label(design, v.b),
                             "arms": [design.arms[v.a], design.arms[v.b]],
                             "pair": v.name, "decision": v.outcome, "stopped_at": v.stopped_at, "seeds": v.seeds,
                             "mean": None if last is None else last.mean,
                             "rci": None if last is None else list(last.rci)})
    plan = spec.sequential
    return {"plan": plan.fixed(), "families": [f.name or "study" for f in design.families],
            "waiting_for": schedule.waiting_for, "verdicts": verdicts,
            "wanted": [c.key for c in S.wanted_cells(spec, design, schedule.seeds)],
            "looks": recorded_looks(None, client, parent_run_id),
            "replay_problem": client.get_run(parent_run_id).data.tags.get(REPLAY_TAG)}


def _number(value: Any) -> str:
    if isinstance(value, float):
        return "—" if math.isnan(value) else "∞" if math.isinf(value) else f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_number(v) for v in value) + "]"
    return str(value)


def look_table(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The recorded rows as a table, header first: the main columns, then any other field a record holds."""
    extra = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in LOOK_COLUMNS
             and k not in ("family", "entry", "note", "se")]
    columns = [c for c in LOOK_COLUMNS if any(c in r for r in rows)] + extra
    return [columns, *([_number(r.get(c, "")) for c in columns] for r in rows)]


def sequential_section(spec: AblationSpec, summary: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the section."""
    plan = spec.sequential
    families = summary["families"]
    lines = ["## Sequential plan", "",
             f"Fixed before the first look: `{plan.measure}` ({plan.better} is better), alpha {plan.alpha:g} "
             f"({plan.sides}-sided), {plan.spending.replace('_', '-')} spending, looks at {list(plan.schedule)} seeds "
             f"per arm, comparisons {plan.comparisons}"
             + (f" of `{plan.compare}` within each setting" if plan.compare else "")
             + f", alpha shared by {plan.sharing} over "
             + ("each setting on its own (each setting is a family with the full alpha)" if plan.family == "setting"
                else "every comparison of the study") + (f"; equivalence margin ±{plan.margin:g}" if plan.margin
                                                          else "") + f". Families: {', '.join(families)}.", ""]
    if summary.get("replay_problem"):
        lines += [f"**The records disagree with the finished cells:** {summary['replay_problem']}", ""]
    rows = [["comparison", "verdict", "stopped at look (seeds)", "mean difference", "repeated CI"]]
    for v in summary["verdicts"]:
        text = OUTCOME_TEXT[v["decision"]].format(a=v["a"], b=v["b"], margin=plan.margin or 0)
        stop = f"{v['stopped_at']} ({v['seeds']})" if v["stopped_at"] else f"not yet ({v['seeds']} seeds so far)"
        rows.append([v["label"], text, stop,
                     "—" if v["mean"] is None else _number(v["mean"]), "—" if v["rci"] is None else _number(v["rci"])])
    lines += [pd.DataFrame(rows[1:], columns=rows[0]).to_markdown(index=False, disable_numparse=True), "",
              "Differences are positive when the first arm is better. The repeated confidence interval holds at "
              "every look, so it stays valid whenever a comparison stops; the plain mean of a comparison that "
              "stopped early does not.", ""]
    early = [v for v in summary["verdicts"] if v["stopped_at"] and v["decision"] in ("a_better", "b_better")
             and v["seeds"] < plan.schedule[-1]]
    equivalent = [v for v in summary["verdicts"] if v["decision"] == "equivalent" and v["seeds"] < plan.schedule[-1]]
    for found, note in ((early, EARLY_STOP_NOTE), (equivalent, EQUIVALENCE_NOTE)):
        if found:
            names = ", ".join(v["label"] for v in found)
            lines += [f"- {names}: {note}."]
    lines += [""] if early or equivalent else []
    if summary["looks"]:
        table = look_table(summary["looks"])
        lines += ["### Every look", "", "One row per look at a comparison, as recorded on the parent run "
                  "(`sequential/looks.csv`, `.json`), appended look by look: seeds per arm, the mean paired "
                  "difference, t, the t critical value and the z boundary, the one-sided nominal level, the "
                  "comparison's share of alpha, the repeated CI and the decision.", "",
                  pd.DataFrame(table[1:], columns=table[0]).to_markdown(index=False, disable_numparse=True), ""]
    else:
        lines += ["No look has been recorded yet.", ""]
    return lines
