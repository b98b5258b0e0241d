"""The ablation report: ``report.md``, ``report.html``, figures and ``summary.json`` in the ablation's folder and
under ``report/`` on the parent run. Per group of cells (equal on every axis but the seed): mean ± std over seeds of
each measure (:mod:`satlab.studies.results`) and Welch p-values, against the baseline group or, for a recall
ablation over ``model.arch``, against the Transformer and ResFormer at the same values of the other axes. With
``model.arch`` an axis, the paper's claims about architectures the ablation has are checked on these numbers and
stated plainly (:mod:`satlab.studies.ablation_claims`). The numbers and verdicts also go onto the parent run as
metrics, params and tags (:mod:`satlab.studies.parent_results`); ``report.html`` carries its figures inside it, as
MLflow's artifact viewer cannot load the files beside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
import pandas as pd
from rich.console import Console
from rich.table import Table

from satlab.studies.ablation_claims import (
    RECALL_REFERENCES,
    arch_names,
    budget_comparison,
    loss_orders,
    paper_verdicts,
    reference_group,
)
from satlab.studies.ablation_plots import loss_curves, metric_vs_axis, tile_images
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.bind_report import BIND_KEY, bind_section
from satlab.studies.ladder_report import ladder_section
from satlab.studies.lr_transfer_report import lr_transfer_section
from satlab.studies.parent_results import log_results, mlflow_name
from satlab.studies.report_html import markdown_page
from satlab.studies.results import (
    RECALL_MEASURES,
    Column,
    GroupResult,
    Measures,
    cell_runs,
    collect,
    compute_used,
    download_heatmap,
    measures_for,
)
from satlab.studies.saturation_study import saturation_section
from satlab.studies.sequential_report import sequential_section, sequential_summary
from satlab.studies.spec import format_value
from satlab.studies.stats import (
    Verdict,
    format_p,
    mean_std,
    welch_p,
)

BASELINE_P = {"val_loss": "loss", "retrieval": "retrieval"}  # measures with a p column against the baseline
REFERENCE_P = {"recall_acc": "acc", "steps_to_0.9": "steps 0.9"}  # ... against each reference architecture
def order_text(archs: Sequence[str]) -> str:
    """``SATFormer < ResFormer < Transformer``: architectures best first, by their display names."""
    return " < ".join(arch_names()[a] for a in archs)


@dataclass
class Comparison:
    """What a p column compares each group with; the reference's own cell shows ``mark``. ``key`` names the p-value
    in summary.json and on the parent run: ``p``, or ``p_vs_<arch>`` beside several references."""

    suffix: str
    mark: str
    reference: Callable[[GroupResult], GroupResult | None]
    key: str = "p"


def comparisons(spec: AblationSpec, groups: Sequence[GroupResult], measures: Measures) \
        -> tuple[dict[str, str], list[Comparison]]:
    if measures is RECALL_MEASURES and "model.arch" in spec.group_axes():
        return REFERENCE_P, [Comparison(f" vs {arch_names()[a]}", "reference",
                                        lambda g, a=a: reference_group(groups, g, a), f"p_vs_{a}")
                             for a in RECALL_REFERENCES]
    baseline_arch = spec.baseline_values().get("model.arch")
    if "model.arch" in spec.group_axes() and baseline_arch is not None:  # the same corpus (or other axes) only
        return BASELINE_P, [Comparison("", "baseline", lambda g: reference_group(groups, g, baseline_arch))]
    baseline = next((g for g in groups if g.values == spec.baseline_values()), None)
    return BASELINE_P, [Comparison("", "baseline", lambda g: baseline)]


def group_labels(spec: AblationSpec, groups: Sequence[GroupResult]) -> dict[str, str]:
    """The value alone when one axis varies besides the seed, else ``key=value`` with short keys."""
    axes = spec.group_axes()
    if len(axes) == 1:
        return {g.label: format_value(g.values[axes[0]]) for g in groups}
    return {g.label: ", ".join(f"{k.rsplit('.', 1)[-1]}={format_value(v)}" for k, v in g.values.items()) or "all"
            for g in groups}


def is_censored(column: Column) -> bool:
    """Steps to an accuracy: a cell that never reached it logged nothing (not so the steps to bind, which every
    recall run logs, censored at its budget)."""
    return column.key.startswith("recall/steps_to_") and column.key != BIND_KEY


def cell_text(group: GroupResult, column: Column) -> str:
    """``mean ± std``, and for a censored measure how many of the group's cells reached it."""
    values = group.samples(column.name)
    mean, std = mean_std(values)
    reached = f" ({len(values)}/{len(group.cells)})" if is_censored(column) else ""
    if mean is None:
        return "—" + reached
    return column.fmt.format(mean) + ("" if std is None else f" ± {column.fmt.format(std)}") + reached


