"""The coordinate check run on CompleteP's reference implementation, to tell a property of CompleteP from a bug of
satlab's.

The reference is EleutherAI's nanoGPT-mup, branch ``completep`` (the code the CompleteP paper, Dey et al. 2025,
points to): a GPT-2 block (LayerNorm, GELU MLP, learned positions, biases) whose residual branches are scaled by
``(L / L_base)^-alpha``, with μP's width rules and CompleteP's learning-rate, epsilon and weight-decay bookkeeping in
its ``configure_optimizers``. Its code is not part of satlab: the caller names the folder of a checkout and its
``model.py`` is imported from there. Each model is built with the reference's own ``GPTConfig`` and optimizer groups
and trained through satlab's loop (:func:`satlab.bench.coord.probed_steps`) on satlab's batch, at the learning rate,
betas, epsilon and weight decay of satlab's config for the same shape, so the two implementations are measured on the
same footing and their slopes come from the same code. The probes are the same kinds as satlab's where the reference
has the module: the embedding, the attention logits (read from the scaled-dot-product call), every attention and
MLP branch before its depth multiplier, every block's output and the logits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType

import torch

from satlab.bench.coord import Batches, Implementation, Measurement, probed_steps
from satlab.bench.coord_probes import Probes
from satlab.bench.coord_settings import Shape, base_shape
from satlab.config.schema import ExperimentConfig
from satlab.data.tokenizer import BYTE_VOCAB

INIT_STD = 0.02
"""The reference's own default init std (its ``train.py``), used unchanged."""


class ReferenceProbes(Probes):
    """:class:`satlab.bench.coord.Probes` hooked on the reference's module names (``transformer.wte``,
    ``transformer.h[i].attn`` / ``.mlp``, the blocks, ``lm_head``). A branch's module does not contain the block's
    ``residual_scaling``, so its output is F(h), as satlab's probes record it."""

    def _install(self) -> None:
        model = self.model
        self._hook(model.transformer.wte, lambda m, i, o: self.add("embed", 0, o))
        self._hook(model.lm_head, lambda m, i, o: self.add("logits", 0, o))
        for n, block in enumerate(model.transformer.h):
            self._hook(block.attn, lambda m, a, kw, n=n: setattr(self, "layer", n), pre=True)
            self._hook(block.attn, lambda m, i, o, n=n: self.add("attn_out", n, o))
            self._hook(block.mlp, lambda m, i, o, n=n: self.add("mlp_out", n, o))
            self._hook(block, lambda m, i, o, n=n: self.add("block_out", n, o))


def load_reference(folder: Path) -> ModuleType:
    """The reference's ``model.py`` from a checkout of EleutherAI/nanoGPT-mup at branch ``completep``. Raises
    ValueError, saying what is missing, when the folder does not hold that file or the file lacks CompleteP's
    depth options."""
    path = Path(folder) / "model.py"
    if not path.is_file():
        raise ValueError(f"{folder} holds no model.py: pass the folder of a checkout of EleutherAI/nanoGPT-mup at "
                         "branch completep (git clone -b completep https://github.com/EleutherAI/nanoGPT-mup)")
    spec = importlib.util.spec_from_file_location("nanogpt_mup_reference_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file is executed
    spec.loader.exec_module(module)
    fields = getattr(getattr(module, "GPTConfig", None), "__dataclass_fields__", {})
    if not {"depth_alpha_enabled", "depth_multiplier", "depth_alpha_exp", "mup_width_multiplier"} <= set(fields):
        raise ValueError(f"{path} has no CompleteP depth options (GPTConfig.depth_alpha_enabled, ...): check out "
                         "branch completep, not master")
    return module


def reference_config(module: ModuleType, shape: Shape, head_dim: int, seq_len: int, alpha: float = 1.0):
    """The reference's GPTConfig of one shape: μP and CompleteP on, the width and depth multipliers against
    satlab's base shape (the tiny preset's width and depth), byte vocabulary, no dropout."""
    base_width, base_depth = base_shape()
    return module.GPTConfig(
        block_size=seq_len, vocab_size=BYTE_VOCAB, n_layer=shape.depth, n_head=shape.width // head_dim,
        n_embd=shape.width, dropout=0.0, bias=True, init_std=INIT_STD, mup_enabled=True,
        mup_width_multiplier=shape.width / base_width, depth_alpha_enabled=True,
        depth_multiplier=shape.depth / base_depth, depth_alpha_exp=alpha)


def reference_implementation(folder: Path, head_dim: int, seq_len: int, alpha: float = 1.0) -> Implementation:
    """The reference as an :class:`Implementation` for :func:`satlab.bench.coord.coord_check`."""
    module = load_reference(folder)

    def measure(cfg: ExperimentConfig, shape: Shape, batches: Batches) -> Measurement:
        optim = cfg.optim
        torch.manual_seed(cfg.train.seed)
        with contextlib.redirect_stdout(io.StringIO()):  # the reference prints its parameter counts
            model = module.GPT(reference_config(module, shape, head_dim, seq_len, alpha))
            optimizer = model.configure_optimizers(optim.weight_decay, optim.lr, tuple(optim.betas), optim.eps,
                                                   "cpu")
        for group in optimizer.param_groups:  # what the reference's train.py does before every step
            group["lr"] = optim.lr * group.get("lr_scale", 1.0)
        model.train()
        return probed_steps(model, ReferenceProbes(model), lambda x, y: model(x, y)[1], optimizer.step, batches)

    def params(cfg: ExperimentConfig, shape: Shape) -> int:
        with torch.device("meta"), contextlib.redirect_stdout(io.StringIO()):
            return sum(p.numel() for p in module.GPT(reference_config(module, shape, head_dim, seq_len, alpha))
                       .parameters())

    return Implementation(f"nanogpt-mup-completep(alpha={alpha:g})", measure, params)
