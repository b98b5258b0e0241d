"""The "Learning-rate transfer" section of an ablation's report, for a spec with an ``lr_transfer:`` block: per
series (the values of the axes other than the learning rate, the shape and the seed: an architecture under a
parametrisation) a table of its shapes with the optimum learning rate, its bootstrap interval and its distance from
the base shape's optimum in octaves, the verdict, and one panel per series of the loss-vs-LR curves with each
fitted minimum marked. The numbers (:mod:`satlab.studies.lr_transfer`) also go to summary.json's ``lr_transfer``,
which ``satlab transfer`` reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from satlab.studies.ablation_claims import arch_names  # noqa: E402
from satlab.studies.ablation_plots import save_figure
from satlab.studies.ablation_spec import AblationSpec  # noqa: E402
from satlab.studies.lr_transfer import INTERIOR, Optimum, local_optimum, optimum, series_verdict  # noqa: E402
from satlab.studies.results import GroupResult  # noqa: E402
from satlab.studies.spec import format_value

LACK_OF_FIT_ALPHA = 0.05
"""The lack-of-fit test's level: a smaller p marks the all-points quadratic as rejected in the table."""

TRANSFER_KEYS = ("model.parametrization", "model.base_width", "model.base_depth", "model.depth_alpha")
"""The fields a parametrisation derives the rest from: recorded with the study, written by ``satlab transfer``."""


def series_label(values: dict[str, Any]) -> str:
    names = arch_names()
    return ", ".join(names.get(v, str(v)) if k == "model.arch" else f"{k.rsplit('.', 1)[-1]}={format_value(v)}"
                     for k, v in values.items()) or "all"


def shape_label(values: dict[str, Any], keys: Sequence[str]) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={format_value(values[k])}" for k in keys)


def _bound(value: float) -> str:
    return "below sweep" if value == -math.inf else "above sweep" if value == math.inf else f"{2 ** value:.2e}"


def optimum_text(o: Optimum) -> str:
    interval = "no interval" if o.interval is None else f"[{_bound(o.interval[0])}, {_bound(o.interval[1])}]"
    return f"{o.lr:.2e} {interval}" if o.status == INTERIOR else f"{o.status} {interval}"


def series_values(spec: AblationSpec, group: GroupResult) -> dict[str, Any]:
    """The group's values on the axes that split cells into series: every axis but the learning rate, the shape
    keys and the seed."""
    plan = spec.lr_transfer
    return {k: group.values[k] for k in spec.group_axes() if k != plan.lr_key and k not in plan.shape_keys}


def series_and_shape(spec: AblationSpec, group: GroupResult) -> tuple[str, str]:
    """The labels of the series and of the shape a group belongs to."""
    return series_label(series_values(spec, group)), shape_label(group.values, spec.lr_transfer.shape_keys)


