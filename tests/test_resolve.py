"""A name or a path -> a file (satlab.config.resolve): presets, sweep specs and ablation specs by name and by path,
and what is refused (a missing name or file, a folder, a file of another kind) with the valid names, cut to a
readable length; and `satlab report` finding an ablation that ran from a spec file outside the ablations folder, by
its name and by its path."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from satlab.cli.main import main as satlab_main
from satlab.config.errors import EXIT_USAGE, ConfigError, listing, unknown_name
from satlab.config.loader import load_experiment
from satlab.config.resolve import KINDS, default_experiments_dir, default_sweeps_dir, read_spec, resolve
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.loader import load_ablation, load_sweep
from satlab.studies.spec import SweepSpec

EXPERIMENTS, SWEEPS = default_experiments_dir(), default_sweeps_dir()
ABLATIONS = EXPERIMENTS / "ablations"
PRESET = "name: mine\nmodel:\n  arch: transformer\n"
SWEEP = "base: tiny/transformer\nn_trials: 2\nspace:\n  optim.lr: {low: 1.0e-4, high: 1.0e-2, log: true}\n"
ABLATION = "base: tiny/transformer\naxes:\n  train.seed: [0, 1]\n"


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a preset, a sweep and an ablation spec of its own, and a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    for name, text in {"mine/p.yaml": PRESET, "mine/s.yaml": SWEEP, "mine/a.yml": ABLATION}.items():
        (tmp_path / name).write_text(text)
    return tmp_path


FOUND = [  # (kind, what a user types, the file it means; {tmp} the working directory)
    ("experiment", "default", str(EXPERIMENTS / "default.yaml")),
    ("experiment", "tiny/satformer", str(EXPERIMENTS / "tiny" / "satformer.yaml")),  # generated: no file
    ("experiment", "recall/mqar", str(EXPERIMENTS / "recall" / "mqar.yaml")),
    ("experiment", str(EXPERIMENTS / "paper" / "small" / "satformer.yaml"),  # a generated one's path (a trial's base)
     str(EXPERIMENTS / "paper" / "small" / "satformer.yaml")),
    ("experiment", "./mine/p.yaml", "mine/p.yaml"),
    ("experiment", "mine/p.yaml", "mine/p.yaml"),  # a YAML suffix makes it a path
    ("experiment", "{tmp}/mine/p.yaml", "{tmp}/mine/p.yaml"),
    ("sweep", "lr_tiny", str(SWEEPS / "lr_tiny.yaml")),
    ("sweep", "./mine/s.yaml", "mine/s.yaml"),
    ("sweep", "{tmp}/mine/s.yaml", "{tmp}/mine/s.yaml"),
    ("ablation", "arch_tiny", str(ABLATIONS / "arch_tiny.yml")),
    ("ablation", "mine/a.yml", "mine/a.yml"),
    ("ablation", "{tmp}/mine/a.yml", "{tmp}/mine/a.yml"),
]


@pytest.mark.parametrize(("kind", "given", "expected"), FOUND)
def test_a_name_or_a_path_finds_its_file(files: Path, kind: str, given: str, expected: str) -> None:
    path = resolve(kind, given.format(tmp=files))
    assert path.resolve() == Path(expected.format(tmp=files)).resolve()


REFUSED = [  # (kind, what a user types, what the message must say)
    ("experiment", "defualt", ["did you mean 'default'", "tiny/<arch>", "recall/mqar"]),
    ("experiment", "tiny/satfomer", ["did you mean 'tiny/satformer'", "tiny/transformer"]),
    ("sweep", "lr_tny", ["unknown sweep spec 'lr_tny'", "did you mean 'lr_tiny'", "lr_paper_small", str(SWEEPS)]),
    ("ablation", "arch_tny", ["unknown ablation spec 'arch_tny'", "did you mean 'arch_tiny'", "gate_fn"]),
    ("ablation", "./nowhere.yml", ["ablation spec file not found: './nowhere.yml'"]),
    ("sweep", "{tmp}/nowhere.yaml", ["sweep spec file not found"]),
    ("ablation", "sub/../../../etc/passwd", ["leaves", "give a file elsewhere as a path"]),
    ("experiment", "tiny", ["'tiny' is a folder of experiment presets", "e.g. tiny/attnres", "satformer"]),
    ("ablation", "./mine", ["'./mine' is a folder, not a YAML file", "a.yml", "p.yaml"]),
    ("experiment", "{tmp}/mine/", ["is a folder, not a YAML file"]),
    ("sweep", "   ", ["the sweep is empty: give a sweep spec name (lr_paper_small", "path of a YAML"]),
]


@pytest.mark.parametrize(("kind", "given", "says"), REFUSED)
def test_what_is_no_file_of_its_kind_is_refused_with_the_valid_names(files: Path, kind: str, given: str,
                                                                   says: list[str]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve(kind, given.format(tmp=files))
    message = str(excinfo.value)
    assert all(s in message for s in says), message
    assert len(message) < 1200 and "\n" not in message


WRONG_KIND = [  # (the command, the file of another kind, what the message says)
    (["ablate", "{sweeps}/lr_tiny.yaml"], "is a sweep spec (it has n_trials, objective, pruner, sampler), not an "
                                          "ablation spec: run it with satlab sweep"),
    (["sweep", "mine/a.yml"], "is an ablation spec (it has axes), not a sweep spec: run it with satlab ablate"),
    (["ablate", "mine/p.yaml"], "is an experiment preset (it has model), not an ablation spec: run it with satlab "
                                "train experiment="),
    (["train", "experiment=mine/s.yaml", "--dry-run"], "is a sweep spec (it has n_trials, space), not an experiment "
                                                       "preset: run it with satlab sweep mine/s.yaml"),
    (["report", "mine/s.yaml"], "is a sweep spec"),
]


@pytest.mark.parametrize(("argv", "says"), WRONG_KIND)
def test_a_file_of_another_kind_names_its_kind_and_its_command(files: Path, argv: list[str], says: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(sweeps=SWEEPS) for a in argv]
    assert satlab_main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert says in " ".join(err.split()), err
    assert sorted(p.name for p in files.iterdir()) == ["mine"]  # nothing written


def test_every_command_resolves_through_the_one_resolver(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train (a preset and its ``base:``), sweep, ablate and an ablation's ``compare_with`` find files where the
    resolver's folders say, so moving a folder (its environment variable) moves every command's names."""
    presets, sweeps = files / "presets", files / "sweeps"
    (presets / "ablations").mkdir(parents=True)
    sweeps.mkdir()
    (presets / "solo.yaml").write_text("base: ./parent\n")
    (presets / "parent.yaml").write_text("name: solo\nmodel:\n  arch: transformer\n")
    (presets / "ablations" / "seeds.yml").write_text(ABLATION.replace("tiny/transformer", "solo")
                                                     + "compare_with: other\n")
    (presets / "ablations" / "other.yml").write_text(ABLATION.replace("tiny/transformer", "solo"))
    (sweeps / "lr.yaml").write_text(SWEEP.replace("tiny/transformer", "solo"))
    monkeypatch.setenv("SATLAB_EXPERIMENTS_DIR", str(presets))
    monkeypatch.setenv("SATLAB_SWEEPS_DIR", str(sweeps))
    assert load_experiment("solo").name == "solo"
    assert load_sweep("lr").base_path() == (presets / "solo.yaml").resolve()
    assert load_ablation("seeds").compare_with == "other"
    with pytest.raises(ConfigError, match="compare_with: unknown ablation spec 'nope'.*valid: other, seeds"):
        load_ablation("seeds", ["compare_with=nope"])
    with pytest.raises(ConfigError, match=r"unknown experiment preset 'tiny/satformer'.*presets in .*presets"):
        load_experiment("tiny/satformer")  # the repository's presets are not looked at any more