def comparison_p(group: GroupResult, comparison: Comparison, column: Column) -> float | None:
    """Welch's p of ``column`` against the group's reference; for a censored measure only when every cell of both
    groups reached it. None for the reference itself, without one, or with fewer than two values a side."""
    reference = comparison.reference(group)
    if reference is None or reference is group:
        return None
    a, b = group.samples(column.name), reference.samples(column.name)
    if is_censored(column) and (len(a) < len(group.cells) or len(b) < len(reference.cells)):
        return None
    return welch_p(a, b)


def group_p(group: GroupResult, comparison: Comparison, column: Column) -> str:
    """The p column's text: :func:`comparison_p`, or the comparison's mark in the reference's own row."""
    if comparison.reference(group) is group:
        return comparison.mark
    return format_p(comparison_p(group, comparison, column))


def results_table(spec: AblationSpec, groups: Sequence[GroupResult], labels: dict[str, str],
                  measures: Measures) -> list[list[str]]:
    """The main table's rows, header first."""
    tested, against = comparisons(spec, groups, measures)
    header = ["cell", "seeds", "params"]
    for column in measures.columns:
        header.append(column.header)
        if column.name in tested:
            header += [f"p {tested[column.name]}{c.suffix}" if c.suffix else f"p ({tested[column.name]})"
                       for c in against]
    rows = [header]
    for group in groups:
        is_baseline = against[0].mark == "baseline" and against[0].reference(group) is group
        row = [labels[group.label] + (" (baseline)" if is_baseline else ""), f"{len(group.cells)}/{group.expected}",
               f"{group.params:,}" if group.params else "—"]
        for column in measures.columns:
            row.append(cell_text(group, column))
            if column.name in tested:
                row += [group_p(group, c, column) for c in against]
        rows.append(row)
    return rows


def group_keys(groups: Sequence[GroupResult], labels: dict[str, str]) -> dict[str, str]:
    """Per group its name in the parent run's keys: its label, MLflow-safe (``satformer``, ``source-kjv
    arch-satformer``); numbered in grid order when two labels would read alike."""
    keys = {g.label: mlflow_name(labels[g.label]) for g in groups}
    if len(set(keys.values())) < len(keys):
        keys = {label: f"{i:02d} {key}" for i, (label, key) in enumerate(keys.items())}
    return keys


def group_numbers(spec: AblationSpec, groups: Sequence[GroupResult], keys: dict[str, str],
                  measures: Measures) -> dict[str, dict]:
    """The numbers behind the table, per group by its key (:func:`group_keys`): the group, its finished cells,
    parameter count and, per measure some cell logged, the mean, std and count over seeds and the p-values of its p
    columns (:attr:`Comparison.key`; None where the table shows a mark or —). summary.json's ``groups``: what the
    parent run's metrics are made of."""
    tested, against = comparisons(spec, groups, measures)
    numbers = {}
    for group in groups:
        measured: dict[str, dict] = {}
        for column in measures.columns:
            if values := group.samples(column.name):
                mean, std = mean_std(values)
                measured[column.name] = {"mean": mean, "std": std, "n": len(values)}
                if column.name in tested:
                    measured[column.name] |= {c.key: comparison_p(group, c, column) for c in against}
        numbers[keys[group.label]] = {"group": group.label, "cells": len(group.cells), "expected": group.expected,
                                      "model_params": group.params, "measures": measured}
    return numbers


