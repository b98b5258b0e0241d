"""SIGTERM outside Lightning's fit: kept, never fatal.

Lightning answers SIGTERM only while its trainer runs (the fit stops at the end of the batch with a checkpoint,
see ``CheckpointOnSigterm``). Outside it (the data being prepared, the model built, the final checkpoint written,
the end-of-run evaluation, the process exiting) Python's default kills the process with 143, and the SLURM scripts
read 143 as a failure: a job pre-empted while it set up is never requeued, and a run that finished a few seconds
before the time limit's warning ends FAILED. The one-node SLURM test met the second case (``--time=2
--signal=SIGTERM@60``: the requeued attempt finished its training and was killed on its way out).

:class:`SigtermWatch` is the handler in those moments. It only notes the signal: one that came before the fit is
honoured at the end of the fit's first batch (every rank stops at the same batch, the state checkpointed, exit 75);
one that came after the fit changes nothing, since the final state is already on disk, and the run finishes and
exits 0. While Lightning runs, its own handler calls this one too, which only notes it again. (The interpreter's
exit runs no Python handler: ``satlab train`` and a study's trial process ignore SIGTERM once their run has
finished, :func:`ignore_sigterm_from_now`.)
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SigtermWatch:
    """The SIGTERM handler outside Lightning's trainer: notes the signal (``received``), does nothing else."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True


@contextmanager
def watching_sigterm() -> Iterator[SigtermWatch | None]:
    """The process's :class:`SigtermWatch`: the one installed already (``satlab train`` installs one for the whole
    process, so it also covers the exit), else one installed here and removed on leaving. None off the main
    thread, where Python allows no signal handler (the signal then keeps its current handling)."""
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, SigtermWatch):
        yield current
        return
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    watch = SigtermWatch()
    signal.signal(signal.SIGTERM, watch)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGTERM, current)


def install_sigterm_watch() -> SigtermWatch:
    """Installs a :class:`SigtermWatch` for the rest of the process: ``satlab train`` calls it first, and once its
    run has finished ignores SIGTERM altogether, since the interpreter's exit (seconds of C-level teardown, torch's
    and gloo's) runs no Python handler."""
    watch = SigtermWatch()
    signal.signal(signal.SIGTERM, watch)
    return watch


def ignore_sigterm_from_now(watch: SigtermWatch, who: str) -> None:
    """The run is over: a SIGTERM from here on (the process writing its outcome, the interpreter's exit) is ignored,
    and one that came during the run's last moments, when no training step was left to stop, is said on stderr."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if watch.received:
        print(f"{who}: SIGTERM arrived with no training step left to stop; the run finished", file=sys.stderr)
