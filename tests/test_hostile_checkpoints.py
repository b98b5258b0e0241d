"""A checkpoint a user passes in is recognised before anything in it is unpickled: a pickle payload, a text file, a
foreign PyTorch file or a sharded directory with a hostile shard index is refused with satlab's own message (never
torch's advice to load with weights_only=False), and the payload never runs, for eval and for resume alike; a real
satlab checkpoint passes the scan and loads."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from satlab.cli.main import main
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.data.tokenizer import byte_tokenizer
from satlab.models import build_model
from satlab.training import checkpoint, checkpoint_scan
from satlab.training.checkpoint import KEY, load_checkpoint, satlab_entry
from satlab.training.checkpoint_scan import inspect_checkpoint_file, pickle_globals
from satlab.training.resilience import AtomicCheckpointIO
from satlab.training.run import resume_point, run_folder, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

README = Path(__file__).resolve().parent.parent / "README.md"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
        "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=8", "train.global_batch_tokens=512",
        "train.max_tokens=1024", "train.val_every_tokens=512", "train.val_tokens=512",
        "train.ckpt_every_tokens=512", "train.accelerator=cpu", "eval.at_end=false", "tracking.enabled=false"]


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tiny_config(base: Path, name: str = "real"):
    return load_experiment("default", [*TINY, f"name={name}", f"train.out_dir={base / 'runs'}",
                                       f"data.cache_dir={base / 'cache'}"])


def write_sharded(path: Path, step: int) -> None:
    """The layout model_parallel writes (as Lightning does: torch.distributed.checkpoint's save of the weights, then
    meta.pt), in this one process."""
    cfg = tiny_config(path)
    weights = {f"model.{k}": v for k, v in build_model(cfg.model).state_dict().items()}
    dcp_save({"state_dict": weights}, storage_writer=FileSystemWriter(path), no_dist=True)
    torch.save({"global_step": step, KEY: satlab_entry(cfg, byte_tokenizer())}, path / "meta.pt")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A run directory of a real (2-step) training: checkpoints/last.ckpt, step0000001.ckpt, step0000002.ckpt."""
    base = tmp_path_factory.mktemp("hostile")
    return train(tiny_config(base), progress=False).run_dir


