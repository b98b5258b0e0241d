"""The dry run is the run's plan: its vocabulary, parameters, FLOPs per token and steps are those the run then
records, for every tokenizer kind and several vocabularies (issue 39)."""

from __future__ import annotations

import random

import mlflow
import pytest

from satlab.cli.train import plan
from satlab.config.loader import load_experiment
from satlab.data.tokenizer import BYTE_VOCAB
from satlab.training.run import train

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "data.seq_len=32",
        "train.micro_batch_size=4", "train.global_batch_tokens=128", "train.max_tokens=256",
        "train.val_every_tokens=256", "train.val_tokens=128", "train.ckpt_every_tokens=256", "train.accelerator=cpu",
        "data.num_proc=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of text files with enough distinct words for a BPE of 1,024 tokens."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    for i in range(30):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(2000)) + "\n")
    return folder


def config(tmp_path, corpus, name: str, *extra: str):
    return load_experiment("default", [*TINY, f"name={name}", f"data.source={corpus}",
                                       f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'runs'}",
                                       f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra])


def assert_plan_is_the_run(cfg) -> dict:
    """Plan ``cfg``, run it, and compare the plan with the RunResult and the run's MLflow params."""
    planned = plan(cfg)
    result = train(cfg, progress=False)
    params = mlflow.MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.params
    assert planned["params"] == result.params == int(params["model.params"])
    assert planned["non_embedding_params"] == result.non_embedding_params
    assert planned["flops_per_token"] == pytest.approx(float(params["model.flops_per_token"]), rel=1e-12)
    assert planned["vocab_size"] == int(params["data.vocab_size_actual"])
    for key, value in planned["schedule"].as_dict().items():
        assert str(value) == params[f"derived.{key}"], key
    return planned


@pytest.mark.parametrize("vocab", [300, 512, 1024])
def test_the_dry_run_of_a_bpe_run_has_the_vocabulary_sizes_and_flops_the_run_records(tmp_path, corpus, vocab):
    cfg = config(tmp_path, corpus, f"bpe{vocab}", "data.tokenizer.kind=bpe", f"data.tokenizer.vocab_size={vocab}")
    planned = assert_plan_is_the_run(cfg)
    assert planned["vocab_size"] == vocab
    again = plan(cfg)  # planned again, from the tokenizer the run trained and cached: the same plan
    assert again.pop("vocab_origin") == "the cached bpe tokenizer"
    assert again == {k: v for k, v in planned.items() if k != "vocab_origin"}


def test_the_dry_run_of_byte_hub_and_recall_runs_is_the_run(tmp_path, corpus):
    sizes = [assert_plan_is_the_run(config(tmp_path, corpus, "byte", "data.tokenizer.kind=byte"))["params"]]
    assert plan(config(tmp_path, corpus, "byte", "data.tokenizer.kind=byte"))["vocab_size"] == BYTE_VOCAB
    # a pretrained tokenizer given as a local tokenizer.json: its file's size, here a BPE saved by an earlier run
    bpe = config(tmp_path, corpus, "bpe600", "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=600")
    train(bpe, progress=False)
    saved = next((tmp_path / "cache" / "tokenizers").glob("bpe-600-*")) / "tokenizer.json"
    hub = assert_plan_is_the_run(config(tmp_path, corpus, "hub", "data.tokenizer.kind=hub",
                                        f"data.tokenizer.name={saved}"))
    sizes.append(hub["params"])
    assert hub["vocab_size"] == 600
    recall = assert_plan_is_the_run(load_experiment("default", [
        *TINY, "name=recall", "data.source=synthetic:mqar", "data.mqar.vocab_size=64", "data.mqar.num_pairs=4",
        "data.mqar.eval_sequences=8", f"train.out_dir={tmp_path / 'runs'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]))
    assert recall["vocab_size"] == 64
    sizes.append(recall["params"])
    assert len(set(sizes)) == 3  # the vocabulary changes the plan as it changes the run


def test_a_hub_tokenizer_not_fetched_yet_is_planned_as_unknown_rather_than_guessed(tmp_path, corpus):
    cfg = config(tmp_path, corpus, "hub", "data.tokenizer.kind=hub", "data.tokenizer.name=someone/not-fetched")
    planned = plan(cfg)
    assert planned["vocab_size"] is None and "unknown until the hub tokenizer" in planned["vocab_origin"]
    assert planned["model_vocab_size"] == cfg.model.vocab_size
