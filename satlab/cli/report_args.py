"""Arguments of `satlab report` (kept apart from the command so `satlab --help` does not import MLflow)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="ABLATION",
                        help="an ablation name (arch_tiny), its spec file, or its MLflow parent run id")
    parser.add_argument("--tracking-uri", metavar="URI",
                        help="the MLflow store (default: the one the ablation ran against, as its study records it, "
                             "else $MLFLOW_TRACKING_URI or mlruns/mlflow.db)")
    parser.add_argument("--out", metavar="DIR", help="where to write the report (default: the ablation's out_dir, "
                                                     "reports/ablations/<name>)")
