"""The coordinate check's settings, shapes and thresholds, without torch (the command's ``--help`` and validation
import them; :mod:`satlab.bench.coord` runs the check)."""

from __future__ import annotations

from dataclasses import dataclass, field

from satlab.config.model import SIZE_PRESETS

TRANSFER_SLOPE_LIMIT = 0.1
"""μP / CompleteP pass when every probe's |slope| (log RMS per log width; under CompleteP per log depth too) is
below this at every step from :data:`FIRST_CHECKED_STEP` on. Fixed before any run."""
SP_SLOPE_SIGNAL = 0.3
"""The check can fail: under the standard parametrisation some probe's |slope| must exceed this (it does when the
measurement is sensitive enough to see what μP fixes). Fixed before any run."""
NOT_COMPARED = {"depth": {
    "block_out[first]": "the residual stream after the first of L blocks is at relative depth 1/L, a different place "
                        "in each model of the depth series: under CompleteP it is the embedding plus one branch "
                        "scaled 1/L, so it shrinks with depth by design; block_out[mid] and block_out[last] compare "
                        "the stream at the same relative depth (1/2 and 1)"}}
"""Probes recorded but left out of a series' verdict, with the reason (shown in the report). Decided after the first
full-grid run under CompleteP (docs/results/2026-12-04-coord-completep.md), which found block_out[first] the worst
depth slope of the residual architectures; the thresholds did not change."""
FIRST_CHECKED_STEP = 3
"""Step 0 is the initial model; the thresholds apply from this step on. Version 2 of the rule (fixed in
docs/results/2026-12-04-coord-diagnostic.md before it ran): version 1 judged from step 1, where the first update's
transient (the logits' init term, the residual stream's 1/√L start under CompleteP) dominated the worst slopes."""
DEFAULT_WIDTHS = (128, 256, 512, 1024, 2048)
"""Version 2: 8x up to the widths the paper's presets use (version 1: 64-1024)."""
DEFAULT_SEEDS = (0, 1, 2)
"""Version 2: each probe's RMS is the geometric mean over these seeds (version 1: one seed), since the diagnostic
measured slopes moving about ±0.15 between seeds, more than the 0.1 threshold."""
DEFAULT_DEPTHS = (2, 4, 8, 16, 32)
DEFAULT_STEPS = 10
HEAD_DIM = 32
"""The tiny preset's head dim (128 / 4); heads = width / head dim."""
BATCH, SEQ_LEN = 4, 32
"""The fixed batch: 4 sequences of 32 byte tokens (chosen so the default grid of ten architectures fits ~15 minutes
on one core, see docs/coord-check.md)."""

@dataclass(frozen=True)
class Shape:
    """One model of a series: ``series`` is "width" or "depth", ``x`` the width or depth it varies."""

    arch: str
    series: str
    width: int
    depth: int

    @property
    def x(self) -> int:
        return self.width if self.series == "width" else self.depth


@dataclass
class CoordSettings:
    archs: list[str]
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))
    widths: list[int] = field(default_factory=lambda: list(DEFAULT_WIDTHS))
    depths: list[int] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    steps: int = DEFAULT_STEPS
    overrides: list[str] = field(default_factory=list)  # model.parametrization=... and any other config override
    head_dim: int = HEAD_DIM
    batch: int = BATCH
    seq_len: int = SEQ_LEN
    fresh_batches: bool = False  # a new batch at every step instead of the one fixed batch


def base_shape() -> tuple[int, int]:
    """(base width, base depth): the tiny preset's, which the parametrisation's base shape defaults to."""
    tiny = SIZE_PRESETS["tiny"]
    return tiny["d_model"], tiny["n_layers"]


def shapes(settings: CoordSettings) -> list[Shape]:
    """Every model the check builds, per architecture the width series then the depth series."""
    width0, depth0 = base_shape()
    return [Shape(arch, series, w, d) for arch in settings.archs
            for series, pairs in (("width", [(w, depth0) for w in settings.widths]),
                                  ("depth", [(width0, d) for d in settings.depths])) for w, d in pairs]


def display_name(arch: str, entry: dict) -> str:
    """The architecture, and whose implementation was measured where it is not satlab's."""
    implementation = entry.get("implementation", "satlab")
    return arch if implementation == "satlab" else f"{arch}, {implementation}"
