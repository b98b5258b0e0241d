"""The bad-input catalogue: every mistake gets one clear message that names the bad value and what is valid, exit
code 2, and nothing written (no run folder, no MLflow store)."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest

from satlab.cli.main import main

# (id, arguments after `satlab`, fragments the message must contain)
TRAIN_CASES = [
    ("top-level key typo", ["optimm.lr=1e-3"], ["optimm", "did you mean 'optim'"]),
    ("nested key typo", ["optim.lrr=1e-3"], ["optim.lrr", "did you mean 'lr'"]),
    ("model key typo", ["model.n_head=4"], ["n_head", "did you mean 'n_heads'"]),
    ("int field given text", ["train.max_tokens=lots"], ["train.max_tokens", "lots"]),
    ("bool field given text", ["train.compile=maybe"], ["train.compile", "maybe"]),
    ("negative learning rate", ["optim.lr=-0.001"], ["optim.lr", "-0.001"]),
    ("zero token budget", ["train.max_tokens=0"], ["train.max_tokens", "0"]),
    ("warmup fraction above 1", ["optim.warmup_fraction=1.5"], ["warmup_fraction", "1.5"]),
    ("beta outside [0, 1)", ["optim.betas=[0.9,1.5]"], ["optim.betas", "1.5"]),
    ("heads not dividing d", ["model.n_heads=5"], ["n_heads=5", "d_model=128", "valid head counts"]),
    ("GQA not dividing heads", ["model.n_kv_heads=3"], ["n_kv_heads=3", "n_heads=4", "valid: 1, 2, 4"]),
    ("sequence longer than RoPE", ["data.seq_len=4096"], ["seq_len", "4096", "max_seq_len"]),
    ("unknown architecture", ["model.arch=satformr"], ["satformr", "did you mean 'satformer'", "transformer"]),
    ("unknown gate function", ["model.satformer.gate_fn=gelu"], ["gelu", "relu", "softmax_sigmoid"]),
    ("unknown gate granularity", ["model.satformer.gate_granularity=token_heads"],
     ["token_heads", "did you mean 'token_head'"]),
    ("last_k beyond depth", ["model.satformer.last_k=9"], ["last_k=9", "n_layers-1=5"]),
    ("unknown size", ["model.size=huge"], ["huge", "tiny", "xl"]),
    ("unknown precision", ["train.precision=fp8"], ["fp8", "bf16-mixed", "32-true"]),
    ("unknown strategy", ["train.strategy=deepspeed"], ["deepspeed", "model_parallel", "fsdp"]),
    ("unknown tokenizer kind", ["data.tokenizer.kind=wordpiece"], ["wordpiece", "bpe", "byte"]),
    ("unknown resume mode", ["train.resume=sometimes"], ["sometimes", "auto", "never"]),
    ("global batch not divisible", ["train.global_batch_tokens=10000"], ["10000", "nearest valid"]),
    ("malformed override", ["optim.lr"], ["optim.lr", "key=value"]),
    ("unknown preset", ["experiment=tiny/transformr"], ["tiny/transformr", "tiny/transformer"]),
    ("missing preset file", ["experiment=./nowhere.yaml"], ["nowhere.yaml"]),
    ("unknown data mix source", ["data.mix.recal=0.1"], ["recal", "did you mean 'recall'"]),
    ("data mix share out of range", ["data.mix.recall=0.9"], ["data.mix.recall", "(0, 0.5]"]),
    ("missing local data files", ["data.source_kind=files", "data.source=/nonexistent/corpus/*.txt"],
     ["/nonexistent/corpus/*.txt"]),
    ("misspelt embedded corpus", ["data.source=shakespear"], ["shakespear", "shakespeare"]),
    ("plain-folder tracking store", ["tracking.uri=./mlruns-folder"], ["mlruns-folder", "sqlite:///"]),
    ("unknown synthetic task", ["data.source=synthetic:mqr"], ["mqr", "did you mean 'mqar'", "synthetic:mqar"]),
    ("unknown recall layout", ["data.source=synthetic:mqar", "data.mqar.layout=interleaved"],
     ["interleaved", "adjacent", "separated", "multi_token_key"]),
    ("recall sequence too short", ["data.source=synthetic:mqar", "data.seq_len=16", "data.mqar.num_pairs=8"],
     ["data.seq_len=16", "needs >= 24", "num_pairs"]),
    ("more recall pairs than keys", ["data.source=synthetic:mqar", "data.mqar.vocab_size=10",
                                     "data.mqar.num_pairs=6"], ["num_pairs=6", "4 key and 4 value tokens"]),
    ("recall stop accuracy above 1", ["data.source=synthetic:mqar", "data.mqar.stop_at_acc=1.5"],
     ["stop_at_acc", "(0, 1]", "1.5"]),
    ("data mix on a synthetic source", ["data.source=synthetic:mqar", "data.mix.recall=0.1"],
     ["data.mix", "synthetic source"]),
    ("unknown parametrisation", ["model.parametrization=mupp"], ["mupp", "did you mean 'mup'", "completep, mup, sp"]),
    ("depth alpha above 1", ["model.depth_alpha=2"], ["model.depth_alpha must be in [0.5, 1], got 2", "CompleteP"]),
    ("depth alpha below 0.5", ["model.depth_alpha=0.25"], ["model.depth_alpha", "[0.5, 1]", "0.25"]),
    ("zero base width", ["model.base_width=0"], ["model.base_width must be an integer in [1, 65,536], got 0"]),
    ("zero base depth", ["model.base_depth=0"], ["model.base_depth must be an integer in [1, 4,096], got 0"]),
    ("base width in no whole number of heads", ["model.parametrization=completep", "model.base_width=100"],
     ["model.base_width=100", "head dim d_model/n_heads = 32", "multiples of 32"]),
    ("negative MLP width", ["model.mlp_hidden=-1"],
     ["model.mlp_hidden must be an integer in [0, 1,048,576], got -1; 0 means no MLP sublayer"]),
    ("run name that climbs out of the runs folder", ["name=../evil"], ["'../evil'", "letters, digits"]),
    ("absurd token budget", ["train.max_tokens=1e30"], ["train.max_tokens", "[1, 1e+15]", "got 1" + "0" * 30]),
    ("learning rate that is not a number", ["optim.lr=nan"], ["optim.lr", "(0, 10]", "nan"]),
    ("infinite learning rate", ["optim.lr=inf"], ["optim.lr", "(0, 10]", "inf"]),
    ("learning rate no one means", ["optim.lr=5e3"], ["optim.lr", "(0, 10]", "5000"]),
    ("negative seed", ["train.seed=-1"], ["train.seed must be an integer in [0, 4,294,967,295], got -1"]),
    ("absurd model width", ["model.d_model=1000000"], ["model.d_model", "[1, 65,536]", "1000000"]),
    ("zero init std", ["model.init_std=0"], ["model.init_std", "(0, 10]"]),
    ("zero embedding init std", ["model.embed_init_std=0"],
     ["model.embed_init_std must be in (0, 100], got 0.0; null means model.init_std"]),
    ("infinite rope theta", ["model.rope_theta=inf"], ["model.rope_theta", "inf"]),
    ("absurd hyper-connection expansion", ["model.hyperconnections.expansion=1000"], ["expansion", "[1, 64]"]),
    ("more data workers than cores could use", ["data.num_workers=100000"], ["data.num_workers", "[0, 256]"]),
    ("zero validation budget", ["train.val_tokens=0"], ["train.val_tokens", "[1, 1e+12]"]),
    ("run name with a slash", ["name=a/b"], ["'a/b'", "'.', '_' and '-'"]),
    ("run name that is a dot", ["name=."], ["'.'", "not '.' or '..'"]),
    ("run name with a space", ["name=my run"], ["'my run'", "1 to 200"]),
    # empty, null and wrongly shaped values (<in> is a folder of the test's input files, see INPUTS)
    ("empty run name", ["name="], ["name ''", "letters, digits"]),
    ("null run name", ["name=null"], ["name ''", "letters, digits"]),
    ("empty learning rate", ["optim.lr="], ["optim.lr has no value", "a number", "0.003"]),
    ("empty architecture", ["model.arch="], ["unknown architecture (model.arch) ''", "satformer", "transformer"]),
    ("empty device count", ["train.devices="], ["train.devices has no value", "an integer"]),
    ("empty task list", ["eval.tasks="], ["eval.tasks has no value", "list[str]"]),
    ("list where one number goes", ["optim.lr=[1e-3,1e-4]"], ["optim.lr takes a number", "got a list"]),
    ("mapping where one text goes", ["name={a: 1}"], ["name takes a text", "got a mapping"]),
    ("empty data source", ["data.source="], ["data.source is empty", "shakespeare"]),
    ("empty cache folder", ["data.cache_dir="], ["data.cache_dir is empty"]),
    ("empty run folder", ["train.out_dir="], ["train.out_dir is empty"]),
    ("unknown accelerator", ["train.accelerator=gpux"], ["gpux", "cuda", "cpu"]),
    ("override of ten megabytes", ["description=" + "x" * 10_000_000], ["10,000,012 characters", "at most 10,000"]),
    # vocabulary bounds known before any data is read (the corpus' own bound: test_a_vocabulary_larger_than...)
    ("BPE vocabulary within the byte alphabet", ["data.tokenizer.vocab_size=258"], ["vocab_size=258", ">= 259"]),
    ("BPE vocabulary above the ceiling", ["data.tokenizer.vocab_size=10000001"],
     ["data.tokenizer.vocab_size", "[1, 1e+07]", "10000001"]),
    # experiment files and names
    ("empty experiment", ["experiment="], ["experiment is empty", "preset name"]),
    ("binary experiment file", ["experiment=<in>/binary.yaml"], ["binary.yaml is not UTF-8 text", "offset 0"]),
    ("experiment holding a number", ["experiment=<in>/scalar.yaml"],
     ["scalar.yaml holds a single value", "not a satlab experiment"]),
    ("experiment holding a list", ["experiment=<in>/list.yaml"], ["list.yaml holds a list", "mapping of keys"]),
    ("experiment of ten megabytes", ["experiment=<in>/huge.yaml", "--dry-run"], ["huge.yaml is 10,000,011 bytes",
                                                                                "at most 1 MiB"]),
    ("YAML syntax error", ["experiment=<in>/syntax.yaml"], ["syntax.yaml, line 4, column 10: invalid YAML",
                                                            "expected ',' or ']'"]),
    ("experiment that is a folder", ["experiment=<in>"], ["is a folder, not a YAML file"]),
    ("experiment that is a symlink loop", ["experiment=<in>/loop.yaml"], ["loop.yaml", "symbolic links"]),
    ("experiment that is a pipe", ["experiment=<in>/fifo.yaml"], ["fifo.yaml is not a regular file"]),
    ("experiment nested too deeply", ["experiment=<in>/deep.yaml"], ["deep.yaml: invalid YAML", "nests deeper"]),
    ("a YAML file that is no experiment", ["experiment=<in>/foreign.yaml"],
     ["foreign.yaml is not a satlab experiment", "none of its 2 top-level key(s)"]),
    ("a system file as experiment", ["experiment=../../../../../../../../../../etc/passwd"],
     ["etc/passwd holds a single value", "not a satlab experiment"]),
    ("preset name that climbs out", ["experiment=tiny/../../../etc/passwd"],
     ["'tiny/../../../etc/passwd' leaves", "experiments", "as a path"]),
    ("base preset that climbs out", ["experiment=<in>/climb.yaml"], ["climb.yaml: base preset name", "leaves"]),
]
NEVER_ECHOED = ["root:x:0:0", "SECRET_TOKEN", "hunter2", "x" * 41]
"""Content of the input files (and of the long override) that a message must never quote."""
INPUTS = {
    "binary.yaml": b"\xca\xfe\xba\xbe" + bytes(range(256)) * 4,
    "scalar.yaml": b"5\n",
    "list.yaml": b"- a\n- b\n",
    "huge.yaml": b"name: huge\n" + b"# padding\n" * 1_000_000,
    "syntax.yaml": b"name: x\nmodel:\n  arch: [satformer\n  d_model: 64\n",
    "foreign.yaml": b"services:\n  SECRET_TOKEN: hunter2\nversion: 3\n",
    "climb.yaml": b"base: tiny/../../../../etc/passwd\n",
    "deep.yaml": b"a: " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
}


def run_cli(argv: list[str], tmp_path, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def isolated(tmp_path, *args: str) -> list[str]:
    return ["train", *args, f"train.out_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"]


def files_under(folder) -> set:
    return {p for p in folder.rglob("*") if p.is_file() or p.is_symlink()}


def assert_nothing_written(tmp_path, inputs: set | None = None) -> None:
    """No run folder (so no checkpoint), no MLflow store, no file in the data cache (corpus, tokenizer, tokens) or
    in the studies' folder (Optuna storage, logs); with ``inputs`` (the files the test made), no file at all besides
    them under ``tmp_path``. Empty folders may be left."""
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "mlruns").exists()
    for folder in (tmp_path / "cache", tmp_path / "studies"):
        assert not folder.exists() or not files_under(folder), sorted(folder.rglob("*"))
    if inputs is not None:
        assert files_under(tmp_path) == inputs, sorted(files_under(tmp_path) - inputs)


def with_inputs(args: list[str], tmp_path) -> tuple[list[str], set]:
    """``args`` with ``<in>`` replaced by a folder holding the :data:`INPUTS` they name (and ``loop.yaml``, a
    symbolic link to itself; ``fifo.yaml``, a named pipe), and the set of those files."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name, content in INPUTS.items():
        if any(f"<in>/{name}" in a for a in args):
            (folder / name).write_bytes(content)
    (folder / "loop.yaml").symlink_to(folder / "loop.yaml")
    if any("<in>/fifo.yaml" in a for a in args):
        os.mkfifo(folder / "fifo.yaml")  # reading it would wait for a writer for ever
    return [a.replace("<in>", str(folder)) for a in args], files_under(tmp_path)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_bad_training_input_is_one_clear_usage_error(case, tmp_path, capsys, monkeypatch):
    _, args, fragments = case
    monkeypatch.chdir(tmp_path)  # what an empty folder setting would write to is watched too
    args, inputs = with_inputs(args, tmp_path)
    given = {a.partition("=")[0] for a in args}  # a case's own setting replaces the isolating one
    argv = [a for a in isolated(tmp_path, *args) if a in args or a.partition("=")[0] not in given]
    code, err = run_cli(argv, tmp_path, capsys)
    assert code == 2, err
    assert err.startswith("satlab train: error:")
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert not [text for text in NEVER_ECHOED if text in err], err[:2000]
    assert_nothing_written(tmp_path, inputs)


