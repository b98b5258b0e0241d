"""Store URLs (MLflow tracking stores, Optuna storages): the one place that reads the file of a ``sqlite:///`` URL.

Both kinds of store are checked before anything is written, and a sqlite file that is not there must not be
created by merely looking (opening a client creates an empty store), so several commands ask the same question of a
URL: is it a sqlite file, which one, and does it exist?"""

from __future__ import annotations

from pathlib import Path

SQLITE = "sqlite:///"


def sqlite_name(url: str) -> str | None:
    """The file name of a ``sqlite:///<path>[?query]`` URL as written (possibly empty or ``:memory:``); None for
    any other URL."""
    return url.removeprefix(SQLITE).partition("?")[0] if url.startswith(SQLITE) else None


def sqlite_file(url: str) -> Path | None:
    """The database file of a sqlite URL, None for any other URL."""
    name = sqlite_name(url)
    return None if name is None else Path(name)


def missing_sqlite_file(url: str) -> bool:
    """True for a sqlite URL whose file does not exist yet (opening it would create an empty store)."""
    path = sqlite_file(url)
    return path is not None and not path.is_file()
