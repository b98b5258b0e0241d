"""`satlab sweep <spec> [key=value ...]`: run (or resume, or join) an Optuna study of a sweep spec, or serve
optuna-dashboard on its storage with --dashboard."""

from __future__ import annotations

import argparse
import contextlib

from satlab.config.errors import EXIT_REQUEUE, ConfigError
from satlab.studies.loader import load_sweep


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


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    if args.n_trials is not None and args.n_trials < 0:
        raise ConfigError(f"--n-trials must be >= 0, got {args.n_trials}")
    spec = load_sweep(args.spec, args.overrides)
    if args.dashboard:
        return serve_dashboard(args.storage or spec.storage_url(), args.host, args.port,
                               create_folder=not (args.storage or spec.storage))
    from satlab.studies.engine import run_study

    result = run_study(spec, workers=args.workers, n_trials=args.n_trials, storage=args.storage)
    return EXIT_REQUEUE if result.interrupted else 0


def serve_dashboard(storage: str, host: str, port: int, create_folder: bool = False) -> int:
    """optuna-dashboard on the storage (Ctrl-C stops it), its best trial the best feasible one as in satlab's report
    (:mod:`satlab.studies.dashboard`). Serving only reads: the study's note is the one the sweep wrote from the spec
    it ran, which the command line that serves it (a spec name without that run's overrides) may not repeat."""
    try:
        from optuna_dashboard import run_server
    except ImportError:
        raise ConfigError("optuna-dashboard is not installed: pip install 'satlab[dashboard]'") from None
    from satlab.studies.dashboard import dashboard_storage
    from satlab.studies.storage import open_storage, safe_url

    open_storage(storage, create_folder=create_folder)  # a bad URL or unreachable server fails before the server
    served = dashboard_storage(storage)  # plain reads: the dashboard needs no write-locking transactions
    print(f"optuna-dashboard on {safe_url(storage)}: http://{host}:{port}  (Ctrl-C stops it)")
    with contextlib.suppress(KeyboardInterrupt):
        run_server(served, host=host, port=port)
    return 0