def analyse(spec: AblationSpec, groups: Sequence[GroupResult]) -> list[dict[str, Any]]:
    """Per series: its shapes' optima by the plan's fit (with the points they were fitted to) and the verdict; a
    shape with fewer than three learning rates with a finished cell is left out. With the local fit, also the
    all-points fit's optima and verdict (``everywhere``), for comparison and its lack-of-fit test."""
    plan = spec.lr_transfer
    keys = plan.shape_keys
    found: dict[str, dict[str, Any]] = {}
    for group in groups:
        losses = group.samples("val_loss")
        if not losses:
            continue
        series_name, shape_name = series_and_shape(spec, group)
        series = found.setdefault(series_name, {"values": series_values(spec, group), "shapes": {}})
        shape = series["shapes"].setdefault(shape_name,
                                            {"values": {k: group.values[k] for k in keys}, "points": {},
                                             "params": group.params})
        shape["points"][float(group.values[plan.lr_key])] = losses
        shape.setdefault("curves", {})[float(group.values[plan.lr_key])] = mean_curve(group)
    base = shape_label(plan.base, keys)
    out = []
    for label, series in found.items():
        everywhere, local = {}, {}
        for name, shape in series["shapes"].items():
            if len(shape["points"]) >= 3 and sum(map(len, shape["points"].values())) >= 4:
                everywhere[name] = optimum(shape["points"], plan.level, plan.resamples, plan.seed)
                if plan.fit == "local":  # the all-points fit is always needed: its lack-of-fit column
                    local[name] = local_optimum(shape["points"], plan.level, plan.resamples, plan.seed)
        optima = local if plan.fit == "local" else everywhere
        on = {name: series["shapes"][name]["values"] for name in optima}
        width = sorted((n for n, v in on.items() if all(v[k] == plan.base[k] for k in plan.depth_keys)),
                       key=lambda n: [on[n][k] for k in plan.width_keys])
        depth = sorted((n for n, v in on.items() if all(v[k] == plan.base[k] for k in plan.width_keys)),
                       key=lambda n: [on[n][k] for k in plan.depth_keys])
        verdict = series_verdict(optima, base, width, depth, plan.tolerance)
        compared = None if plan.fit == "all" else series_verdict(everywhere, base, width, depth, plan.tolerance)
        at_base_depth = sorted((n for n, shape in series["shapes"].items()
                                if all(shape["values"][k] == plan.base[k] for k in plan.depth_keys)),
                               key=lambda n: [series["shapes"][n]["values"][k] for k in plan.width_keys])
        out.append({"label": label, "values": series["values"], "base": base, "optima": optima,
                    "everywhere": everywhere, "everywhere_verdict": compared,
                    "shapes": series["shapes"], "width_series": width, "depth_series": depth, "verdict": verdict,
                    "wider": wider_is_better([series["shapes"][n]["curves"] for n in at_base_depth], at_base_depth)})
    return out


def mean_curve(group: GroupResult) -> dict[float, float]:
    """Tokens -> the mean over the group's seeds of the validation loss, at the token counts every seed logged."""
    curves = [dict(c.curve) for c in group.cells if c.curve]
    common = set.intersection(*(set(c) for c in curves)) if curves else set()
    return {t: float(np.mean([c[t] for c in curves])) for t in sorted(common)}


def wider_is_better(curves: Sequence[dict[float, dict[float, float]]], names: Sequence[str]) -> dict[str, Any]:
    """μP's "wider is better": at each learning rate that every width of the width series ran, whether the mean
    validation loss falls strictly with width at every token count > 0 they all logged. ``curves[i]``: the i-th width's
    learning rate -> mean curve (widths in increasing order, named by ``names``). The learning rates where it holds,
    and the first (lr, tokens) where it does not at the others. The validation before training is left out: no step
    at any learning rate has been taken there, and with small initial logits every width starts within a hair of the
    same loss (ln of the vocabulary size), so it would decide the comparison by noise."""
    holds, broken = [], []
    shared = set.intersection(*(set(c) for c in curves)) if len(curves) > 1 else set()
    for lr in sorted(shared):
        tokens = {t for t in set.intersection(*(set(c[lr]) for c in curves)) if t > 0}
        if not tokens:
            continue
        pairs = list(zip(curves, curves[1:], strict=False))  # each width with the next wider one
        bad = next((t for t in sorted(tokens) if any(a[lr][t] <= b[lr][t] for a, b in pairs)), None)
        if bad is None:
            holds.append(lr)
        else:
            losses = ", ".join(f"{n} {c[lr][bad]:.4f}" for n, c in zip(names, curves, strict=True))
            broken.append({"lr": lr, "tokens": bad, "losses": losses})
    return {"widths": list(names), "holds_at": holds, "broken": broken}


def wider_text(wider: dict[str, Any]) -> str:
    checked = len(wider["holds_at"]) + len(wider["broken"])
    if not checked:
        return "Wider is better: not checked (fewer than two widths ran a learning rate in common)."
    text = (f"Wider is better (mean validation loss strictly lower at each larger width, at every validation after "
            f"training began; widths {', '.join(wider['widths'])}): holds at {len(wider['holds_at'])} of {checked} "
            f"learning rates")
    if wider["broken"]:
        first = wider["broken"][0]
        lrs = ", ".join(f"{b['lr']:.3g}" for b in wider["broken"])
        text += (f"; broken at lr {lrs} (first at lr "
                 f"{first['lr']:.3g}, {first['tokens']:,.0f} tokens: {first['losses']})")
    return text + "."


