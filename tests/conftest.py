"""Every test process keeps to one CPU thread: ``make test`` runs one pytest process per core (pytest-xdist), and
two processes each taking every core run several times slower than one. Set before torch is imported."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# No test reaches a hub: huggingface_hub and datasets read these once, when imported (below), so a test that sets
# them later would wait for a network timeout instead (about 20 s a call) and test another path than it names.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Lightning and datasets give their loggers a StreamHandler on the sys.stderr of the moment they are imported. Were
# that inside a test using capsys, the handler would keep that test's capture, closed when it ends, and every later
# test of the process would print "--- Logging error ---" tracebacks (a test passing alone and failing after another
# in one process). Imported here, they write to the session's stderr.
import datasets  # noqa: E402, F401
import lightning.pytorch  # noqa: E402, F401


def pytest_collection_modifyitems(items: list) -> None:
    """Tests that start processes (marked ``process``: trial workers, ranks, servers, kills) run first, in their
    order. pytest-xdist hands each worker a contiguous share of the list and an idle worker steals from the end of
    another's; with the long tests at the front, the run ends on short ones instead of one worker finishing a
    two-minute test while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("process") is None)
