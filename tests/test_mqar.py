"""Synthetic associative recall (``data.source=synthetic:mqar``): the generator's layouts and determinism, the
held-out set kept out of training, the answer-only head against the full head, and recall runs through the trainer
(learning, stopping at the target accuracy, resuming exactly)."""

from __future__ import annotations

import lightning as L
import mlflow
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from satlab.config.loader import load_experiment
from satlab.config.model import ModelConfig
from satlab.config.schema import MQARConfig
from satlab.data.mqar import BLOCK, IGNORE_INDEX, MQARBatches, MQARTask, generate
from satlab.models import ARCHITECTURES, build_model
from satlab.training.checkpoint import load_checkpoint
from satlab.training.run import train


def rows_of(inputs: torch.Tensor) -> set[bytes]:
    return {r.numpy().tobytes() for r in inputs}


@pytest.mark.parametrize("layout", ["adjacent", "separated", "multi_token_key"])
def test_every_query_asks_a_key_of_its_sequence_and_its_target_is_that_keys_value(layout):
    cfg = MQARConfig(vocab_size=512, num_pairs=6, num_queries=9, layout=layout)
    inputs, targets = generate(cfg, 80, np.random.default_rng(0), 32)
    k, pair = cfg.key_len, cfg.pair_len
    for x, y in zip(inputs, targets, strict=True):
        context = x[: cfg.num_pairs * pair].reshape(cfg.num_pairs, pair)
        keys, values = [tuple(c[:k]) for c in context], context[:, -1]
        assert len(set(keys)) == cfg.num_pairs and len(set(values.tolist())) == cfg.num_pairs
        assert all(cfg.first_key <= t < cfg.first_key + cfg.num_keys for key in keys for t in key)
        assert (values >= cfg.first_key + cfg.num_keys).all()
        if layout == "separated":
            assert (context[:, 1] == 1).all()
        answers = np.flatnonzero(y != IGNORE_INDEX)
        assert len(answers) == 9 and answers.min() >= cfg.num_pairs * pair
        for position in answers:
            asked = tuple(x[position - k + 1: position + 1])
            assert y[position] == values[keys.index(asked)]


