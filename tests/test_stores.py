"""Store URLs: which file a sqlite URL names, and whether it exists (what the commands check before they open a
store, since opening one creates it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from satlab.config.stores import missing_sqlite_file, sqlite_file, sqlite_name


@pytest.mark.parametrize("url, name", [
    ("sqlite:////abs/path/optuna.db", "/abs/path/optuna.db"),
    ("sqlite:///rel/mlflow.db?timeout=30", "rel/mlflow.db"),  # the query is not part of the file
    ("sqlite:///:memory:", ":memory:"),
    ("sqlite:///", ""),
    ("postgresql://user@host/db", None),
    ("http://127.0.0.1:5000", None),
    ("/plain/folder", None),
])
def test_the_file_of_a_sqlite_url_and_none_for_any_other(url, name):
    assert sqlite_name(url) == name
    assert sqlite_file(url) == (None if name is None else Path(name))


def test_only_a_sqlite_url_whose_file_is_not_there_is_missing(tmp_path):
    db = tmp_path / "optuna.db"
    assert missing_sqlite_file(f"sqlite:///{db}")
    assert missing_sqlite_file(f"sqlite:///{tmp_path}")  # a folder is no store
    db.write_bytes(b"")
    assert not missing_sqlite_file(f"sqlite:///{db}") and not missing_sqlite_file(f"sqlite:///{db}?timeout=5")
    assert not missing_sqlite_file("postgresql://user@host/db")  # not a file: nothing to find missing


def test_a_sqlite_url_without_its_third_slash_is_refused_as_a_store_saying_how_to_write_it():
    from satlab.training.tracking import store_problem

    assert "sqlite:///<path" in store_problem("sqlite://mlflow.db")
