"""Arguments of `satlab sweep` (kept apart from the command so `satlab --help` does not import Optuna or MLflow)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="a sweep under sweeps/ (lr_tiny, lr_paper_small) or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides of the spec, e.g. n_trials=4 space.optim.lr.high=1e-2 "
                             "overrides.train.max_tokens=1e5 pruner.name=hyperband")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="trials run in parallel on this host (default 1); the CPU threads are shared out")
    parser.add_argument("--storage", metavar="URL",
                        help="Optuna storage (default sqlite:///sweeps/studies/<name>/optuna.db); the same "
                             "postgresql://user:password@host/db on several hosts makes them share the study")
    parser.add_argument("--n-trials", type=int, metavar="N",
                        help="trials to add in this run (default the spec's n_trials; 0 only rewrites the report)")
    parser.add_argument("--dashboard", action="store_true",
                        help="serve optuna-dashboard on the study's storage instead of running trials")
    parser.add_argument("--host", default="127.0.0.1", help="dashboard address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="dashboard port (default 8080)")