def test_the_stream_is_a_function_of_seed_and_row_whatever_the_batching():
    task = MQARTask(MQARConfig(vocab_size=256, num_pairs=4, eval_sequences=50), 32)
    whole = torch.cat([MQARBatches(task, 24, seed=3).micro_batch(k)[0] for k in range(8)])  # rows 0..191
    # two ranks of 8: rank r's micro-batch k holds rows (2k + r) * 8 ...
    ranks = [MQARBatches(task, 8, seed=3, rank=r, world_size=2) for r in range(2)]
    interleaved = torch.cat([ranks[k % 2].micro_batch(k // 2)[0] for k in range(24)])
    assert torch.equal(whole, interleaved)
    resumed = MQARBatches(task, 24, seed=3, start_token=5 * 24 * 32)  # a run resumed after 5 micro-batches
    assert torch.equal(next(iter(resumed))[0], whole[5 * 24: 6 * 24])
    assert torch.equal(torch.cat([task.train_rows(3, 0, BLOCK)[0], task.train_rows(3, BLOCK, 10)[0]]),
                       task.train_rows(3, 0, BLOCK + 10)[0])
    other_seed = MQARBatches(task, 24, seed=4).micro_batch(0)[0]
    assert not torch.equal(other_seed, whole[:24])


def test_the_held_out_set_depends_on_the_setting_only_and_no_training_row_equals_one():
    # 1 pair and 1 query in 3 tokens (k v k), 3 keys x 3 values: only 9 distinct sequences, so random training rows
    # would repeat held-out ones all the time
    cfg = MQARConfig(vocab_size=8, num_pairs=1, eval_sequences=4)
    task = MQARTask(cfg, 3)
    assert torch.equal(task.held_out[0], MQARTask(cfg, 3).held_out[0])
    held_out = rows_of(task.held_out[0])
    assert len(held_out) >= 2
    raw = generate(cfg, 3, np.random.default_rng(0), 512)[0]
    assert {r.tobytes() for r in raw} & held_out, "the setting is too large to test the exclusion"
    for seed in range(3):
        assert not rows_of(task.train_rows(seed, 0, 512)[0]) & held_out
    assert not torch.equal(MQARTask(MQARConfig(vocab_size=8, num_pairs=2, eval_sequences=4), 6).held_out[0][:, :3],
                           task.held_out[0])


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_answer_only_head_gives_the_full_heads_masked_loss_and_gradients(arch):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, size="recall-2l", d_model=32, n_heads=2, vocab_size=64, n_layers=3)
    model = build_model(cfg).double()
    task = MQARTask(MQARConfig(vocab_size=64, num_pairs=3, eval_sequences=4), 16)
    x, y = task.train_rows(0, 0, 6)

    def loss_and_grads(answer_only: bool):
        model.zero_grad()
        if answer_only:
            scored = y != IGNORE_INDEX
            loss = F.cross_entropy(model(x, select=scored).logits, y[scored])
        else:
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full_loss, full_grads = loss_and_grads(False)
    loss, grads = loss_and_grads(True)
    assert torch.allclose(loss, full_loss, rtol=0, atol=1e-12)
    assert len(grads) == len(full_grads)
    for g, ref in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)


def test_attention_only_blocks_have_no_mlp_and_count_no_mlp_flops():
    from satlab.models import count_params, flops_per_token

    model = build_model(ModelConfig(arch="satformer", size="recall-2l"))
    assert all(block.mlp is None for block in model.blocks)
    with_mlp = build_model(ModelConfig(arch="satformer", size="recall-2l", mlp_hidden=128))
    assert count_params(with_mlp) - count_params(model) == 2 * (3 * 64 * 128 + 64)
    assert flops_per_token(model, 64, head_fraction=4 / 64) < flops_per_token(model, 64)


RECALL = ["data.mqar.vocab_size=64", "data.mqar.eval_sequences=128", "train.log_every_n_steps=10"]


def recall_config(tmp_path, *extra: str):
    overrides = [*RECALL, f"train.out_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                 f"data.cache_dir={tmp_path / 'cache'}", *extra]
    return load_experiment("recall/mqar", overrides)


def recall_history(result, key="recall/acc") -> list[tuple[int, float]]:
    client = mlflow.MlflowClient(result.tracking_uri)
    return [(m.step, m.value) for m in client.get_metric_history(result.mlflow_run_id, key)]


def test_a_recall_run_stops_at_its_target_accuracy_and_stays_stopped_when_resumed(tmp_path):
    # two pairs among 62 tokens: guessing between the two values in context (0.5) comes within a few hundred steps
    cfg = recall_config(tmp_path, "name=stops", "data.seq_len=16", "data.mqar.num_pairs=2",
                        "data.mqar.stop_at_acc=0.4", "train.micro_batch_size=32", "train.global_batch_tokens=512",
                        "train.max_tokens=1_024_000", "train.val_every_tokens=25_600", "optim.lr=3e-3")
    result = train(cfg, progress=False)
    assert result.recall["recall/acc"] >= 0.4 and result.tokens < cfg.train.max_tokens
    history = recall_history(result)
    assert history[0][0] == 0 and history[0][1] < 0.4
    reached = [acc >= 0.4 for _, acc in history]
    assert reached.count(True) == 1 and reached[-1]  # the first validation at the target ended it, logged once
    stopped_at = result.tokens // cfg.train.global_batch_tokens
    assert result.recall["recall/steps_to_bind"] == stopped_at and result.recall["recall/bound"] == 1.0
    again = train(cfg, progress=False)
    assert again.tokens == result.tokens and again.recall["recall/acc"] == result.recall["recall/acc"]
    assert again.recall["recall/steps_to_bind"] == stopped_at and again.recall["recall/bound"] == 1.0
    # the time-to-bind is logged once, at the last step, and the resumed run adds no second point
    assert recall_history(result, "recall/steps_to_bind") == [(stopped_at, stopped_at)]
    assert recall_history(result, "recall/bound") == [(stopped_at, 1.0)]
    loaded = load_checkpoint(result.run_dir)
    assert loaded.tokenizer.kind == "mqar" and loaded.tokenizer.decode([2, 1, 40]) == "k0 = v7"


@pytest.mark.slow
def test_the_recall_preset_learns_four_adjacent_pairs_above_0_9(tmp_path):
    """About 1,300 steps at batch 64 (two pairs plateau at 0.5, guessing between the two values, for at least 3,000
    steps in this generator; four pairs bind sooner: docs/results/2026-12-01-recall-arch.md)."""
    cfg = load_experiment("recall/mqar", ["name=learns", "data.mqar.eval_sequences=256", "data.mqar.stop_at_acc=0.9",
                                          "train.val_every_tokens=409_600", f"train.out_dir={tmp_path / 'runs'}",
                                          f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    result = train(cfg, progress=False)
    assert result.recall["recall/acc"] >= 0.9
    steps = result.recall["recall/steps_to_0.9"]
    assert steps * cfg.train.global_batch_tokens == result.tokens < cfg.train.max_tokens
    assert result.recall["recall/sequences_to_0.9"] == steps * 64


class CrashAfter(L.Callback):
    """Raises after optimizer step ``step``, as a crash would (the checkpoints written before it stay)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_a_recall_run_that_crashed_resumes_to_the_uninterrupted_runs_weights_and_records(tmp_path):
    common = ["data.seq_len=16", "data.mqar.num_pairs=2", "train.micro_batch_size=16", "optim.lr=3e-3",
              "train.global_batch_tokens=256", "train.max_tokens=30_720", "train.val_every_tokens=5120",
              "train.ckpt_every_tokens=10_240", "data.mqar.stop_at_acc=null", "data.mqar.num_queries=4"]
    whole = train(recall_config(tmp_path, "name=whole", *common), progress=False)
    crashing = recall_config(tmp_path, "name=crashed", *common)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(crashing, progress=False, callbacks=[CrashAfter(55)])  # after the checkpoint and validation at 40
    resumed = train(crashing, progress=False)
    # never at 0.99 (no stop_at_acc: the bind threshold) in 120 steps: censored at the last step, logged once
    assert resumed.recall["recall/steps_to_bind"] == 120 and resumed.recall["recall/bound"] == 0.0
    for run in (whole, resumed):
        assert recall_history(run, "recall/steps_to_bind") == [(120, 120.0)]
        assert recall_history(run, "recall/bound") == [(120, 0.0)]
    a, b = load_checkpoint(whole.run_dir).model.state_dict(), load_checkpoint(resumed.run_dir).model.state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert resumed.recall == whole.recall


def test_the_bind_step_survives_a_checkpoint_and_an_unbound_run_is_censored_at_its_step(tmp_path):
    """The first step at the bind threshold goes into the checkpoint (a run that bound mid-run and was resumed later
    still reports it); a checkpoint older than the measure falls back on steps_to_<threshold>."""
    from satlab.config.derived import derive_schedule
    from satlab.training.module import LMModule

    cfg = recall_config(tmp_path, "data.seq_len=16", "data.mqar.num_pairs=2", "data.mqar.stop_at_acc=null",
                        "train.micro_batch_size=16", "train.global_batch_tokens=256")
    schedule = derive_schedule(cfg, world_size=1)
    module = LMModule(cfg, schedule)
    assert module.bind_threshold == 0.99 and module.bind_record() == {"recall/steps_to_bind": 0.0, "recall/bound": 0.0}
    module.bound_at = 300
    saved: dict = {}
    module.on_save_checkpoint(saved)
    restored = LMModule(cfg, schedule)
    restored.on_load_checkpoint(saved)
    assert restored.bind_record() == {"recall/steps_to_bind": 300.0, "recall/bound": 1.0}
    older = LMModule(cfg, schedule)
    older.on_load_checkpoint({"satlab_train_state": {"recall_reached": {"0.9": 200, "0.99": 700}}})
    assert older.bound_at == 700
