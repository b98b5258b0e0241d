"""The ``sequential:`` block of an ablation spec: a group-sequential plan fixed before the first look, so that seeds
can be added where a comparison is still open without breaking the error rate the report states.

A plan names the family-wise error rate ``alpha`` and its sidedness, the looks (how many seeds each comparison has
at each look), the alpha-spending function, an optional equivalence margin, which comparisons are made and how
alpha is shared among them. The statistics are in :mod:`satlab.studies.sequential`; docs/studies.md explains the
choices. Without ``looks`` (the default) there is no plan and an ablation runs its fixed seed axis as before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from satlab.config.errors import shown
from satlab.config.structured import field_problems, in_range

SPENDING = ("obrien_fleming", "pocock")
"""Lan-DeMets spending functions: O'Brien-Fleming-type (spends little early) and Pocock-type (evenly)."""
COMPARISONS = ("baseline", "all_pairs")
SHARING = ("holm", "bonferroni")
BETTER = ("lower", "higher")
FAMILIES = ("study", "setting")
METRIC_NAME = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")
"""The form of an MLflow metric key satlab logs (``val/loss``, ``recall/steps_to_bind``): parts of letters, digits,
``_ . -`` between single slashes. Whether the cells log it is known only once one has finished: the first look
names a finished run that lacks it, with the metrics it did log."""
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
    measure: str = "val/loss"
    better: str = field(default="lower", metadata={"choices": BETTER})
    compare: str | None = None
    family: str = field(default="study", metadata={"choices": FAMILIES})

    @property
    def lower_is_better(self) -> bool:
        return self.better == "lower"

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
            given = [name for name, default in (("n_max", None), ("margin", None), ("compare", None))
                     if getattr(self, name) != default]
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
        if not isinstance(self.measure, str) or not METRIC_NAME.fullmatch(self.measure):
            problems.append(f"{prefix}measure must name an MLflow metric the cells log (parts of letters, digits, "
                            f"'_', '.' or '-' between single '/', e.g. val/loss or recall/steps_to_bind), got "
                            f"{shown(self.measure)}")
        if self.family == "setting" and self.compare is None:
            problems.append(f"{prefix}family: setting makes each setting (the values of the axes other than "
                            f"{prefix}compare) its own family, but {prefix}compare is not set: set compare (e.g. "
                            f"compare: model.arch) or use family: study")
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

    def grid_problems(self, axes: Mapping[str, Any], seed_key: str, prefix: str = "sequential.") -> list[str]:
        """``compare`` is an axis other than the seeds, with at least two values (checked when a spec is read)."""
        if not self.enabled or self.compare is None:
            return []
        others = [k for k in axes if k != seed_key]
        if self.compare not in others:
            return [f"{prefix}compare must be an axis of the grid other than the seeds ({', '.join(others) or 'none'}),"
                    f" got {shown(self.compare)}"]
        if not isinstance(axes[self.compare], list) or len(axes[self.compare]) < 2:
            return [f"{prefix}compare: axis {self.compare} has one value; its values are the arms, so give it at "
                    f"least two"]
        return []

    def seed_problems(self, axes: Mapping[str, Any], seed_key: str) -> list[str]:
        """The seed axis lists at least n_max seeds: look k runs the first n_k of them in the axis' order, and seeds
        beyond n_max are never run. Checked before an ablation runs or shows its plan (``--simulate`` runs nothing
        and needs none)."""
        seeds = axes.get(seed_key)
        if not self.enabled or not self.schedule or not isinstance(seeds, list) or len(seeds) >= self.schedule[-1]:
            return []
        n_max = self.schedule[-1]
        return [f"sequential: the seed axis {seed_key} lists {len(seeds)} seed(s), but the plan may run up to n_max = "
                f"{n_max} per arm (look k runs the first n_k seeds of the axis, in its order): list at least {n_max}, "
                f"e.g. axes.{seed_key}=[{','.join(map(str, range(n_max)))}]"]

    def fixed(self) -> dict[str, str]:
        """The plan as the study stores it before the first look (``sequential.<field>`` params of the parent run and
        the study's user attr): every field as text, n_max as the last look it resolves to."""
        values = asdict(self) | {"n_max": self.schedule[-1] if self.schedule else None}
        return {f"sequential.{k}": _text(v) for k, v in values.items()}


def _text(value: Any) -> str:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(map(str, value)) + "]"
    return "none" if value is None else str(value)
