"""The work of one training step, counted instead of timed: ``satlab bench --census``.

A paired bench on a shared 2-core host resolves runtime ratios to about ±2 %
(docs/results/2026-12-04-bench-completep.md), too coarse to show that a model option costs under 1 %. What the step
does can be counted exactly instead: every aten op the forward, the backward and AdamW's step dispatch
(:class:`OpCensus`), the elements those ops write, and the matmul FLOPs (PyTorch's ``FlopCounterMode``). If an option
changes none of these by more than a fraction f, it cannot change the step's time by much more than f, whatever the
host; what the count cannot see is a slower kernel for the same op and size. The step is the bench's own
(:class:`satlab.bench.throughput._Runner`: the training's AdamW groups, one fixed batch), on the CPU in fp32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from satlab.bench.throughput import _Runner

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_cudnn_attention", "convolution"}
"""Ops whose cost is their FLOPs (counted by FlopCounterMode); every other op's cost is taken as the elements it
writes."""


class OpCensus(TorchDispatchMode):
    """Counts every aten op dispatched inside it: calls and elements written, per op."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.elements: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] += 1
        self.elements[name] += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


@dataclass
class StepCensus:
    label: str
    calls: int
    elements: int  # written by the ops that are not matmuls
    flops: int  # of the matmuls
    by_op: dict[str, tuple[int, int]] = field(default_factory=dict)  # op -> (calls, elements)

    def ratios(self, reference: StepCensus) -> dict[str, float]:
        return {"calls": self.calls / reference.calls, "elements": self.elements / reference.elements,
                "flops": self.flops / reference.flops}

    def added_ops(self, reference: StepCensus) -> dict[str, tuple[int, int]]:
        """The ops whose calls or elements differ from the reference's: op -> (calls, elements) added."""
        ops = set(self.by_op) | set(reference.by_op)
        diff = {op: (self.by_op.get(op, (0, 0))[0] - reference.by_op.get(op, (0, 0))[0],
                     self.by_op.get(op, (0, 0))[1] - reference.by_op.get(op, (0, 0))[1]) for op in ops}
        return {op: d for op, d in sorted(diff.items()) if d != (0, 0)}


def step_census(arch: str, size: str = "tiny", batch: int = 8, seq_len: int = 256, overrides: dict | None = None,
                label: str | None = None, seed: int = 0) -> StepCensus:
    """Counts the second training step of ``arch`` (the first creates AdamW's state, a one-off)."""
    runner = _Runner(arch, size, batch, seq_len, torch.device("cpu"), torch.float32, False, seed, overrides or {},
                     label)
    runner.step()
    census, flops = OpCensus(), FlopCounterMode(display=False)
    with flops, census:
        runner.step()
    elements = sum(n for op, n in census.elements.items() if op not in MATMULS)
    return StepCensus(runner.arch, sum(census.calls.values()), elements, flops.get_total_flops(),
                      {op: (census.calls[op], census.elements[op]) for op in census.calls})


def compare_census(archs: Sequence[str], field_name: str, values: Sequence, size: str = "tiny", batch: int = 8,
                   seq_len: int = 256, model: dict | None = None) -> list[tuple[StepCensus, StepCensus]]:
    """Per architecture, (its census at the first value, at each other value); ``model`` sets fields of every
    model."""
    def census(arch: str, value) -> StepCensus:
        return step_census(arch, size, batch, seq_len, {**(model or {}), field_name: value},
                           f"{arch} {field_name}:{value}")

    pairs = []
    for arch in archs:
        reference = census(arch, values[0])
        pairs.extend((reference, census(arch, value)) for value in values[1:])
    return pairs