def test_a_hub_dataset_while_offline_names_the_offline_alternatives(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = run_cli(isolated(tmp_path, "data.source=someone/some-dataset"), tmp_path, capsys)
    assert code == 2 and "someone/some-dataset" in err and "shakespeare" in err
    assert_nothing_written(tmp_path)


def test_a_hub_tokenizer_while_offline_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = run_cli(isolated(tmp_path, "data.source=kjv", "data.tokenizer.kind=hub",
                                 "data.tokenizer.name=meta-llama/Llama-2-7b-hf"), tmp_path, capsys)
    assert code == 2 and "meta-llama/Llama-2-7b-hf" in err
    assert_nothing_written(tmp_path)


def test_an_unreachable_mlflow_server_fails_fast_before_anything_is_written(tmp_path, capsys):
    argv = [a for a in isolated(tmp_path, "data.source=kjv", "data.tokenizer.kind=byte")
            if not a.startswith("tracking.uri")] + ["tracking.uri=http://127.0.0.1:9"]
    code, err = run_cli(argv, tmp_path, capsys)
    assert code == 2 and "http://127.0.0.1:9" in err and "fallback_local" in err
    assert not (tmp_path / "runs").exists()


def test_resuming_with_another_tokenizer_is_refused(tmp_path, capsys):
    from satlab.config.loader import load_experiment
    from satlab.training.run import train

    small = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
             "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_tokens=256", "train.max_tokens=512",
             "train.val_tokens=256", "name=vocab"]
    argv = isolated(tmp_path, *small)
    train(load_experiment("default", [*argv[1:], "data.tokenizer.kind=byte"]), progress=False)
    runs_before = sorted(p.name for p in (tmp_path / "runs").iterdir())
    code, err = run_cli([*argv, "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=300",
                         "train.max_tokens=1024"], tmp_path, capsys)
    assert code == 2 and "data.tokenizer.kind: byte -> bpe" in err and "train.resume=never" in err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == runs_before


