"""Preallocated key/value cache for incremental decoding.

Each layer caches its keys after QK-norm and RoPE and its values after the value path (V'_n), so a SATFormer's
cache is exactly the Transformer's size: V_1 is needed only for the tokens being processed.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKVCache:
    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H_kv, T, d_h) after the cached tokens; return all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} tokens; cannot append up to position {end}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """One :class:`LayerKVCache` per layer, plus the number of tokens already processed."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.layers = [LayerKVCache(batch, n_kv_heads, max_len, head_dim, device, dtype) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length
