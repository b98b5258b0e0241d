"""``python -m satlab.ablate.cell experiment=<cell.yaml> --no-progress``: ``satlab train`` for one ablation cell.

The command is exactly ``satlab train`` (so whatever it runs, evaluation included, runs for every cell), in a
process that ends with the driver that launched it: on Linux it asks for SIGTERM when its parent dies, so killing
the driver, even with SIGKILL, leaves no orphan training behind. Lightning turns that SIGTERM into a clean stop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

DRIVER_PID = "SATLAB_ABLATE_DRIVER_PID"
_PR_SET_PDEATHSIG = 1


def end_with_driver() -> bool:
    """Ask for SIGTERM when the launching process dies; False if it is already gone (nothing to report to)."""
    driver = os.environ.get(DRIVER_PID)
    if not driver:
        return True
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == int(driver)


def main(argv: list[str] | None = None) -> int:
    if not end_with_driver():
        print("satlab ablate: the driver that launched this cell is gone; not starting it", file=sys.stderr)
        return 1
    from satlab.cli.main import main as satlab_main

    return satlab_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