@pytest.mark.parametrize("change", [["model.parametrization=completep"], ["model.base_width=64"],
                                    ["model.depth_alpha=0.5"]], ids=["parametrization", "base width", "alpha"])
def test_resuming_with_another_parametrisation_is_refused(tmp_path, capsys, change):
    """A run's learning rates, inits and multipliers follow its parametrisation and base shape: continuing it under
    others would be another experiment, refused (exit 2) with nothing written."""
    from satlab.config.loader import load_experiment
    from satlab.training.run import train

    small = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
             "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4",
             "train.global_batch_tokens=256", "train.max_tokens=256", "train.val_tokens=256", "name=param",
             "eval.at_end=false", "model.parametrization=mup", "model.base_width=32", "model.base_depth=2"]
    argv = isolated(tmp_path, *small)
    train(load_experiment("default", argv[1:]), progress=False)
    files = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs").rglob("*")
                   if p.name != ".lock")
    code, err = run_cli([*argv, *change, "train.max_tokens=512"], tmp_path, capsys)
    key = change[0].split("=")[0]
    assert code == 2 and f"{key}: " in err.split("a resume may change only")[0], err
    assert files == sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs").rglob("*")
                           if p.name != ".lock")


def test_resuming_a_finished_run_with_another_model_is_refused_and_leaves_it_as_it_was(tmp_path, capsys):
    import mlflow

    from satlab.config.loader import load_experiment
    from satlab.training.run import train

    small = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64", "data.source=kjv",
             "data.tokenizer.kind=byte", "data.seq_len=64", "train.micro_batch_size=4",
             "train.global_batch_tokens=256", "train.max_tokens=512", "train.val_tokens=256", "name=sized",
             "eval.at_end=false"]
    argv = isolated(tmp_path, *small)
    first = train(load_experiment("default", argv[1:]), progress=False)
    def run_files() -> list:  # .lock names the last process that took the lock, which the refused one did
        return sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs").rglob("*")
                      if p.name != ".lock")

    files = run_files()
    code, err = run_cli([*argv, "model.d_model=48", "optim.lr=1e-3", "train.max_tokens=1024"], tmp_path, capsys)
    assert code == 2, err
    assert "model.d_model: 32 -> 48" in err and "optim.lr: 0.003 -> 0.001" in err and "train.max_tokens" not in \
        err.split("a resume may change only")[0]
    assert "another name" in err and "train.max_tokens" in err.split("a resume may change only")[1]
    assert run_files() == files
    run = mlflow.MlflowClient(first.tracking_uri).get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    extended = train(load_experiment("default", [*argv[1:], "train.max_tokens=1024"]), progress=False)
    assert extended.mlflow_run_id == first.mlflow_run_id and extended.tokens == 1024


