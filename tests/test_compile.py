"""Per-block torch.compile: every architecture compiles with fullgraph=True, matches eager, and never recompiles
once the training and evaluation graphs exist. ``aot_eager`` traces exactly what inductor would receive (same
graphs, same guards) without spending minutes generating CPU kernels."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from satlab.models import ARCHITECTURES, build_model
from satlab.training.parallel import compile_blocks

CFG = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=64, vocab_size=101, max_seq_len=64)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_compiled_blocks_match_eager_and_do_not_recompile(arch):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = build_model(dict(arch=arch, **CFG))
    compiled = build_model(dict(arch=arch, **CFG))
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled, backend="aot_eager", fullgraph=True)
    idx = torch.randint(0, 101, (2, 32))

    def step(model):
        loss = model(idx).logits.logsumexp(-1).mean()
        loss.backward()
        with torch.no_grad():
            model.eval()
            model(idx)
            model.train()
        return loss.detach()

    assert torch.allclose(step(compiled), step(eager), atol=1e-5)
    for p_compiled, p_eager in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert torch.allclose(p_compiled.grad, p_eager.grad, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            step(compiled)
    assert counters["stats"]["unique_graphs"] == graphs
