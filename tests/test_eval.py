"""Evaluation through lm-eval: the generated offline tasks are deterministic and answerable from their context,
the `satlab` adapter scores exactly what the model's logits say (through lm-eval's own simple_evaluate too), the
suite runs end to end, and `satlab eval` reports and logs into the checkpoint's MLflow run."""

from __future__ import annotations

import json
import re
import shutil

import mlflow
import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from satlab.cli.main import main
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.data.tokenizer import byte_tokenizer
from satlab.evaluation.lm_adapter import SatlabLM
from satlab.evaluation.suite import AVERAGES_KEY, metric_keys, run_offline_suite, run_tasks
from satlab.evaluation.tasks import FAMILIES, RETRIEVAL, split_task_names
from satlab.evaluation.tasks.build import build_offline_tasks
from satlab.models import build_model
from satlab.training.checkpoint import satlab_entry

TINY = dict(arch="satformer", d_model=32, n_layers=2, n_heads=2, mlp_hidden=64, vocab_size=258)
TOKENIZER = byte_tokenizer()


def tiny(max_seq_len: int = 1024):
    torch.manual_seed(0)
    return build_model({**TINY, "max_seq_len": max_seq_len}).eval()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("eval-cache")


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    """simple_evaluate's report of the environment (torch's collect_env, seconds per call) adds nothing here, nor
    does a second thread on models this small: it only adds synchronisation, which stalls when the cores are busy."""
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def read_items(folder, task: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def direct_loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's log-probability straight from the logits, with lm-eval's conventions: trailing context
    whitespace belongs to the continuation, an empty context is the end-of-text token, the window is cut from the
    left to max_seq_len + 1 tokens."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    ids = TOKENIZER.encode(context) if context else [TOKENIZER.eos_id]
    target = TOKENIZER.encode(continuation)
    window = (ids + target)[-(model.cfg.max_seq_len + 1):]
    with torch.no_grad():
        logprobs = model(torch.tensor([window[:-1]])).logits[0].log_softmax(-1)
    rows = logprobs[len(window) - 1 - len(target):]
    picked = rows[torch.arange(len(target)), torch.tensor(target)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(target)).all())


def test_generated_tasks_are_deterministic_seeded_and_prefix_stable(cache):
    folder = build_offline_tasks(TOKENIZER, cache, seed=0, limit=6)
    first = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    shutil.rmtree(folder)
    again = build_offline_tasks(TOKENIZER, cache, seed=0, limit=6)
    assert again == folder and {p.name: p.read_bytes() for p in sorted(again.iterdir()) if p.is_file()} == first
    other = build_offline_tasks(TOKENIZER, cache, seed=1, limit=6)
    assert read_items(other, "satlab_mqar_8") != read_items(folder, "satlab_mqar_8")
    fewer = build_offline_tasks(TOKENIZER, cache, seed=0, limit=3)
    for family in FAMILIES.values():
        for task in family.tasks:
            assert read_items(fewer, task) == read_items(folder, task)[:3], task
    assert {"satlab_mqar.yaml", "satlab_mqar_8.yaml", "satlab_phonebook_768.jsonl"} <= set(first)


def test_retrieval_answers_occur_once_in_context_and_an_oracle_gets_them_all(cache):
    folder = build_offline_tasks(TOKENIZER, cache, seed=0, limit=25)
    for family in RETRIEVAL:
        for task in FAMILIES[family].tasks:
            for item in read_items(folder, task):
                context, choices = item["context"], [c.strip() for c in item["choices"]]
                assert len(set(choices)) == 4 and all(context.count(c) == 1 for c in choices), task
                # Cheating scorer: the first choice to appear after the query's first occurrence.
                start = context.index(item["query"])
                oracle = min(range(4), key=lambda k: context.find(choices[k], start) % (len(context) + 1))
                assert oracle == item["gold"], task
    for item in read_items(folder, "satlab_cloze"):
        assert re.search(rf"\b{item['target'].strip()}\b", item["context"])
    for item in read_items(folder, "satlab_cloze_choice"):  # every candidate word occurs in the passage
        assert all(re.search(rf"\b{c.strip()}\b", item["context"], re.IGNORECASE) for c in item["choices"])


def test_loglikelihood_equals_the_models_logits_with_batching_and_truncation():
    model = tiny(max_seq_len=64)
    lm = SatlabLM(model=model, tokenizer=TOKENIZER, batch_size=2)
    pairs = [("The cat sat on the", " mat."), ("", "Hello world"), ("To be or not", " to be"),
             ("x" * 150 + " long context that must be cut from the left", " here"),
             ("So foul and fair a day I have not\n", "seen."),
             # choices of one context share its KV cache, unless one of them must be cut from the left
             ("Look up Ada:", " 417-5520"), ("Look up Ada:", "!"), ("Look up Ada:", " 23-11"), ("Q:", "a"), ("Q:", "b"),
             ("y" * 60, " a"), ("y" * 60, " abcdef")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                           disable_tqdm=True)
    for (score, greedy), pair in zip(got, pairs, strict=True):
        expected, expected_greedy = direct_loglikelihood(model, *pair)
        assert score == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy


def test_rolling_loglikelihood_is_the_sum_over_the_text():
    model = tiny(max_seq_len=64)
    lm = SatlabLM(model=model, tokenizer=TOKENIZER, batch_size=3)
    texts = ["A short text.", "Double, double toil and trouble; fire burn and cauldron bubble. " * 4]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)],
                                   disable_tqdm=True)
    for text, score in zip(texts, got, strict=True):
        padded = [TOKENIZER.eos_id] + TOKENIZER.encode(text)  # token j + 1 is predicted from padded[: j + 1]
        expected, start, length = 0.0, 0, len(padded) - 1
        while start < length:  # chunks of max_seq_len predictions, each with as much context as fits
            end = min(start + 64, length)
            window = padded[max(0, end - 64) : end + 1]
            with torch.no_grad():
                logprobs = model(torch.tensor([window[:-1]])).logits[0].log_softmax(-1)
            count = end - start
            expected += logprobs[-count:].gather(-1, torch.tensor(window[-count:])[:, None]).sum().item()
            start = end
        assert score == pytest.approx(expected, abs=1e-3)


def test_generate_until_matches_uncached_greedy_decoding_and_stops_at_the_stop_string():
    model = tiny(max_seq_len=128)
    lm = SatlabLM(model=model, tokenizer=TOKENIZER)
    prompt = "Phone book\nAda Abara: 523-1234\nLook up Ada Abara:"
    ids = TOKENIZER.encode(prompt)
    with torch.no_grad():
        for _ in range(40):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    reference = TOKENIZER.decode(ids[len(TOKENIZER.encode(prompt)):]).split("<|endoftext|>")[0]
    stop = reference[6:8]
    requests = [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 40}), 0),
                Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 40}), 1)]
    full, stopped = lm.generate_until(requests, disable_tqdm=True)
    assert full == reference
    assert stopped == reference.split(stop)[0] and len(stopped) <= 6


def test_simple_evaluate_with_the_registered_adapter_matches_direct_accuracy(cache):
    model = tiny()
    folder = build_offline_tasks(TOKENIZER, cache, seed=0, limit=8)
    out = simple_evaluate(model="satlab", model_args={"model": model, "tokenizer": TOKENIZER, "batch_size": 3},
                          tasks=["satlab_mc_continuation", "satlab_mqar_8"], bootstrap_iters=0, log_samples=False,
                          task_manager=TaskManager(include_path=folder, include_defaults=False))
    for task in ("satlab_mc_continuation", "satlab_mqar_8"):
        hits = hits_norm = 0
        items = read_items(folder, task)
        for item in items:
            scores = [direct_loglikelihood(model, item["context"], c)[0] for c in item["choices"]]
            normed = [s / len(c) for s, c in zip(scores, item["choices"], strict=True)]
            hits += max(range(4), key=scores.__getitem__) == item["gold"]
            hits_norm += max(range(4), key=normed.__getitem__) == item["gold"]
        assert out["results"][task]["acc,none"] == pytest.approx(hits / len(items))
        if task == "satlab_mc_continuation":
            assert out["results"][task]["acc_norm,none"] == pytest.approx(hits_norm / len(items))


def test_offline_suite_reports_every_task_size_group_and_average(cache):
    model = tiny()
    model.train()
    results = run_offline_suite(model, TOKENIZER, limit=3, cache_dir=cache)
    assert model.training  # the caller's mode is restored
    expected = {t for f in FAMILIES.values() for t in f.tasks} | {f.name for f in FAMILIES.values() if f.sizes}
    assert expected | {AVERAGES_KEY} == set(results)
    for task, metrics in results.items():
        for metric, value in metrics.items():
            if metric == "perplexity":
                assert value >= 1.0
            elif metric == "seconds":  # the model's time on the task's requests
                assert value > 0.0, task
            else:
                assert 0.0 <= value <= 1.0, (task, metric)
    assert {task for task, metrics in results.items() if "seconds" in metrics} == expected
    family = FAMILIES["satlab_phonebook"]
    assert results[family.name]["seconds"] == pytest.approx(sum(results[t]["seconds"] for t in family.tasks))
    assert set(results[AVERAGES_KEY]) == {"offline_zero_shot_avg", "offline_retrieval_avg"}
    keys = metric_keys(results)
    assert "zero_shot/satlab_phonebook_192/acc" in keys and "zero_shot/offline_retrieval_avg" in keys
    assert all(re.fullmatch(r"[A-Za-z0-9_/. -]+", key) for key in keys)


