"""The paper's claims checked on an ablation's groups (held, contradicted, not resolved or not measurable at this
scale: :mod:`satlab.studies.stats`): SATFormer < ResFormer < Transformer in final validation loss and SATFormer best
on retrieval, per point of the other axes and pooled; for a recall ablation, SATFormer against the Transformer and
ResFormer. Also the order of the three at each token count, and whether it persists against another budget. Only
claims whose architectures the ablation has are made."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import mlflow

from satlab.config.archs import ARCH_SPECS
from satlab.evaluation.tasks import RETRIEVAL, chance_level
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import load_ablation
from satlab.studies.parent_results import mlflow_name
from satlab.studies.results import RECALL_MEASURES, GroupResult, Measures, collect
from satlab.studies.runs import find_parent_run
from satlab.studies.spec import format_value
from satlab.studies.stats import Verdict, best_verdict, decide_all, ordering_verdict

RECALL_REFERENCES = ("transformer", "resformer")


CLAIMED_LOSS_ORDER = ("satformer", "resformer", "transformer")  # the paper's validation-loss claim, best first


def arch_names() -> dict[str, str]:
    """Display names from the registry (read when a report is written: an architecture registered late counts)."""
    return {name: arch.label for name, arch in ARCH_SPECS.items()}


def reference_group(groups: Sequence[GroupResult], group: GroupResult, arch: str) -> GroupResult | None:
    """The group with ``model.arch=arch`` and the same values as ``group`` on every other axis."""
    return next((g for g in groups if g.values == group.values | {"model.arch": arch}), None)


def by_seed(group: GroupResult | None, column: str) -> dict:
    """``{seed: value}`` of a group's cells that logged ``column`` (the seed pairs cells across groups)."""
    if group is None:
        return {}
    return {c.cell.seed: c.metrics[column] for c in group.cells if c.metrics.get(column) is not None}


def point_label(group: GroupResult) -> str:
    """The group's values on the axes other than the architecture, e.g. ``source=kjv``."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={format_value(v)}" for k, v in group.values.items() if k != "model.arch")


def point_values(group: GroupResult) -> dict[str, object]:
    """The group's values on the axes other than the architecture."""
    return {k: v for k, v in group.values.items() if k != "model.arch"}


def loss_orders(groups: Sequence[GroupResult]) -> dict[str, dict[str, list[str]]]:
    """Per point of the other axes (a corpus), the paper's three architectures in order of mean validation loss at
    each token count they share (best first): whether an order at the end of a run already held earlier, and
    whether it persists in a run with a longer budget. Only points where all three have a shared validation: an
    ablation without one of them has no order to give."""
    orders: dict[str, dict[str, list[str]]] = {}
    for group in (g for g in groups if g.values.get("model.arch") in CLAIMED_LOSS_ORDER):
        tokens, values = group.shared_curve()
        for i, t in enumerate(tokens):
            if t and values:
                means = orders.setdefault(point_label(group), {}).setdefault(f"{t:.0f}", {})
                means[group.values["model.arch"]] = sum(v[i] for v in values) / len(values)
    complete = {point: {t: sorted(means, key=means.get) for t, means in by_tokens.items() if len(means) == 3}
                for point, by_tokens in orders.items()}
    return {point: by_tokens for point, by_tokens in complete.items() if by_tokens}  # no point without an order


def budget_comparison(spec: AblationSpec, client: mlflow.MlflowClient,
                      orders: dict[str, dict[str, list[str]]]) -> dict[str, dict] | None:
    """Per point of the other axes both ablations have, the order at the end of ``spec.compare_with`` (a shorter
    budget, say) beside this ablation's at the same token count and at its own end; None when that ablation has no
    runs in this store."""
    other = load_ablation(spec.compare_with)
    parent = find_parent_run(client, other) or find_parent_run(client, other, same_settings=False)
    if parent is None:
        return None
    theirs = loss_orders(collect(other, client, parent.info.run_id))
    comparison = {}
    for point in orders.keys() & theirs.keys():
        there_end, here_end = (max(o, key=int) for o in (theirs[point], orders[point]))
        comparison[point] = {"there_tokens": int(there_end), "there": theirs[point][there_end],
                             "here_same_tokens": orders[point].get(there_end), "here_tokens": int(here_end),
                             "here": orders[point][here_end],
                             "persists": orders[point][here_end] == theirs[point][there_end]}
    return comparison


@dataclass(frozen=True)
class Claim:
    """One of the paper's claims at one point of the other axes: ``key`` names it where its sentence cannot (the
    parent run's tag ``verdict.<key>``), ``subjects`` are the architectures it is about, ``check`` gives its
    undecided verdict. ``column`` (the measure), ``steps`` (each ``(better, worse)`` pair it asserts) and ``point``
    (its values on the other axes; None when pooled over them) let a sequential plan's verdicts decide it instead."""

    key: str
    subjects: tuple[str, ...]
    check: Callable[[], Verdict]
    column: str = ""
    steps: tuple[tuple[str, str], ...] = ()
    point: Mapping[str, object] | None = None


