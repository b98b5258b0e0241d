"""Distributed strategies and torch.compile, selected by ``train.strategy`` and ``train.compile``.

- ``ddp``: Lightning DDP (gloo on CPU, NCCL on GPUs).
- ``fsdp``: Lightning's FSDPStrategy, auto-wrapping each block, sharded checkpoints, optional activation
  checkpointing per block. It refuses a CPU.
- ``model_parallel``: Lightning's ModelParallelStrategy; :func:`shard_model` applies FSDP2 ``fully_shard`` to each
  block and then the root inside ``configure_model``, after per-block compilation. It also runs on CPU (gloo).

Compilation is per block (``fullgraph=True``): every block of one architecture shares one graph (only block 0,
which records V_1, differs), so a run compiles a handful of graphs and never recompiles. ``torch.compile`` on the
LightningModule itself is not supported by Lightning; compiling the blocks is also what FSDP2 wants.
"""

from __future__ import annotations

import torch
from torch import nn

from satlab.config.schema import ExperimentConfig
from satlab.models.layers import Block


def make_strategy(cfg: ExperimentConfig):
    """The Lightning strategy object (or name) for ``cfg.train.strategy``."""
    t = cfg.train
    if t.strategy in ("auto", "ddp"):
        return t.strategy
    if t.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if t.activation_checkpointing else None,
            state_dict_type="sharded",
            sharding_strategy="FULL_SHARD",
        )
    from lightning.pytorch.strategies import ModelParallelStrategy

    # A full (gathered) checkpoint keeps `load_checkpoint` and `satlab eval` working on one file.
    return ModelParallelStrategy(data_parallel_size=t.data_parallel_size or t.devices * t.num_nodes,
                                 tensor_parallel_size=1,
                                 save_distributed_checkpoint=False)


def compile_blocks(model: nn.Module, backend: str = "inductor", fullgraph: bool = True) -> None:
    """Compile each block's sublayers in place. Depth loops that rewire sublayers (hyper-connections, MUDD) call
    ``attend``/``feedforward`` directly, so those are compiled too, not only ``forward``."""
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
        block.attend = torch.compile(block.attend, backend=backend, fullgraph=fullgraph)
        block.feedforward = torch.compile(block.feedforward, backend=backend, fullgraph=fullgraph)


def shard_model(model: nn.Module, mesh, precision: str, activation_checkpointing: bool) -> None:
    """FSDP2: shard every block, then the root (embedding, final norm and the variants' own parameters)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision.startswith("bf16"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
