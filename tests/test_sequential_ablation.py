"""A tiny sequential ablation end to end (processes): the cells of a look are queued only up to its seeds, every look
is recorded on the study and the parent run, the plan is fixed there before the first look and a changed one is
refused (exit 2, nothing written), a rerun resumes without running a cell twice, and a recorded look the finished
cells no longer give is reported, not overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import yaml
from test_ablate import MICRO
from test_postgres import finish, hosts, postgres, start  # noqa: F401  (the session's PostgreSQL)

from satlab.cli.main import main as satlab_main
from satlab.studies import sequential_schedule as S
from satlab.studies.attrs import LOG, SEQUENTIAL_LOOKS, SEQUENTIAL_PLAN, WORKER
from satlab.studies.engine import run_study
from satlab.studies.loader import load_ablation
from satlab.studies.plans import GridPlan
from satlab.studies.results import cell_runs
from satlab.studies.sequential_looks import LOOKS_CSV, LOOKS_JSON, REPLAY_TAG, fixed_plan

TAG = "verdict.sequential.0.01_vs_1e-09"


def write_spec(tmp_path: Path) -> Path:
    """Two arms far apart (a learning rate of 1e-9 barely trains), four seeds listed, looks at 3 and 4."""
    overrides = {**MICRO, "model.arch": "transformer", "tracking.uri": f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
                 "train.out_dir": str(tmp_path / "runs"), "data.cache_dir": str(tmp_path.parent / "ablate-cache")}
    spec = {"name": "seq", "base": "default", "overrides": overrides, "out_dir": str(tmp_path / "out"),
            "axes": {"optim.lr": [1e-2, 1e-9], "train.seed": [0, 1, 2, 3]}, "baseline": {"optim.lr": 1e-9},
            "sequential": {"looks": [3, 4]}}
    path = tmp_path / "seq.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def state(spec, client: mlflow.MlflowClient, parent: str) -> tuple:
    """What a refused command must leave as it was: the study's trials and attrs, the parent run, the cell runs,
    and the files of the ablation's folder."""
    study = GridPlan(spec).recorded_study()
    run = client.get_run(parent)
    files = {p: p.stat().st_size for p in Path(spec.out_path()).rglob("*") if p.is_file() and p.suffix != ".db"}
    return (len(study.trials), study.user_attrs, run.data.params, run.data.tags, run.info.status,
            {k: r.info.run_id for k, r in cell_runs(client, parent).items()}, files)


