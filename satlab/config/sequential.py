"""The ``sequential:`` block of an ablation spec: a group-sequential plan fixed before the first look, so that seeds
can be added where a comparison is still open without breaking the error rate the report states.

A plan names the family-wise error rate ``alpha`` and its sidedness, the looks (how many seeds each comparison has
at each look), the alpha-spending function, an optional equivalence margin, which comparisons are made and how
alpha is shared among them. The statistics are in :mod:`satlab.studies.sequential`; docs/studies.md explains the
choices. Without ``looks`` (the default) there is no plan and an ablation runs its fixed seed axis as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from satlab.config.errors import shown
from satlab.config.structured import field_problems, in_range

SPENDING = ("obrien_fleming", "pocock")
"""Lan-DeMets spending functions: O'Brien-Fleming-type (spends little early) and Pocock-type (evenly)."""
COMPARISONS = ("baseline", "all_pairs")
SHARING = ("holm", "bonferroni")
MIN_FIRST_LOOK = 3
"""The fewest seeds of the first look. Two seeds leave the paired t statistic one degree of freedom: its critical
value at the nominal levels a spending function gives early (O'Brien-Fleming's 2.7e-7 at the first of five looks)
is about 1.2 million, and even Pocock's (0.008) is 40, so a look at two seeds spends alpha with no real chance to
stop. From three seeds on (two degrees of freedom) the t distribution has a finite variance."""
MAX_SEEDS = 10_000


@dataclass
class SequentialPlan:
    """``alpha`` is the family-wise error rate over all comparisons and looks; ``sides: 2`` tests both directions
    (either arm may win), ``sides: 1`` only "the first arm of a pair is better" (the architecture against the
    baseline). ``looks`` are cumulative seed counts per arm; ``n_max`` (default: the last look) is the last.
    ``margin`` (in the measure's units, e.g. nats) allows the verdict "equivalent within the margin" when the
    repeated confidence interval of the difference lies inside ±margin. ``sharing``: ``bonferroni`` gives each of
    the m comparisons alpha/m; ``holm`` does the same and passes the alpha of a comparison that is decided to the
    others (the graphical Holm procedure for group-sequential tests, Maurer & Bretz 2013), never less powerful."""

    alpha: float = 0.05
    sides: int = 2
    looks: list[int] = field(default_factory=list)
    n_max: int | None = None
    spending: str = field(default="obrien_fleming", metadata={"choices": SPENDING})
    margin: float | None = field(default=None, metadata=in_range(0, 1e9, True))
    comparisons: str = field(default="baseline", metadata={"choices": COMPARISONS})
    sharing: str = field(default="holm", metadata={"choices": SHARING})

    @property
    def enabled(self) -> bool:
        return bool(self.looks)

    @property
    def schedule(self) -> tuple[int, ...]:
        """The looks as seed counts, ending at ``n_max`` (appended when it is beyond the last look given)."""
        looks = tuple(self.looks)
        return looks + (self.n_max,) if self.n_max is not None and looks and self.n_max > looks[-1] else looks

    def problems(self, prefix: str = "sequential.") -> list[str]:
        """Every value outside what the plan allows, with the valid values; none for a plan that is off."""
        if not self.enabled:
            given = [name for name, default in (("n_max", None), ("margin", None)) if getattr(self, name) != default]
            return [f"{prefix}{name} is set but {prefix}looks is empty: give the looks (seeds per look), e.g. "
                    f"looks: [3, 5, 8, 12, 20]" for name in given]
        problems = field_problems(self, prefix)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < 0.5 \
                or math.isnan(self.alpha):
            problems.append(f"{prefix}alpha must be in (0, 0.5), the family-wise error rate (e.g. 0.05), got "
                            f"{shown(self.alpha)}")
        if self.sides not in (1, 2) or isinstance(self.sides, bool):
            problems.append(f"{prefix}sides must be 1 (only 'the first arm is better' is tested) or 2 (either arm "
                            f"may win), got {shown(self.sides)}")
        looks = list(self.looks)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in looks):
            return problems + [f"{prefix}looks must be whole seed counts, got {shown(looks)}"]
        if looks[0] < MIN_FIRST_LOOK:
            problems.append(f"{prefix}looks: the first look must have at least {MIN_FIRST_LOOK} seeds (the paired t "
                            f"statistic needs 2 degrees of freedom to stop at an early look), got {looks[0]}")
        if looks[-1] > MAX_SEEDS:
            problems.append(f"{prefix}looks: at most {MAX_SEEDS:,} seeds, got {looks[-1]:,}")
        if steps := [(a, b) for a, b in zip(looks, looks[1:], strict=False) if b <= a]:
            problems.append(f"{prefix}looks must strictly increase (cumulative seeds per look, e.g. [3, 5, 8, 12, "
                            f"20]), got {shown(looks)}: {steps[0][1]} after {steps[0][0]}")
        if self.n_max is not None:
            if isinstance(self.n_max, bool) or not isinstance(self.n_max, int):
                problems.append(f"{prefix}n_max must be a whole seed count, got {shown(self.n_max)}")
            elif self.n_max < looks[0]:
                problems.append(f"{prefix}n_max ({self.n_max}) is below the first look ({looks[0]}): n_max is the "
                                f"last look, at least {looks[0]}, at most {MAX_SEEDS:,}")
            elif self.n_max > MAX_SEEDS:
                problems.append(f"{prefix}n_max must be at most {MAX_SEEDS:,}, got {self.n_max:,}")
            elif beyond := [n for n in looks if n > self.n_max]:
                problems.append(f"{prefix}looks {shown(beyond)} are beyond n_max ({self.n_max}): n_max is the last "
                                f"look; drop them or raise n_max")
        return problems