def test_kinds_marks_are_the_spec_classes_own_fields() -> None:
    """satlab.config cannot import the spec classes (they are above it): each kind's marks are checked here to be
    fields of its class only, so a file of one kind is never taken for another's."""
    fields = {cls.kind: {f.name for f in dataclasses.fields(cls)} for cls in (SweepSpec, AblationSpec)}
    for kind, own in fields.items():
        other = set().union(*(f for k, f in fields.items() if k != kind))
        assert set(KINDS[kind].marks) <= own - other, kind
    assert not set(KINDS["experiment"].marks) & set().union(*fields.values())


def test_a_list_of_valid_names_is_cut_to_a_readable_length() -> None:
    many = [f"name_{i:04d}" for i in range(2000)]
    text = listing(many)
    assert text.startswith("name_0000, name_0001") and text.endswith("more") and len(text) < 500
    assert f"and {2000 - text.count(',')} more" in text  # every name shown or counted
    message = unknown_name("thing", "x" * 10_000, many + ["y" * 5000])
    assert len(message) < 1000 and "(10,000 characters)" in message
    assert listing(["a", "b"]) == "a, b" and listing(["a", "b", "c"], most=2) == "a, b, ... and 1 more"


def test_read_spec_takes_the_name_from_the_file(files: Path) -> None:
    path, data = read_spec("ablation", "mine/a.yml")
    assert path == Path("mine/a.yml") and data["name"] == "a"


