"""What SATFormer's gates do on a fixed evaluation batch: per layer × KV head mean gate, sparsity, saturation and dead
heads, and the mean gate by token category.

Definitions (``tol`` is ``bound_tol`` and ``share`` is ``saturation_share``, arguments of :func:`analyze_gates`
like ``dead_share``; "elements" are the gate values of one (layer, head): tokens, or tokens × channels for
``token_channel`` gates):

- *mean*: the mean gate over a head's elements; for ``token_channel`` gates this averages over channels too.
- *sparsity*: the share of elements with ``|g| < tol`` (the issue's "exactly zero or < 1e-3" at the default tol).
  Signed gate functions (tanh, identity) count by magnitude.
- *saturation*: by the rule of the gate function in the table (:attr:`GateFunction.saturates
  <satlab.config.gate_functions.GateFunction.saturates>`, :func:`saturation_rule`), against its bounds
  (:func:`gate_bounds`); the report's ``saturation`` is the share of a head's elements within ``tol`` of its most
  frequent bound, whatever the rule.

  - ``pinned`` (sigmoid: 0 or 1; 2sigmoid: 0 or 2; tanh: -1 or 1; softmax and softmax_sigmoid: 0 or G, G = number
    of gate heads, so G means "one head takes all"; with G = 1 softmax is the constant 1 and counts as saturated,
    softmax_sigmoid is a sigmoid): saturated when at least ``share`` of its elements lie within ``tol`` of one and
    the same bound. A head that flips between two bounds is a switch, not saturated.
  - ``dead`` (relu): saturated only when closed, ``|g| < tol``, on at least ``dead_share`` of its elements; the
    default 1.0 means on every element of the windows. A ReLU head closed on most but not all tokens is sparse
    (a feature: it still opens, and learns, on the others), which ``sparsity`` reports; it is not saturated.
  - ``never`` (identity): unbounded, never saturated (a closed identity gate shows up as a dead head).
- *dead head*: a (layer, head) whose sparsity is at least ``share`` (the gate is ~0 for nearly every element), for
  every gate function; for sigmoid and the softmax variants a dead head is also saturated at 0, for relu only when
  its sparsity reaches ``dead_share`` (by default: closed on every element).

Categories average each token's gate over heads (and channels) and report, per gated layer, the mean over the
tokens of each category value: ``occurrence`` (``first`` vs ``repeated``: the token id already occurred earlier in
the same row), ``kind`` (decoded token text: ``space``, ``punct``, ``word`` if it has a letter or digit,
``other`` for special tokens and byte fragments of a multi-byte character; needs a tokenizer) and ``position``
(log2 buckets ``0``, ``1``, ``2-3``, ``4-7``, ...; they cover every position).

Layers are numbered as in the model (0-based); layer 0 never has a gate, so the tables hold only gated layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from satlab.config.gate_functions import GATE_FUNCTIONS, GateFunction
from satlab.data.tokenizer import TextTokenizer


def gate_bounds(gate_fn: str, heads: int) -> tuple[float, ...]:
    """The values a gate of ``gate_fn`` over ``heads`` gate heads can be pinned at (the gate-function table's)."""
    return _gate_function(gate_fn).bounds(heads)


def saturation_rule(gate_fn: str) -> str:
    """``pinned``, ``dead`` or ``never``: when a head of ``gate_fn`` is saturated (the gate-function table's)."""
    return _gate_function(gate_fn).saturates


def _gate_function(gate_fn: str) -> GateFunction:
    if gate_fn not in GATE_FUNCTIONS:
        raise ValueError(f"unknown gate function {gate_fn!r}; known: {', '.join(GATE_FUNCTIONS)}")
    return GATE_FUNCTIONS[gate_fn]


def required_share(gate_fn: str, saturation_share: float = 0.99, dead_share: float = 1.0) -> float | None:
    """The share of a head's elements at one bound that makes it saturated under ``gate_fn``'s rule (None: never)."""
    return {"pinned": saturation_share, "dead": dead_share, "never": None}[saturation_rule(gate_fn)]


def head_saturation(gates: Tensor, gate_fn: str, bound_tol: float = 1e-3, saturation_share: float = 0.99,
                    dead_share: float = 1.0) -> tuple[list[float], list[float | None]]:
    """One layer's gates (B, T, G, C) as :func:`analyze_gates` judges them: per head, the share of elements at the
    most frequent bound, and that bound where the head is saturated under ``gate_fn``'s rule, else None."""
    bounds = gate_bounds(gate_fn, gates.shape[-2])
    _, _, share, which, _ = _layer_stats(gates.float(), bounds, bound_tol)
    need = required_share(gate_fn, saturation_share, dead_share)
    return share.tolist(), _saturated_at(share.tolist(), which.tolist(), bounds, need)


def _saturated_at(share: list[float], which: list[int], bounds: tuple[float, ...],
                  need: float | None) -> list[float | None]:
    return [bounds[w] if need is not None and s >= need else None for s, w in zip(share, which, strict=True)]


METRIC_PREFIX = "val/gates"
SATURATION_METRIC = f"{METRIC_PREFIX}/saturated_frac"  # what the saturation guard watches
"""Gate statistics are measured on fixed validation windows, and MLflow orders a run's chart sections by name:
under ``val/`` they follow the loss curves instead of preceding them."""

@dataclass
class CategoryTable:
    """Mean gate per category value: ``counts[v]`` tokens, ``layer_means[v][l]`` over gated layer l, ``means[v]``
    over all gated layers."""

    values: list[str]
    counts: list[int]
    layer_means: np.ndarray  # (values, gated layers)

    @property
    def means(self) -> np.ndarray:
        return self.layer_means.mean(axis=1)


@dataclass
class GateReport:
    """Per (gated layer, head) tables, each of shape (len(layers), heads), and the category tables."""

    gate_fn: str
    granularity: str
    layers: list[int]
    heads: int
    channels: int
    n_tokens: int
    bounds: tuple[float, ...]
    mean: np.ndarray
    sparsity: np.ndarray
    saturation: np.ndarray  # share of elements at the most frequent bound (0 where there is no bound)
    saturated_at: list[list[float | None]]  # that bound where the head is saturated, else None
    dead: np.ndarray
    categories: dict[str, CategoryTable] = field(default_factory=dict)
    settings: dict[str, float] = field(default_factory=dict)
    label: str = "SATFormer"  # the architecture's display name
    rule: str = "pinned"  # the gate function's saturation rule: pinned, dead or never (see the module docstring)

    @property
    def saturated(self) -> np.ndarray:
        return np.array([[b is not None for b in row] for row in self.saturated_at], dtype=bool)

    def scalars(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """Summary metrics: overall mean, sparsity (over elements; every layer has the same number), share of
        saturated (layer, head) pairs, dead heads. Per layer and per category (position, token kind) they are in
        :meth:`to_json`, the heatmap, the category plot and the training run's ``gates/layer_means.png``, not
        here: as metrics they were a chart section per layer, or dozens of single-point charts, in front of the
        loss curves."""
        out = {
            f"{prefix}/mean": float(self.mean.mean()),
            f"{prefix}/sparsity": float(self.sparsity.mean()),
            f"{prefix}/saturated_frac": float(self.saturated.mean()),
            f"{prefix}/dead_heads": float(self.dead.sum()),
            f"{prefix}/dead_head_frac": float(self.dead.mean()),
        }
        return out

    def layer_means(self) -> list[float]:
        """The mean gate of each gated layer (over its heads), in :attr:`layers` order."""
        return [float(row.mean()) for row in self.mean]

    def to_json(self) -> dict[str, Any]:
        """The raw tables as plain JSON data (lists indexed [gated layer][head])."""
        return {
            "gate_fn": self.gate_fn,
            "granularity": self.granularity,
            "layers": self.layers,
            "heads": self.heads,
            "channels": self.channels,
            "n_tokens": self.n_tokens,
            "bounds": list(self.bounds),
            "rule": self.rule,
            "settings": self.settings,
            "mean": self.mean.tolist(),
            "sparsity": self.sparsity.tolist(),
            "saturation": self.saturation.tolist(),
            "saturated": self.saturated.tolist(),
            "saturated_at": self.saturated_at,
            "dead": self.dead.tolist(),
            "categories": {
                name: {"values": t.values, "counts": t.counts, "means": t.means.tolist(),
                       "layer_means": t.layer_means.tolist()}
                for name, t in self.categories.items()
            },
        }


def analyze_gates(model: nn.Module, idx: Tensor, tokenizer: TextTokenizer | None = None, gate_fn: str | None = None,
                  bound_tol: float = 1e-3, saturation_share: float = 0.99,
                  dead_share: float = 1.0) -> GateReport | None:
    """Gate statistics of ``model`` on token ids ``idx`` (B, T) or (T,), from one forward pass in eval mode.

    ``gate_fn`` and the granularity default to the model's ``cfg.satformer``. Returns None when no layer produces a
    gate (every architecture but SATFormer). The model's training mode is restored afterwards. ``bound_tol``,
    ``saturation_share`` (bounded gates) and ``dead_share`` (relu) define saturation: see the module docstring.
    """
    idx = idx.unsqueeze(0) if idx.dim() == 1 else idx
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            gates = model(idx.to(device), return_gates=True).gates
    finally:
        model.train(was_training)
    layers = [i for i, g in enumerate(gates or ()) if g is not None]
    if not layers:
        return None
    architecture = getattr(model, "architecture", None)
    options = architecture.options_of(model.cfg) if architecture is not None else None
    if gate_fn is None:
        gate_fn = architecture.gate_fn(model.cfg) if architecture is not None and architecture.gate_fn else "relu"
    heads, channels = gates[layers[0]].shape[-2:]
    bounds = gate_bounds(gate_fn, heads)
    stats = [_layer_stats(gates[i].float(), bounds, bound_tol) for i in layers]
    mean, sparsity, share, which, token_gate = (torch.stack(s).cpu() for s in zip(*stats, strict=True))
    need = required_share(gate_fn, saturation_share, dead_share)
    saturated_at = [_saturated_at(s_row, w_row, bounds, need)
                    for s_row, w_row in zip(share.tolist(), which.tolist(), strict=True)]
    return GateReport(
        label=architecture.label if architecture is not None else "SATFormer",
        gate_fn=gate_fn,
        granularity=getattr(options, "gate_granularity", "token_head"),
        layers=layers,
        heads=heads,
        channels=channels,
        n_tokens=idx.numel(),
        bounds=bounds,
        mean=mean.numpy(),
        sparsity=sparsity.numpy(),
        saturation=share.numpy(),
        saturated_at=saturated_at,
        dead=(sparsity >= saturation_share).numpy(),
        categories=category_tables(token_gate, idx.cpu(), tokenizer),
        settings={"bound_tol": bound_tol, "saturation_share": saturation_share, "dead_share": dead_share},
        rule=saturation_rule(gate_fn),
    )


def _layer_stats(g: Tensor, bounds: tuple[float, ...], tol: float) -> tuple[Tensor, ...]:
    """One layer's gates (B, T, G, C), on their device: per head mean, sparsity, share of elements at the most
    frequent bound and that bound's index (0 and 0 without bounds), and the per-token gate (B, T)."""
    per_head = g.permute(2, 0, 1, 3).flatten(1)  # (G, B·T·C)
    if bounds:
        share, which = torch.stack([(per_head - b).abs().lt(tol).float().mean(-1) for b in bounds]).max(0)
    else:
        share, which = per_head.new_zeros(per_head.shape[0]), per_head.new_zeros(per_head.shape[0], dtype=torch.long)
    sparsity = per_head.abs().lt(tol).float().mean(-1)
    return per_head.mean(-1), sparsity, share, which, g.mean(dim=(-2, -1))


def occurrence_labels(idx: Tensor) -> np.ndarray:
    """``first`` or ``repeated`` per token of ``idx`` (B, T): whether its id occurred earlier in the same row."""
    labels = np.empty(idx.shape, dtype=object)
    for b, row in enumerate(idx.tolist()):
        seen: set[int] = set()
        for t, token in enumerate(row):
            labels[b, t] = "repeated" if token in seen else "first"
            seen.add(token)
    return labels


def position_bucket(position: int) -> str:
    """The log2 bucket of a 0-based position: ``0``, ``1``, ``2-3``, ``4-7``, ..."""
    if position < 2:
        return str(position)
    low = 1 << int(math.log2(position))
    return f"{low}-{2 * low - 1}"


def token_kind(text: str, special: bool) -> str:
    """``space``, ``punct``, ``word`` or ``other`` (special tokens, undecodable byte fragments)."""
    if special or "\ufffd" in text:
        return "other"
    if not text.strip():
        return "space"
    return "word" if any(ch.isalnum() for ch in text) else "punct"


def kind_labels(idx: Tensor, tokenizer: TextTokenizer) -> np.ndarray:
    """:func:`token_kind` per token, decoding each distinct id once."""
    special_ids = {getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", None)} - {None}
    kinds = {i: token_kind(tokenizer.decode([i]), i in special_ids) for i in set(idx.flatten().tolist())}
    return np.vectorize(kinds.__getitem__, otypes=[object])(idx.numpy())


def category_tables(token_gate: Tensor, idx: Tensor,
                    tokenizer: TextTokenizer | None = None) -> dict[str, CategoryTable]:
    """Per category, the mean of ``token_gate`` (L_g, B, T) over the tokens of each value, per gated layer."""
    buckets = [position_bucket(t) for t in range(idx.shape[1])]
    labelled = {"occurrence": (occurrence_labels(idx), ["first", "repeated"])}
    if tokenizer is not None:
        labelled["kind"] = (kind_labels(idx, tokenizer), ["word", "punct", "space", "other"])
    labelled["position"] = (np.broadcast_to(np.array(buckets, dtype=object), idx.shape), list(dict.fromkeys(buckets)))
    flat = token_gate.flatten(1).numpy()  # (L_g, B·T)
    tables = {}
    for name, (labels, order) in labelled.items():
        labels = labels.reshape(-1)
        values = [v for v in order if (labels == v).any()]
        masks = [labels == v for v in values]
        tables[name] = CategoryTable(values, [int(m.sum()) for m in masks],
                                     np.stack([flat[:, m].mean(axis=1) for m in masks]))
    return tables
