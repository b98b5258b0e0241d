"""`satlab coord --reference DIR`: the check run on another code base's models, here a stand-in written with the
reference's interface (nanoGPT-mup, branch completep: GPTConfig, GPT, configure_optimizers with ``lr_scale``), since
the reference itself is not shipped. What is tested is satlab's side: probes on the reference's module names, a
branch read before the block's depth multiplier, the reference's per-group ``lr_scale`` applied, and bad input."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from satlab.bench.coord import Measurement
from satlab.bench.coord_reference import reference_implementation
from satlab.bench.coord_settings import CoordSettings, Shape
from satlab.cli.main import main

STAND_IN = textwrap.dedent('''
    from dataclasses import dataclass
    import torch
    from torch import nn
    from torch.nn import functional as F

    @dataclass
    class GPTConfig:
        block_size: int = 64
        vocab_size: int = 256
        n_layer: int = 2
        n_head: int = 2
        n_embd: int = 32
        dropout: float = 0.0
        bias: bool = True
        init_std: float = 0.02
        mup_enabled: bool = False
        mup_width_multiplier: float = 1.0
        depth_alpha_enabled: bool = False
        depth_multiplier: float = 1.0
        depth_alpha_exp: float = 1.0
        lr_scale: float = 1.0  # the stand-in's knob: every group's lr_scale

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n_head, self.qkv = c.n_head, nn.Linear(c.n_embd, 3 * c.n_embd)
            self.proj = nn.Linear(c.n_embd, c.n_embd)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / q.shape[-1])
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
            self.attn = Attention(c)
            self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))
            self.residual_scaling = 1 / c.depth_multiplier ** c.depth_alpha_exp if c.depth_alpha_enabled else 1.0

        def forward(self, x):
            x = x + self.residual_scaling * self.attn(self.ln_1(x))
            return x + self.residual_scaling * self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = c = config
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
                h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]), ln_f=nn.LayerNorm(c.n_embd)))
            self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
            print("number of parameters: printed, as the reference does")

        def forward(self, idx, targets=None):
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        def configure_optimizers(self, weight_decay, learning_rate, betas, adam_eps, device_type):
            groups = [{"params": list(self.parameters()), "weight_decay": weight_decay,
                       "lr_scale": self.config.lr_scale}]
            return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=adam_eps)
''')


@pytest.fixture
def stand_in(tmp_path):
    folder = tmp_path / "nanogpt-mup"
    folder.mkdir()
    (folder / "model.py").write_text(STAND_IN)
    return folder


def measured(folder, shape: Shape, steps: int = 3, **config) -> Measurement:
    """One shape measured through the reference path, with the stand-in's config fields overridden."""
    from satlab.bench.coord import shape_config, token_batch

    implementation = reference_implementation(folder, head_dim=16, seq_len=16)
    module = __import__("nanogpt_mup_reference_model")
    made = module.GPTConfig

    def patched(**kwargs):
        return made(**{**kwargs, **config})

    module.GPTConfig = patched
    try:
        settings = CoordSettings(archs=["transformer"], batch=2, seq_len=16, head_dim=16)
        return implementation.measure(shape_config(shape, settings), shape, [token_batch(2, 16)] * (steps + 1))
    finally:
        module.GPTConfig = made


def test_the_command_measures_the_reference_and_says_so(stand_in, tmp_path, capsys, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "out"
    code = main(["coord", "--reference", str(stand_in), "--widths", "32,64", "--depths", "1,2", "--steps", "3",
                 "--seeds", "0", "--head-dim", "16", "--batch", "2", "--seq-len", "16", "--out", str(out)])
    assert code in (0, 1)
    report = json.loads((out / "coord.json").read_text())
    assert report["implementation"].startswith("nanogpt-mup-completep") and report["parametrization"] == "completep"
    rms = report["archs"]["transformer"]["series"]["depth"]["rms"][1]  # depth 2
    for probe in ("embed", "logits", "attn_logits[first]", "attn_out[last]", "mlp_out[mid]", "block_out[all]"):
        assert len(rms[probe]) == 4 and all(v > 0 for v in rms[probe]), probe
    assert "nanogpt-mup-completep" in capsys.readouterr().out
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run, = client.search_runs([client.get_experiment_by_name("coord").experiment_id])
    assert run.info.run_name == "coord-completep-nanogpt-mup-completep(alpha=1)"  # told apart from satlab's run
    assert run.data.params["implementation"] == "nanogpt-mup-completep(alpha=1)"


def test_a_branch_is_read_before_the_blocks_depth_multiplier(stand_in):
    shape = Shape("transformer", "depth", 32, 2)
    plain = measured(stand_in, shape, steps=0, depth_alpha_enabled=False)
    scaled = measured(stand_in, shape, steps=0, depth_alpha_enabled=True, depth_multiplier=100.0)
    # the first attention branch reads the embedding alone: its F(h) is the same whatever multiplies it ...
    assert scaled.rms["attn_out[first]"] == pytest.approx(plain.rms["attn_out[first]"], rel=1e-6)
    assert scaled.losses[0] != pytest.approx(plain.losses[0], rel=1e-6)  # ... while the multiplier did act


def test_the_references_per_group_lr_scale_is_applied(stand_in):
    shape = Shape("transformer", "width", 32, 2)
    frozen = measured(stand_in, shape, lr_scale=0.0)
    moving = measured(stand_in, shape, lr_scale=1.0)
    assert frozen.losses == pytest.approx([frozen.losses[0]] * 4)  # lr x 0: nothing moves
    assert moving.losses[-1] < moving.losses[0] - 0.05


def test_the_dry_run_counts_the_references_parameters(stand_in, tmp_path, capsys):
    assert main(["coord", "--reference", str(stand_in), "--widths", "32,64", "--depths", "1,2", "--steps", "3",
                 "--head-dim", "16", "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    with torch.device("meta"):
        module = __import__("nanogpt_mup_reference_model")
        params = sum(p.numel() for p in module.GPT(module.GPTConfig(n_layer=2, n_head=8, n_embd=128,
                                                                     block_size=32)).parameters())
    assert f"{params / 1e6:.2f}M" in printed and "nanogpt-mup-completep" in printed  # width 128, depth 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--reference", "{missing}"], "holds no model.py"),
    (["--reference", "{plain}"], "no CompleteP depth options"),
    (["--reference", "{stand_in}", "--archs", "satformer"], "plain Transformer only"),
    (["--reference", "{stand_in}", "--parametrization", "sp"], "leave --parametrization out or pass completep"),
])
def test_bad_reference_input_is_refused_with_nothing_written(args, message, stand_in, tmp_path, capsys):
    plain = tmp_path / "master"
    plain.mkdir()
    (plain / "model.py").write_text("from dataclasses import dataclass\n\n@dataclass\nclass GPTConfig:\n"
                                    "    n_layer: int = 2\n")  # master's model: no depth options
    paths = {"missing": tmp_path / "nowhere", "plain": plain, "stand_in": stand_in}
    out = tmp_path / "out"
    code = main(["coord", *[a.format(**paths) for a in args], "--widths", "32,64", "--depths", "1,2",
                 "--head-dim", "16", "--out", str(out), "--no-mlflow"])
    assert code == 2 and message in capsys.readouterr().err and not out.exists()
