"""One data preparation per multi-process job: :func:`prepare_once` is ``prepare_data`` for a process that may be one
of many (torchrun, SLURM, Lightning's own launcher).

One process prepares: global rank 0, or local rank 0 of every node with ``data.prepare_per_node`` (for nodes that do
not share ``data.cache_dir``). While it works, a daemon thread rewrites a status file every few seconds,
``<cache_dir>/prepare/<key>.json`` (``key``: :func:`status_key`), with its state (``running``, ``done``, ``failed``),
pid, host, job id, the time of the last write and, on failure, the error. Every other process polls
``find_prepared`` (read-only) until the data is there, and gives up with a :class:`ConfigError` when the preparer
reports a failure of this job, or when it has shown no sign of life (the status file unchanged, or never written) for
``data.prepare_timeout_s`` seconds.

Signs of life are changes of the status file seen by the waiting process on its own clock, so hosts whose clocks
disagree still agree on them. A ``failed`` status is only believed when it is of this job (its job id) and was written
while this process lived (allowing :data:`FAILED_SLACK_S` for clock differences), so the failure of an earlier launch
under the same job id does not stop a new one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from satlab.config.errors import ConfigError
from satlab.config.schema import DataConfig
from satlab.data import prepare as pipeline
from satlab.data.common import read_json, replace_json, stable_hash
from satlab.data.packing import PROGRESS_FILE
from satlab.data.prepare import PreparedData

POLL_S = 2.0
"""How often a waiting process looks for the prepared data and the status file."""
HEARTBEAT_S = 5.0
"""How often the preparer rewrites its status file."""
REPORT_EVERY_S = 60.0
"""How often a waiting process says it still waits."""
ANNOUNCE_AFTER_S = 5.0
"""A waiting process says it waits when the preparer's status appears, or after this long without one."""
FAILED_SLACK_S = 60.0
"""A ``failed`` status written up to this long before this process started is still taken as this launch's."""
STATUS_DIR = "prepare"
NOT_DATA_FIELDS = frozenset({"cache_dir", "num_workers", "num_proc", "prepare_per_node", "prepare_timeout_s",
                             "seq_len", "mqar"})
"""DataConfig fields that do not change the prepared files (where they go, how fast, how they are read later)."""

_imported_at = time.time()


@dataclass(frozen=True)
class LaunchRanks:
    """Where this process stands in its job: ``launcher`` is ``torchrun``, ``slurm``, ``lightning`` or None (a
    single process); ``rank`` is the global rank, None where the environment does not give it (a Lightning child on
    a node other than the first)."""

    launcher: str | None
    rank: int | None
    local_rank: int
    node_rank: int | None = None

    @property
    def label(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank}"
        return f"node {self.node_rank} local rank {self.local_rank}"


def launch_ranks(environ: Mapping[str, str] | None = None) -> LaunchRanks:
    """This process's ranks from the launcher's environment variables: torchrun (``RANK``, ``LOCAL_RANK``), then
    SLURM (``SLURM_PROCID``, ``SLURM_LOCALID``), then Lightning's subprocess launcher (its children get
    ``LOCAL_RANK`` and ``NODE_RANK``; the parent has neither and is local rank 0). None of them: a single process.

    SLURM's variables are also set in an interactive allocation where Lightning launches the processes itself; there
    a ``LOCAL_RANK`` that disagrees with ``SLURM_LOCALID`` is Lightning's and wins (as in Lightning's own order)."""
    env = os.environ if environ is None else environ

    def number(name: str, default: int | None = None) -> int | None:
        value = env.get(name, "").strip()
        return int(value) if value else default

    if number("RANK") is not None:
        rank = number("RANK")
        return LaunchRanks("torchrun", rank, number("LOCAL_RANK", rank))
    lightning_child = number("LOCAL_RANK") is not None or number("NODE_RANK") is not None
    slurm = number("SLURM_PROCID") is not None
    if slurm and not (lightning_child and number("LOCAL_RANK", 0) != number("SLURM_LOCALID", 0)):
        rank = number("SLURM_PROCID")
        return LaunchRanks("slurm", rank, number("SLURM_LOCALID", rank))
    if lightning_child:
        local, node = number("LOCAL_RANK", 0), number("NODE_RANK", 0)
        return LaunchRanks("lightning", local if node == 0 else None, local, node)
    return LaunchRanks(None, 0, 0)


