"""Library chatter goes to the run's log file, not the terminal.

Lightning, datasets and MLflow print notices at INFO level (devices found, a "litlogger" tip, a line per split
generated, database migrations) that say nothing a researcher acts on; satlab's own output (the plan, the progress
bar with tokens/s and ETA, the summary table) and every warning or error still reach the terminal. The notices
are kept, with timestamps, in ``<run dir>/train.log``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LIBRARY_LOGGERS = ("lightning.pytorch", "lightning.fabric", "datasets", "mlflow", "optuna")
LOG_FILE = "train.log"


@contextmanager
def library_chatter_to(run_dir: Path, log_file: str = LOG_FILE) -> Iterator[None]:
    """While the block runs, the libraries' INFO records go to ``run_dir/<log_file>`` and only their warnings to the
    console."""
    import datasets

    datasets.disable_progress_bars()  # "Generating train split" bars: satlab shows its own progress
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a deprecation inside Lightning, not ours
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
