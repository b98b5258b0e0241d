"""Which cells a sequential ablation runs, given the values its finished cells logged (pure: no storage, no MLflow).

A plan (:class:`satlab.config.sequential.SequentialPlan`) compares *arms*, the groups of cells that differ only in
their seed. Without ``compare`` every group is an arm and the comparisons are among all of them; with ``compare``
(an axis, e.g. ``model.arch``) the arms are its values and the comparisons are made within each *setting* (the
values of the other axes besides the seeds). ``family: study`` shares alpha over every comparison, ``family:
setting`` gives each setting the full alpha. :func:`decide` replays the plan on the values so far
(:func:`satlab.studies.sequential.evaluate`, per family) and says how many seeds each arm needs by now: the next
look's seed count for an arm in an open comparison, the seeds it had when its last comparison stopped otherwise.
Look k runs the first n_k seeds of the seed axis, in the axis' order; the driver queues exactly those cells
(:func:`wanted_cells`), and evaluates again once all of them have finished.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from satlab.config.sequential import SequentialPlan
from satlab.studies.ablation_spec import AblationSpec, Cell
from satlab.studies.parent_results import VERDICT_TAG, mlflow_name
from satlab.studies.sequential import PairVerdict, evaluate, pairs
from satlab.studies.spec import format_value

OPEN = ("waiting", "continue")
TAG_OUTCOME = {"a_better": "a_better", "b_better": "b_better", "equivalent": "equivalent",
               "undecided": "undecided", "continue": "open", "waiting": "open"}
ROW_KEY = ("family", "pair", "entry")


@dataclass(frozen=True)
class Family:
    """Comparisons that share alpha; ``name`` is the setting (``data.mqar.layout=adjacent``), "" for the study."""

    name: str
    comparisons: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Design:
    """A spec's plan as comparisons of arms (group keys, :attr:`satlab.studies.ablation_spec.Cell.group`)."""

    plan: SequentialPlan
    seeds: tuple[str, ...]  # the seed axis' values as overrides write them, in the axis' order
    families: tuple[Family, ...]
    arms: dict[str, dict[str, Any]]  # group key -> its values on the axes other than the seeds
    settings: dict[str, str]  # group key -> its setting ("" without compare)

    @property
    def comparisons(self) -> list[tuple[str, str]]:
        return [c for f in self.families for c in f.comparisons]


def setting_of(values: Mapping[str, Any], compare: str | None) -> str:
    return " ".join(f"{k}={format_value(v)}" for k, v in values.items() if k != compare) if compare else ""


def design(spec: AblationSpec) -> Design:
    """The arms, settings, comparisons and families of the spec's plan."""
    plan = spec.sequential
    arms: dict[str, dict[str, Any]] = {}
    for cell in spec.cells():
        arms.setdefault(cell.group, cell.group_values)
    settings = {group: setting_of(values, plan.compare) for group, values in arms.items()}
    baseline = spec.baseline_values()
    by_setting: dict[str, list[tuple[str, str]]] = {}
    for setting in dict.fromkeys(settings.values()):
        members = [g for g in arms if settings[g] == setting]
        if plan.compare is None:
            reference = next((g for g in members if arms[g] == baseline), members[0])
        else:
            value = format_value(baseline[plan.compare])
            reference = next(g for g in members if format_value(arms[g][plan.compare]) == value)
        by_setting[setting] = pairs(members, reference, plan.comparisons)
    if plan.family == "setting":
        families = tuple(Family(s, tuple(c)) for s, c in by_setting.items())
    else:
        families = (Family("", tuple(c for cs in by_setting.values() for c in cs)),)
    seeds = tuple(format_value(s) for s in spec.axes.get(spec.seed_key, []))
    return Design(plan, seeds, families, arms, settings)


def observations(design: Design, cells: Sequence[Cell], values: Mapping[str, float]) \
        -> dict[str, dict[int, float]]:
    """``values`` (cell key -> its measure) as ``{arm: {seed index: value}}``: per arm the finished seeds from the
    first of the axis on, up to the first one missing (a look at n seeds reads the first n) and at most n_max."""
    n_max = design.plan.schedule[-1]
    by_arm: dict[str, dict[int, float]] = {arm: {} for arm in design.arms}
    for cell in cells:
        index = design.seeds.index(format_value(cell.seed))
        if cell.key in values and index < n_max:
            by_arm[cell.group][index] = values[cell.key]
    return {arm: {i: seen[i] for i in range(_prefix(seen))} for arm, seen in by_arm.items()}


def _prefix(seen: Mapping[int, float]) -> int:
    n = 0
    while n in seen:
        n += 1
    return n


@dataclass
class Schedule:
    """What the plan says now: per family its verdicts, per arm the seeds it needs, per family the look it waits
    for (1-based; None when every comparison of it is decided)."""

    verdicts: list[tuple[Family, list[PairVerdict]]]
    seeds: dict[str, int]
    waiting_for: dict[str, int | None] = field(default_factory=dict)

    @property
    def decided(self) -> bool:
        return all(v is None for v in self.waiting_for.values())