def test_a_run_whose_only_checkpoint_is_unreadable_is_refused_not_restarted_elsewhere(tmp_path, capsys):
    argv = isolated(tmp_path, "data.source=kjv", "data.tokenizer.kind=byte", "name=broken")
    checkpoints = tmp_path / "runs" / "broken" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"not a checkpoint")
    code, err = run_cli(argv, tmp_path, capsys)
    assert code == 2 and "run 'broken' cannot resume" in err and "last.ckpt.corrupt" in err and "remove" in err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["broken"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt.corrupt"]
    code, err = run_cli(argv, tmp_path, capsys)  # the same answer the second time
    assert code == 2 and "last.ckpt.corrupt" in err


class _Down(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # a server that answers, but not as MLflow: health checks fail with 503
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_tracking_server_that_is_down_can_fall_back_to_the_local_store(tmp_path, capsys, monkeypatch):
    from satlab.training import tracking

    server = http.server.HTTPServer(("127.0.0.1", 0), _Down)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(tracking, "default_tracking_uri", lambda: f"sqlite:///{tmp_path / 'local' / 'mlflow.db'}")
    try:
        with pytest.raises(tracking.ConfigError, match="cannot be used"):
            tracking.ensure_reachable(uri, fallback_local=False)
        assert tracking.ensure_reachable(uri, fallback_local=True).endswith("local/mlflow.db")
        assert "logging to the local store" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_bench_rejects_an_unknown_architecture(capsys):
    code = main(["bench", "--archs", "transformer,densformer"])
    err = capsys.readouterr().err
    assert code == 2 and "densformer" in err and "did you mean 'denseformer'" in err


@pytest.mark.parametrize("argv", [["bench", "--batch", "0"], ["bench", "--seq-len", "-8"], ["archs", "--seq-len", "0"]])
def test_counts_of_the_bench_and_archs_must_be_positive(argv, capsys):
    assert main(argv) == 2
    assert f"{argv[1]} must be >= 1, got {argv[2]}" in capsys.readouterr().err


def test_a_vocabulary_beyond_the_token_files_dtype_is_refused():
    from satlab.config.errors import ConfigError
    from satlab.data.packing import token_dtype

    assert token_dtype(2**16 - 1).name == "uint16" and token_dtype(2**32).name == "uint32"
    with pytest.raises(ConfigError, match="stored as uint32"):
        token_dtype(2**32 + 1)


# storage cases shared by sweeps and ablations (<tmp> is the test's folder)
STORAGE_CASES = [
    ("storage in a folder that does not exist", ["--storage", "sqlite:////nonexistent/dir/x.db"],
     ["/nonexistent/dir, does not exist", "create it first (mkdir -p /nonexistent/dir)"]),
    ("storage under a file", ["--storage", "sqlite:///<in>/scalar.yaml/x.db"], ["scalar.yaml, is a file, not a"]),
    ("storage that is a folder", ["--storage", "sqlite:///<tmp>"], ["names the folder", "optuna.db"]),
    ("in-memory storage", ["--storage", "sqlite://"], ["in-memory database", "cannot share"]),
    ("zero workers", ["--workers", "0"], ["--workers must be >= 1, got 0"]),
    ("negative workers", ["--workers", "-2"], ["--workers must be >= 1, got -2"]),
]
SWEEP_CASES = [
    ("sweep spec with an empty space", ["space=null"], ["search space is empty"]),
    ("sweep storage that is not a database URL", ["--storage", "studies/lr.journal"], ["studies/lr.journal", "sqlite:///"]),
    ("sweep storage whose server cannot be reached", ["--storage", "postgresql://satlab@127.0.0.1:9/optuna"],
     ["postgresql://satlab@127.0.0.1:9/optuna"]),
    ("no trials", ["n_trials=0"], ["n_trials must be an integer in [1, 1e+06], got 0"]),
    ("negative trials", ["n_trials=-3"], ["n_trials must be an integer in [1, 1e+06], got -3"]),
    ("empty trial count", ["n_trials="], ["n_trials has no value", "an integer"]),
    ("negative trials flag", ["--n-trials", "-1"], ["--n-trials must be >= 0, got -1"]),
    ("report rewrite of a study that does not exist", ["--n-trials", "0"], ["--n-trials 0", "has none yet"]),
    ("zero threads per trial", ["trial.threads=0"], ["trial.threads must be an integer in [1, 4,096], got 0"]),
    ("negative sampler warm-up", ["sampler.n_startup_trials=-1"], ["sampler.n_startup_trials", "got -1"]),
    ("empty spec name", ["name="], ["'name' must be letters, digits", "got ''"]),
    ("empty sampler", ["sampler.name="], ["unknown sampler ''", "tpe"]),
    ("spec item of ten megabytes", ["description=" + "x" * 10_000_000], ["10,000,012 characters"]),
    ("spec base outside the experiments", ["base=tiny/../../../etc/passwd"], ["leaves", "as a path"]),
    ("storage in the spec, in a folder that does not exist", ["storage=sqlite:////nonexistent/dir/x.db"],
     ["mkdir -p /nonexistent/dir"]),
    *STORAGE_CASES,
]


def study_argv(command: str, spec: str, args: list[str], tmp_path) -> tuple[list[str], set]:
    """``satlab <command> <spec>`` isolated in ``tmp_path`` (studies, run folders, MLflow, data cache), then
    ``args``."""
    (spec, *args), inputs = with_inputs([spec, *(a.replace("<tmp>", str(tmp_path)) for a in args)], tmp_path)
    prefix = "overrides." if command == "sweep" else ""
    isolating = [f"out_dir={tmp_path / 'studies'}", f"{prefix}tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'x.db'}",
                 f"{prefix}data.cache_dir={tmp_path / 'cache'}", f"{prefix}train.out_dir={tmp_path / 'runs'}"]
    return [command, spec, *isolating, *args], inputs


def assert_refused_study(command: str, spec: str, case, tmp_path, capsys) -> None:
    """``satlab <command> <spec> <case's args>`` exits 2 with the case's fragments and writes nothing."""
    _, args, fragments = case
    argv, inputs = study_argv(command, spec, args, tmp_path)
    code, err = run_cli(argv, tmp_path, capsys)
    assert code == 2, err
    assert err.startswith(f"satlab {command}: error:")
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert not [text for text in NEVER_ECHOED if text in err], err[:2000]
    assert_nothing_written(tmp_path, inputs)
    assert not Path("/nonexistent").exists()


@pytest.mark.parametrize("case", SWEEP_CASES, ids=[c[0] for c in SWEEP_CASES])
def test_bad_sweep_input_is_one_clear_usage_error(case, tmp_path, capsys):
    assert_refused_study("sweep", "lr_tiny", case, tmp_path, capsys)


ABLATE_CASES = [
    ("empty seed axis", ["axes.train.seed=[]"], ["axis 'train.seed' is empty"]),
    ("seed axis that is no list", ["axes.train.seed=3"], ["axis 'train.seed' must be a list", "got 3"]),
    ("empty seed key", ["seed_key="], ["'seed_key' is empty", "train.seed"]),
    ("zero timeout", ["timeout_minutes=0"], ["'timeout_minutes' must be a positive number"]),
    ("compare_with a file that is no ablation", ["compare_with=<in>/foreign.yaml"],
     ["compare_with: ", "foreign.yaml is not a satlab ablation spec"]),
    ("compare_with a binary file", ["compare_with=<in>/binary.yaml"], ["compare_with: ", "not UTF-8 text"]),
    ("cell override of an empty value", ["optim.lr="], ["optim.lr has no value"]),
    ("unknown spending function", ["sequential.looks=[3,5,8]", "sequential.spending=pocok"],
     ["unknown sequential.spending 'pocok'", "did you mean 'pocock'", "obrien_fleming"]),
    ("sequential alpha of 0.5", ["sequential.looks=[3,5,8]", "sequential.alpha=0.5"],
     ["sequential.alpha must be in (0, 0.5)", "got 0.5"]),
    ("sequential alpha of 0", ["sequential.looks=[3,5,8]", "sequential.alpha=0"], ["sequential.alpha", "got 0"]),
    ("equivalence margin of 0", ["sequential.looks=[3,5,8]", "sequential.margin=0"],
     ["sequential.margin must be in (0, 1e+09]", "got 0"]),
    ("looks that do not increase", ["sequential.looks=[3,8,5]"],
     ["sequential.looks must strictly increase", "5 after 8"]),
    ("looks that repeat", ["sequential.looks=[3,3,5]"], ["sequential.looks must strictly increase", "3 after 3"]),
    ("first look of two seeds", ["sequential.looks=[2,4]"], ["first look must have at least 3 seeds", "got 2"]),
    ("n_max below the first look", ["sequential.looks=[5,8]", "sequential.n_max=3"],
     ["n_max (3) is below the first look (5)"]),
    ("looks beyond n_max", ["sequential.looks=[3,5,8]", "sequential.n_max=6"], ["looks [8] are beyond n_max (6)"]),
    ("three-sided test", ["sequential.looks=[3,5,8]", "sequential.sides=3"], ["sequential.sides must be 1", "got 3"]),
    ("unknown alpha sharing", ["sequential.looks=[3,5,8]", "sequential.sharing=hochberg"],
     ["unknown sequential.sharing 'hochberg'", "bonferroni, holm"]),
    ("looks that are no numbers", ["sequential.looks=[a,b]"], ["sequential.looks"]),
    ("a margin without looks", ["sequential.margin=0.1"], ["sequential.margin is set but sequential.looks is empty"]),
    ("unknown direction of the measure", ["sequential.looks=[3]", "sequential.better=smaller"],
     ["unknown sequential.better 'smaller'", "higher, lower"]),
    ("measure that is no metric name", ["sequential.looks=[3]", "sequential.measure=val loss"],
     ["sequential.measure must name an MLflow metric", "got 'val loss'"]),
    ("compare on the seed axis", ["sequential.looks=[3]", "sequential.compare=train.seed"],
     ["sequential.compare must be an axis of the grid other than the seeds", "data.source, model.arch"]),
    ("family per setting without compare", ["sequential.looks=[3]", "sequential.family=setting"],
     ["family: setting makes each setting", "use family: study"]),
    ("unknown family", ["sequential.looks=[3]", "sequential.compare=model.arch", "sequential.family=pair"],
     ["unknown sequential.family 'pair'", "setting, study"]),
    ("compare without looks", ["sequential.compare=model.arch"],
     ["sequential.compare is set but sequential.looks is empty"]),
    ("fewer seeds than n_max", ["sequential.looks=[3,5]"],
     ["seed axis train.seed lists 3 seed(s), but the plan may run up to n_max = 5", "axes.train.seed=[0,1,2,3,4]"]),
    ("dry run with fewer seeds than n_max", ["sequential.looks=[3,5]", "--dry-run"],
     ["seed axis train.seed lists 3 seed(s)"]),
    ("simulate without a plan", ["--simulate", "200"], ["has no sequential plan", "looks: [3, 5, 8, 12, 20]"]),
    ("simulate too few studies", ["sequential.looks=[3,5,8]", "--simulate", "10"], ["at least 100 studies, got 10"]),
    ("simulate-transfer without an lr_transfer block", ["--simulate-transfer", "20"],
     ["has no lr_transfer: block, so there is no transfer verdict to simulate"]),
    ("simulate-transfer of one study", ["--simulate-transfer", "1"], ["at least 2 simulated studies, got 1"]),
    ("simulate-transfer of one seed a point", ["--simulate-transfer", "20", "--seeds-per-point", "3,1"],
     ["--seeds-per-point takes comma-separated integers from 2 to 1000, e.g. 3,6,12,24; got '3,1'"]),
    ("simulate-transfer with a drift that is no number", ["--simulate-transfer", "20", "--drifts", "0.5,far"],
     ["--drifts takes comma-separated numbers from -4 to 4, e.g. 0.5,0.75,1; got '0.5,far'"]),
    *STORAGE_CASES,
]


@pytest.mark.parametrize("case", ABLATE_CASES, ids=[c[0] for c in ABLATE_CASES])
def test_bad_ablation_input_is_one_clear_usage_error(case, tmp_path, capsys):
    assert_refused_study("ablate", "arch_tiny", case, tmp_path, capsys)


SPEC_FILE_CASES = [
    ("binary spec file", "<in>/binary.yaml", ["binary.yaml is not UTF-8 text", "offset 0"]),
    ("spec holding a number", "<in>/scalar.yaml", ["scalar.yaml holds a single value", "not a satlab"]),
    ("spec holding a list", "<in>/list.yaml", ["list.yaml holds a list"]),
    ("spec of ten megabytes", "<in>/huge.yaml", ["huge.yaml is 10,000,011 bytes", "at most 1 MiB"]),
    ("spec with a YAML syntax error", "<in>/syntax.yaml", ["syntax.yaml, line 4, column 10: invalid YAML"]),
    ("spec that is a folder", "<in>", ["is a folder, not a YAML file"]),
    ("spec that is a symlink loop", "<in>/loop.yaml", ["loop.yaml", "symbolic links"]),
    ("spec nested too deeply", "<in>/deep.yaml", ["deep.yaml: invalid YAML", "nests deeper"]),
    ("a YAML file that is no spec", "<in>/foreign.yaml", ["foreign.yaml is not a satlab", "spec: none of its 2"]),
    ("a system file as spec", "../../../../../../../../../../etc/passwd", ["etc/passwd holds a single value"]),
    ("spec name that climbs out", "x/../../../etc/passwd", ["'x/../../../etc/passwd' leaves", "as a path"]),
]


@pytest.mark.parametrize("command", ["sweep", "ablate"])
@pytest.mark.parametrize("case", SPEC_FILE_CASES, ids=[c[0] for c in SPEC_FILE_CASES])
def test_a_bad_spec_file_is_one_clear_usage_error(case, command, tmp_path, capsys, monkeypatch):
    _, spec, fragments = case
    monkeypatch.chdir(tmp_path)
    argv, inputs = study_argv(command, spec, [], tmp_path)
    code, err = run_cli(argv, tmp_path, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert not [text for text in NEVER_ECHOED if text in err], err[:2000]
    assert_nothing_written(tmp_path, inputs)


def test_a_vocabulary_larger_than_the_corpus_allows_is_refused_before_anything_is_written(tmp_path, capsys):
    """The BPE trainer stops when every word is one token; the run is refused then, before the corpus' split files,
    the tokenizer or any token file is cached, and before a run folder or an MLflow run exists."""
    code, err = run_cli(isolated(tmp_path, "data.tokenizer.vocab_size=10_000_000"), tmp_path, capsys)
    assert code == 2, err
    assert ("data.tokenizer.vocab_size=10000000 is more than this corpus allows: BPE on the train split of embedded "
            "corpus 'shakespeare' stops at 45,902 tokens") in err
    assert "use at most data.tokenizer.vocab_size=45902" in err
    assert_nothing_written(tmp_path, set())


def test_the_vocabulary_bound_of_a_corpus_is_exact(tmp_path):
    """At the bound the tokenizer is trained and kept; one more is refused and keeps nothing."""
    import json

    from satlab.config.errors import ConfigError
    from satlab.config.loader import load_experiment
    from satlab.data.prepare import prepare_data

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: the cat sat on mat number {i * 7}"}) + "\n"
                              for i in range(200)))

    def prepare(vocab_size: int):
        cfg = load_experiment("default", [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                                          f"data.tokenizer.vocab_size={vocab_size}"])
        return prepare_data(cfg.data, progress=False)

    with pytest.raises(ConfigError, match="use at most data.tokenizer.vocab_size=") as refused:
        prepare(10**7)
    bound = int(str(refused.value).rsplit("=", 1)[1].split(",")[0])
    assert 259 < bound < 2000 and f"stops at {bound:,} tokens" in str(refused.value)
    with pytest.raises(ConfigError, match=f"use at most data.tokenizer.vocab_size={bound},"):
        prepare(bound + 1)
    assert not files_under(tmp_path / "cache")
    assert prepare(bound).vocab_size == bound


def test_a_storage_folder_that_cannot_be_written_is_refused(tmp_path, capsys, monkeypatch):
    from satlab.studies import storage

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root writes anywhere: let the check see what another user would
        monkeypatch.setattr(storage.os, "access", lambda path, mode: Path(path) != folder)
    try:
        argv, inputs = study_argv("sweep", "lr_tiny", ["--storage", f"sqlite:///{folder / 'x.db'}"], tmp_path)
        code, err = run_cli(argv, tmp_path, capsys)
    finally:
        folder.chmod(0o755)
    assert code == 2 and f"{folder} is not writable" in err, err
    assert_nothing_written(tmp_path, inputs)


def test_satlab_makes_the_folder_of_its_own_default_storage_only(tmp_path):
    from satlab.config.errors import ConfigError
    from satlab.studies.loader import load_sweep
    from satlab.studies.storage import open_storage

    url = load_sweep("lr_tiny", [f"out_dir={tmp_path / 'a' / 'b'}"]).storage_url()
    with pytest.raises(ConfigError, match="create it first"):
        open_storage(url)
    assert not (tmp_path / "a").exists()
    open_storage(url, create_folder=True)
    assert (tmp_path / "a" / "b" / "optuna.db").is_file()


def test_a_yaml_file_of_up_to_one_mebibyte_is_read(tmp_path):
    from satlab.config.errors import ConfigError
    from satlab.config.specs import MAX_YAML_BYTES, read_mapping

    path = tmp_path / "big.yaml"
    path.write_text("name: big\n" + "#" * (MAX_YAML_BYTES - 11) + "\n")
    assert path.stat().st_size == MAX_YAML_BYTES and read_mapping(path) == {"name": "big"}
    path.write_text("name: big\n" + "#" * (MAX_YAML_BYTES - 10) + "\n")
    with pytest.raises(ConfigError, match="1,048,577 bytes"):
        read_mapping(path)


def _empty_file(folder):
    (folder / "empty.txt").write_text("")
    return folder / "empty.txt", ["empty.txt", "is empty"]


def _folder_without_text(folder):
    (folder / "image.png").write_bytes(b"\x89PNG not text")
    return folder, ["unsupported file type", "supported: .json, .jsonl"]


def _undecodable(folder):
    (folder / "a.txt").write_text("plain words " * 50)
    (folder / "b.txt").write_bytes(b"caf" + b"\xe9 au lait " * 20)
    return folder / "*.txt", ["b.txt", "offset 3", "0xe9", "utf-8", "iconv"]


DATA_CASES = [("empty text file", _empty_file), ("folder with no text", _folder_without_text),
              ("undecodable bytes", _undecodable)]


@pytest.mark.parametrize("case", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_a_data_problem_is_one_clear_error_and_writes_nothing(case, tmp_path, capsys):
    _, make = case
    folder = tmp_path / "corpus"
    folder.mkdir()
    source, fragments = make(folder)
    code, err = run_cli(isolated(tmp_path, f"data.source={source}"), tmp_path, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert_nothing_written(tmp_path)


@pytest.mark.process
def test_overrides_are_accepted_before_and_after_flags(monkeypatch):
    import argparse
    import importlib
    from types import SimpleNamespace

    from satlab.cli import main as cli

    seen: list[argparse.Namespace] = []
    real = importlib.import_module

    def declared_only(name: str) -> argparse.Namespace:  # the commands' arguments, but record instead of running
        return argparse.Namespace(add_arguments=getattr(real(name), "add_arguments", None), run=seen.append)

    # the CLI's own name for importlib only: the process's importlib.import_module stays (other code imports with it)
    monkeypatch.setattr(cli, "importlib", SimpleNamespace(import_module=declared_only))
    cli.main(["sweep", "lr_tiny", "n_trials=2", "--workers", "1", "space.optim.lr.high=1e-2", "--n-trials", "3"])
    assert seen[0].overrides == ["n_trials=2", "space.optim.lr.high=1e-2"] and seen[0].workers == 1
    cli.main(["ablate", "arch_tiny", "--workers", "2", "train.max_tokens=1e5"])
    assert seen[1].overrides == ["train.max_tokens=1e5"] and seen[1].workers == 2
    with pytest.raises(SystemExit) as stopped:
        cli.main(["sweep", "lr_tiny", "--workers", "1", "--no-such-flag"])
    assert stopped.value.code == 2
