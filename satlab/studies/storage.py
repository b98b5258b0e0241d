"""Optuna storages: an RDB (a sqlite file on one host, PostgreSQL across hosts) with heartbeats."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.exceptions import ExperimentalWarning
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial

from satlab.config.errors import ConfigError
from satlab.config.stores import sqlite_name
from satlab.studies.spec import TrialSettings


def open_storage(url: str, settings: TrialSettings | None = None,
                 stale_callback: Callable[[optuna.Study, FrozenTrial], None] | None = None,
                 create_tables: bool = True, create_folder: bool = False) -> RDBStorage:
    """With ``settings`` it records heartbeats: a trial whose worker died is failed after ``grace_seconds`` and
    handed to ``stale_callback``. Not journal storages: Optuna's heartbeats are for RDB storages only, and without
    them a killed worker's trial would stay RUNNING for ever.

    The folder of a sqlite file is made only with ``create_folder`` (satlab's own default location); a path the user
    names must be in a writable folder that exists, so a typo makes no folders and starts nothing."""
    if "://" not in url:
        raise ConfigError(f"storage '{url}' is not a database URL; use sqlite:///<abs path>/optuna.db on one host or "
                          "postgresql://user:password@host/db across hosts (journal files lack heartbeats)")
    if url.startswith("sqlite:"):
        check_sqlite_file(url, create_folder)
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 120}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    heartbeat: dict[str, Any] = {} if settings is None else dict(
        heartbeat_interval=settings.heartbeat_seconds, grace_period=settings.grace_seconds,
        heartbeat_stale_trial_callback=stale_callback)
    attempts = 3  # two processes creating the tables of one new database race: the loser tries again
    for attempt in range(1, attempts + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                storage = RDBStorage(url, engine_kwargs=engine_kwargs, skip_table_creation=not create_tables,
                                     **heartbeat)
            break
        except ImportError as e:
            raise ConfigError(f"storage '{safe_url(url)}' needs a database driver that is not installed ({e}); "
                              "for PostgreSQL: pip install 'satlab[postgres]' (psycopg 3)") from None
        except Exception as e:  # SQLAlchemy's OperationalError and friends: unreachable server, bad credentials
            if attempt == attempts:
                raise ConfigError(f"cannot open the storage '{safe_url(url)}': {type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}") from None
            time.sleep(attempt)
    if url.startswith("sqlite"):
        serialize_sqlite(storage.engine)
    return storage


def trial_id(storage: BaseStorage, study_name: str, number: int) -> int:
    """The storage's id of trial ``number`` of a study: what ``optuna.Trial(study, id)`` takes (a trial process
    reporting to the trial its driver started) and the storage's per-trial calls (an attribute on a trial of another
    process, or one Optuna's Trial no longer sets). Study, Trial and FrozenTrial keep it private (``_trial_id``); the
    storage's own interface (BaseStorage, which the storage classes implement) looks it up by study name and number."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)


def check_sqlite_file(url: str, create_folder: bool) -> None:
    """A sqlite storage is a file the trial processes share: not in memory, not a folder, in a writable folder that
    exists (made here only with ``create_folder``)."""
    name = sqlite_name(url) or ""
    if name in ("", ":memory:") or "mode=memory" in url:
        raise ConfigError(f"storage '{url}' is an in-memory database, which the trial processes cannot share; use "
                          "sqlite:///<abs path>/optuna.db")
    path = Path(name)
    folder = path.parent
    if create_folder:
        folder.mkdir(parents=True, exist_ok=True)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"the folder of the storage '{url}', {folder}, is a file, not a folder; fix the path")
    if not folder.is_dir():
        raise ConfigError(f"the folder of the storage '{url}', {folder}, does not exist; satlab makes no folders for a "
                          f"storage you name: create it first (mkdir -p {folder}) or fix the path")
    if path.is_dir():
        raise ConfigError(f"storage '{url}' names the folder {path}; name a database file in it, e.g. "
                          f"sqlite:///{path / 'optuna.db'}")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.R_OK | os.W_OK)):
        where = path if path.exists() else folder
        raise ConfigError(f"storage '{url}': {where} is not writable by this user; sqlite needs to write the database "
                          "and its journal next to it, so pick a folder of yours or fix the permissions")


def serialize_sqlite(engine: sqlalchemy.engine.Engine) -> None:
    """SQLite ignores ``SELECT ... FOR UPDATE``, so two workers could both pop the same WAITING trial (an enqueued
    point or a retry). ``BEGIN IMMEDIATE`` (SQLAlchemy's recipe for pysqlite) takes the write lock up front, making
    Optuna's read-check-write atomic across threads and processes; transactions are short, so waiting costs little."""

    @sqlalchemy.event.listens_for(engine, "connect")
    def no_implicit_begin(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sqlalchemy.event.listens_for(engine, "begin")
    def begin_immediate(connection: sqlalchemy.engine.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners existed must not be reused


def safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: nothing to hide that we could parse
        return url
