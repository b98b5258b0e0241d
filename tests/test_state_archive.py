"""scripts/state_archive.sh: a study's records packed, unpacked elsewhere exactly, never over an existing store."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "state_archive.sh"


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STATE_ROOT": str(root)}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=root, env=env, capture_output=True, text=True, timeout=60)


def make_store(root: Path) -> sqlite3.Connection:
    (root / "mlruns" / "artifacts" / "run1").mkdir(parents=True)
    (root / "mlruns" / "artifacts" / "run1" / "config.yaml").write_text("model: {arch: satformer}\n")
    (root / "reports" / "ablations" / "study").mkdir(parents=True)
    (root / "reports" / "ablations" / "study" / "study.log").write_text("cell 1 finished\n")
    (root / "runs").mkdir()
    (root / "runs" / "last.ckpt").write_bytes(b"x" * 100)
    db = sqlite3.connect(root / "reports" / "ablations" / "study" / "optuna.db")
    db.execute("create table trials (id integer, state text)")
    db.executemany("insert into trials values (?, ?)", [(1, "COMPLETE"), (2, "RUNNING")])
    db.commit()  # the connection stays open, as a running study's would
    return db


def test_a_saved_study_restores_exactly_on_a_machine_without_it(tmp_path: Path) -> None:
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    db = make_store(here)
    saved = run(here, "save", "state/study.tar.xz", "mlruns", "reports/ablations/study")
    db.close()
    assert saved.returncode == 0, saved.stderr
    there.mkdir()
    restored = run(there, "restore", str(here / "state" / "study.tar.xz"))
    assert restored.returncode == 0, restored.stderr
    assert (there / "mlruns/artifacts/run1/config.yaml").read_text() == "model: {arch: satformer}\n"
    assert (there / "reports/ablations/study/study.log").read_text() == "cell 1 finished\n"
    rows = sqlite3.connect(there / "reports/ablations/study/optuna.db").execute("select * from trials").fetchall()
    assert rows == [(1, "COMPLETE"), (2, "RUNNING")]
    assert not (there / "runs").exists()  # checkpoints are not packed unless named
    assert not (there / ".state-archive-paths").exists()


def test_restore_refuses_to_mix_stores_and_bad_input_writes_nothing(tmp_path: Path) -> None:
    make_store(tmp_path).close()
    assert run(tmp_path, "save", "state/a.tar.xz", "mlruns").returncode == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    clash = run(tmp_path, "restore", "state/a.tar.xz")
    assert clash.returncode == 2 and "mlruns" in clash.stderr and "nothing was written" in clash.stderr
    for args in (["save", "state/b.tar.xz", "no_such_folder"], ["save", "state/b.tar", "mlruns"],
                 ["save", "state/b.tar.xz", "../outside"], ["restore", "state/missing.tar.xz"], ["frobnicate"]):
        bad = run(tmp_path, *args)
        assert bad.returncode == 2, (args, bad.stderr)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

    shutil.rmtree(tmp_path / "mlruns")
    assert run(tmp_path, "restore", "state/a.tar.xz").returncode == 0
    assert (tmp_path / "mlruns/mlflow.db").exists() is False  # it saved no db of its own
    assert (tmp_path / "mlruns/artifacts/run1/config.yaml").exists()
