"""The rich summary table printed at the end of every run."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from satlab.config.schema import ExperimentConfig
from satlab.console import console as make_console
from satlab.training.views import open_lines


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def recall_rows(cfg: ExperimentConfig, recall: dict[str, float]) -> list[tuple[str, str]]:
    """A recall task's held-out accuracy and the steps at which it first reached each threshold."""
    if "recall/acc" not in recall:
        return []
    rows = [("held-out recall accuracy", f"{recall['recall/acc']:.4f} ({cfg.data.mqar.eval_sequences:,} sequences)")]
    for threshold in ("0.9", "0.99"):
        steps = recall.get(f"recall/steps_to_{threshold}")
        seqs = recall.get(f"recall/sequences_to_{threshold}")
        rows.append((f"first reached {threshold} at", "not reached" if steps is None else
                     f"step {steps:,.0f} ({seqs:,.0f} sequences)"))
    if (bind := recall.get("recall/steps_to_bind")) is not None:
        label = f"time to bind (accuracy {cfg.data.mqar.bind_threshold:g})"
        rows.append((label, f"step {bind:,.0f}" if recall.get("recall/bound") else
                     f"not bound by step {bind:,.0f} (censored)"))
    return rows


def evaluation_time_rows(result) -> list[tuple[str, str]]:
    """The end-of-run evaluation's wall time against the training it followed (fit without it)."""
    if not result.eval_seconds:
        return []
    training = result.fit_seconds - result.eval_seconds
    share = (f" = {100 * result.eval_seconds / training:.1f} % of training ({training / 60:.1f} min)"
             if training > 0 else "")
    return [("end-of-run evaluation", f"{result.eval_seconds:.1f} s{share}")]


def print_summary(cfg: ExperimentConfig, result, console: Console | None = None) -> None:
    import math

    table = Table(title=f"satlab run '{cfg.name}' ({cfg.model.arch}, {cfg.model.size})", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("parameters", f"{result.params:,} ({result.non_embedding_params:,} non-embedding)"),
        ("tokens trained", f"{result.tokens:,}"),
        ("val loss: start -> end", f"{_fmt(result.initial_val_loss, '.4f')} -> {_fmt(result.final_val_loss, '.4f')}"),
        ("val perplexity", _fmt(None if result.final_val_loss is None else math.exp(result.final_val_loss), ".2f")),
        ("final train loss", _fmt(result.final_train_loss, ".4f")),
        *recall_rows(cfg, result.recall),
        ("tokens/s (training)", _fmt(result.tokens_per_sec, ",.0f")),
        ("wall time", f"{result.wall_seconds / 60:.1f} min"),
        *evaluation_time_rows(result),
        ("checkpoints", str(result.run_dir / "checkpoints")),
    ]
    if result.mlflow_run_id:
        rows += [
            ("MLflow", f"experiment '{result.experiment}', run {result.mlflow_run_id}"),
            ("tracking URI", result.tracking_uri),
        ]
    for row in rows:
        table.add_row(*row)
    console = console or make_console()
    console.print(table)
    if result.mlflow_run_id and result.view_url:  # below the table, whole on one line: a table cell would cut it
        for label, value in open_lines(result.tracking_uri, result.view_url):
            console.print(f"{label.strip()}: {value}", soft_wrap=True)