def test_unknown_tasks_and_offline_hub_tasks_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="satlab_mqar_16.*paper_retrieval"):
        split_task_names(["satlab_mqar_9"])
    with pytest.raises(ConfigError, match="run_tasks"):
        run_offline_suite(tiny(), TOKENIZER, tasks=["piqa"])

    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("socket.create_connection", unreachable)
    with pytest.raises(ConfigError, match="tasks=satlab_offline"):
        run_tasks(tiny(), TOKENIZER, ["paper_zero_shot"])


def test_cli_reports_logs_into_the_checkpoint_run_and_rejects_bad_input(cache, tmp_path, capsys):
    cfg = load_experiment("default", [f"model.{k}={v}" for k, v in TINY.items()] + [
        "data.tokenizer.kind=byte", f"data.cache_dir={cache}"])
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    weights = {f"model.{k}": v for k, v in build_model(cfg.model).state_dict().items()}
    torch.save({"state_dict": weights, "satlab": satlab_entry(cfg, TOKENIZER), "global_step": 7},
               run_dir / "checkpoints" / "last.ckpt")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("eval-test", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    (run_dir / "run.json").write_text(json.dumps({"mlflow_run_id": run_id, "tracking_uri": uri}))

    out = tmp_path / "results.json"
    assert main(["eval", f"ckpt={run_dir}", "tasks=satlab_mqar_8,satlab_phonebook_192", "limit=2",
                 "--json", str(out)]) == 0
    assert "satlab_phonebook_192" in capsys.readouterr().out
    assert set(json.loads(out.read_text())) == {"satlab_mqar_8", "satlab_phonebook_192"}
    history = client.get_metric_history(run_id, "zero_shot/satlab_mqar_8/acc")
    assert [m.step for m in history] == [7]

    assert SatlabLM(ckpt=run_dir).step == 7  # lm-eval's model_args=ckpt=...
    assert main(["eval", f"ckpt={tmp_path / 'missing'}"]) == 2
    assert main(["eval", f"ckpt={run_dir}", "tasks=satlab_phonbook"]) == 2
    assert main(["eval", f"ckpt={run_dir}", "limt=3"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "did you mean 'satlab_phonebook'" in err and "did you mean 'limit'" in err


@pytest.mark.parametrize(("device", "gpus", "message"), [
    ("tpu", 0, "device takes cpu, cuda or cuda:N, got 'tpu'"),
    ("auto", 0, "device takes cpu, cuda or cuda:N, got 'auto'"),
    ("cuda", 0, "device cuda: torch " + torch.__version__ + " sees no CUDA GPU here; use cpu"),
    ("cuda:3", 1, "device cuda:3: torch sees 1 CUDA GPU(s), cuda:0 to cuda:0"),
])
def test_eval_refuses_a_device_that_is_not_there_before_loading_anything(device, gpus, message, tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert main(["eval", f"ckpt={tmp_path / 'missing'}", f"device={device}", "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert message in err and "no checkpoint at" not in err  # the device is checked first


@pytest.mark.parametrize("progress", [True, False])
def test_progress_false_silences_every_bar_of_the_suite_lm_evals_included(progress, cache, capfd):
    """``satlab train --no-progress`` and study trials: no bar from lm-eval's request building, its tokenizing or the
    adapter's scoring (shown=True proves the check sees them)."""
    run_tasks(tiny(), TOKENIZER, ["satlab_mc_continuation", "satlab_cloze"], limit=4, cache_dir=cache,
              progress=progress)
    err = capfd.readouterr().err
    bars = ("it/s]" in err, "Tokenizing inputs" in err, "satlab loglikelihood" in err)
    assert bars == ((True,) * 3 if progress else (False,) * 3), err[-2000:]


def test_satlab_eval_logs_into_the_run_with_a_tokens_seen_point_at_the_step(tmp_path):
    """A checkpoint's later evaluation plots against tokens like the run's own metrics: its step gets one
    ``tokens_seen`` point, unless the run already has one there."""
    from satlab.cli.eval import log_to_run

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("e", artifact_location=str(tmp_path / "a"))).info.run_id
    client.log_metric(run_id, "tokens_seen", 5120.0, step=10)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"tracking_uri": client.tracking_uri,
                                                          "mlflow_run_id": run_id}))
    for step in (10, 20, 20):
        assert log_to_run(tmp_path / "run" / "checkpoints" / "x.ckpt", {"zero_shot/a": 0.5}, step, step * 512) == run_id
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "tokens_seen")) == \
        [(10, 5120.0), (20, 10240.0)]
