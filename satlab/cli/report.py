"""`satlab report <ablation or parent run id>`: (re)write an ablation's report from its MLflow runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from satlab.console import console as make_console


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="ABLATION",
                        help="an ablation name (arch_tiny, or the name of one run from a spec file elsewhere), its "
                             "spec file, or its MLflow parent run id")
    parser.add_argument("--tracking-uri", metavar="URI",
                        help="the MLflow store (default: the one the ablation ran against, as its study records it, "
                             "else $MLFLOW_TRACKING_URI or mlruns/mlflow.db)")
    parser.add_argument("--out", metavar="DIR", help="where to write the report (default: the ablation's out_dir, "
                                                     "reports/ablations/<name>)")


def run(args: argparse.Namespace) -> int:
    from satlab.studies.ablation_report import write_report
    from satlab.studies.lookup import open_ablation

    spec, client, parent_run_id = open_ablation(args.target, args.tracking_uri)
    write_report(spec, client, parent_run_id, Path(args.out) if args.out else None, console=make_console())
    return 0
