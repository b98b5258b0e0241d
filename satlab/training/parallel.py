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
    # Both sharded strategies write checkpoints as directories of per-rank shards (no rank ever holds the whole
    # model and optimizer state), renamed into place when complete (satlab.training.resilience); `satlab eval` and
    # resume read them in that form (docs/checkpoints.md).
    from satlab.training.resilience import AtomicFSDPStrategy, AtomicModelParallelStrategy

    if t.strategy == "fsdp":
        return AtomicFSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if t.activation_checkpointing else None,
            state_dict_type="sharded",
            sharding_strategy="FULL_SHARD",
        )
    return AtomicModelParallelStrategy(data_parallel_size=t.data_parallel_size or t.devices * t.num_nodes,
                                       tensor_parallel_size=1,
                                       save_distributed_checkpoint=True)


RECOMPILE_LIMIT = 64
"""Graphs dynamo may keep per code object. Every architecture's blocks run the one ``Block.forward``, and each
architecture gives it a few graphs of its own (whole block or sublayer, layer 0 or later, training or no-grad, its
value path): at most 6, counted by ``tests/test_compile.py``. Torch's default of 8 is for one model per process; a
process that compiles several architectures (the bench, the GPU check, a test) needs room for all of them. A
recompile within one architecture is still an error there (``error_on_recompile``)."""


def compile_blocks(model: nn.Module, backend: str = "inductor", fullgraph: bool = True,
                   whole_loop: bool = True) -> None:
    """Compile each block in place. Depth loops that rewire sublayers (hyper-connections, MUDD) call them through
    the block's forward (``part=``), so one compiled forward serves every depth loop.

    With ``whole_loop``, a depth loop with mixing of its own (it has a ``mixing_impl``: hyper-connections, mHC,
    MUDDFormer, DenseFormer, AttnRes) is compiled whole as well, so that inductor fuses the mixing between the
    blocks: one graph of the unrolled loop, the blocks traced inline. That graph is only used where the mixing
    resolves to its reference (``model.mixing_impl``: always on a GPU with ``auto``): the hand-written functions
    are for eager CPU runs, and the model is on the CPU here, moved to its device later (Lightning), so the choice
    is made per call. A model that FSDP will shard passes ``whole_loop=False`` and keeps the per-block graphs:
    dynamo does not trace through FSDP's hooks in one graph."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    stream, impl = model.stream, getattr(model.stream, "mixing_impl", None)
    if not whole_loop or impl is None or impl == "handwritten":
        return
    from satlab.models.layers import handwritten

    loop, eager = torch.compile(stream.forward, backend=backend, fullgraph=fullgraph), stream.forward

    def forward(x: torch.Tensor, ctx) -> torch.Tensor:
        return eager(x, ctx) if handwritten(impl, x) else loop(x, ctx)

    stream.forward = forward


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing: each block call (a whole block or one sublayer) keeps only its inputs and is
    recomputed in backward. The blocks are wrapped where they are called (the depth loops call every sublayer
    through the block's forward), so it applies to every architecture, under any strategy but Lightning's FSDP,
    which wraps them itself."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))


def shard_model(model: nn.Module, mesh, precision: str) -> None:
    """FSDP2: shard every block, then the root (embedding, final norm and the variants' own parameters).

    With bf16 the parameters are gathered and computed in bf16 and gradients reduced in fp32; the sharded
    parameters and AdamW's states stay fp32. That differs from DDP with bf16 autocast, where the fp32 parameters are
    cast per op and matmuls run in bf16 but norms, softmax and the mixing functions that disable autocast (depth
    sums, hyper-connection streams) run in fp32: under FSDP2 those see bf16 parameters (cast back to fp32 where
    they compute in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision.startswith("bf16"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