def matched_token_rows(groups: Sequence[GroupResult], labels: dict[str, str], measures: Measures) -> list[list[str]]:
    """The curve metric (mean ± std over seeds) of every group at each token count all of them were validated at,
    the untrained point left out; header first, [] when the groups share none."""
    shared = {g.label: g.shared_curve() for g in groups}
    with_curves = [at for at, _ in shared.values() if at]
    tokens = sorted(set.intersection(*map(set, with_curves)) - {0}) if with_curves else []
    if not tokens:
        return []
    fmt = next(c.fmt for c in measures.columns if c.key == measures.curve_key)
    rows = [["cell", *(f"{t:,.0f}" for t in tokens)]]
    for group in groups:
        at, values = shared[group.label]
        row = [labels[group.label]]
        for t in tokens:
            mean, std = mean_std([v[at.index(t)] for v in values]) if t in at else (None, None)
            row.append("—" if mean is None else fmt.format(mean) + ("" if std is None else f" ± {fmt.format(std)}"))
        rows.append(row)
    return rows


def write_figures(spec: AblationSpec, client: mlflow.MlflowClient, groups: Sequence[GroupResult],
                  labels: dict[str, str], measures: Measures, out: Path) -> dict[str, Path]:
    """The learning curves, accuracy against the difficulty axis (a recall ablation with one), and one gate heatmap
    per group (its first seed that logged one); those with nothing to show are left out."""
    difficulty = [k for k in spec.group_axes() if k != "model.arch"]
    by_difficulty = None
    if measures is RECALL_MEASURES and "model.arch" in spec.group_axes() and len(difficulty) == 1:
        by_difficulty = metric_vs_axis(groups, difficulty[0], "model.arch", "recall_acc", arch_names(),
                                       out / "accuracy_vs_difficulty.png",
                                       f"{spec.name}: held-out recall accuracy (mean ± std over seeds)")
    heatmaps = []
    for group in groups:
        for cell in sorted(group.cells, key=lambda c: format_value(c.cell.seed)):
            if image := download_heatmap(client, cell.run_id, out / "heatmaps" / f"{cell.cell.slug}.png"):
                heatmaps.append((f"{labels[group.label]} (seed {format_value(cell.cell.seed)})", image))
                break
    figures = {
        "loss_curves": loss_curves(groups, labels, out / "loss_curves.png",
                                   f"{spec.name}: {measures.curve_label} (mean over seeds)", measures.curve_label),
        "accuracy_vs_difficulty": by_difficulty,
        "gate_heatmaps": tile_images(heatmaps, out / "gate_heatmaps.png",
                                     f"{spec.name}: gate heatmaps (final step, one seed)"),
    }
    return {name: path for name, path in figures.items() if path is not None}


