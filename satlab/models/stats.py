"""Parameter counts and analytic FLOPs per token."""

from __future__ import annotations

from torch import nn


def count_params(model: nn.Module) -> int:
    """All parameters, a tied embedding/head counted once."""
    return sum(p.numel() for p in model.parameters())


def non_embedding_params(model) -> int:
    """Parameters outside the embedding tables (the token embedding, and lookup tables such as value embeddings:
    no FLOPs) and the LM head (tied by default: then one matrix)."""
    head = 0 if model.lm_head is None else model.lm_head.weight.numel()
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    return count_params(model) - tables - head


def flops_per_token(model, seq_len: int, head_fraction: float = 1.0) -> float:
    """Training FLOPs per token: 6·(N_non_emb + f·V·d) + 12·L·d·T, plus the depth loop's own mixing matmuls.

    The LM head is a matmul that runs at the scored positions, a share ``f`` (``head_fraction``) of them: every
    token of text, the answers of a synthetic recall task; counted as V·d (tied by default, when its weight is the
    embedding's); the embedding lookup is free. 12·L·d·T is the attention score and value matmuls (forward and
    backward, causal masking not discounted), as in torchtitan and nanoGPT. Hyper-connections add their stream
    mixing (about 2 % at the tiny size, < 0.1 % at the paper sizes).
    """
    cfg = model.cfg
    n = non_embedding_params(model) + head_fraction * cfg.vocab_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len + model.stream.extra_flops_per_token()
