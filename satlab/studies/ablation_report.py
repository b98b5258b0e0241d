"""The ablation report: ``report.md`` and ``report.html`` (plus figures and ``summary.json``) in the ablation's
folder, and the same files as artifacts under ``report/`` on the parent run.

Per group of cells (same values on every axis but the seed): mean ± std over seeds of the final validation loss,
the offline zero-shot and retrieval averages, tokens/s, peak memory and gate sparsity, the parameter count, and
Welch p-values against the baseline group. When ``model.arch`` is an axis, the paper's claims are checked on these
numbers and stated plainly, held or not. A metric no run logged shows as "—".

An ablation of a synthetic recall task reports held-out accuracy and the steps to 0.9 and 0.99 instead, with
p-values against the Transformer and ResFormer at the same values of the other axes, accuracy plotted against the
difficulty axis, and the claim that SATFormer retrieves better checked at every difficulty.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlflow
from markdown_it import MarkdownIt
from rich.console import Console
from rich.table import Table

from satlab.studies.ablation_plots import loss_curves, metric_vs_axis, tile_images
from satlab.studies.results import (
    RECALL_MEASURES,
    Column,
    GroupResult,
    Measures,
    collect,
    download_heatmap,
    measures_for,
)
from satlab.studies.spec import AblationSpec, format_value
from satlab.studies.stats import Verdict, best_verdict, format_p, mean_std, ordering_verdict, welch_p

ARCH_NAMES = {"transformer": "Transformer", "resformer": "ResFormer", "satformer": "SATFormer",
              "denseformer": "DenseFormer", "hyperconnections": "Hyper-Connections", "muddformer": "MUDDFormer"}
P_COLUMNS = {"val_loss": "p (loss)", "retrieval": "p (retrieval)"}
RECALL_P_COLUMNS = {"recall_acc": "acc", "steps_to_0.9": "steps 0.9"}
RECALL_REFERENCES = ("transformer", "resformer")
"""The architectures a recall ablation's p-values and verdicts compare SATFormer (and every group) against."""
_CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}"
        "table{border-collapse:collapse;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "th:first-child,td:first-child{text-align:left}img{max-width:100%}code{background:#f3f3f3;padding:0 3px}")


def group_labels(spec: AblationSpec, groups: Sequence[GroupResult]) -> dict[str, str]:
    """Short names: the value alone when one axis varies besides the seed, else ``key=value`` with short keys."""
    axes = spec.group_axes()
    labels = {}
    for group in groups:
        if len(axes) == 1:
            labels[group.label] = format_value(group.values[axes[0]])
        else:
            labels[group.label] = ", ".join(f"{k.rsplit('.', 1)[-1]}={format_value(v)}" for k, v in
                                            group.values.items()) or "all"
    return labels


def cell_text(values: list[float], fmt: str, cells: int | None = None) -> str:
    """``mean ± std``; with ``cells`` (a metric that some runs never log, such as steps to an accuracy), also how many
    of the group's cells logged it."""
    mean, std = mean_std(values)
    reached = "" if cells is None else f" ({len(values)}/{cells})"
    if mean is None:
        return "—" + reached
    return fmt.format(mean) + ("" if std is None else f" ± {fmt.format(std)}") + reached


def is_censored(column: Column) -> bool:
    return column.key.startswith("recall/steps_to_")


def reference_group(groups: Sequence[GroupResult], group: GroupResult, arch: str) -> GroupResult | None:
    """The group with ``model.arch=arch`` and the same values as ``group`` on every other axis."""
    target = group.values | {"model.arch": arch}
    return next((g for g in groups if g.values == target), None)


def group_p(group: GroupResult, reference: GroupResult | None, column: Column) -> str:
    """Welch's p of ``column`` between two groups; for steps to an accuracy, only when every cell reached it."""
    if reference is None:
        return "—"
    if reference is group:
        return "reference"
    a, b = group.samples(column.name), reference.samples(column.name)
    if is_censored(column) and (len(a) < len(group.cells) or len(b) < len(reference.cells)):
        return "—"
    return format_p(welch_p(a, b))


def results_table(spec: AblationSpec, groups: Sequence[GroupResult], labels: dict[str, str],
                  measures: Measures) -> list[list[str]]:
    """Rows of the main table (header first): p-values against the baseline group, or, for recall, against the
    Transformer and ResFormer groups at the same values of the other axes."""
    recall = measures is RECALL_MEASURES and "model.arch" in spec.group_axes()
    baseline = next((g for g in groups if g.values == spec.baseline_values()), None)
    header = ["cell", "seeds", "params"]
    for column in measures.columns:
        header.append(column.header)
        if recall and column.name in RECALL_P_COLUMNS:
            header += [f"p {RECALL_P_COLUMNS[column.name]} vs {ARCH_NAMES[a]}" for a in RECALL_REFERENCES]
        elif not recall and column.name in P_COLUMNS:
            header.append(P_COLUMNS[column.name])
    rows = [header]
    for group in groups:
        is_base = group is baseline and not recall
        row = [labels[group.label] + (" (baseline)" if is_base else ""), f"{len(group.cells)}/{group.expected}",
               f"{group.params:,}" if group.params else "—"]
        for column in measures.columns:
            row.append(cell_text(group.samples(column.name), column.fmt,
                                 len(group.cells) if is_censored(column) else None))
            if recall and column.name in RECALL_P_COLUMNS:
                row += [group_p(group, reference_group(groups, group, a), column) for a in RECALL_REFERENCES]
            elif not recall and column.name in P_COLUMNS:
                p = None if is_base or baseline is None else welch_p(group.samples(column.name),
                                                                     baseline.samples(column.name))
                row.append("baseline" if is_base else format_p(p))
        rows.append(row)
    return rows


def recall_verdicts(groups: Sequence[GroupResult]) -> list[Verdict]:
    """"SATFormer retrieves better" at every combination of the other axes (the difficulty points): higher held-out
    accuracy than the Transformer, and than ResFormer, with Welch's p."""
    verdicts = []
    for group in (g for g in groups if g.values.get("model.arch") == "satformer"):
        point = ", ".join(f"{k.rsplit('.', 1)[-1]}={format_value(v)}" for k, v in group.values.items()
                          if k != "model.arch") or "this setting"
        for arch in RECALL_REFERENCES:
            reference = reference_group(groups, group, arch)
            samples = {"satformer": group.samples("recall_acc"),
                       arch: [] if reference is None else reference.samples("recall_acc")}
            verdicts.append(best_verdict(samples, "satformer", f"SATFormer retrieves better than {ARCH_NAMES[arch]} "
                                         f"(held-out accuracy, {point})", labels=ARCH_NAMES))
    return verdicts


def paper_verdicts(spec: AblationSpec, groups: Sequence[GroupResult], measures: Measures) -> list[Verdict]:
    """The paper's claims on the architecture groups (other axes at their baseline values); none when
    ``model.arch`` is not an axis."""
    if "model.arch" not in spec.group_axes():
        return []
    if measures is RECALL_MEASURES:
        return recall_verdicts(groups)
    others = {k: v for k, v in spec.baseline_values().items() if k != "model.arch"}
    by_arch = {g.values["model.arch"]: g for g in groups if all(g.values[k] == v for k, v in others.items())}
    loss = {arch: g.samples("val_loss") for arch, g in by_arch.items()}
    retrieval = {arch: g.samples("retrieval") for arch, g in by_arch.items()}
    return [
        ordering_verdict(loss, ["satformer", "resformer", "transformer"],
                         "SATFormer < ResFormer < Transformer in final validation loss", labels=ARCH_NAMES),
        best_verdict(retrieval, "satformer", "SATFormer best on the retrieval average", labels=ARCH_NAMES),
    ]


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def write_report(spec: AblationSpec, client: mlflow.MlflowClient, parent_run_id: str, out_dir: Path | None = None,
                 console: Console | None = None) -> dict[str, Path]:
    """Write the report files and log them on the parent run; returns ``{"markdown", "html", ...}`` paths."""
    out = out_dir or spec.out_path()
    out.mkdir(parents=True, exist_ok=True)
    measures = measures_for(spec)
    groups = collect(spec, client, parent_run_id, measures)
    labels = group_labels(spec, groups)
    rows = results_table(spec, groups, labels, measures)
    verdicts = paper_verdicts(spec, groups, measures)
    files: dict[str, Path] = {}
    curves = loss_curves(groups, labels, out / "loss_curves.png",
                         f"{spec.name}: {measures.curve_label} (mean over seeds)", measures.curve_label)
    if curves is not None:
        files["loss_curves"] = curves
    difficulty = [k for k in spec.group_axes() if k != "model.arch"]
    if measures is RECALL_MEASURES and "model.arch" in spec.group_axes() and len(difficulty) == 1:
        by_axis = metric_vs_axis(groups, difficulty[0], "model.arch", "recall_acc", ARCH_NAMES,
                                 out / "accuracy_vs_difficulty.png", f"{spec.name}: held-out recall accuracy "
                                 "(mean ± std over seeds)")
        if by_axis is not None:
            files["accuracy_vs_difficulty"] = by_axis
    heatmaps = []
    for group in groups:
        for cell in sorted(group.cells, key=lambda c: format_value(c.cell.seed)):
            image = download_heatmap(client, cell.run_id, out / "heatmaps" / f"{cell.cell.slug}.png")
            if image is not None:
                heatmaps.append((f"{labels[group.label]} (seed {format_value(cell.cell.seed)})", image))
                break
    tiles = tile_images(heatmaps, out / "gate_heatmaps.png", f"{spec.name}: gate heatmaps (final step, one seed)")
    if tiles is not None:
        files["gate_heatmaps"] = tiles
    text = render_markdown(spec, groups, rows, verdicts, files, parent_run_id, client.tracking_uri, measures)
    files["markdown"] = out / "report.md"
    files["markdown"].write_text(text)
    body = MarkdownIt("commonmark").enable("table").render(text)
    files["html"] = out / "report.html"
    files["html"].write_text(f"<!doctype html>\n<html><head><meta charset='utf-8'><title>ablation {spec.name}</title>"
                             f"<style>{_CSS}</style></head><body>\n{body}</body></html>\n")
    summary = {"name": spec.name, "parent_run_id": parent_run_id, "table": rows,
               "verdicts": [{"claim": v.claim, "held": v.held, "detail": v.detail} for v in verdicts],
               "runs": {c.cell.key: c.run_id for g in groups for c in g.cells}}
    files["summary"] = out / "summary.json"
    files["summary"].write_text(json.dumps(summary, indent=2))
    for path in files.values():
        client.log_artifact(parent_run_id, str(path), "report")
    if console is not None:
        print_summary(console, spec, rows, verdicts)
        console.print(f"report: {files['markdown']} and {files['html']} (also on the parent run {parent_run_id})",
                      soft_wrap=True)
    return files


def print_summary(console: Console, spec: AblationSpec, rows: list[list[str]], verdicts: list[Verdict]) -> None:
    """The main table and the verdicts on the terminal."""
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
                    measures: Measures) -> str:
    finished = sum(len(g.cells) for g in groups)
    total = sum(g.expected for g in groups)
    axes = " × ".join(f"`{k}` ({len(v)})" for k, v in spec.axes.items())
    fixed = ", ".join(f"`{k}={format_value(v)}`" for k, v in spec.overrides.items()) or "none"
    lines = [f"# Ablation `{spec.name}`", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += [f"Base experiment `{spec.base}`; fixed overrides: {fixed}.", "",
              f"Axes: {axes}; cells that differ only in `{spec.seed_key}` are grouped.", "",
              f"Finished cells: {finished} of {total}. MLflow: `{tracking_uri}`, experiment `{spec.experiment_name}`, "
              f"parent run `{parent_run_id}`.", "",
              "## Results", ""]
    if measures is RECALL_MEASURES:
        against = ("against the Transformer and ResFormer groups at the same values of the other axes (for steps, "
                   "only when every cell of both groups reached it)" if "model.arch" in spec.group_axes() else
                   "of the answer loss against the baseline group (— with fewer than two seeds a side)")
        lines += ["Mean ± sample std over seeds. Held-out accuracy: the share of answers right (argmax over the "
                  "whole vocabulary) on the task's fixed held-out sequences at the end of the run (a run that "
                  "reached its `stop_at_acc` stopped there); best acc: the highest of any validation. Steps to 0.9 / "
                  "0.99: the first validation at that accuracy, as optimizer steps (resolution: the validation "
                  f"interval), mean over the cells that reached it, (k/n) how many did. p: two-sided Welch t-test "
                  f"over seeds {against}. Answer loss: cross-entropy at the answers.", ""]
    else:
        lines += ["Mean ± sample std over seeds. p: two-sided Welch t-test against the baseline group over seeds "
                  "(— when a side has fewer than two values). Throughput is the mean logged tokens/s; memory the "
                  "peak; gate sparsity the share of exactly-zero gates at the last analysis. — marks a metric no run "
                  "logged (e.g. evaluation not run, or no gates).", ""]
    lines += [markdown_table(rows), ""]
    if verdicts:
        lines += ["## The paper's claims at this scale", ""]
        lines += [f"- {v.sentence()}" for v in verdicts]
        lines += ["", "Verdicts compare means; \"significant\" means Welch p < 0.05 over the seeds. They hold for "
                  "this ablation's model size and token budget only.", ""]
    if "accuracy_vs_difficulty" in files:
        lines += ["## Accuracy against difficulty", "", "![accuracy vs difficulty](accuracy_vs_difficulty.png)", ""]
    lines += ["## Learning curves", ""]
    lines += [f"![{measures.curve_label}](loss_curves.png)" if "loss_curves" in files else
              "No validation curve was logged.", "", "## Gate heatmaps", ""]
    lines += ["![gate heatmaps](gate_heatmaps.png)" if "gate_heatmaps" in files else
              "No cell logged a gate heatmap (no gated architecture, or gate analysis not run).", ""]
    headline = measures.columns[0]
    lines += ["## Runs", "", f"| cell | run | {headline.header} |", "|---|---|---|"]
    results = {c.cell.key: c for g in groups for c in g.cells}
    for cell in spec.cells():
        result = results.get(cell.key)
        value = None if result is None else result.metrics.get(headline.name)
        run = "not finished" if result is None else f"`{result.run_id}`"
        lines.append(f"| `{cell.key}` | {run} | {'—' if value is None else headline.fmt.format(value)} |")
    return "\n".join(lines) + "\n"
