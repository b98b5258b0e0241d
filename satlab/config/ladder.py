"""The ``ladder:`` block of an ablation spec: a scaling ladder (docs/ladder.md). Rungs of model sizes, smallest first;
token budgets per rung as multiples of a parameter count; seeds and a learning rate per rung; the reference
architecture that sets every rung's token budgets; and the settings of the fit (docs/scaling-laws.md).

The block expands into the ablation's axes and one ``grids:`` sub-grid per rung (:mod:`satlab.studies.ladder`), so
a ladder is an ordinary ablation: its cells are queued, resumed and shared across hosts by the study engine. The
checks here need no config or model; those that need parameter counts (rungs in increasing order, the decades of
compute, the shortest run's steps) are made when the ladder is expanded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from satlab.config.errors import quoted, shown
from satlab.config.structured import in_range

MIN_RUNGS = 3
"""The fewest rungs: L(N, D) has five parameters, and a backtest holds the top rung out of the fit."""
MIN_DECADES = 1.5
"""The least span of training compute (log10 of the largest run's FLOPs over the smallest's) per architecture."""
TRANSFER_RULES = ("mup", "completep")
"""Parametrisations under which one learning rate serves every rung (docs/lr-transfer.md)."""
OWNED_KEYS = ("model.arch", "train.max_tokens", "optim.lr", "optim.warmup_tokens", "optim.warmup_fraction")
"""Config keys a rung may not set: the ladder sets them (the architecture is an axis of the spec)."""
PARAM_COUNTS = ("total", "non_embedding")
BANDS = ("pointwise", "simultaneous")


@dataclass
class LadderFit:
    """The settings the report's fit reads (docs/scaling-laws.md): the Huber loss's ``huber_delta`` on log loss,
    ``resamples`` bootstrap refits drawn by run from ``seed``, intervals at ``level``, the compute multiplier at the
    compute-optimal ``target_params`` sizes, and the backtest (``top_rung``: fit on the lower rungs, predict the top
    one; ``none``). ``grid``: the fit's starting points, Hoffmann et al.'s 4,500 (``hoffmann``) or 243 of them
    (``coarse``, ~18x faster, for a quick look).

    The backtest's ``band``: ``pointwise`` gives each top-rung run its own ``level`` interval, so a correct law
    still misses about one run in ten; ``simultaneous`` widens each of the k runs judged to 1 - (1 - level)/k
    (Bonferroni), so that all of them fall inside together with probability at least ``level`` when the law holds.
    ``backtest_seeds``: the top-rung seeds the backtest judges (all when empty), e.g. seeds added to the top rung
    after a plan was fixed, to judge only runs nobody had seen when the reading was chosen."""

    huber_delta: float = field(default=1e-3, metadata=in_range(0, 10, True))
    resamples: int = field(default=1000, metadata=in_range(10, 10**6))
    level: float = field(default=0.9, metadata=in_range(0, 0.999, True))
    seed: int = 0
    target_params: list[float] = field(default_factory=lambda: [1e9, 1e10, 1e11])
    backtest: str = field(default="top_rung", metadata={"choices": ("top_rung", "none"), "label": "backtest"})
    grid: str = field(default="hoffmann", metadata={"choices": ("hoffmann", "coarse"), "label": "start grid"})
    band: str = field(default="pointwise", metadata={"choices": BANDS, "label": "backtest band"})
    backtest_seeds: list[int] = field(default_factory=list)


@dataclass
class LadderPlan:
    """``rungs``: one mapping of config keys per size, smallest first (a key without a dot is a model key:
    ``d_model`` is ``model.d_model``); every rung gives the same keys. ``budgets``: tokens per parameter, one run
    each (``per``: which parameter count they multiply, the reference architecture's at the rung). ``seeds``: how
    many seeds each rung gets. ``lr``: one learning rate per rung, or one number for all under a parametrisation
    that transfers it (mup, completep). ``warmup``: the linear warmup in tokens as a multiple of the rung's
    parameter count (short, as Porian et al. 2024 find best at small scale)."""

    rungs: list[dict[str, Any]] = field(default_factory=list)
    budgets: list[float] = field(default_factory=lambda: [10.0, 20.0, 40.0])
    per: str = field(default="total", metadata={"choices": PARAM_COUNTS, "label": "parameter count (per)"})
    reference: str = "transformer"
    seeds: list[int] = field(default_factory=list)
    lr: Any = None
    warmup: float = field(default=1.0, metadata=in_range(0, 1000))
    fit: LadderFit = field(default_factory=LadderFit)

    @property
    def enabled(self) -> bool:
        return bool(self.rungs)

    def rung_keys(self) -> list[str]:
        """The config keys of the rungs, in the first rung's order."""
        return list(self.rungs[0]) if self.rungs and isinstance(self.rungs[0], Mapping) else []

    def lr_of(self, rung: int) -> float:
        return self.lr[rung] if isinstance(self.lr, list) else self.lr

    def problems(self, axes: Mapping[str, Any], seed_key: str, parametrization: str | None = None,
                 prefix: str = "ladder.") -> list[str]:
        """The block on its own and against the spec's axes: enough rungs with the same keys, positive increasing
        budgets, a seed count and a learning rate per rung, and the reference among the ``model.arch`` axis."""
        if not self.enabled:
            return []
        problems = []
        if len(self.rungs) < MIN_RUNGS:
            problems.append(f"{prefix}rungs: a ladder needs at least {MIN_RUNGS} rungs (sizes) for the fit of "
                            f"L(N, D) and its backtest, got {len(self.rungs)}")
        keys = self.rung_keys()
        for i, rung in enumerate(self.rungs):
            if not isinstance(rung, Mapping) or not rung:
                problems.append(f"{prefix}rungs[{i}] must map config keys to values (d_model: 64, n_layers: 4, "
                                f"...), got {shown(rung)}")
            elif set(rung) != set(keys):
                problems.append(f"{prefix}rungs[{i}] sets {', '.join(rung)} but rungs[0] sets {', '.join(keys)}: "
                                "every rung gives the same keys (a key a rung left out would take every other "
                                "rung's value)")
        for key in keys:
            if key in OWNED_KEYS or key == seed_key:
                problems.append(f"{prefix}rungs: {quoted(key)} is set by the ladder (budgets, lr, warmup, seeds) "
                                "or by the spec's model.arch axis, not by a rung")
        budgets = self.budgets
        if not budgets or not all(_positive(b) for b in budgets) or sorted(set(budgets)) != list(budgets):
            problems.append(f"{prefix}budgets must be tokens-per-parameter multiples, positive and increasing, "
                            f"e.g. [10, 20, 40], got {shown(budgets)}")
        if len(self.seeds) != len(self.rungs) or not all(isinstance(s, int) and s >= 1 for s in self.seeds):
            problems.append(f"{prefix}seeds must give each rung's number of seeds (at least 1; more on the small "
                            f"rungs, e.g. [3, 3, 2, 1, 1]), one per rung ({len(self.rungs)}), got {shown(self.seeds)}")
        problems.extend(self.lr_problems(parametrization, prefix))
        arch = axes.get("model.arch")
        if not isinstance(arch, list) or not arch:
            problems.append(f"{prefix}: a ladder compares architectures: give the spec an axis model.arch that "
                            f"includes the reference {quoted(self.reference)}, e.g. axes: {{model.arch: "
                            "[transformer, resformer, satformer]}")
        elif self.reference not in arch:
            problems.append(f"{prefix}reference {quoted(self.reference)} is not a value of the model.arch axis "
                            f"{shown(arch)}: the reference's parameter count sets every rung's token budgets, and "
                            "its fit is what the others' compute multipliers are measured against")
        problems.extend(self.backtest_seed_problems(prefix))
        targets = self.fit.target_params
        if not targets or not all(_positive(t) for t in targets):
            problems.append(f"{prefix}fit.target_params must be positive parameter counts, e.g. [1e9, 1e10, 1e11], "
                            f"got {shown(targets)}")
        return problems

    def backtest_seed_problems(self, prefix: str = "ladder.") -> list[str]:
        """The seeds the backtest judges must be seeds the top rung runs."""
        chosen, seeds = self.fit.backtest_seeds, self.seeds[-1] if self.seeds else None
        if not chosen or not isinstance(seeds, int):
            return []
        if all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < seeds for s in chosen) \
                and len(set(chosen)) == len(chosen):
            return []
        return [f"{prefix}fit.backtest_seeds must be distinct seeds of the top rung, which runs seeds 0 to "
                f"{seeds - 1} (ladder.seeds[-1] = {seeds}), got {shown(chosen)}; leave it empty to judge every "
                "top-rung run"]

    def lr_problems(self, parametrization: str | None, prefix: str = "ladder.") -> list[str]:
        """One learning rate per rung, or a single number when the parametrisation transfers it."""
        lr, n = self.lr, len(self.rungs)
        if isinstance(lr, list):
            if len(lr) == n and all(_positive(v) for v in lr):
                return []
        elif _positive(lr):
            if parametrization is None or parametrization in TRANSFER_RULES:
                return []
            return [f"{prefix}lr is one number ({shown(lr)}) but the parametrisation is {quoted(parametrization)}: "
                    f"one learning rate serves every size only under {' or '.join(TRANSFER_RULES)} (the transfer "
                    f"rule, docs/lr-transfer.md); give one per rung ({n}), e.g. from a sweep per size, or set "
                    "model.parametrization: completep"]
        return [f"{prefix}lr must be one positive learning rate per rung ({n}), or one number under "
                f"{' or '.join(TRANSFER_RULES)}, got {shown(lr)}"]


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and value != float("inf")
