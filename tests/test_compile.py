"""Per-block torch.compile at the paper's depths: every architecture compiles with fullgraph=True into a few graphs
that serve every depth (none per layer), never recompiles once its training and no-grad graphs exist, and all of
them compile in one process. ``aot_eager`` traces exactly what inductor would receive (same graphs, same guards)
without spending minutes generating CPU kernels."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from satlab.models import ARCHITECTURES, build_model
from satlab.training.parallel import compile_blocks

CFG = dict(d_model=32, n_heads=4, n_kv_heads=2, mlp_hidden=64, vocab_size=101, max_seq_len=64)
MOST_GRAPHS = 6  # an architecture's own: block or sublayer, layer 0 or later, training or no-grad, its value path


def step(model, idx) -> torch.Tensor:
    """A training forward and backward, then a no-grad forward in eval mode (as validation runs)."""
    loss = model(idx).logits.logsumexp(-1).mean()
    loss.backward()
    with torch.no_grad():
        model.eval()
        model(idx)
        model.train()
    return loss.detach()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def compile_every_architecture(n_layers: int, idx: torch.Tensor, **cfg) -> tuple[list, dict[str, int]]:
    """Each architecture built at ``n_layers``, its blocks compiled (fullgraph) and stepped once: the models and the
    graphs each one added."""
    models, new_graphs = [], {}
    for arch in ARCHITECTURES:
        before = graphs()
        models.append(build_model(dict(arch=arch, n_layers=n_layers, **CFG, **cfg)))
        compile_blocks(models[-1], backend="aot_eager", fullgraph=True)
        step(models[-1], idx)
        new_graphs[arch] = graphs() - before
    return models, new_graphs


def test_every_architecture_compiles_a_few_graphs_that_serve_every_depth():
    """All architectures in one process, as the bench and the GPU check run them (they share Block's code, and their
    graphs add up past torch's default recompile limit of 8): a few graphs each at 11 layers, none more at 24 (no
    graph per layer), and no recompile when they run again, interleaved as the bench's paired rounds run them.
    That compiled equals eager, per architecture, is checked by ``test_sharding.py`` (compiled and sharded against
    one eager process)."""
    torch._dynamo.reset()
    counters.clear()
    idx = torch.randint(0, 101, (2, 16))
    models, new_graphs = compile_every_architecture(11, idx)
    assert new_graphs["transformer"] > 0 and max(new_graphs.values()) <= MOST_GRAPHS, new_graphs
    total = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        models += compile_every_architecture(24, idx)[0]
        for model in models:
            step(model, idx)
    assert graphs() == total


def test_completep_compiles_once_for_every_depth():
    """Under completep the branch multiplier changes with the depth: it is a tensor, not a float that dynamo would
    guard on, so 24 layers reuse the graphs of 11 (and their weights and multipliers differ from sp's)."""
    torch._dynamo.reset()
    counters.clear()
    idx = torch.randint(0, 101, (2, 16))
    completep = dict(parametrization="completep", base_width=16, base_depth=3)
    shallow, new_graphs = compile_every_architecture(11, idx, **completep)
    assert graphs() > 0 and max(new_graphs.values()) <= MOST_GRAPHS, new_graphs
    total = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        deep = compile_every_architecture(24, idx, **completep)[0]
    assert graphs() == total
    assert deep[-1].multipliers.branch != shallow[-1].multipliers.branch


@pytest.mark.slow  # make test-full (~40 s); every architecture and completep compile in the fast suite
def test_the_reference_mixing_compiles_the_whole_depth_loop_in_one_graph():
    """With ``model.mixing_impl=reference`` (what ``auto`` resolves to on a GPU) compile_blocks compiles the depth
    loop too, the blocks traced inline, so that inductor can fuse the mixing between them: it matches eager, makes
    one graph for training and one for no-grad (none per layer), and does not recompile. At 12 layers all six
    mixing loops (with mHC, DenseFormer and AttnRes) were checked so, 30-100 s each: here three of them at 3 layers
    (hyper-connections: the recomputed coefficients; MUDD: the per-token depth sums; Block AttnRes: the block sums)."""
    idx = torch.randint(0, 101, (2, 16))
    for arch in ("hyperconnections", "muddformer", "block_attnres"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        eager = build_model(dict(arch=arch, n_layers=3, mixing_impl="reference", **CFG))
        compiled = build_model(dict(arch=arch, n_layers=3, mixing_impl="reference", **CFG))
        compiled.load_state_dict(eager.state_dict())
        compile_blocks(compiled, backend="aot_eager", fullgraph=True)
        assert torch.allclose(step(compiled, idx), step(eager, idx), atol=1e-5), arch
        for p_compiled, p_eager in zip(compiled.parameters(), eager.parameters(), strict=True):
            assert torch.allclose(p_compiled.grad, p_eager.grad, atol=1e-5), arch
        assert graphs() == 2, f"{arch}: {graphs()} graphs, not one depth loop for training and one for no-grad"
        with torch._dynamo.config.patch(error_on_recompile=True):
            step(compiled, idx)
        assert graphs() == 2, arch
