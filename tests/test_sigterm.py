"""A SIGTERM outside Lightning's fit is never fatal (satlab/training/sigterm.py): before the fit it stops the run at
the end of its first step with its state checkpointed, and the same command resumes it to the losses of a run never
stopped; after the training it changes nothing and ``satlab train`` exits 0. The SLURM test that found it
(tests/test_slurm.py, the time limit's warning) runs the real scheduler."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import mlflow
import optuna
import pytest
import yaml
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_resilience import args_for, losses_by_step, run_named

import satlab.studies.child as child
import satlab.training.run as run_module
from satlab.cli.main import main
from satlab.config.loader import load_experiment
from satlab.studies import attrs as A
from satlab.studies.loader import load_ablation
from satlab.training.run import train
from satlab.training.sigterm import SigtermWatch, install_sigterm_watch, watching_sigterm
from satlab.training.tracking import END_TAG

SHORT = ["train.max_tokens=6144", "train.val_every_tokens=3072", "train.ckpt_every_tokens=3072", "eval.at_end=false"]
"""Six steps of test_resilience's tiny run, a validation and a checkpoint every three."""


class ReachedTheFallback(Exception):
    pass


@pytest.fixture
def fallback() -> Iterator[None]:
    """This process's SIGTERM handler while a test runs: raises, where Python's default would kill pytest, so a
    signal that satlab left unhandled fails the test instead. The process's handler is restored after."""
    def reached(signum, frame):
        raise ReachedTheFallback("SIGTERM reached the default handling: nothing in satlab was watching")

    previous = signal.signal(signal.SIGTERM, reached)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_before_the_fit_stops_it_after_one_step_and_the_same_command_resumes_exactly(
        tmp_path, monkeypatch, fallback):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    train(load_experiment("default", args_for(tmp_path, "calm", *SHORT, cache)), progress=False)
    real_schedule = run_module.derive_schedule

    def schedule_then_sigterm(*args, **kwargs):  # while the run sets up: no Lightning handler yet
        os.kill(os.getpid(), signal.SIGTERM)
        return real_schedule(*args, **kwargs)

    monkeypatch.setattr(run_module, "derive_schedule", schedule_then_sigterm)
    cfg = load_experiment("default", args_for(tmp_path, "early", *SHORT, cache))
    with pytest.raises(SIGTERMException):
        train(cfg, progress=False)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    assert run_named(client, "early").data.tags[END_TAG].startswith("KILLED at step 1: SIGTERM")
    assert (tmp_path / "runs" / "early" / "checkpoints" / "last.ckpt").exists()
    monkeypatch.setattr(run_module, "derive_schedule", real_schedule)
    train(cfg, progress=False)
    assert signal.getsignal(signal.SIGTERM).__name__ == "reached"  # train() put the process's handler back
    early, status = losses_by_step(tmp_path, "early")
    calm, _ = losses_by_step(tmp_path, "calm")
    assert status == "FINISHED" and early == pytest.approx(calm, abs=1e-6) and sorted(early) == list(range(6))


def test_a_sigterm_after_the_training_ended_leaves_the_run_finished_and_exit_code_0(tmp_path, monkeypatch, capsys,
                                                                                      fallback):
    """As when SLURM's warning before the time limit reaches a run that has just finished: the process is on its
    way out (the summary printed, MLflow closed), and before satlab watched to the end it died with 143. The
    interpreter's exit, seconds of C-level teardown where no Python handler runs, then ignores SIGTERM."""
    real_train = run_module.train

    def train_then_sigterm(*args, **kwargs):
        result = real_train(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(run_module, "train", train_then_sigterm)
    code = main(["train", "--no-progress", *args_for(tmp_path, "late", *SHORT)])
    assert code == 0 and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # and the interpreter's exit
    assert "SIGTERM arrived with no training step left to stop; the run finished" in capsys.readouterr().err
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    assert run_named(client, "late").info.status == "FINISHED"
    code = main(["train", "--no-progress", *args_for(tmp_path, "late", *SHORT)])  # and a requeue of it does nothing
    assert code == 0 and run_named(client, "late").info.status == "FINISHED"


def test_the_watch_is_shared_while_installed_and_removed_after(fallback):
    before = signal.getsignal(signal.SIGTERM)
    with watching_sigterm() as outer:
        assert isinstance(outer, SigtermWatch) and signal.getsignal(signal.SIGTERM) is outer
        with watching_sigterm() as inner:
            assert inner is outer
        os.kill(os.getpid(), signal.SIGTERM)
        assert outer.received and signal.getsignal(signal.SIGTERM) is outer
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []
    thread = threading.Thread(target=lambda: seen.append(watching_sigterm().__enter__()))
    thread.start()
    thread.join()
    assert seen == [None]  # Python allows no handler off the main thread: left as it was


@pytest.mark.parametrize("when", ["after its run", "before its fit"])
def test_a_study_trial_process_handles_sigterm_as_satlab_train_does(tmp_path, monkeypatch, fallback, when):
    """A study's trial process (satlab/studies/child.py) under the same SIGTERM: after its run it reports the run's
    value (exit 0, the cell done; the SLURM pre-emption test saw it killed on its way out, its finished cell marked
    interrupted and taken again); before its fit it stops after one step with a checkpoint and exit 75 (the driver
    records the cell interrupted, and the next attempt resumes it)."""
    spec_file = tmp_path / "late.yml"
    spec_file.write_text(yaml.safe_dump({"name": "late", "base": "default", "axes": {"train.seed": [0]}}))
    spec = load_ablation(spec_file)
    cfg = load_experiment("default", args_for(tmp_path, "trial", *SHORT, f"data.cache_dir={tmp_path / 'cache'}"))
    trial = optuna.create_study().ask()
    real_train, real_schedule = child.train, run_module.derive_schedule

    def train_then_sigterm(*args, **kwargs):
        result = real_train(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    def schedule_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_schedule(*args, **kwargs)

    if when == "after its run":
        monkeypatch.setattr(child, "train", train_then_sigterm)
    else:
        monkeypatch.setattr(run_module, "derive_schedule", schedule_then_sigterm)
    code = child.train_trial(cfg, spec, trial, True, lambda reason: None, install_sigterm_watch())
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    if when == "after its run":
        assert code == A.EXIT_COMPLETE and trial.user_attrs[A.VALUE] > 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # and the interpreter's exit
        assert run_named(client, "trial").info.status == "FINISHED"
    else:
        assert code == A.EXIT_INTERRUPTED == 75 and A.VALUE not in trial.user_attrs
        assert run_named(client, "trial").data.tags[END_TAG].startswith("KILLED at step 1: SIGTERM")
        assert (tmp_path / "runs" / "trial" / "checkpoints" / "last.ckpt").exists()
