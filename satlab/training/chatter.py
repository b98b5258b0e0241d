"""Library chatter goes to the run's log file, not the terminal.

Lightning, datasets and MLflow print notices at INFO level (devices found, a "litlogger" tip, a line per split
generated, database migrations) that say nothing a researcher acts on; satlab's own output (the plan, the progress
bar with tokens/s and ETA, the summary table) and every warning or error still reach the terminal. The notices
are kept, with timestamps, in ``<run dir>/train.log``.

One warning is not shown at all, as it does not apply: Lightning's advice to log with ``sync_dist=True`` for the
values satlab logs once per validation (``val/*``, ``recall/*``). Those are already global: the loss and the recall
are torchmetrics aggregates, which sum over every rank's batches before ``compute`` returns, and the step counts
derive from them; an all-reduce would only average a value that is the same on every rank. Values that differ per
rank (the training loss of each rank's micro-batches) are logged with ``sync_dist=True``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LIBRARY_LOGGERS = ("lightning.pytorch", "lightning.fabric", "datasets", "mlflow", "optuna")
LOG_FILE = "train.log"
SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\('(val|recall)/[^']*', \.\.\., sync_dist=True\)`"
"""Lightning's advice for an epoch-level value logged without ``sync_dist``, for satlab's global values only."""


@contextmanager
def library_chatter_to(run_dir: Path, log_file: str = LOG_FILE) -> Iterator[None]:
    """While the block runs, the libraries' INFO records go to ``run_dir/<log_file>`` and only their warnings to the
    console."""
    import datasets

    datasets.disable_progress_bars()  # "Generating train split" bars: satlab shows its own progress
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a deprecation inside Lightning, not ours
    warnings.filterwarnings("ignore", message=SYNC_DIST_ADVICE)  # see the module docstring
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    consoles = []
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.setLevel(logging.INFO)
        for console in library.handlers:
            if type(console) is logging.StreamHandler:
                consoles.append((console, console.level))
                console.setLevel(logging.WARNING)
        library.addHandler(handler)
    try:
        yield
    finally:
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        for console, level in consoles:
            console.setLevel(level)
        handler.close()