def series_rows(entry: dict[str, Any], tolerance: float) -> list[list[str]]:
    reference = entry["verdict"].base_log2_lr
    rows = [["shape", "seeds", "params", "optimum LR [interval]", "log2 LR*", "octaves from base",
             f"interval within ±{tolerance:g}", "all-points quadratic: lack of fit p"]]
    for name, o in entry["optima"].items():
        octaves = "—" if o.log2_lr is None or reference is None else f"{o.log2_lr - reference:+.2f}"
        params = entry["shapes"][name]["params"]
        rows.append([name + (" (base)" if name == entry["base"] else ""), str(o.seeds),
                     f"{params:,}" if params else "—", optimum_text(o),
                     "—" if o.log2_lr is None else f"{o.log2_lr:.2f}", octaves,
                     "—" if reference is None else "yes" if name not in entry["verdict"].outside else "no",
                     p_text(entry["everywhere"][name].lack_of_fit_p)])
    return rows


def p_text(p: float | None) -> str:
    return "—" if p is None else f"{p:.2g}" + (" (rejected)" if p < LACK_OF_FIT_ALPHA else "")


def compared_text(entry: dict[str, Any]) -> list[str]:
    """With the local fit: the all-points fit's verdict and how many of its fits the lack-of-fit test rejects."""
    v = entry["everywhere_verdict"]
    if v is None:
        return []
    tested = [o.lack_of_fit_p for o in entry["everywhere"].values() if o.lack_of_fit_p is not None]
    rejected = sum(p < LACK_OF_FIT_ALPHA for p in tested)
    base = "no base optimum" if v.base_log2_lr is None else f"base optimum {2 ** v.base_log2_lr:.2e}"
    return [f"With a quadratic over every learning rate instead: {v.outcome}"
            + (f" (outside: {', '.join(v.outside)})" if v.outside else "")
            + f", {base}; its lack of fit rejected at {rejected} of {len(tested)} shapes.", ""]