@pytest.mark.slow  # make test-full (~120 s); the dry run below is fast
@pytest.mark.process
def test_a_sequential_ablation_runs_look_by_look_records_every_look_and_resumes(tmp_path, capsys):
    path = write_spec(tmp_path)
    spec = load_ablation(path)
    result = run_study(spec, workers=2)
    assert not result.failed and not result.interrupted
    client = mlflow.MlflowClient(result.tracking_uri)
    study = GridPlan(spec).recorded_study()
    rows = study.user_attrs[SEQUENTIAL_LOOKS]
    assert [r["look"] for r in rows] == list(range(1, len(rows) + 1)) and rows[0]["seeds"] == 3
    assert [r["decision"] for r in rows[:-1]] == ["continue"] * (len(rows) - 1)
    assert rows[-1]["decision"] in ("a_better", "undecided")  # the second arm cannot win: it barely trains
    seeds = rows[-1]["seeds"]
    runs = {k: r.info.run_id for k, r in cell_runs(client, result.parent_run_id).items()}
    assert set(runs) == {c.key for c in spec.cells() if c.seed < seeds}  # queued only up to the last look
    assert sorted(result.finished) == sorted(runs)

    parent = client.get_run(result.parent_run_id)
    assert {k: v for k, v in parent.data.params.items() if k.startswith("sequential.")} == \
        fixed_plan(spec, S.design(spec)) == study.user_attrs[SEQUENTIAL_PLAN]
    assert parent.data.tags[TAG] == S.TAG_OUTCOME[rows[-1]["decision"]]
    assert json.loads(Path(client.download_artifacts(result.parent_run_id, LOOKS_JSON, str(tmp_path))).read_text()) \
        == rows
    table = Path(client.download_artifacts(result.parent_run_id, LOOKS_CSV, str(tmp_path))).read_text().splitlines()
    assert len(table) == len(rows) + 1
    assert table[0].startswith("pair,look,seeds,decision,t,critical,mean,rci,family,")  # what a preview shows first
    summary = json.loads(result.report["summary"].read_text())["sequential"]
    assert summary["verdicts"][0]["stopped_at"] == rows[-1]["look"] and summary["looks"] == rows
    markdown = result.report["markdown"].read_text()
    assert "## Sequential plan" in markdown and "### Every look" in markdown

    again = run_study(spec, workers=1, report=False)  # a rerun replays the looks: the same decisions, no cell again
    assert again.finished == [] and sorted(again.skipped) == sorted(runs) and not again.failed
    assert GridPlan(spec).recorded_study().user_attrs[SEQUENTIAL_LOOKS] == rows

    before = state(spec, client, result.parent_run_id)
    capsys.readouterr()
    assert satlab_main(["ablate", str(path), "sequential.alpha=0.01", "sequential.spending=pocock"]) == 2
    err = capsys.readouterr().err
    assert "alpha 0.05 -> 0.01" in err and "spending obrien_fleming -> pocock" in err and "name=..." in err
    assert state(spec, client, result.parent_run_id) == before  # nothing written

    assert satlab_main(["ablate", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "looks recorded" in out and "z boundary" in out and ("nothing more to run" in out) == (seeds == 3 or
                                                                                                 rows[-1]["look"] == 2)

    tampered = [dict(rows[0], t=rows[0]["t"] + 1.0), *rows[1:]]  # as if a cell's run had changed since
    GridPlan(spec).recorded_study().set_user_attr(SEQUENTIAL_LOOKS, tampered)
    third = run_study(spec, workers=1, report=False)
    assert "no longer match" in third.failed["sequential"] and third.finished == []
    assert GridPlan(spec).recorded_study().user_attrs[SEQUENTIAL_LOOKS] == tampered  # kept, not overwritten
    assert "no longer match" in client.get_run(result.parent_run_id).data.tags[REPLAY_TAG]


def test_the_dry_run_before_any_look_prints_the_plan_and_the_first_looks_cells(tmp_path, capsys):
    path = write_spec(tmp_path)
    assert satlab_main(["ablate", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sequential plan: val/loss (lower is better), alpha 0.05" in out and "looks [3, 4]" in out
    assert "no look recorded yet" in out and "next: look 1 (study): 6 cell(s) to run" in out
    assert sum(line.startswith("  optim.lr=") for line in out.splitlines()) == 6
    printed = " ".join(out.split())  # a sign-flip p of 4 seeds is at least 1/16, above the 0.025 a side of one
    assert "the looks at 3, 4 seeds cannot stop" in printed and "at least 6 seeds" in printed  # comparison
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()
    (tmp_path / "more").mkdir()
    looked = write_spec(tmp_path / "more")  # the reproduce plan's looks and alpha shared six ways: dead until 20
    data = yaml.safe_load(looked.read_text())
    data["axes"]["train.seed"] = list(range(20))
    data["sequential"] = {"looks": [3, 5, 8, 12, 20]}
    data["axes"]["optim.lr"] = [1e-2, 3e-3, 1e-3, 1e-9]  # all pairs of four: six comparisons
    data["sequential"]["comparisons"] = "all_pairs"
    looked.write_text(yaml.safe_dump(data))
    assert satlab_main(["ablate", str(looked), "--dry-run"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "the looks at 3, 5, 8, 12 seeds cannot stop" in printed and "decided before 20 seeds" in printed


@pytest.mark.slow  # make test-full (~2 min)
@pytest.mark.process
def test_two_drivers_share_a_sequential_ablation_and_record_each_look_once(tmp_path, postgres):  # noqa: F811
    """Two drivers from two working directories on one PostgreSQL study, as two hosts join a sequential ablation:
    each replays the looks on the cells finished so far, so both may record a look at about the same moment. The
    looks must come out once each, in order, as one driver records them (a rerun replays them unchanged), every cell
    launched once, and only the seeds the looks reached run."""
    path = write_spec(tmp_path)
    (tmp_path / "mlruns").mkdir()
    mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").search_experiments()  # made once, first
    url = postgres("sequential")
    drivers = [start(["ablate", str(path), "--storage", url, "--no-report"], cwd) for cwd in hosts(tmp_path)]
    for driver in drivers:
        finish(driver)
    spec = load_ablation(path)
    plan = GridPlan(spec)
    study = plan.recorded_study(url)
    rows = study.user_attrs[SEQUENTIAL_LOOKS]
    assert [r["look"] for r in rows] == list(range(1, len(rows) + 1)), rows  # one row per look, in order
    launched = {key: [t for t in trials if t.user_attrs.get(LOG)] for key, trials in plan.trials_by_cell(study).items()}
    ran = {key for key, trials in launched.items() if trials}
    assert all(len(trials) == 1 and trials[0].state.name == "COMPLETE" for key, trials in launched.items()
               if key in ran), launched
    assert ran == {c.key for c in spec.cells() if c.seed < rows[-1]["seeds"]}
    assert len({t.user_attrs[WORKER] for key in ran for t in launched[key]}) == 2  # both drivers ran cells
    again = run_study(spec, workers=1, storage=url, report=False)  # one driver replaying: nothing new, nothing run
    assert again.finished == [] and not again.failed
    assert plan.recorded_study(url).user_attrs[SEQUENTIAL_LOOKS] == rows