def claim_key(name: str, point: str) -> str:
    """``loss_order``, ``loss_order.source-kjv``, ``loss_order.pooled``: the claim, and where when not everywhere."""
    return f"{name}.{mlflow_name(point)}" if point else name


def paper_verdicts(spec: AblationSpec, groups: Sequence[GroupResult], measures: Measures,
                   sequential: Mapping[str, object] | None = None) -> list[Verdict]:
    """The paper's claims on the architecture groups (:func:`loss_claims`, :func:`recall_claims`) that are about
    architectures this ablation has, checked; Holm's correction runs over all of them together. With a sequential
    plan (its report summary, :func:`satlab.studies.sequential_report.sequential_summary`) the plan's verdicts
    decide them instead (:func:`sequential_verdict`)."""
    if "model.arch" not in spec.group_axes():
        return []
    claims = recall_claims(groups) if measures is RECALL_MEASURES else loss_claims(groups)
    archs = {g.values["model.arch"] for g in groups}
    if sequential is None:
        return checked(claims, archs)
    column = next((c.name for c in measures.columns if c.reduce == "last" and c.key == spec.sequential.measure), None)
    outcomes = arch_outcomes(sequential)
    return [sequential_verdict(claim, outcomes, column, spec.sequential.measure) for claim in claims
            if len(archs) > 1 and archs.issuperset(claim.subjects)]


def checked(claims: Sequence[Claim], archs: set[str]) -> list[Verdict]:
    """The claims whose subjects are all among ``archs`` (and that have another architecture to compare with),
    decided and keyed. A claim about an architecture the ablation does not have is no finding of it: it is left out,
    not reported as "could not be checked" (which says a cell of the ablation is missing or too few)."""
    verdicts = []
    for claim in claims:
        if len(archs) > 1 and archs.issuperset(claim.subjects):
            verdict = claim.check()
            verdict.key = claim.key
            verdicts.append(verdict)
    return decide_all(verdicts)


def point_key(values: Mapping[str, object]) -> frozenset[tuple[str, str]]:
    """A point of the axes other than the architecture, comparable across groups and sequential arms."""
    return frozenset((k, format_value(v)) for k, v in values.items() if k != "model.arch")


def arch_outcomes(sequential: Mapping[str, object]) -> dict[tuple, dict]:
    """The sequential verdicts between two architectures at one point, by ``(point, arch a, arch b)``."""
    found = {}
    for v in sequential["verdicts"]:
        a, b = v["arms"]
        if point_key(a) == point_key(b) and a.get("model.arch") != b.get("model.arch"):
            found[(point_key(a), a["model.arch"], b["model.arch"])] = v
    return found


OUTSIDE_PLAN = ("Not decided by a test: the study's seeds were chosen by its sequential plan, so a fixed-number test "
                "on them has no stated error rate. The plan compares {measure} per setting; {why}")


def step_text(v: Mapping, arms: tuple[str, str], winner: str | None, names: Mapping[str, str]) -> str:
    """One step of a claim as the plan decided it: ``ResFormer vs SATFormer: ResFormer better (8 seeds, look 1,
    mean difference +0.692, positive when ResFormer is better, repeated CI [0.494, 0.89])``."""
    a, b = (names.get(arm, arm) for arm in arms)
    found = f"{names.get(winner, winner)} better" if winner else v["outcome"]
    details = [f"{v['seeds']} seeds"] + ([f"look {v['stopped_at']}"] if v["stopped_at"] else []) \
        + ([f"mean difference {v['mean']:+.3g}, positive when {a} is better"] if v["mean"] is not None else []) \
        + ([f"repeated CI [{v['rci'][0]:.3g}, {v['rci'][1]:.3g}]"] if v["rci"] is not None else [])
    return f"{a} vs {b}: {found} ({', '.join(details)})"


def sequential_verdict(claim: Claim, outcomes: Mapping[tuple, dict], column: str | None, measure: str) -> Verdict:
    """The claim decided by the sequential plan's verdicts on its steps: held when every step was decided in the
    claimed direction, contradicted when one was decided the other way, else not resolved. A claim on another
    measure, pooled over settings, or with a step the plan does not compare, is not resolved, and says why (a
    claim whose architectures all sit at chance keeps that finding: it is no test)."""
    fixed = claim.check()  # its sentence, and whether every architecture is at chance
    names = arch_names()
    found = [(better, worse, outcomes.get((point_key(claim.point), better, worse)),
              outcomes.get((point_key(claim.point), worse, better))) for better, worse in claim.steps] \
        if claim.point is not None else []
    if fixed.outcome in ("not measurable at this scale", "could not be checked"):
        verdict = fixed
    elif claim.point is None or claim.column != column or not claim.steps or \
            any(ab is None and ba is None for _, _, ab, ba in found):
        why = ("this claim pools them." if claim.point is None else
               "this claim is on another measure." if claim.column != column else
               "not every step of this claim is one of its comparisons.")
        verdict = Verdict(fixed.claim, "not resolved", OUTSIDE_PLAN.format(measure=measure, why=why))
    else:
        won, lost, texts = 0, 0, []
        for better, worse, ab, ba in found:
            v, arms = (ab, (better, worse)) if ab else (ba, (worse, better))  # the plan's pair, in its order
            winner = {"a_better": arms[0], "b_better": arms[1]}.get(v["outcome"])
            won, lost = won + (winner == better), lost + (winner == worse)
            texts.append(step_text(v, arms, winner, names))
        outcome = "held" if won == len(found) else "contradicted" if lost else "not resolved"
        verdict = Verdict(fixed.claim, outcome, f"From the sequential plan's verdicts: {'; '.join(texts)}.")
    verdict.key = claim.key
    return verdict