@pytest.fixture
def unpickled(monkeypatch) -> list[str]:
    """Records every unpickling entry point that gets called (torch.load, pickle's and torch's unpicklers)."""
    calls: list[str] = []

    def recorder(name: str, real):
        if isinstance(real, type):  # torch subclasses pickle's Unpickler: still a class
            class Recorded(real):
                def __init__(self, *args, **kwargs):
                    calls.append(name)
                    super().__init__(*args, **kwargs)
            return Recorded

        def record(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return record

    for owner, name in [(torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                        (torch._weights_only_unpickler, "Unpickler")]:
        monkeypatch.setattr(owner, name, recorder(name, getattr(owner, name)))
    return calls


def payload_checkpoint(path: Path, marker: Path) -> Path:
    """A torch.save'd file that even carries the satlab entry's strings, and a payload."""
    torch.save({"state_dict": {"w": torch.ones(2)}, "x": Payload(marker),
                "satlab": {"config": "", "tokenizer": {}}}, path)
    return path


def test_a_payload_checkpoint_is_refused_by_eval_with_satlabs_message_and_never_runs(tmp_path, capsys, unpickled):
    marker = tmp_path / "pwned"
    for name, write in [("torch.ckpt", lambda p: payload_checkpoint(p, marker)),
                        ("plain.ckpt", lambda p: p.write_bytes(pickle.dumps(Payload(marker))))]:
        path = tmp_path / name
        write(path)
        assert main(["eval", f"ckpt={path}", "tasks=satlab_mqar_8", "--no-mlflow"]) == 2
        err = capsys.readouterr().err
        assert f"'{path}' cannot be read as a satlab checkpoint" in err and "nothing in it was unpickled" in err
        assert "weights_only" not in err and "touch" not in err, err
        assert ("references posix.system" in err) if name == "torch.ckpt" else ("is a plain pickle" in err)
    assert not marker.exists() and unpickled == []


def test_a_global_that_stack_global_takes_from_the_memo_is_named():
    """What an attacker may write by hand: the module and name pushed, memoized, popped, then fetched back for
    STACK_GLOBAL past a decoy. The scan names the global that a real unpickler resolves (its find_class is asked,
    and answers harmlessly here)."""
    data = (b"\x80\x04" b"\x8c\x05posix\x94" b"0" b"\x8c\x06system\x94" b"0"  # memo 0 and 1, popped
            b"\x8c\x0bcollections\x8c\x0bOrderedDict" b"0" b"0"  # a decoy pair, popped
            b"h\x00h\x01\x93" b"\x8c\x02id\x85R.")  # STACK_GLOBAL of memo 0 and 1, called
    asked = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            asked.append(f"{module}.{name}")
            return lambda *args: None

    Recorder(io.BytesIO(data)).load()
    assert pickle_globals(data)[0] == set(asked) == {"posix.system"}


@pytest.mark.parametrize("kind", ["text", "readme", "empty"])
def test_a_text_file_or_readme_is_refused_with_a_clear_reason(kind, tmp_path, capsys, unpickled):
    path = {"text": tmp_path / "notes.txt", "readme": README, "empty": tmp_path / "empty.ckpt"}[kind]
    if kind != "readme":
        path.write_text("" if kind == "empty" else "step 100: loss 2.31\n")
    assert main(["eval", f"ckpt={path}", "tasks=satlab_mqar_8", "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    reason = "it is empty" if kind == "empty" else "it is not a PyTorch checkpoint archive (a text file?)"
    assert f"cannot be read as a satlab checkpoint: {reason}" in err and "IndexError" not in err, err
    assert unpickled == []


def test_a_foreign_torch_file_is_not_a_satlab_checkpoint(tmp_path, capsys, unpickled):
    path = tmp_path / "weights.pt"
    torch.save({"layer.weight": torch.ones(3, 3), "layer.bias": torch.zeros(3)}, path)
    assert inspect_checkpoint_file(path) == ("it is a PyTorch file but not a satlab checkpoint (no 'satlab' entry "
                                             "with config and tokenizer)")
    assert main(["eval", f"ckpt={path}", "tasks=satlab_mqar_8", "--no-mlflow"]) == 2
    assert "cannot be read as a satlab checkpoint: it is a PyTorch file but not a satlab" in capsys.readouterr().err
    assert unpickled == []


def test_a_real_satlab_checkpoint_passes_the_scan_and_loads_and_a_cut_one_does_not(real_run, tmp_path):
    files = sorted((real_run / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in files] == ["last.ckpt", "step0000001.ckpt", "step0000002.ckpt"]
    assert [inspect_checkpoint_file(p) for p in files] == [None] * 3
    loaded = load_checkpoint(real_run)
    assert loaded.step == 2 and loaded.cfg.model.d_model == 32
    assert AtomicCheckpointIO().load_checkpoint(files[0])["global_step"] == 2

    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(files[0].read_bytes()[:5000])
    with pytest.raises(ConfigError, match="cannot be read as a satlab checkpoint: it is a cut-off or damaged zip"):
        load_checkpoint(cut)


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_an_archive_that_names_its_pickle_twice_is_refused(real_run, tmp_path):
    """Python's zipfile reads the last of two entries of one name, another reader may read the first: a payload
    first and the real pickle last would pass a scan of the last."""
    real = real_run / "checkpoints" / "last.ckpt"
    path = tmp_path / "twice.ckpt"
    with zipfile.ZipFile(real) as source, zipfile.ZipFile(path, "w") as archive:
        pickled = next(name for name in source.namelist() if name.endswith("/data.pkl"))
        archive.writestr(pickled, pickle.dumps(Payload(tmp_path / "pwned"), protocol=2))
        for name in source.namelist():
            archive.writestr(name, source.read(name))
    assert inspect_checkpoint_file(path) == ("it is a zip archive but not one torch.save writes (one folder with "
                                             "data.pkl)")


def test_torch_refusing_a_file_the_scan_let_through_is_reported_without_its_advice(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    path = payload_checkpoint(tmp_path / "payload.ckpt", marker)
    monkeypatch.setattr(checkpoint_scan, "inspect_checkpoint_file", lambda path: None)  # as if the scan missed it
    refused = r"cannot be read \(UnpicklingError: Weights only load failed: it references posix.system\)$"
    with pytest.raises(ConfigError, match=refused):
        load_checkpoint(path)
    with pytest.raises(ConfigError, match=refused):
        AtomicCheckpointIO().load_checkpoint(path)
    assert not marker.exists()


def test_a_payload_planted_as_last_ckpt_is_set_aside_on_resume_never_run(real_run, tmp_path, capsys, unpickled):
    marker = tmp_path / "pwned"
    runs = tmp_path / "runs"
    shutil.copytree(real_run, runs / "real")
    last = runs / "real" / "checkpoints" / "last.ckpt"
    payload_checkpoint(last, marker)
    unpickled.clear()  # torch.save above pickles; only reads count
    cfg = tiny_config(tmp_path)
    resume_from, _ = resume_point(run_folder(cfg), cfg)
    assert resume_from == runs / "real" / "checkpoints" / "step0000002.ckpt"
    assert last.with_name("last.ckpt.corrupt").exists() and not last.exists() and not marker.exists()
    err = capsys.readouterr().err
    assert "last.ckpt is unreadable (NotSatlabCheckpoint: it references posix.system" in err
    assert "kept as last.ckpt.corrupt" in err and "weights_only" not in err
    assert "load" in unpickled  # the step checkpoint was read, after its scan
    with pytest.raises(ConfigError, match="cannot be read as a satlab checkpoint: it references posix.system"):
        AtomicCheckpointIO().load_checkpoint(last.with_name("last.ckpt.corrupt"))  # what Lightning's resume calls
    assert not marker.exists()


@pytest.mark.parametrize("planted", [".metadata", "meta.pt"])
def test_a_sharded_directory_with_a_payload_index_or_meta_is_refused_before_any_unpickling(planted, tmp_path, capsys,
                                                                                           unpickled):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "shards" / "checkpoints" / "last.ckpt"
    write_sharded(ckpt, 3)
    assert load_checkpoint(ckpt).step == 3
    if planted == ".metadata":
        (ckpt / planted).write_bytes(pickle.dumps(Payload(marker)))
    else:
        payload_checkpoint(ckpt / planted, marker)
    unpickled.clear()
    where = "its shard index .metadata" if planted == ".metadata" else "its meta.pt"
    with pytest.raises(ConfigError, match=f"{where} references posix.system, which no .* contains; nothing in it"):
        load_checkpoint(ckpt)
    with pytest.raises(checkpoint.NotSatlabCheckpoint, match=f"{where} references posix.system"):
        checkpoint.load_sharded_weights(ckpt) if planted == ".metadata" else checkpoint.read_checkpoint_meta(ckpt)
    assert main(["eval", f"ckpt={ckpt}", "tasks=satlab_mqar_8", "--no-mlflow"]) == 2
    assert f"{where} references posix.system" in capsys.readouterr().err
    assert not marker.exists() and unpickled == []


def test_a_global_named_below_a_popped_mark_is_named_as_the_unpickler_would():
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    # "posix" "system", then MARK "a" "b" POP_MARK (the unpickler drops the mark and all above it), STACK_GLOBAL
    data = b"\x80\x04" + text("posix") + text("system") + b"(" + text("a") + text("b") + b"1" + b"\x93" + b")R."
    assert pickle_globals(data)[0] == {"posix.system"}