def write_report(spec: AblationSpec, client: mlflow.MlflowClient, parent_run_id: str, out_dir: Path | None = None,
                 console: Console | None = None) -> dict[str, Path]:
    """Write the report files and log them on the parent run, with the numbers and verdicts as its metrics, params
    and tags (:func:`satlab.studies.parent_results.log_results`: a second report replaces the first's values);
    returns ``{"markdown", "html", "summary", <figure>...}`` paths."""
    out = out_dir or spec.out_path()
    out.mkdir(parents=True, exist_ok=True)
    measures = measures_for(spec)
    groups = collect(spec, client, parent_run_id, measures)
    labels = group_labels(spec, groups)
    rows = results_table(spec, groups, labels, measures)
    matched = matched_token_rows(groups, labels, measures)
    orders = loss_orders(groups) if measures is not RECALL_MEASURES else {}
    budgets = budget_comparison(spec, client, orders) if spec.compare_with and orders else None
    files = write_figures(spec, client, groups, labels, measures, out)
    bind_lines, bind_summary, bind_figure = bind_section(spec, groups, labels, out)
    files |= {"bind_curves": bind_figure} if bind_figure else {}
    transfer_lines, transfer, transfer_figure = lr_transfer_section(spec, groups, out)
    files |= {"lr_transfer": transfer_figure} if transfer_figure else {}
    ladder_lines, ladder, ladder_figure = ladder_section(spec, groups, out)
    files |= {"ladder_fit": ladder_figure} if ladder_figure else {}
    if transfer is not None:  # the commit the sweep ran at, for `satlab transfer` to record
        transfer["sweep"]["commit"] = client.get_run(parent_run_id).data.tags.get("git_revision")
    saturation_lines, saturation = [], None
    if spec.saturation.threshold is not None:  # the cells ran with an observing guard: judge it
        saturation_lines, saturation = saturation_section(spec, client, parent_run_id)
    sequential = sequential_summary(spec, client, parent_run_id) if spec.sequential.enabled else None
    verdicts = paper_verdicts(spec, groups, measures, sequential)
    compute = compute_used(cell_runs(client, parent_run_id))
    text = render_markdown(spec, groups, rows, verdicts, files, parent_run_id, client.tracking_uri, measures,
                           matched, orders, budgets, [*(sequential_section(spec, sequential) if sequential else []),
                                                      *saturation_lines], [*bind_lines, *transfer_lines, *ladder_lines],
                           wanted=None if sequential is None else set(sequential["wanted"]), compute=compute)
    summary = {"name": spec.name, "parent_run_id": parent_run_id, "table": rows,
               "groups": group_numbers(spec, groups, group_keys(groups, labels), measures),
               "verdicts": [verdict_summary(v) for v in verdicts],
               "matched_tokens": matched, "loss_orders": orders, "compared_with": spec.compare_with,
               "budget_comparison": budgets, "saturation": saturation, "sequential": sequential,
               "time_to_bind": bind_summary, "lr_transfer": transfer, "ladder": ladder, "compute": compute,
               "runs": {c.cell.key: c.run_id for g in groups for c in g.cells}}
    for name, filename, content in (
            ("markdown", "report.md", text),
            ("html", "report.html", markdown_page(text, f"ablation {spec.name}", out)),
            ("summary", "summary.json", json.dumps(summary, indent=2))):
        files[name] = out / filename
        files[name].write_text(content)
    for path in files.values():
        client.log_artifact(parent_run_id, str(path), "report")
    log_results(client, parent_run_id, summary)
    if console is not None:
        print_results(console, spec, rows, verdicts)
        console.print(f"report: {files['markdown']} and {files['html']} (also on the parent run {parent_run_id})",
                      soft_wrap=True)
    return files


def verdict_summary(verdict: Verdict) -> dict:
    """A verdict in summary.json: with its key, and each comparison with the p-value its verdict used (``p``)."""
    return {"key": verdict.key, "claim": verdict.claim, "outcome": verdict.outcome, "detail": verdict.detail,
            "comparisons": [asdict(c) | {"p": c.p} for c in verdict.comparisons]}


def print_results(console: Console, spec: AblationSpec, rows: list[list[str]], verdicts: list[Verdict]) -> None:
    table = Table(title=f"ablation '{spec.name}' (mean ± std over seeds)")
    for i, header in enumerate(rows[0]):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows[1:]:
        table.add_row(*row)
    console.print(table)
    for verdict in verdicts:
        console.print(f"- {verdict.sentence().replace('**', '')}", soft_wrap=True)