def curves_figure(entries: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """One panel per series: each shape's final losses (dots, one per seed), its fitted quadratic over the learning
    rates it was fitted to and its minimum (a star, with the interval as a bar; none without an interior minimum)."""
    if not entries:
        return None
    columns = min(3, len(entries))
    rows = -(-len(entries) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.0 * rows), squeeze=False)
    for ax in grid.flat[len(entries):]:
        ax.axis("off")
    for ax, entry in zip(grid.flat, entries, strict=False):
        for i, (name, o) in enumerate(entry["optima"].items()):
            color = plt.get_cmap("tab10")(i % 10)
            points = entry["shapes"][name]["points"]
            xs = [math.log2(lr) for lr, ys in points.items() for _ in ys]
            ax.scatter(xs, [y for ys in points.values() for y in ys], s=10, color=color, alpha=0.6)
            grid_x = np.linspace(max(min(xs), o.window[0]), min(max(xs), o.window[1]), 100)
            ax.plot(grid_x, o.fit.a + o.fit.b * grid_x + o.fit.c * grid_x ** 2, color=color, label=name)
            if o.log2_lr is not None:
                y = o.fit.a + o.fit.b * o.log2_lr + o.fit.c * o.log2_lr ** 2
                ax.plot([o.log2_lr], [y], marker="*", markersize=12, color=color, markeredgecolor="black")
                if o.interval is not None:
                    low, high = (max(o.interval[0], min(xs)), min(o.interval[1], max(xs)))
                    ax.plot([low, high], [y, y], color=color, linewidth=3, alpha=0.5)
        ax.set(title=f"{entry['label']}: {entry['verdict'].outcome}", xlabel="log2(learning rate)",
               ylabel="final validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(figure, path, title, dpi=110)


def sweep_record(spec: AblationSpec, entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a transferred learning rate depends on besides the parametrisation: the tokens per run (the base
    shape's, where the budget comes with the shape), the batch, the tokens per parameter at the base shape, and the
    study's own parametrisation fields."""
    cfg = spec.base_config()
    params = next((e["shapes"][e["base"]]["params"] for e in entries if e["base"] in e["shapes"]
                   and e["shapes"][e["base"]]["params"]), None)
    fixed = {k: v for k, v in spec.overrides.items() if k in TRANSFER_KEYS}
    tokens = spec.lr_transfer.base.get("train.max_tokens", cfg.train.max_tokens)
    return {"max_tokens": tokens, "per_shape_tokens": "train.max_tokens" in spec.lr_transfer.tied_keys,
            "global_batch_tokens": cfg.train.global_batch_tokens,
            "seq_len": cfg.data.seq_len, "base_params": params,
            "tokens_per_param": tokens / params if params else None, "fixed": fixed}


def comparison(entries: Sequence[dict[str, Any]], study: str) -> tuple[list[str], dict[str, Any]]:
    """(markdown lines, summary entry) setting each shape's optimum beside the same series' and shape's in the
    earlier study ``study``: its optimum then, now, and the move in octaves. A shape without an optimum in either
    is listed with a dash; a study that cannot be read is said so, not raised (the report is still written)."""
    from satlab.config.errors import ConfigError
    from satlab.studies.lr_transfer_summary import read_summary

    try:
        earlier = read_summary(study)["lr_transfer"]
    except ConfigError as error:
        return [f"### Compared with {study}", "", f"Not compared: {error}", ""], {"study": study, "error": str(error)}
    then_series = {s["label"]: s for s in earlier["series"]}
    tokens = earlier.get("sweep", {}).get("max_tokens")
    lines = [f"### Compared with {study}", "",
             f"Each shape's optimum here beside the same shape's in `{study}`"
             + (f" ({tokens:,} tokens a run)" if tokens else "") + ", by each study's own fit; the move is now minus "
             "then, in octaves.", ""]
    record: dict[str, Any] = {"study": study, "max_tokens": tokens, "series": {}}
    for entry in entries:
        then = then_series.get(entry["label"])
        if then is None:
            lines += [f"{entry['label']}: not in `{study}`.", ""]
            continue
        rows, moves = [], {}
        for name, o in entry["optima"].items():
            before = then["shapes"].get(name, {}).get("log2_lr")
            move = None if before is None or o.log2_lr is None else o.log2_lr - before
            moves[name] = {"then": before, "now": o.log2_lr, "move": move}
            rows.append([name, "—" if before is None else f"{2 ** before:.2e}",
                         "—" if o.log2_lr is None else f"{2 ** o.log2_lr:.2e}",
                         "—" if move is None else f"{move:+.2f}"])
        record["series"][entry["label"]] = moves
        lines += [f"**{entry['label']}**", "",
                  pd.DataFrame(rows, columns=["shape", "optimum then", "optimum now", "move (octaves)"]).to_markdown(
                      index=False, disable_numparse=True), ""]
    return lines, record


def lr_transfer_section(spec: AblationSpec, groups: Sequence[GroupResult], out: Path) \
        -> tuple[list[str], dict[str, Any] | None, Path | None]:
    """(markdown lines, summary.json entry, figure) of the section; empty when the spec has no ``lr_transfer``."""
    plan = spec.lr_transfer
    if not plan.enabled:
        return [], None, None
    entries = analyse(spec, groups)
    figure = curves_figure(entries, out / "lr_transfer.png", f"{spec.name}: final validation loss against the "
                           "learning rate, quadratic fits, minima (stars) with their intervals")
    record = sweep_record(spec, entries)
    level = f"{plan.level * 100:g} %"
    fit = (f"a least-squares quadratic of the final validation loss against log2(`{plan.lr_key}`) over every "
           "finished seed; its minimum is the optimum, given only inside the swept range (\"no interior minimum\" "
           "when the fit curves down, \"below/above the swept range\" when its vertex is beyond it)"
           if plan.fit == "all" else
           f"the parabola through the mean final validation loss at the best `{plan.lr_key}` and its two neighbours "
           "(log2 scale); its vertex is the optimum, not located (\"below/above the swept range\") when the best "
           "learning rate is the first or last swept")
    lines = ["## Learning-rate transfer", "",
             f"Per shape, {fit}. The interval is the {level} percentile bootstrap ({plan.resamples} resamples, seed "
             f"{plan.seed}) resampling the seeds within each learning rate (expanded for few seeds: "
             "docs/lr-transfer.md)" + ("" if plan.fit == "all" else ", the best learning rate picked again in each")
             + ". The last column tests the quadratic over every learning rate against the seeds' scatter "
             f"(pure-error F test; rejected below p = {LACK_OF_FIT_ALPHA:g}). A series transfers when every shape's "
             f"interval lies within ±{plan.tolerance:g} octave of the base shape's optimum "
             f"(base: {shape_label(plan.base, plan.shape_keys)}). "
             + ("Each shape trains on its own token budget (in its label); the base shape's runs: "
                if record["per_shape_tokens"] else "Each run: ")
             + f"{record['max_tokens']:,} tokens in batches of {record['global_batch_tokens']:,}"
             + (f", {record['tokens_per_param']:.1f} tokens per parameter at the base shape"
                if record["tokens_per_param"] else "") + ". A transferred learning rate holds for this horizon "
             "and batch only.", ""]
    summary: dict[str, Any] = {"plan": {"lr_key": plan.lr_key, "base": plan.base, "level": plan.level,
                                        "tolerance": plan.tolerance, "resamples": plan.resamples},
                               "sweep": record, "series": []}
    for entry in entries:
        v = entry["verdict"]
        shifts = "; ".join(f"{name} series {'—' if s is None else f'{s:+.2f}'} octaves from smallest to largest"
                           for name, s in (("width", v.width_shift), ("depth", v.depth_shift)))
        lines += [f"### {entry['label']}", "",
                  pd.DataFrame(series_rows(entry, plan.tolerance)[1:],
                               columns=series_rows(entry, plan.tolerance)[0]).to_markdown(
                      index=False, disable_numparse=True), "",
                  f"**{v.outcome}**" + (f" (outside: {', '.join(v.outside)})" if v.outside else "")
                  + f"; shift of the optimum: {shifts}.", "", *compared_text(entry), wider_text(entry["wider"]), ""]
        summary["series"].append({
            "label": entry["label"], "values": entry["values"], "base": entry["base"], "outcome": v.outcome,
            "base_log2_lr": v.base_log2_lr, "base_lr": None if v.base_log2_lr is None else 2 ** v.base_log2_lr,
            "outside": list(v.outside), "width_shift": v.width_shift, "depth_shift": v.depth_shift,
            "wider_is_better": entry["wider"], "fit": plan.fit,
            "all_points": None if (w := entry["everywhere_verdict"]) is None else {
                "outcome": w.outcome, "base_log2_lr": w.base_log2_lr, "outside": list(w.outside)},
            "shapes": {name: {"values": entry["shapes"][name]["values"], "status": o.status, "log2_lr": o.log2_lr,
                              "interval": None if o.interval is None else list(o.interval), "seeds": o.seeds,
                              "no_minimum_share": o.no_minimum_share, "params": entry["shapes"][name]["params"],
                              "fit": [o.fit.a, o.fit.b, o.fit.c], "window": list(o.window),
                              "lack_of_fit_p": entry["everywhere"][name].lack_of_fit_p}
                       for name, o in entry["optima"].items()}})
    if not entries:
        lines += ["No shape has finished cells at three learning rates yet.", ""]
    elif plan.compare_with:
        compared, summary["compared_with"] = comparison(entries, plan.compare_with)
        lines += compared
    if figure is not None:
        lines += ["![learning-rate transfer](lr_transfer.png)", ""]
    return lines, summary, figure
