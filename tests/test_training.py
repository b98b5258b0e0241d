"""Training runs end to end on the CPU: every architecture trains 20 steps and lands in a temporary MLflow store;
resume=auto continues the same run; the optimizer and schedule do what the config says."""

from __future__ import annotations

import math
import subprocess
import sys

import mlflow
import pytest
import torch

from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.config.schema import OptimConfig
from satlab.models import ARCHITECTURES, build_model
from satlab.training.checkpoint import load_checkpoint
from satlab.training.module import lr_factor, parameter_groups
from satlab.training.run import train

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.mlp_hidden=64",
    "data.source=kjv", "data.tokenizer.kind=byte", "data.seq_len=64",
    "train.micro_batch_size=8", "train.global_batch_tokens=512", "train.max_tokens=10240",
    "train.val_every_tokens=5120", "train.val_tokens=1024", "train.ckpt_every_tokens=5120",
    "train.log_every_n_steps=5",
]


def tiny_config(tmp_path, *extra: str):
    overrides = [*TINY, f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'runs'}",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}", *extra]
    return load_experiment("default", overrides)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_twenty_steps_of_every_architecture_land_in_mlflow(workdir, arch):
    cfg = tiny_config(workdir, f"model.arch={arch}", f"name=t-{arch}", "tracking.experiment=tests")
    result = train(cfg, preset="test", progress=False)
    assert result.tokens == 20 * 512
    assert math.isfinite(result.final_val_loss) and result.final_val_loss < result.initial_val_loss

    client = mlflow.MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.arch"] == arch and run.data.tags["arch"] == arch
    for metric in ("train/loss", "val/loss", "val/ppl", "system/tokens_per_sec", "tokens_seen", "train/lr"):
        assert metric in run.data.metrics, metric
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")][0] == 0
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert (result.run_dir / "checkpoints" / "last.ckpt").exists()


def test_resume_auto_continues_the_same_run_and_mlflow_record(tmp_path):
    first = train(tiny_config(tmp_path, "name=resumed", "train.log_every_n_steps=1"), progress=False)
    assert first.tokens == 20 * 512
    second = train(tiny_config(tmp_path, "name=resumed", "train.max_tokens=15360", "train.log_every_n_steps=1"),
                   progress=False)
    assert second.run_dir == first.run_dir and second.mlflow_run_id == first.mlflow_run_id
    assert second.tokens == 30 * 512 and second.initial_val_loss is None
    history = mlflow.MlflowClient(first.tracking_uri).get_metric_history(first.mlflow_run_id, "tokens_seen")
    assert max(m.value for m in history) == 30 * 512


def test_resume_never_starts_a_new_directory_and_keeps_the_old_one(tmp_path):
    first = train(tiny_config(tmp_path, "name=fresh", "train.max_tokens=2560"), progress=False)
    second = train(tiny_config(tmp_path, "name=fresh", "train.max_tokens=2560", "train.resume=never"),
                   progress=False)
    assert second.run_dir != first.run_dir and (first.run_dir / "checkpoints" / "last.ckpt").exists()
    assert second.mlflow_run_id != first.mlflow_run_id


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_weight_decay_skips_norms_and_static_mixing_weights_unless_decay_all():
    model = build_model(dict(arch="hyperconnections", d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                             vocab_size=64, max_seq_len=64))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = parameter_groups(model, OptimConfig(weight_decay=0.1, lr=1e-3))
    decayed = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert "blocks.0.attn.q_proj.weight" in decayed and "embed.weight" in decayed
    assert not {n for n in decayed if "norm" in n or "static" in n}
    everything = parameter_groups(model, OptimConfig(weight_decay=0.1, decay_all=True, lr=1e-3))
    assert all(g["weight_decay"] == 0.1 for g in everything)


def test_gate_parameters_get_their_own_learning_rate():
    model = build_model(dict(arch="satformer", d_model=32, n_layers=2, n_heads=2, mlp_hidden=64, vocab_size=64,
                             max_seq_len=64))
    groups = parameter_groups(model, OptimConfig(weight_decay=0.1, lr=1e-3, gate_lr_multiplier=10.0))
    gate = model.blocks[1].attn.value_path.proj.weight
    lrs = {g["lr"] for g in groups if any(p is gate for p in g["params"])}
    assert lrs == {1e-2}
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in model.parameters())


