"""Sharded checkpoints (train.strategy model_parallel and fsdp): written atomically, found by resume, never renamed
corrupt, resumed to exactly the losses of an uninterrupted run after a SIGKILL of every rank, and evaluated in one
process.

The unit tests write real sharded checkpoints through the strategies satlab trains with, in this one process (no
process group): that also covers Lightning's FSDP layout, which needs GPUs to train."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
from test_distributed import TINY, free_port  # the tiny gloo config and a free MASTER_PORT
from test_resilience import losses_by_step

from satlab.cli.main import main
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.data.tokenizer import byte_tokenizer
from satlab.models import build_model
from satlab.training import resilience
from satlab.training.checkpoint import KEY, load_checkpoint, satlab_entry
from satlab.training.parallel import make_strategy
from satlab.training.resilience import (
    AtomicCheckpointIO,
    find_resume_checkpoint,
    readable,
    remove_partial_checkpoints,
)
from satlab.training.run import check_resumable, resume_point, run_folder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant

MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "model.vocab_size=258",
         "data.tokenizer.kind=byte"]


def config(strategy: str = "model_parallel", *extra: str):
    return load_experiment("default", [*MODEL, f"train.strategy={strategy}", *extra])


def save_sharded(path, step: int, strategy: str = "model_parallel") -> dict[str, torch.Tensor]:
    """What a run of ``strategy`` writes at ``path`` (minus the other ranks' shards); returns the weights."""
    cfg = config(strategy)
    torch.manual_seed(step)
    weights = {f"model.{k}": v for k, v in build_model(cfg.model).state_dict().items()}
    make_strategy(cfg).save_checkpoint({"state_dict": dict(weights), "optimizer_states": [], "global_step": step,
                                        KEY: satlab_entry(cfg, byte_tokenizer())}, path)
    return weights


def test_resume_takes_the_complete_sharded_directory_of_the_highest_step_and_renames_none(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    save_sharded(folder / "last.ckpt", 4)
    save_sharded(folder / "step0000004.ckpt", 4)
    save_sharded(folder / "step0000006.ckpt", 6)
    save_sharded(folder / "step0000008.ckpt", 8)
    (folder / "step0000008.ckpt" / "meta.pt").unlink()  # as a writer that is not atomic leaves it when killed
    save_sharded(folder / "step0000009.ckpt", 9)
    shard = folder / "step0000009.ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    save_sharded(folder / ".step0000010.ckpt.tmp-4242", 10)  # complete, but never renamed into place
    (folder / "step0000007.ckpt").write_bytes(b"not a checkpoint")

    assert readable(folder / "step0000006.ckpt") == (6, None)
    assert find_resume_checkpoint(folder) == folder / "step0000006.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == [
        ".step0000010.ckpt.tmp-4242", "last.ckpt", "step0000004.ckpt", "step0000006.ckpt", "step0000007.ckpt.corrupt",
        "step0000008.ckpt", "step0000009.ckpt"]
    err = capsys.readouterr().err
    assert "step0000008.ckpt is not usable (ValueError: it is an incomplete sharded checkpoint (no meta.pt" in err
    assert "step0000009.ckpt is not usable (ValueError: its shard __0_0.distcp is cut short" in err
    assert "step0000007.ckpt is unreadable" in err and "tmp-4242" not in err

    assert remove_partial_checkpoints(folder) == [".step0000010.ckpt.tmp-4242"]
    assert find_resume_checkpoint(folder) == folder / "step0000006.ckpt"


def test_a_save_cut_off_midway_leaves_the_previous_checkpoint_in_place(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    save_sharded(folder / "last.ckpt", 4)

    save = torch.save

    def killed(obj, f, *args, **kwargs):  # the shards and their index are written; the process dies before meta.pt
        if isinstance(f, os.PathLike) and Path(f).name == "meta.pt":
            raise KeyboardInterrupt
        return save(obj, f, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            save_sharded(folder / "last.ckpt", 5)
    partial = [p.name for p in folder.iterdir() if p.name.startswith(".last.ckpt.tmp-")]
    assert len(partial) == 1 and (folder / partial[0] / ".metadata").is_file()
    assert find_resume_checkpoint(folder) == folder / "last.ckpt" and readable(folder / "last.ckpt") == (4, None)

    rename = os.rename

    def rename_then_die(src, dst):  # dies between the two renames of the replace
        if Path(src).name.startswith(".last.ckpt.tmp-"):
            raise KeyboardInterrupt
        rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(resilience.os, "rename", rename_then_die)
        with pytest.raises(KeyboardInterrupt):
            save_sharded(folder / "last.ckpt", 6)
    assert not (folder / "last.ckpt").exists()
    assert find_resume_checkpoint(folder) == folder / "last.ckpt"  # the replaced one, renamed back
    assert readable(folder / "last.ckpt") == (4, None)
    assert remove_partial_checkpoints(folder) == partial  # one name: the second write (same PID) replaced it
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]

    save_sharded(folder / "last.ckpt", 7)  # a replace that completes
    assert readable(folder / "last.ckpt") == (7, None) and sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


def test_removing_a_sharded_checkpoint_renames_it_aside_first(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    save_sharded(folder / "step0000002.ckpt", 2)
    save_sharded(folder / "step0000004.ckpt", 4)
    with monkeypatch.context() as patch:
        patch.setattr(resilience.shutil, "rmtree", lambda path: (path / "meta.pt").unlink() or 1 / 0)
        with pytest.raises(ZeroDivisionError):
            AtomicCheckpointIO().remove_checkpoint(folder / "step0000004.ckpt")  # keep_last_k's delete, cut off
    assert find_resume_checkpoint(folder) == folder / "step0000002.ckpt"
    assert [name.split("-")[0] for name in remove_partial_checkpoints(folder)] == [".step0000004.ckpt.removed"]
    AtomicCheckpointIO().remove_checkpoint(folder / "step0000002.ckpt")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("strategy", ["model_parallel", "fsdp"])
def test_a_sharded_checkpoint_loads_whole_in_one_process(tmp_path, strategy):
    weights = save_sharded(tmp_path / "run" / "checkpoints" / "last.ckpt", 3, strategy)
    loaded = load_checkpoint(tmp_path / "run")
    assert loaded.step == 3 and loaded.path == tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = loaded.model.state_dict()
    assert state.keys() == {k.removeprefix("model.") for k in weights}
    assert all(torch.equal(state[k.removeprefix("model.")], v) for k, v in weights.items())


def test_an_incomplete_sharded_checkpoint_is_a_clear_error_for_eval_and_resume(tmp_path, capsys):
    ckpt = tmp_path / "runs" / "shards" / "checkpoints" / "last.ckpt"
    save_sharded(ckpt, 3)
    (ckpt / ".metadata").unlink()
    with pytest.raises(ConfigError, match="cannot be read .*incomplete sharded checkpoint .*no .metadata"):
        load_checkpoint(ckpt)
    assert main(["eval", f"ckpt={ckpt.parent.parent}", "tasks=satlab_mqar_8", "--no-mlflow"]) == 2
    assert "incomplete sharded checkpoint" in capsys.readouterr().err

    cfg = config("model_parallel", f"train.out_dir={tmp_path / 'runs'}", "name=shards")
    with pytest.raises(ConfigError, match=r"unreadable or incomplete \(last.ckpt\)"):
        resume_point(run_folder(cfg), cfg)
    assert sorted(p.name for p in ckpt.iterdir()) == ["__0_0.distcp", "meta.pt"]  # left as it was


def test_a_sharded_checkpoint_resumes_only_under_the_strategy_that_reads_its_layout(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    save_sharded(ckpt, 3)
    assert check_resumable(ckpt, config("model_parallel", "train.devices=2", "train.micro_batch_size=16"),
                            byte_tokenizer()) == 3  # another world size: DCP reshards
    for other in ("ddp", "fsdp"):
        with pytest.raises(ConfigError, match="strategy=model_parallel writes it, which only that strategy can"):
            check_resumable(ckpt, config(other), byte_tokenizer())


STEPS = 8
SHARDED = [f"train.max_tokens={STEPS * 512}", "train.val_every_tokens=1024", "train.ckpt_every_tokens=1024",
           "train.keep_last_k=2", "train.deterministic=true", "train.devices=2", "train.strategy=model_parallel"]


@pytest.fixture
def processes():
    """Every training started here; whatever still runs at the end is killed with its whole process group (rank 1
    is rank 0's child)."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch(processes: list, base, cache, log) -> subprocess.Popen:
    """`satlab train` of two gloo ranks in a session of its own, so a kill of its group stops both ranks."""
    args = [*TINY, *SHARDED, "name=sharded", f"data.cache_dir={cache}", f"train.out_dir={base / 'runs'}",
            f"tracking.uri=sqlite:///{base / 'mlruns' / 'mlflow.db'}"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    base.mkdir(parents=True, exist_ok=True)  # the store's folder is made only inside one that exists
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "satlab.cli.main", "train", "--no-progress", *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    processes.append(proc)
    return proc


def finish(proc: subprocess.Popen, log) -> None:
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]


@pytest.mark.slow  # make test-full (~65 s)
@pytest.mark.process
def test_two_ranks_killed_then_resumed_from_sharded_checkpoints_match_an_uninterrupted_run(tmp_path, processes,
                                                                                        monkeypatch):
    cache, whole, killed = tmp_path / "cache", tmp_path / "whole", tmp_path / "killed"
    reference = launch(processes, whole, cache, tmp_path / "whole.log")  # alongside, to keep the wall time down
    proc = launch(processes, killed, cache, tmp_path / "killed.log")
    checkpoints = killed / "runs" / "sharded" / "checkpoints"
    deadline = time.time() + 180
    while not list(checkpoints.glob("step*.ckpt")):  # a step checkpoint's name appears only once it is complete
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    deadline = time.time() + 5
    while not list(checkpoints.glob(".*.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)  # kill in the middle of the next write (last.ckpt's follows at once) where it can
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    interrupted, _ = losses_by_step(killed, "sharded")
    assert len(interrupted) < STEPS, "the kill must land before the run finished"
    steps = [p for p in checkpoints.glob("step*.ckpt") if p.is_dir()]
    assert steps and all((p / "meta.pt").is_file() for p in steps)
    checkpoint_step = min(int(p.stem.removeprefix("step")) for p in steps)

    resumed_log = tmp_path / "resumed.log"
    finish(launch(processes, killed, cache, resumed_log), resumed_log)
    finish(reference, tmp_path / "whole.log")
    expected, _ = losses_by_step(whole, "sharded")
    resumed, status = losses_by_step(killed, "sharded")  # asserts one MLflow run: a restart would open a second
    assert status == "FINISHED" and len(expected) == STEPS
    assert set(range(checkpoint_step, STEPS)) <= set(resumed) <= set(range(STEPS))
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx([expected[s] for s in sorted(resumed)], abs=1e-6)
    assert not list(checkpoints.parent.rglob("*.corrupt")) and "unreadable" not in resumed_log.read_text()
    # only directories, no leftovers, keep_last_k=2 (the checkpoint resumed from stays: Lightning never deletes it)
    names, kept = {p.name for p in checkpoints.iterdir()}, {"last.ckpt", "step0000006.ckpt", "step0000008.ckpt"}
    assert all(p.is_dir() for p in checkpoints.iterdir())
    assert kept <= names <= kept | {f"step{checkpoint_step:07d}.ckpt"}

    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)  # torch's collect_env: seconds
    threads = torch.get_num_threads()
    try:
        assert main(["eval", f"ckpt={checkpoints.parent}", "tasks=satlab_mqar_8", "limit=1", "threads=1"]) == 0
    finally:
        torch.set_num_threads(threads)
    client = mlflow.MlflowClient(f"sqlite:///{killed / 'mlruns' / 'mlflow.db'}")
    run_id = client.search_runs([client.get_experiment_by_name("default").experiment_id])[0].info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "zero_shot/satlab_mqar_8/acc")] == [STEPS]
