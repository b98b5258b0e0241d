"""The bad-input catalogue: every mistake gets one clear message that names the bad value and what is valid, exit
code 2, and nothing written (no run folder, no MLflow store)."""

from __future__ import annotations

import http.server
import threading

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
    ("negative MLP width", ["model.mlp_hidden=-1"], ["model.mlp_hidden", "[0, 1,048,576]", "-1"]),
    ("run name that climbs out of the runs folder", ["name=../evil"], ["'../evil'", "letters, digits"]),
    ("absurd token budget", ["train.max_tokens=1e30"], ["train.max_tokens", "[1, 1e+15]", "got 1" + "0" * 30]),
    ("learning rate that is not a number", ["optim.lr=nan"], ["optim.lr", "(0, 10]", "nan"]),
    ("infinite learning rate", ["optim.lr=inf"], ["optim.lr", "(0, 10]", "inf"]),
    ("learning rate no one means", ["optim.lr=5e3"], ["optim.lr", "(0, 10]", "5000"]),
    ("negative seed", ["train.seed=-1"], ["train.seed", "[0, 4.29497e+09]", "-1"]),
    ("absurd model width", ["model.d_model=1000000"], ["model.d_model", "[1, 65,536]", "1000000"]),
    ("zero init std", ["model.init_std=0"], ["model.init_std", "(0, 10]"]),
    ("infinite rope theta", ["model.rope_theta=inf"], ["model.rope_theta", "inf"]),
    ("absurd hyper-connection expansion", ["model.hyperconnections.expansion=1000"], ["expansion", "[1, 64]"]),
    ("more data workers than cores could use", ["data.num_workers=100000"], ["data.num_workers", "[0, 256]"]),
    ("zero validation budget", ["train.val_tokens=0"], ["train.val_tokens", "[1, 1e+12]"]),
    ("run name with a slash", ["name=a/b"], ["'a/b'", "'.', '_' and '-'"]),
    ("run name that is a dot", ["name=."], ["'.'", "not '.' or '..'"]),
    ("run name with a space", ["name=my run"], ["'my run'", "1 to 200"]),
]


def run_cli(argv: list[str], tmp_path, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def isolated(tmp_path, *args: str) -> list[str]:
    return ["train", *args, f"train.out_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"]


def assert_nothing_written(tmp_path) -> None:
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "mlruns").exists()
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()], list(cache.rglob("*"))


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_bad_training_input_is_one_clear_usage_error(case, tmp_path, capsys):
    _, args, fragments = case
    argv = isolated(tmp_path, *args)
    if any(a.startswith("tracking.uri=") for a in args):
        argv = [a for a in argv if not a.startswith("tracking.uri=sqlite")]
    code, err = run_cli(argv, tmp_path, capsys)
    assert code == 2, err
    assert err.startswith("satlab train: error:")
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert_nothing_written(tmp_path)


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
    files = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs").rglob("*"))
    code, err = run_cli([*argv, "model.d_model=48", "optim.lr=1e-3", "train.max_tokens=1024"], tmp_path, capsys)
    assert code == 2, err
    assert "model.d_model: 32 -> 48" in err and "optim.lr: 0.003 -> 0.001" in err and "train.max_tokens" not in \
        err.split("a resume may change only")[0]
    assert "another name" in err and "train.max_tokens" in err.split("a resume may change only")[1]
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs").rglob("*")) == files
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
        with pytest.raises(tracking.ConfigError, match="unreachable"):
            tracking.ensure_reachable(uri, fallback_local=False)
        assert tracking.ensure_reachable(uri, fallback_local=True).endswith("local/mlflow.db")
        assert "logging to the local store" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_bench_rejects_an_unknown_architecture(capsys):
    code = main(["bench", "--archs", "transformer,densformer"])
    err = capsys.readouterr().err
    assert code == 2 and "densformer" in err and "did you mean 'denseformer'" in err


SWEEP_CASES = [
    ("sweep spec with an empty space", ["space=null"], ["search space is empty"]),
    ("sweep storage that is not a database URL", ["--storage", "studies/lr.journal"], ["studies/lr.journal", "sqlite:///"]),
    ("sweep storage whose server cannot be reached", ["--storage", "postgresql://satlab@127.0.0.1:9/optuna"],
     ["postgresql://satlab@127.0.0.1:9/optuna"]),
]


@pytest.mark.parametrize("case", SWEEP_CASES, ids=[c[0] for c in SWEEP_CASES])
def test_bad_sweep_input_is_one_clear_usage_error(case, tmp_path, capsys):
    _, args, fragments = case
    tracking = f"overrides.tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    code, err = run_cli(["sweep", "lr_tiny", f"out_dir={tmp_path / 'studies'}", tracking, *args], tmp_path, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert not (tmp_path / "mlruns").exists()


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


def test_overrides_are_accepted_before_and_after_flags(monkeypatch):
    import argparse

    from satlab.cli import main as cli

    seen: list[argparse.Namespace] = []
    real = cli.importlib.import_module

    def declared_only(name: str) -> argparse.Namespace:  # the commands' arguments, but record instead of running
        return argparse.Namespace(add_arguments=getattr(real(name), "add_arguments", None), run=seen.append)

    monkeypatch.setattr(cli.importlib, "import_module", declared_only)
    cli.main(["sweep", "lr_tiny", "n_trials=2", "--workers", "1", "space.optim.lr.high=1e-2", "--n-trials", "3"])
    assert seen[0].overrides == ["n_trials=2", "space.optim.lr.high=1e-2"] and seen[0].workers == 1
    cli.main(["ablate", "arch_tiny", "--workers", "2", "train.max_tokens=1e5"])
    assert seen[1].overrides == ["train.max_tokens=1e5"] and seen[1].workers == 2
    with pytest.raises(SystemExit) as stopped:
        cli.main(["sweep", "lr_tiny", "--workers", "1", "--no-such-flag"])
    assert stopped.value.code == 2
