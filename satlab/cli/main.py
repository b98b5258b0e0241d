"""`satlab <command>`: the one console script. A command's module declares its arguments and imports what it runs
with (torch, Lightning, MLflow, Optuna) only inside ``run``, so ``--help`` stays instant: importing Lightning alone
takes about ten seconds (``tests/test_config.py`` checks that no command's module imports them)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module under satlab.cli, one-line help)
COMMANDS = {
    "train": ("train", "train an experiment preset (make train), resumable with train.resume=auto"),
    "archs": ("archs", "list every architecture and variant with parameter counts"),
    "sweep": ("sweep", "run, resume or join an Optuna sweep of a sweeps/*.yaml spec (make sweep), or --dashboard"),
    "bench": ("bench", "interleaved training throughput, memory and MFU per architecture (make bench)"),
    "eval": ("eval", "evaluate a checkpoint with lm-eval: the offline suite, the paper's groups or any task"),
    "ablate": ("ablate", "run or resume an ablation grid of experiments/ablations/*.yml (make ablate, make reproduce)"),
    "coord": ("coord", "coordinate check: how each module's output scales with width and depth (sp, mup, completep)"),
    "report": ("report", "write an ablation's report (markdown, HTML, MLflow artifacts) from its runs"),
    "ladder": ("ladder", "run or resume a scaling ladder (sizes x token budgets x architectures), or --dry-run it"),
    "transfer": ("transfer", "write a preset at the learning rate an LR-transfer study found at its base shape"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="satlab", description="satlab: a lab bench for SATFormer and its baselines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module)
        importlib.import_module(f"satlab.cli.{module}").add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse takes positionals only before the first flag: `sweep lr_tiny --workers 1 n_trials=3`
        if hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.parse_args(argv)  # argparse's own usage error (exit 2) for what is really not understood
    if args.command is None:
        parser.print_help()
        return 0
    from satlab.config.errors import EXIT_USAGE, ConfigError, RunStopped

    try:
        return importlib.import_module(f"satlab.cli.{args._module}").run(args)
    except ConfigError as error:
        print(f"satlab {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except RunStopped as error:
        print(f"satlab {args.command}: stopped: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
