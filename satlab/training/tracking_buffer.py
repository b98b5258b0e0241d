"""Logging through a tracking store outage: an MLflow server restarted or a database briefly down costs no training
and no record.

:class:`BufferedClient` stands in for the run's ``MlflowClient``. A write that fails because the store does not
answer is appended to a spool file in the run folder (``mlflow-pending.jsonl``, artifacts beside it) and training
goes on; later writes join the queue behind it, in order, and every ``RETRY_SECONDS`` the queue is sent again,
oldest first. The spool is a file, not memory, so a run killed during an outage sends what it kept when it is
resumed. Sending twice is harmless: metric points keep the timestamps they were logged with, and MLflow stores a
point (key, step, timestamp, value) once; tags, params and artifacts are set to the same value again.

Only writes are queued; reads (``get_run``, ``get_metric_history``) go straight to the store and raise as usual.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPOOL = "mlflow-pending.jsonl"
SPOOL_FILES = "mlflow-pending"
RETRY_SECONDS = 20.0
"""How long the queue waits after a failed send before the next try (each try may cost a connection timeout)."""

HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""MLflow's http client retries a failed request 7 times with exponential backoff (minutes) and waits 120 s per
request by default; a training step must not wait that long. Applied unless the user set them."""


def store_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the store did not answer (as opposed to refusing the request): MLflow's 5xx errors
    (its http client's connection failures and the SQL store's "database unavailable" both are), and the network
    and database errors beneath them."""
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        return error.get_http_status_code() >= 500
    import requests
    import sqlalchemy.exc

    if isinstance(error, sqlalchemy.exc.OperationalError | sqlalchemy.exc.DisconnectionError):
        return True

    return isinstance(error, requests.ConnectionError | requests.Timeout | ConnectionError | TimeoutError)


def _encode(value: Any) -> Any:
    """MLflow's entities as tagged dicts (the rest of a write's arguments is JSON already)."""
    from mlflow.entities import Metric, Param, RunTag

    if isinstance(value, Metric):
        return {"__metric__": [value.key, value.value, value.timestamp, value.step]}
    if isinstance(value, Param | RunTag):
        return {f"__{type(value).__name__.lower()}__": [value.key, value.value]}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    from mlflow.entities import Metric, Param, RunTag

    if isinstance(value, dict):
        for tag, entity in (("__metric__", Metric), ("__param__", Param), ("__runtag__", RunTag)):
            if tag in value:
                return entity(*value[tag])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


class BufferedClient:
    """An ``MlflowClient`` whose writes survive an outage of the store (see the module docstring)."""

    WRITES = frozenset({"log_batch", "log_metric", "log_param", "set_tag", "set_terminated", "set_experiment_tag",
                        "log_text", "log_dict", "log_table", "log_artifact", "log_figure", "update_run"})

    def __init__(self, client: Any, run_dir: Path, describe_store: str,
                 clock: Callable[[], float] = time.monotonic):
        for key, value in HTTP_SETTINGS.items():
            os.environ.setdefault(key, value)
        self._client, self._store, self._clock = client, describe_store, clock
        self.spool, self.files = run_dir / SPOOL, run_dir / SPOOL_FILES
        self._retry_at = 0.0  # a spool left by an earlier process is sent at the first write
        self.outage_started: float | None = None
        self.queued = 0
        self._pending = self.spool.exists()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if name not in self.WRITES:
            return attribute
        return lambda *args, **kwargs: self._write(name, args, kwargs)

    def _write(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self._pending and not self.flush():
            self._queue(name, args, kwargs)
            return None
        try:
            return getattr(self._client, name)(*args, **kwargs)
        except Exception as error:
            if not store_unavailable(error):
                raise
            self._queue(name, args, kwargs)
            self._outage(error)
            return None

    def _queue(self, name: str, args: tuple, kwargs: dict) -> None:
        if name == "log_figure":  # a figure is drawn now, into the spool's folder, and sent as a file later
            name, args, kwargs = "log_artifact", *self._figure_file(*args, **kwargs)
        entry = {"call": name, "args": _encode(list(args)), "kwargs": _encode(kwargs)}
        self.spool.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spool, "a") as spool:
            spool.write(json.dumps(entry) + "\n")
            spool.flush()
            os.fsync(spool.fileno())
        self.queued += 1
        self._pending = True

    def _figure_file(self, run_id: str, figure: Any, artifact_file: str, save_kwargs: dict | None = None
                     ) -> tuple[tuple, dict]:
        """(args, kwargs) of the ``log_artifact`` that sends ``figure``, drawn now into the spool's folder."""
        local = self.files / str(time.time_ns()) / Path(artifact_file).name
        local.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(local, **(save_kwargs or {}))
        folder = str(Path(artifact_file).parent)
        return (run_id, str(local)), {"artifact_path": None if folder == "." else folder}

    def _outage(self, error: BaseException) -> None:
        self._retry_at = self._clock() + RETRY_SECONDS
        if self.outage_started is None:
            self.outage_started = self._clock()
            first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            print(f"satlab: the tracking store {self._store} does not answer ({first_line}); training goes on, and "
                  f"what it logs is kept in {self.spool} and sent when the store is back", file=sys.stderr)

    def flush(self, force: bool = False) -> bool:
        """Send the queue, oldest first; True when it is empty. Until ``RETRY_SECONDS`` after a failed try, only a
        forced flush tries again. An entry the store refuses (not an outage) is dropped with a message: it
        would be refused again."""
        if not self._pending:
            return True
        if not force and self._clock() < self._retry_at:
            return False
        entries = [json.loads(line) for line in self.spool.read_text().splitlines() if line.strip()]
        sent = 0
        for entry in entries:
            try:
                getattr(self._client, entry["call"])(*_decode(entry["args"]), **_decode(entry["kwargs"]))
            except Exception as error:
                if store_unavailable(error):
                    self._keep(entries[sent:])
                    self._outage(error)
                    return False
                print(f"satlab: the tracking store refused a record kept during its outage ({entry['call']}: "
                      f"{error}); dropped", file=sys.stderr)
            sent += 1
        self._keep([])
        seconds = "" if self.outage_started is None else f" after {self._clock() - self.outage_started:.0f} s"
        print(f"satlab: the tracking store {self._store} answers again{seconds}; sent the {sent} records kept "
              "meanwhile", file=sys.stderr)
        self.outage_started = None
        return True

    def _keep(self, entries: list[dict]) -> None:
        """Rewrites the spool to ``entries`` (atomically: a kill leaves the old or the new list, and what was sent
        twice is recorded once)."""
        if not entries:
            self.spool.unlink(missing_ok=True)
            shutil.rmtree(self.files, ignore_errors=True)
            self._pending = False
            return
        tmp = self.spool.with_name(f".{self.spool.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
        os.replace(tmp, self.spool)

    def wait_for_store(self, seconds: float) -> bool:
        """At the end of a run: try the queue until it is sent or ``seconds`` have passed; True when sent."""
        deadline = self._clock() + seconds
        while not self.flush(force=True):
            if self._clock() >= deadline:
                return False
            time.sleep(min(5.0, max(0.0, deadline - self._clock())))
        return True
