"""The rich summary table printed at the end of every run."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from satlab.config.schema import ExperimentConfig
from satlab.console import console as make_console


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


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
        ("tokens/s (training)", _fmt(result.tokens_per_sec, ",.0f")),
        ("wall time", f"{result.wall_seconds / 60:.1f} min"),
        ("checkpoints", str(result.run_dir / "checkpoints")),
    ]
    if result.mlflow_run_id:
        rows += [
            ("MLflow", f"experiment '{result.experiment}', run {result.mlflow_run_id}"),
            ("tracking URI", result.tracking_uri),
            ("open the UI", "make ui  (http://127.0.0.1:5000)"),
        ]
    for row in rows:
        table.add_row(*row)
    (console or make_console()).print(table)
