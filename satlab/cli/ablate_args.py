"""Arguments of `satlab ablate` (kept apart from the command so `satlab --help` does not import MLflow)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC",
                        help="an ablation under experiments/ablations/ (arch_tiny, granularity, gate_fn, arch_small, "
                             "...) or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="spec fields (axes.train.seed=[0,1], baseline.model.arch=resformer, out_dir=...) or "
                             "config overrides for every cell (train.max_tokens=1e5)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="cells run in parallel on this host (default 1); the CPU threads are shared out, and on "
                             "a GPU host each worker gets its own train.devices GPUs")
    parser.add_argument("--storage", metavar="URL",
                        help="Optuna storage of the grid (default sqlite:///<out_dir>/optuna.db); the same "
                             "postgresql://user:password@host/db on several hosts makes them share the cells")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the grid and what the study records of each cell; run nothing")
    parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")
