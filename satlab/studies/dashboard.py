"""What optuna-dashboard (0.21) shows of a sweep, made to agree with satlab.

* Feasibility: the dashboard greys out a trial whose ``constraints`` system attr (a list) has a value above 0;
  :meth:`satlab.studies.plans.SearchPlan.record_constraint` records the list as well as Optuna's named constraint.
* The best trial: the dashboard marks ``storage.get_best_trial(study_id)``, which in Optuna's storages is the best
  value of any completed trial, infeasible or not (``Study.best_trial`` filters afterwards; the dashboard does not).
  No trial data changes that short of falsifying a value or a state, so ``satlab sweep --dashboard`` serves the
  storage through :class:`FeasibleBestStorage`, whose best trial is :func:`satlab.studies.best.best_trial`. A plain
  ``optuna-dashboard <storage>`` still marks the best value; the study's note says so.
* Labels: the intermediate-value plot's axes are fixed ("Step", "Objective Value"); the study's note (Markdown, shown
  on the study's page) says that the steps are training tokens, what the objective is and what infeasible means.
"""

from __future__ import annotations

import hashlib

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from satlab.studies.attrs import WOULD_PRUNE_AT, WOULD_PRUNE_REASON
from satlab.studies.best import best_trial
from satlab.studies.plans import CONSTRAINT, FEASIBLE
from satlab.studies.spec import SweepSpec

NOTE_HASH = "satlab:note_sha256"  # study user attr: the note satlab last wrote (a note edited since is kept). A user
# attr, as Optuna has no public call for a study's system attrs (where the dashboard keeps the note itself)


class FeasibleBestStorage(RDBStorage):
    """An RDB storage whose best trial is the best feasible one (the dashboard's "Best Trial")."""

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        directions = self.get_study_directions(study_id)
        if len(directions) > 1:
            raise RuntimeError("Best trial can be obtained only for single-objective optimization.")
        trials = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
        best = best_trial(trials, directions[0].name.lower())
        if best is None:
            raise ValueError("No trials are completed yet.")
        return best


def dashboard_storage(url: str) -> FeasibleBestStorage:
    """The storage as optuna-dashboard opens a URL itself (reads, no table creation, no version check)."""
    return FeasibleBestStorage(url, skip_compatibility_check=True, skip_table_creation=True)


def study_note(spec: SweepSpec) -> str:
    """The study's note: how to read the dashboard's views of this sweep."""
    metric, guard, pruner = spec.objective.metric, spec.saturation, spec.pruner
    lines = [f"### satlab sweep `{spec.name}`", *([spec.description] if spec.description else []), "",
             f"* **Objective**: `{metric}` ({spec.objective.direction}d) at the end of each trial's training.",
             f"* **Intermediate values**: `{metric}` after each validation. Their **Step is the number of training "
             f"tokens seen** (the plot's axis says \"Step\"; the dashboard has no option for its label)."]
    if pruner.name == "median":
        lines.append(f"* **Pruning**: a trial worse than the median of the trials of its architecture at the same "
                     f"token count is stopped, from {pruner.warmup_tokens:,} tokens on.")
    elif pruner.name == "hyperband":
        lines.append("* **Pruning**: Hyperband, its resources in tokens.")
    lines.append("* **Architecture**: the `arch` user attribute of each trial (and the `model.arch` parameter when it "
                 "is searched).")
    if guard.threshold is not None and guard.action == "observe":
        lines.append(f"* **Saturation guard (observing)**: it prunes nothing and records no constraint (every "
                     f"completed trial is feasible); a trial whose gates were more than {guard.threshold:.0%} "
                     f"saturated for {guard.patience} validations in a row has the user attribute "
                     f"`{WOULD_PRUNE_AT}` (tokens seen when the guard would have pruned it) and "
                     f"`{WOULD_PRUNE_REASON}`.")
    elif guard.threshold is not None and guard.constraint:
        lines.append(f"* **Infeasible**: a trial whose last validation had more than {guard.threshold:.0%} of its "
                     f"gates saturated (user attribute `saturated_frac`) breaks the `{CONSTRAINT}` constraint: "
                     f"grey / \"Infeasible\" in the plots, `{FEASIBLE}` False among its user attributes, never the "
                     f"best trial.")
    else:
        lines.append("* **Infeasible**: no constraint is recorded (the saturation guard is off or not a "
                     "constraint): every completed trial is feasible.")
    lines.append(f"* **Best trial**: the best feasible trial, as in `satlab sweep`'s summary and Optuna's "
                 f"`study.best_trial`. `satlab sweep {spec.name} --dashboard` marks it so; a plain `optuna-dashboard "
                 f"<storage>` marks the best value, feasible or not.")
    return "\n".join(lines) + "\n"


def write_note(study: optuna.Study, spec: SweepSpec) -> bool:
    """Set the study's note when it has none or still has the one satlab wrote (the spec may have changed since);
    a note someone edited is left alone. False when optuna-dashboard is not installed or nothing changed."""
    try:
        from optuna_dashboard import get_note, save_note
    except ImportError:
        return False
    body = study_note(spec)
    current = get_note(study)
    written = study.user_attrs.get(NOTE_HASH)
    if current == body or (current and _sha256(current) != written):
        return False
    save_note(study, body)
    study.set_user_attr(NOTE_HASH, _sha256(body))
    return True


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
