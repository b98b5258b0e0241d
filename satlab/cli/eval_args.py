"""Arguments of `satlab eval` (kept apart from the command so `satlab --help` imports neither lm-eval nor torch)."""

from __future__ import annotations

import argparse

from satlab.config.errors import ConfigError, did_you_mean

SETTINGS = {
    "ckpt": "checkpoint file or run directory (required), e.g. runs/default",
    "tasks": "satlab_offline (default), paper_zero_shot, paper_retrieval or a comma list of task names",
    "limit": "items per task (offline: how many are generated; hub tasks: lm-eval's limit)",
    "device": "cpu (default), cuda, cuda:1, ...",
    "batch_size": "sequences per forward pass (default 32)",
    "seed": "seed of the generated offline items (default 0)",
    "threads": "torch CPU threads (default: one per core; 1 is much faster for tiny models on a busy machine)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("settings", nargs="*", metavar="key=value",
                        help="; ".join(f"{key}: {text}" for key, text in SETTINGS.items()))
    parser.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    parser.add_argument("--no-mlflow", action="store_true",
                        help="do not log into the checkpoint's MLflow run (by default the results go there when "
                             "the run directory holds a run.json)")


def parse_settings(items: list[str]) -> dict[str, str]:
    """``key=value`` items as a dict; every malformed or unknown item is reported at once."""
    settings, problems = {}, []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"'{item}' is not key=value; valid keys: {', '.join(SETTINGS)}")
        elif key not in SETTINGS:
            problems.append(f"unknown setting '{key}'{did_you_mean(key, SETTINGS)}; valid: {', '.join(SETTINGS)}")
        else:
            settings[key] = value
    if "ckpt" not in settings:
        problems.append("ckpt=<checkpoint file or run directory> is required, e.g. satlab eval ckpt=runs/default")
    if problems:
        raise ConfigError(problems)
    return settings
