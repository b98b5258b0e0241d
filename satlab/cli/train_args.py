"""Arguments of `satlab train` (kept apart from the command so `satlab --help` does not import Lightning)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="experiment=<preset name or YAML path> (default: default), then any config overrides, "
                             "e.g. model.arch=transformer optim.lr=1e-3 train.max_tokens=5e5")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config before training")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, sizes, FLOPs, derived steps and a time estimate; no training")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (for logs and CI)")


def split_experiment(overrides: list[str]) -> tuple[str, list[str]]:
    """The `experiment=` argument (default 'default') and the remaining overrides."""
    experiment, rest = "default", []
    for item in overrides:
        if item.startswith("experiment="):
            experiment = item.split("=", 1)[1]
        else:
            rest.append(item)
    return experiment, rest