MICRO = {  # the smallest cell that trains (tests/test_ablate.py's)
    "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.mlp_hidden": 64,
    "data.source": "kjv", "data.tokenizer.kind": "byte", "data.seq_len": 64,
    "train.micro_batch_size": 4, "train.global_batch_tokens": 256, "train.max_tokens": 512,
    "train.val_every_tokens": 512, "train.val_tokens": 256, "train.accelerator": "cpu", "eval.at_end": False,
}


@pytest.mark.slow  # make test-full
@pytest.mark.process
def test_report_finds_an_ablation_run_from_a_spec_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`satlab ablate specs/frompath.yml`, then `satlab report frompath` (no spec of that name in the ablations
    folder: its study in reports/ablations/frompath names the parent run and its store), `satlab report
    specs/frompath.yml`, and by name with the study gone (the parent run in the MLflow store)."""
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    overrides = {**MICRO, "train.out_dir": str(tmp_path / "runs"), "data.cache_dir": str(tmp_path.parent / "cache")}
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "frompath.yml").write_text(yaml.safe_dump(
        {"base": "default", "overrides": overrides, "axes": {"train.seed": [0]}}))
    assert satlab_main(["ablate", "specs/frompath.yml", "--no-report"]) == 0
    assert not (ABLATIONS / "frompath.yml").exists()
    out = tmp_path / "reports" / "ablations" / "frompath"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # by name, the study says which store
    for target, folder in (("frompath", "by-name"), ("specs/frompath.yml", "by-path")):
        assert satlab_main(["report", target, "--out", str(tmp_path / folder)]) == 0, capsys.readouterr().err
        summary = json.loads((tmp_path / folder / "summary.json").read_text())
        assert summary["groups"] and list(summary["runs"]) == ["train.seed=0"]
    parent = json.loads((tmp_path / "by-name" / "summary.json").read_text())["runs"]
    assert parent == json.loads((tmp_path / "by-path" / "summary.json").read_text())["runs"]

    (out / "optuna.db").unlink()  # no study: the parent run of that name in the store given
    assert satlab_main(["report", "frompath", "--tracking-uri", store, "--out", str(tmp_path / "by-run")]) == 0
    assert json.loads((tmp_path / "by-run" / "summary.json").read_text())["runs"] == parent
    capsys.readouterr()
    assert satlab_main(["report", "frompth", "--tracking-uri", store]) == EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown ablation spec 'frompth'" in err and "arch_tiny" in err and "no parent run tagged" in err
    assert f"satlab.ablation=frompth in {store}" in err