@pytest.mark.process
def test_train_cli_rejects_a_typo_with_did_you_mean_and_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "satlab.cli.main", "train", "optim.lrr=1e-3",
                           f"train.out_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "did you mean 'lr'" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_alone_restores_model_tokenizer_and_config(tmp_path):
    result = train(tiny_config(tmp_path, "name=ckpt", "model.arch=resformer", "train.max_tokens=1024"),
                   progress=False)
    loaded = load_checkpoint(result.run_dir)
    assert loaded.model.embed.weight.shape[0] == 258  # the model's vocabulary is the byte tokenizer's
    assert loaded.cfg.model.arch == "resformer" and loaded.step == 2
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("In the beginning")) == "In the beginning"
    idx = torch.tensor([loaded.tokenizer.encode("In the beginning")])
    assert torch.isfinite(loaded.model(idx).logits).all()


def test_loading_a_missing_or_corrupt_checkpoint_says_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_checkpoint(bad)


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_a_lightning_step_equals_a_bare_adamw_step_with_norm_clipping():
    """The module clips with the norm it logs (one pass over the gradients): the parameters after three steps with
    clipping active equal a plain loop's AdamW + ``clip_grad_norm_`` + scheduler steps, and those of the bare loop
    the bench's Lightning-overhead figure times (which must do the Trainer's work)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from satlab.bench.overhead import _bare_steps
    from satlab.config.derived import derive_schedule
    from satlab.training.module import LMModule, lr_factor, parameter_groups

    cfg = load_experiment("default", [*TINY[:4], "model.vocab_size=64", "data.seq_len=32", "train.micro_batch_size=4",
                                      "train.global_batch_tokens=128", "train.max_tokens=384", "optim.grad_clip=0.05"])
    schedule, optim = derive_schedule(cfg), cfg.optim
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    loader = DataLoader([(tokens[:, :-1], tokens[:, 1:])] * 3, batch_size=None)
    modules = []
    for _ in range(3):
        torch.manual_seed(0)
        modules.append(LMModule(cfg, schedule))
    plain, bench_loop, lightning = modules
    optimizer = torch.optim.AdamW(parameter_groups(plain.model, optim, cfg.model), betas=tuple(optim.betas),
                                  eps=optim.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, schedule.warmup_steps, schedule.max_steps, optim.min_lr_ratio))
    for idx, targets in loader:
        plain.loss(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(plain.model.parameters(), optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    assert len(_bare_steps(bench_loop, loader, optim.grad_clip)) == 3
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=optim.grad_clip,
              limit_val_batches=0).fit(lightning, train_dataloaders=loader)
    for other in (bench_loop, lightning):
        for (name, a), b in zip(plain.model.named_parameters(), other.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def metric_points(client: mlflow.MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics}


def test_every_metric_has_one_tokens_seen_point_at_its_step_and_batch_sizes_line_up_on_it(tmp_path):
    """MLflow plots a metric against ``tokens_seen`` by joining their points on the step: every step at which any
    metric (train, validation, gates, throughput) is logged has exactly one ``tokens_seen`` point. Two runs of
    different batch sizes in two experiments validate at the same token counts. A fit that validated at its last
    step is not validated again: the last val/loss point is logged once, not repeated a step later."""
    results = [train(tiny_config(tmp_path, f"name=b{tokens}", f"train.global_batch_tokens={tokens}",
                                 f"tracking.experiment=batch-{tokens}"), progress=False)
               for tokens in (512, 1024)]
    client = mlflow.MlflowClient(results[0].tracking_uri)
    val_tokens = []
    for result in results:
        points = metric_points(client, result.mlflow_run_id)
        tokens = points.pop("tokens_seen")
        steps = [step for step, _ in tokens]
        assert len(steps) == len(set(steps)), tokens  # one point per step: the join pairs each metric point once
        assert [value for _, value in tokens] == sorted(value for _, value in tokens)
        for key, history in points.items():
            assert {step for step, _ in history} <= set(steps), key
        at = dict(tokens)
        assert len(points["val/loss"]) == len({step for step, _ in points["val/loss"]}) == 3  # before, middle, end
        assert points["val/loss"][-1][1] == pytest.approx(result.final_val_loss)
        val_tokens.append([at[step] for step, _ in points["val/loss"]])
    assert val_tokens[0] == val_tokens[1] == [0, 5120, 10240]
    assert len({r.experiment for r in results}) == 2