def decide(design: Design, observed: Mapping[str, Mapping[int, float]]) -> Schedule:
    """Replay the plan on ``observed`` (:func:`observations`) and say what each arm needs by now."""
    plan, looks = design.plan, design.plan.schedule
    schedule = Schedule([], dict.fromkeys(design.arms, 0))
    for family in design.families:
        verdicts = evaluate(plan, observed, list(family.comparisons), plan.lower_is_better)
        schedule.verdicts.append((family, verdicts))
        open_ = [v for v in verdicts if v.outcome in OPEN]
        look = len(open_[0].records) if open_ else None  # the open ones of a family are looked at together
        schedule.waiting_for[family.name] = None if look is None else look + 1
        for v in verdicts:
            need = looks[look] if v.outcome in OPEN and look is not None else v.seeds
            for arm in (v.a, v.b):
                schedule.seeds[arm] = max(schedule.seeds[arm], need)
    return schedule


def wanted_cells(spec: AblationSpec, design: Design, seeds: Mapping[str, int]) -> list[Cell]:
    """The cells of each arm's first ``seeds[arm]`` seeds, in run order."""
    return [c for c in spec.run_order() if design.seeds.index(format_value(c.seed)) < seeds.get(c.group, 0)]


def look_rows(schedule: Schedule) -> list[dict[str, Any]]:
    """One row per look record, every field of :class:`satlab.studies.sequential.LookRecord` (whatever it holds)
    after its family and its entry (1-based position among its comparison's records: a comparison tested again
    after alpha was passed on has a second record of an earlier look), as JSON gives them back."""
    rows = []
    for family, verdicts in schedule.verdicts:
        for verdict in verdicts:
            for i, record in enumerate(verdict.records, 1):
                rows.append({"family": family.name, "entry": i, **asdict(record)})
    return json.loads(json.dumps(rows))


@dataclass
class Replay:
    """Recorded rows against the rows the finished cells give now: ``new`` to append, ``changed`` (recorded, now
    different: a cell's run deleted and run again, or changed) and ``missing`` (recorded, not reached now: a cell's
    run is gone)."""

    new: list[dict[str, Any]]
    changed: list[tuple[dict[str, Any], dict[str, Any]]]
    missing: list[dict[str, Any]]


def replay(recorded: Sequence[Mapping[str, Any]], rows: Sequence[dict[str, Any]]) -> Replay:
    now = {_key(r): r for r in rows}
    keys = {_key(r) for r in recorded}
    changed = [(dict(r), now[_key(r)]) for r in recorded if _key(r) in now and not _same(r, now[_key(r)])]
    missing = [dict(r) for r in recorded if _key(r) not in now]
    return Replay([r for r in rows if _key(r) not in keys], changed, missing)


def _key(row: Mapping[str, Any]) -> tuple:
    return tuple(row.get(k) for k in ROW_KEY)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(change: tuple[Mapping[str, Any], Mapping[str, Any]]) -> str:
    """``t 2.1 -> 1.8, decision continue -> a_better``: the fields of a changed row that differ."""
    old, new = change
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in {**old, **new} if not _same(old.get(k), new.get(k)))


def arm_label(design: Design, arm: str) -> str:
    """An arm as a comparison names it: its ``compare`` value, or its values on the axes that vary."""
    values = design.arms[arm]
    if design.plan.compare is not None:
        return format_value(values[design.plan.compare])
    varying = [k for k in values if len({format_value(v[k]) for v in design.arms.values()}) > 1] or list(values)
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={format_value(values[k])}" for k in varying) if len(varying) > 1 \
        else format_value(values[varying[0]]) if varying else arm


def comparison_label(design: Design, a: str, b: str) -> str:
    """``satformer vs transformer``, with the setting after it when there are several
    (``satformer vs transformer (data.source=kjv)``): one study family can hold the same pair of arms per setting."""
    setting = design.settings[a]
    where = f" ({setting})" if setting and len(set(design.settings.values())) > 1 else ""
    return f"{arm_label(design, a)} vs {arm_label(design, b)}{where}"


def verdict_tag(design: Design, a: str, b: str) -> str:
    """``verdict.sequential.satformer_vs_transformer``, with the setting first when there are several
    (``verdict.sequential.layout-separated.satformer_vs_transformer``)."""
    setting = design.settings[a]
    where = f"{mlflow_name(setting.replace('=', '-'))}." if setting and len(set(design.settings.values())) > 1 else ""
    return f"{VERDICT_TAG}sequential.{where}{mlflow_name(arm_label(design, a))}_vs_{mlflow_name(arm_label(design, b))}"


def verdict_tags(design: Design, schedule: Schedule) -> dict[str, str]:
    """Per comparison its outcome: a_better, b_better, equivalent, undecided (at n_max) or open."""
    return {verdict_tag(design, v.a, v.b): TAG_OUTCOME[v.outcome]
            for _, verdicts in schedule.verdicts for v in verdicts}