def recall_claims(groups: Sequence[GroupResult]) -> list[Claim]:
    """"SATFormer retrieves better" than each reference architecture, at every point of the other axes (the
    difficulties)."""
    claims = []
    for group in (g for g in groups if g.values.get("model.arch") == "satformer"):
        point = point_label(group)
        for arch in RECALL_REFERENCES:
            def check(group: GroupResult = group, arch: str = arch, where: str = point or "this setting") -> Verdict:
                samples = {"satformer": by_seed(group, "recall_acc"),
                           arch: by_seed(reference_group(groups, group, arch), "recall_acc")}
                return best_verdict(samples, "satformer", f"SATFormer retrieves better than {arch_names()[arch]} "
                                    f"(held-out accuracy, {where})", labels=arch_names())

            claims.append(Claim(claim_key(f"recall_vs_{arch}", point), ("satformer", arch), check, "recall_acc",
                                (("satformer", arch),), point_values(group)))
    return claims


def loss_claims(groups: Sequence[GroupResult]) -> list[Claim]:
    """SATFormer < ResFormer < Transformer in final validation loss, and SATFormer best on the retrieval average, at
    every point of the other axes (a corpus axis, say) and, with more than one point, pooled over them. When no run
    logged the retrieval average (evaluation off), its claim is stated once, unchecked, not once per point."""
    points: dict[str, dict[str, GroupResult]] = {}  # one per value of the other axes (a corpus axis, say)
    for group in groups:
        points.setdefault(point_label(group), {})[group.values["model.arch"]] = group
    retrieval_chance = sum(chance_level(f) for f in RETRIEVAL) / len(RETRIEVAL)  # the chance of their average
    retrieval_logged = any(by_seed(g, "retrieval") for g in groups)

    def loss_claim(samples: Callable[[str], dict[str, dict]], where: str, point: str,
                   values: Mapping[str, object] | None) -> Claim:
        order = tuple(zip(CLAIMED_LOSS_ORDER, CLAIMED_LOSS_ORDER[1:], strict=False))
        return Claim(claim_key("loss_order", point), CLAIMED_LOSS_ORDER, lambda: ordering_verdict(
            samples("val_loss"), list(CLAIMED_LOSS_ORDER),
            f"SATFormer < ResFormer < Transformer in final validation loss{where}", labels=arch_names()),
                     "val_loss", order, values)

    def retrieval_claim(samples: Callable[[str], dict[str, dict]], where: str, point: str, archs: Sequence[str],
                        values: Mapping[str, object] | None) -> Claim:
        return Claim(claim_key("retrieval_best", point), ("satformer",), lambda: best_verdict(
            samples("retrieval"), "satformer", f"SATFormer best on the retrieval average{where}",
            labels=arch_names(), chance=retrieval_chance),
                     "retrieval", tuple(("satformer", a) for a in archs if a != "satformer"), values)

    found = []
    for point, by_arch in points.items():
        def samples(column: str, by_arch: dict[str, GroupResult] = by_arch) -> dict[str, dict]:
            return {a: by_seed(g, column) for a, g in by_arch.items()}

        where, values = f" ({point})" if point else "", point_values(next(iter(by_arch.values())))
        found.append(loss_claim(samples, where, point, values))
        if retrieval_logged or len(points) == 1:
            found.append(retrieval_claim(samples, where, point, list(by_arch), values))
    if len(points) > 1:  # pooled: a cell is paired with the cell of the same point and seed
        archs = sorted({a for by_arch in points.values() for a in by_arch})

        def pooled(column: str) -> dict[str, dict]:
            return {arch: {(point, seed): value for point, by_arch in points.items()
                           for seed, value in by_seed(by_arch.get(arch), column).items()} for arch in archs}

        where = " (pooled over " + ("; ".join(points) if len(points) <= 4 else
                                    f"{len(points)} settings of {', '.join(other_axes(groups))}") + ")"
        found.append(loss_claim(pooled, where, "pooled", None))
        if retrieval_logged:
            found.append(retrieval_claim(pooled, where, "pooled", archs, None))
        else:  # nothing any run could check: the claim once, with no point named
            found.append(retrieval_claim(pooled, "", "", archs, None))
    return found


def other_axes(groups: Sequence[GroupResult]) -> list[str]:
    """The short names of the axes other than the architecture that vary between ``groups``."""
    keys = [k for k in groups[0].values if k != "model.arch"] if groups else []
    return [k.rsplit(".", 1)[-1] for k in keys if len({format_value(g.values.get(k)) for g in groups}) > 1]
