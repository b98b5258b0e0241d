"""The one error type for bad user input, with "did you mean" help."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad user input (config key, value, name or path). The CLI prints it and exits with code 2.

    ``problems`` holds every problem found, so one run reports them all at once.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the configuration:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """A short hint naming the closest valid spelling, or an empty string."""
    matches = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> str:
    """One-line message for an unknown name, listing what is valid."""
    valid = sorted(valid)
    return f"unknown {kind} '{name}'{did_you_mean(name, valid)}; valid: {', '.join(valid)}"


EXIT_USAGE = 2
"""Bad input (a :class:`ConfigError`): nothing was written."""
EXIT_NO_SPACE = 74
"""A checkpoint did not fit on its disk (``EX_IOERR``): the previous checkpoints are intact; free space, then run
the same command (under SLURM the job script puts the job back in the queue, held, for that)."""
EXIT_REQUEUE = 75
"""Stopped with its state saved (``EX_TEMPFAIL``): SIGTERM (pre-emption, a time limit) during training, or an
interrupted study. Running the same command again continues it; SLURM job scripts requeue on it."""


class RunStopped(RuntimeError):
    """A run (training, trial, cell) stopped itself for a reason the user should read; the CLI prints the message
    and exits with ``exit_code`` (1 unless a subclass says otherwise)."""

    exit_code = 1
