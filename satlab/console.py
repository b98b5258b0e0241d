"""The rich console every satlab command prints through: 140 columns when output goes to a file or pipe (rich
would otherwise wrap tables at 80), the terminal's own width otherwise."""

from __future__ import annotations

import sys

from rich.console import Console


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140)
