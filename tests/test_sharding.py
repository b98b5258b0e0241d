"""The scale path for every architecture at the paper's depth, on the CPU: FSDP2 sharding on 2 gloo ranks (eager,
compiled, activation-checkpointed) trains to the losses of one process, and activation checkpointing stores less.

The ranks run what ``LMModule.configure_model`` runs under ``train.strategy=model_parallel`` (``checkpoint_blocks``,
``compile_blocks``, ``shard_model``) with the training's AdamW groups, in one pair of processes for every
architecture: a Lightning run per architecture and mode would take minutes each. The end-to-end Lightning runs are
``tests/test_distributed.py``."""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from filelock import FileLock

from satlab.config.schema import OptimConfig
from satlab.models import ARCHITECTURES, build_model
from satlab.training.module import parameter_groups
from satlab.training.parallel import checkpoint_blocks, compile_blocks, shard_model

DEPTH = 11  # the paper's small model
CFG = dict(d_model=32, n_layers=DEPTH, n_heads=4, n_kv_heads=2, mlp_hidden=64, vocab_size=97, max_seq_len=64)
STEPS, BATCH, SEQ, WORLD = 3, 4, 16, 2
MODES = ("eager", "compiled", "checkpointed", "completep")
"""``completep``: compiled, under CompleteP (the branch multiplier a buffer of each sharded block, the per-group
learning rates and epsilons of its table)."""
COMPLETEP = dict(parametrization="completep", base_width=16, base_depth=3)
VIEW_WARNING = "returned a view tensor"
"""FSDP2's warning for a sharded block that returns a view (which no block does; see Attention's docstring)."""


def batches() -> list[torch.Tensor]:
    """One batch, every step: its loss must fall (a check that training happened at all)."""
    batch = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [batch] * STEPS


def prepared(arch: str, mode: str, mesh=None) -> torch.nn.Module:
    """The model as ``configure_model`` leaves it: checkpoint wrappers, then compile, then FSDP2 when ``mesh``."""
    torch.manual_seed(0)
    model = build_model(dict(arch=arch, **CFG, **(COMPLETEP if mode == "completep" else {})))
    if mode == "checkpointed":
        checkpoint_blocks(model)
    if mode in ("compiled", "completep"):
        compile_blocks(model, backend="aot_eager", fullgraph=True, whole_loop=mesh is None)
    if mesh is not None:
        shard_model(model, mesh, "32-true")
    return model


def train_losses(model: torch.nn.Module, rows: slice = slice(None)) -> list[float]:
    """AdamW steps on ``rows`` of each batch; the loss of the whole batch (mean over ranks when distributed)."""
    optimizer = torch.optim.AdamW(parameter_groups(model, OptimConfig(weight_decay=0.1, lr=3e-3)), lr=3e-3)
    losses = []
    for batch in batches():
        idx, targets = batch[rows, :-1], batch[rows, 1:]
        loss = F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        per_rank = BATCH // WORLD
        results, views = {}, {}
        for arch in ARCHITECTURES:
            for mode in MODES:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        results[f"{arch}/{mode}"] = train_losses(prepared(arch, mode, mesh),
                                                                 slice(rank * per_rank, (rank + 1) * per_rank))
                    except Exception as error:  # reported per case, so one failure does not hide the others
                        results[f"{arch}/{mode}"] = f"{type(error).__name__}: {error}"[:500]
                views[f"{arch}/{mode}"] = [str(w.message)[:200] for w in caught if VIEW_WARNING in str(w.message)]
        results["views"] = views
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded_losses(tmp_path_factory) -> dict:
    """Every architecture trained once on two ranks, for all the parametrised cases: the losses are written to the
    test session's shared folder under a lock, so a pytest-xdist worker that gets some of the cases reads them
    instead of training the ranks again."""
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's folder is popen-gwN inside the session's
        session = session.parent
    out = session / "fsdp2-losses.json"
    with FileLock(f"{out}.lock"):
        if not out.is_file():
            mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn", join=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.process
def test_fsdp2_on_two_ranks_trains_every_architecture_to_the_single_process_losses(sharded_losses, arch):
    torch.set_num_threads(1)
    single = train_losses(prepared(arch, "eager"))
    torch.manual_seed(0)
    single_completep = train_losses(build_model(dict(arch=arch, **CFG, **COMPLETEP)))  # eager, one process
    for mode in MODES:
        losses = sharded_losses[f"{arch}/{mode}"]
        assert not isinstance(losses, str), f"{mode}: {losses}"
        assert not sharded_losses["views"][f"{arch}/{mode}"], mode
        assert losses == pytest.approx(single_completep if mode == "completep" else single, abs=2e-5), mode
    assert single[-1] < single[0] and single_completep[-1] < single_completep[0]
    assert single_completep != single


def saved_activation_bytes(model: torch.nn.Module, idx: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward in one training forward (parameters not counted; one count
    per storage)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(idx).logits.float().logsumexp(-1).mean()
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_activation_checkpointing_stores_less_for_every_architecture(arch):
    """Every block or sublayer call is recomputed: what stays is the depth loop's own state (the streams of
    hyper-connections and mHC, the dense loops' buffers) and each call's inputs."""
    idx = torch.randint(0, CFG["vocab_size"], (BATCH, 64))
    full = saved_activation_bytes(prepared(arch, "eager"), idx)
    checkpointed = saved_activation_bytes(prepared(arch, "checkpointed"), idx)
    assert checkpointed < 0.6 * full, f"{checkpointed / 1e6:.2f} MB checkpointed against {full / 1e6:.2f} MB"
