"""Which trials are feasible and which is best: one rule for satlab's report, Optuna's ``study.best_trial`` and the
dashboard that ``satlab sweep --dashboard`` serves (:mod:`satlab.studies.dashboard`).

Feasible is Optuna's definition: every constraint recorded on the trial (``trial.constraints``, see
:meth:`satlab.studies.plans.SearchPlan.record_constraint`) is at most 0; a trial without constraints is feasible.
The best trial is the best completed feasible one, the lowest trial number on a tie; when no completed trial is
feasible the best completed one stands in, so that a report still names a learning rate (it says it is infeasible).
"""

from __future__ import annotations

from collections.abc import Iterable

from optuna.trial import FrozenTrial, TrialState


def is_feasible(trial: FrozenTrial) -> bool:
    return all(value <= 0.0 for value in trial.constraints.values())


def best_trial(trials: Iterable[FrozenTrial], direction: str) -> FrozenTrial | None:
    """The best completed feasible trial of ``trials`` (else the best completed one; None when none completed).
    ``direction``: ``minimize`` or ``maximize``."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    sign = 1.0 if direction == "minimize" else -1.0
    ranked = sorted(complete, key=lambda t: (sign * t.value, t.number))  # type: ignore[operator]
    return next((t for t in ranked if is_feasible(t)), ranked[0] if ranked else None)