def render_markdown(spec: AblationSpec, groups: Sequence[GroupResult], rows: list[list[str]],
                    verdicts: list[Verdict], files: dict[str, Path], parent_run_id: str, tracking_uri: str,
                    measures: Measures, matched: list[list[str]], orders: dict[str, dict[str, list[str]]],
                    budgets: dict[str, dict] | None, saturation: Sequence[str] = (), bind: Sequence[str] = (),
                    wanted: set[str] | None = None, compute: Mapping[str, float] | None = None) -> str:
    """The report's Markdown. ``wanted``: the cells a sequential plan has asked for so far (None: every cell); the
    Runs table says of the others that the plan did not need them, rather than that they did not finish.
    ``compute``: :func:`satlab.studies.results.compute_used` of the cells' runs."""
    axes = " × ".join(f"`{k}` ({len(v)})" for k, v in spec.axes.items())
    axes += f", the union of {len(spec.grids)} sub-grids of them ({len(spec.cells())} cells)" if spec.grids else ""
    fixed = ", ".join(f"`{k}={format_value(v)}`" for k, v in spec.overrides.items()) or "none"
    lines = [f"# Ablation `{spec.name}`", "", *([spec.description, ""] if spec.description else []),
             f"Base experiment `{spec.base}`; fixed overrides: {fixed}.", "",
             f"Axes: {axes}; cells that differ only in `{spec.seed_key}` are grouped.", "",
             f"Finished cells: {sum(len(g.cells) for g in groups)} of {sum(g.expected for g in groups)}. MLflow: "
             f"`{tracking_uri}`, experiment `{spec.experiment_name}`, parent run `{parent_run_id}`.", "",
             *([compute_text(compute), ""] if compute else []), "## Results", ""]
    if measures is RECALL_MEASURES:
        against = ("against the Transformer and ResFormer groups at the same values of the other axes (for steps, "
                   "only when every cell of both groups reached it)" if "model.arch" in spec.group_axes() else
                   "of the answer loss against the baseline group (— with fewer than two seeds a side)")
        lines += ["Mean ± sample std over seeds. Held-out accuracy: the share of answers right (argmax over the "
                  "whole vocabulary) on the task's fixed held-out sequences at the end of the run (a run that "
                  "reached its `stop_at_acc` stopped there); best acc: the highest of any validation. Steps to 0.9 / "
                  "0.99: the first validation at that accuracy, as optimizer steps (resolution: the validation "
                  f"interval), mean over the cells that reached it, (k/n) how many did; steps to bind: every cell's, a "
                  "cell that never bound counted at its last step (see Time to bind), and bound the fraction that did. "
                  "p: two-sided Welch t-test "
                  f"over seeds {against}. Answer loss: cross-entropy at the answers.", ""]
    else:
        lines += ["Mean ± sample std over seeds. p: two-sided Welch t-test over seeds against the baseline group (with "
                  "`model.arch` an axis: the baseline architecture at the same values of the other axes; — when a "
                  "side has fewer than two values). Throughput is the mean logged tokens/s; memory the "
                  "peak; gate sparsity the share of exactly-zero gates at the last analysis. — marks a metric no run "
                  "logged (e.g. evaluation not run, or no gates).", ""]
    lines += [pd.DataFrame(rows[1:], columns=rows[0]).to_markdown(index=False, disable_numparse=True), "", *bind]
    if verdicts:  # with a sequential plan (wanted given) its verdicts decide the claims: it chose the seeds
        legend = (
            "Decided by the sequential plan's verdicts (section \"Sequential plan\"), at its stated error rate: "
            "**held**: every step of the claim decided in the claimed direction; **contradicted**: a step "
            "decided the other way; **not resolved**: neither, or the claim is not one the plan tests (no "
            "fixed-number test is made on seeds that a sequential plan chose); " if wanted is not None else
            "**held**: the claimed order, every step of it significant; **contradicted**: a step significantly "
            "the other way; **not resolved**: neither, with the minimum detectable difference at 80 % power "
            "and the seeds a side that would resolve the observed one; ")
        fixed_number = "" if wanted is not None else (
            " Significant: p < 0.05 after Holm's correction over all the comparisons above. The verdict uses the "
            "paired t-test over seeds when both groups have the same seeds (a seed fixes the data order and the "
            "initial draws, so pairing removes what cells of one seed share), Welch's otherwise; both are given.")
        lines += ["## The paper's claims at this scale", "", *(f"- {v.sentence()}" for v in verdicts), "",
                  legend + "**not measurable at this scale**: every architecture within noise of the metric's chance "
                  f"level.{fixed_number} They hold for this ablation's model size and token budget only.", ""]
    if matched:
        lines += [f"## {measures.curve_label.capitalize()} at matched tokens", "",
                  f"Mean ± std over seeds of the {measures.curve_label} at each token count every cell was validated "
                  "at (the same held-out tokens each time). The cells of one ablation share a learning-rate "
                  "schedule, so a column compares architectures after equal training; the same column of an "
                  "ablation with another budget is another point of its schedule (a higher learning rate there).", "",
                  pd.DataFrame(matched[1:], columns=matched[0]).to_markdown(index=False, disable_numparse=True), ""]
        for point, by_tokens in orders.items():
            steps = "; ".join(f"{int(t):,}: {order_text(order)}" for t, order in by_tokens.items())
            lines.append(f"- Order by mean {measures.curve_label}{f' ({point})' if point else ''}, tokens: {steps}.")
        lines += [""] if orders else []
    if spec.compare_with and orders:
        lines += [f"## Against `{spec.compare_with}`", ""]
        if budgets is None:
            lines += [f"`{spec.compare_with}` has no runs in this store: run it (`satlab ablate {spec.compare_with}`) "
                      "and write this report again (`satlab report`) to compare the orders.", ""]
        for point, c in (budgets or {}).items():
            same = "" if c["here_same_tokens"] is None else \
                f"; here at {c['there_tokens']:,} tokens {order_text(c['here_same_tokens'])}"
            lines.append(f"- {point or 'all cells'}: `{spec.compare_with}` at its end ({c['there_tokens']:,} tokens) "
                         f"{order_text(c['there'])}{same}; here at the end ({c['here_tokens']:,} tokens) "
                         f"{order_text(c['here'])}: the order **{'persists' if c['persists'] else 'changes'}**.")
        lines += ["", "Orders of means; which steps are significant is in the claims above."] if budgets else []
        lines += [""]
    if "accuracy_vs_difficulty" in files:
        lines += ["## Accuracy against difficulty", "", "![accuracy vs difficulty](accuracy_vs_difficulty.png)", ""]
    lines += ["## Learning curves", "", *curve_lines(files, measures), "", "## Gate heatmaps", "",
              "![gate heatmaps](gate_heatmaps.png)" if "gate_heatmaps" in files else
              "No cell logged a gate heatmap (no gated architecture, or gate analysis not run).", ""]
    lines += saturation
    headline = measures.columns[0]
    lines += ["## Runs", "", f"| cell | run | {headline.header} |", "|---|---|---|"]
    results = {c.cell.key: c for g in groups for c in g.cells}
    for cell in spec.cells():
        result = results.get(cell.key)
        value = None if result is None else result.metrics.get(headline.name)
        run = f"`{result.run_id}`" if result is not None else "not finished" if wanted is None or cell.key in wanted \
            else "not needed by the sequential plan"
        lines.append(f"| `{cell.key}` | {run} | {'—' if value is None else headline.fmt.format(value)} |")
    return "\n".join(lines) + "\n"


def compute_text(compute: Mapping[str, float]) -> str:
    untimed = int(compute["runs"] - compute["runs_timed"])
    return (f"Compute: {compute['cpu_hours']:.2f} CPU-hours (user + system time of the trial processes, every attempt "
            f"of a cell) over {compute['runs_timed']} cell runs"
            + (f"; {untimed} more ran before satlab recorded CPU time or were killed before they could, and are not "
               "counted" if untimed else "") + ".")


def curve_lines(files: dict[str, Path], measures: Measures) -> list[str]:
    if "loss_curves" not in files:
        return ["No validation curve was logged."]
    return [f"![{measures.curve_label}](loss_curves.png)", "",
            f"Mean {measures.curve_label} over seeds (shaded: lowest to highest seed) from the first validation after "
            "training began; the one before it (0 tokens, about the same for every cell) is left out."]