def is_preparer(ranks: LaunchRanks, per_node: bool) -> bool:
    """Whether this process prepares the data: local rank 0 with ``per_node``, else global rank 0."""
    return ranks.local_rank == 0 if per_node else ranks.rank == 0


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """An id all processes of one launch share: torchrun's run id, SLURM's job (and step), else the rendezvous
    address; restart counters included, so a restarted job does not read its previous attempt's status."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        step = f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else ""
        return f"slurm:{env['SLURM_JOB_ID']}{step}/{env.get('SLURM_RESTART_COUNT', '0')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def status_key(data_cfg: DataConfig) -> str:
    """The hash of what defines the prepared data (every DataConfig field but :data:`NOT_DATA_FIELDS`)."""
    return stable_hash({k: v for k, v in asdict(data_cfg).items() if k not in NOT_DATA_FIELDS})


def status_path(data_cfg: DataConfig) -> Path:
    return Path(data_cfg.cache_dir).expanduser() / STATUS_DIR / f"{status_key(data_cfg)}.json"


def read_status(path: Path) -> dict[str, Any] | None:
    """The status in ``path``, or None when there is none (or it cannot be read as one)."""
    try:
        status = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def write_status(path: Path, status: dict[str, Any]) -> None:
    """Write ``status`` atomically (see :func:`satlab.data.common.replace_json`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_json(path, status)


def _packing_progress(cache_dir: Path) -> str | None:
    """What the newest tokenization under ``cache_dir`` has done so far (its resumable progress file)."""
    try:
        files = sorted(cache_dir.glob(f"tokens/.*.partial/{PROGRESS_FILE}"), key=lambda p: p.stat().st_mtime)
        progress = read_json(files[-1]) if files else None
    except (OSError, ValueError):
        return None
    if not progress:
        return None
    tokens = sum((progress.get("tokens") or {}).values())
    return f"tokenizing: {progress.get('rows', 0):,} documents, {tokens:,} tokens so far"


def _process_started() -> float:
    """The wall-clock time this process started (Linux ``/proc``), or when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _imported_at


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Heartbeat:
    """Keeps the preparer's status file fresh from a daemon thread; :meth:`finish` writes the final state."""

    def __init__(self, path: Path, status: dict[str, Any], cache_dir: Path):
        self.path, self.status, self.cache_dir = path, status, cache_dir
        self._stop = threading.Event()
        self._warned = False
        self._write()  # before any work, so the waiting processes learn who prepares at once
        self._thread = threading.Thread(target=self._run, name="satlab-prepare-heartbeat", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.status.update(updated=time.time(), progress=_packing_progress(self.cache_dir))
        try:
            write_status(self.path, self.status)
        except OSError as error:  # a read-only cache still serves prepared data; only the waiters lose their news
            if not self._warned:
                self._warned = True
                _say(f"satlab: cannot write the data preparation status {self.path} ({error}); other processes "
                     "waiting for this data will not see this process's progress")

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._write()

    def finish(self, state: str, **fields: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.status.update(state=state, **fields)
        self._write()


def _prepare(data_cfg: DataConfig, progress: bool, ranks: LaunchRanks, job: str | None) -> PreparedData:
    cache_dir = Path(data_cfg.cache_dir).expanduser()
    beat = _Heartbeat(status_path(data_cfg), {
        "state": "running", "pid": os.getpid(), "host": socket.gethostname(), "job": job, "rank": ranks.label,
        "started": time.time(), "cache_dir": str(cache_dir.resolve()),
    }, cache_dir)
    try:
        data = pipeline.prepare_data(data_cfg, progress=progress)
    except BaseException as error:
        beat.finish("failed", error=str(error) or type(error).__name__, error_type=type(error).__name__)
        raise
    beat.finish("done", directory=str(data.directory))
    if ranks.launcher is not None:
        _say(f"{ranks.label}: the data is ready in {data.directory}")
    return data


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _timeout_error(data_cfg: DataConfig, ranks: LaunchRanks, who: str, status: dict | None, path: Path,
                   waited: float, quiet: float) -> ConfigError:
    cache = Path(data_cfg.cache_dir).expanduser().resolve()
    advice = (f"If the nodes of this job do not share the folder {cache}, set data.prepare_per_node=true so that "
              "local rank 0 of every node prepares its own copy; if the preparation is just slow (a large corpus, "
              f"a slow hub download), raise data.prepare_timeout_s (now {data_cfg.prepare_timeout_s:g}).")
    if status is None:
        what = (f"{ranks.label} waited {_minutes(waited)} for {who} to prepare the data in {cache}, but the data is "
                f"not there and {who} never wrote its status file {path}: it may have failed before preparing (see "
                "its log), or it writes into another folder than this process reads.")
    elif status.get("state") == "done":
        what = (f"{who} (host {status.get('host')}, pid {status.get('pid')}) reported the data prepared in "
                f"{status.get('directory')}, but {ranks.label} has not found it under {cache} for "
                f"{_minutes(quiet)}: the processes do not see the same files, or their data settings differ.")
    else:
        what = (f"{who} (host {status.get('host')}, pid {status.get('pid')}) has shown no sign of life for "
                f"{_minutes(quiet)} while preparing the data in {cache} (its status file {path} stopped changing): "
                f"it was probably killed or hangs; {ranks.label} gives up.")
    return ConfigError(f"{what} {advice}")


def wait_for_data(data_cfg: DataConfig, ranks: LaunchRanks, job: str | None) -> PreparedData:
    """Wait until the preparer's data can be read (see the module docstring for when it gives up)."""
    path = status_path(data_cfg)
    who = "local rank 0 of this node" if data_cfg.prepare_per_node else "rank 0"
    timeout = float(data_cfg.prepare_timeout_s)
    process_started = _process_started()
    start = time.monotonic()
    last_life, seen, believed_failure = start, None, False
    announced, next_report, polls = False, start + REPORT_EVERY_S, 0
    while True:
        data = pipeline.find_prepared(data_cfg)
        if data is not None:
            if announced:
                _say(f"{ranks.label}: the data is ready in {data.directory}")
            return data
        now = time.monotonic()
        status = read_status(path)
        ours = status if status is not None and status.get("job") == job else None
        if ours is not None:
            signature = tuple(ours.get(k) for k in ("host", "pid", "state", "updated", "progress"))
            if signature != seen:  # a sign of life, seen on this process's clock
                last_life, seen = now, signature
                believed_failure = polls > 0 or float(ours.get("updated") or 0) >= process_started - FAILED_SLACK_S
            if ours.get("state") == "failed" and believed_failure:
                raise ConfigError(
                    f"{who} (host {ours.get('host')}, pid {ours.get('pid')}) failed to prepare the data in "
                    f"{Path(data_cfg.cache_dir).expanduser().resolve()}: {ours.get('error')}. {ranks.label} stops "
                    f"too; fix the cause (the log of {who} has the details) and launch again.")
        if not announced and (ours is not None or now - start >= ANNOUNCE_AFTER_S):
            announced = True
            whose = f"host {ours.get('host')}, pid {ours.get('pid')}" if ours else f"no status in {path} yet"
            _say(f"{ranks.label}: waiting for {who} ({whose}) to prepare the data in "
                 f"{Path(data_cfg.cache_dir).expanduser()}...")
        if now >= next_report:
            next_report = now + REPORT_EVERY_S
            news = ours.get("progress") if ours else None
            _say(f"{ranks.label}: still waiting for {who} after {_minutes(now - start)}"
                 + (f": {news}" if news else f" (last sign of life {_minutes(now - last_life)} ago)"))
        if now - last_life > timeout:
            raise _timeout_error(data_cfg, ranks, who, ours, path, now - start, now - last_life)
        polls += 1
        time.sleep(max(0.01, min(POLL_S, last_life + timeout - now + 0.01)))


def prepare_once(data_cfg: DataConfig, progress: bool = True) -> PreparedData:
    """``prepare_data(data_cfg)`` on the one process of this job (or of this node) that prepares; every other
    process waits for that one's data (see the module docstring). A process with no launcher variables and no
    rendezvous address (``MASTER_ADDR``) is alone: it prepares without a status file."""
    ranks, job = launch_ranks(), job_id()
    if ranks.launcher is None and job is None:  # alone: no one to tell, and a bad config leaves nothing behind
        return pipeline.prepare_data(data_cfg, progress=progress)
    if is_preparer(ranks, data_cfg.prepare_per_node):
        return _prepare(data_cfg, progress, ranks, job)
    return wait_for_data(data_cfg, ranks, job)
