"""How each kind of study chooses its trials: a sweep samples them (TPE or random, with pruning), an ablation
enumerates its grid; everything else is the same engine (:mod:`satlab.studies.engine`)."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, TrialState

from satlab.config.stores import missing_sqlite_file
from satlab.studies.ablation_spec import AblationSpec, Cell
from satlab.studies.attrs import ARCH, CELL, IGNORED, REASON, SUPERSEDED
from satlab.studies.runs import CELL_TAG, GROUP_TAG
from satlab.studies.spec import Param, SweepSpec, format_value, short_label
from satlab.studies.storage import open_storage, trial_id
from satlab.training.views import COLOUR_TAG, arch_colour, colour

CONSTRAINT = "gate_saturation"
DASHBOARD_CONSTRAINTS = "constraints"  # the trial system attr optuna-dashboard 0.21 reads: a list of values
FEASIBLE = "feasible"  # trial user attr: whether the trial met its constraints (the dashboard lists user attrs)


@dataclass
class Point:
    """What one trial runs: its key (a cell's, or ``t0007``), file names, run name and tags, whether it resumes."""

    key: str
    slug: str
    label: str  # the run's name in MLflow: its values (``satformer lr=3.1e-3 (trial 7)``)
    tags: dict[str, str] = field(default_factory=dict)
    resume: str = "never"


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    """Steps are tokens seen, so warm-up and Hyperband's resources are token counts (its brackets stay study-wide)."""
    p = spec.pruner
    if p.name == "median":
        median = optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=p.warmup_tokens)
        return SameArchitecturePruner(median) if "model.arch" in spec.space else median
    if p.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=p.min_tokens or 1, max_resource="auto",
                                              reduction_factor=p.reduction_factor)
    return optuna.pruners.NopPruner()


class SameArchitecturePruner(optuna.pruners.BasePruner):
    """``inner`` judging a trial against the trials of the same ``model.arch`` only: architectures differ in loss at
    every token count, so a study-wide median would prune the weaker architecture's best learning rates."""

    def __init__(self, inner: optuna.pruners.BasePruner):
        self.inner = inner

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.inner.prune(_SameArchitecture(study, trial.params.get("model.arch")), trial)


class _SameArchitecture:
    """A study whose trials are those of one architecture (all a percentile pruner reads)."""

    def __init__(self, study: optuna.Study, arch: Any):
        self._study, self._arch = study, arch

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[FrozenTrial]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states)
                if t.params.get("model.arch") == self._arch]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


class QueuedCells(optuna.samplers.BaseSampler):
    """The sampler of an ablation's study, which samples nothing. Each cell is queued as a trial with its values
    (``Study.enqueue_trial``, in the spec's run order: :func:`satlab.studies.engine.reconcile_cells`), and a queued
    trial's values are fixed parameters, which ``Trial`` takes without asking the sampler; a worker pops the oldest
    waiting trial, so the cells run in that order. (Optuna's GridSampler shuffles its grid and has no option for the
    order.) A trial that finds the queue empty is set aside before it asks for anything (``TrialRunner``); should one
    ask all the same, this fails it rather than make up a cell."""

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: Any) -> Any:
        raise RuntimeError(f"trial {trial.number} of an ablation asked for '{param_name}', but an ablation's trials "
                           f"run queued cells, whose values are given")


class SearchPlan:
    def __init__(self, spec: SweepSpec, base_arch: str, n_trials: int):
        self.spec, self.base_arch, self.n_trials = spec, base_arch, n_trials

    def sampler(self) -> optuna.samplers.BaseSampler:
        """TPE grouped for the per-architecture parameters, with a constant liar for parallel workers."""
        if self.spec.sampler.name == "random":
            return optuna.samplers.RandomSampler(seed=self.spec.sampler.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=self.spec.sampler.seed, multivariate=True, group=True,
                                              n_startup_trials=self.spec.sampler.n_startup_trials, constant_liar=True)

    def pruner(self) -> optuna.pruners.BasePruner:
        return make_pruner(self.spec)

    def direction(self) -> str:
        return self.spec.objective.direction

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """``model.arch`` first: it decides which of the other parameters apply. The architecture is also the
        trial's ``arch`` user attribute, searched or fixed (the dashboard lists a trial's user attributes, and
        ``model.arch`` is among its parameters only when searched)."""
        params: dict[str, Any] = {}
        if "model.arch" in self.spec.space:
            params["model.arch"] = suggest_one(trial, "model.arch", self.spec.space["model.arch"])
        trial.set_user_attr(ARCH, params.get("model.arch", self.base_arch))
        for name in self.spec.active_params(params.get("model.arch", self.base_arch)):
            if name != "model.arch":
                params[name] = suggest_one(trial, name, self.spec.space[name])
        return params

    def point(self, trial: optuna.Trial, params: dict[str, Any]) -> Point:
        arch = params.get("model.arch", self.base_arch)
        values = short_label((k, v) for k, v in params.items() if k != "model.arch")
        label = f"{arch} {values} (trial {trial.number})".replace("  ", " ")
        return Point(f"t{trial.number:04d}", f"t{trial.number:04d}", label, {COLOUR_TAG: arch_colour(arch)})

    def study_name(self) -> str:
        return self.spec.name

    def next_action(self, study: optuna.Study, launched: int, starting: int) -> str:
        """``run`` a trial, ``wait`` for other workers' trials, or ``done``."""
        return "run" if launched < self.n_trials else "done"

    def record_constraint(self, trial: optuna.Trial, saturation: float | None) -> None:
        """Feasible (for TPE, ``study.best_trial`` and the report) when the saturated fraction is at most the
        threshold; a model without gates saturates none. Optuna 5 keeps a named constraint under
        ``constraints:<name>``, which optuna-dashboard 0.21 does not read: it reads the list under ``constraints``
        (Optuna's older format, which Optuna still reads too), so the value is recorded both ways. Optuna then sees
        the value twice; feasibility and TPE's ranking of infeasible trials (by their summed violation) are the
        same. An observing guard (``action: observe``) records none: its trials stay feasible, so that the sweep's
        best trial is the one without the guard and the guard's would-be decisions can be judged against it. The
        list is a trial system attr, which Optuna's public calls no longer write (Trial's ``set_system_attr`` is
        gone, TPE's ``constraints_func`` deprecated), so it goes through the trial's storage."""
        guard = self.spec.saturation
        if not guard.records_constraint():
            return
        value = float(saturation or 0.0) - guard.threshold
        storage = trial.storage
        storage.set_trial_system_attr(trial_id(storage, trial.study.study_name, trial.number), DASHBOARD_CONSTRAINTS,
                                      [value])
        trial.set_constraint(CONSTRAINT, value)
        trial.set_user_attr(FEASIBLE, value <= 0.0)


class GridPlan:
    """An ablation: each cell once, from a queue in run order; a worker with none left waits while others train (one
    may die, and its cell be queued again)."""

    def __init__(self, spec: AblationSpec):
        self.spec = spec
        self.cells = {c.key: c for c in spec.cells()}
        self.wanted: set[str] | None = None  # a sequential plan's cells by now (None: every cell)
        self.looks: Any = None  # its last replay (satlab.studies.sequential_looks.LookState)
        cells = list(self.cells.values())
        self.colours = group_colours([c.group_values for c in cells], [c.group for c in cells])

    def study_name(self) -> str:
        """Another budget or setting is another study. So is another grid: Optuna fixes a parameter's choices
        within a study (a grown axis would be refused), and the new grid's study adopts the cells MLflow records as
        finished (:func:`satlab.studies.engine.reconcile_cells`), so more seeds or values keep those."""
        layout = [self.spec.axes, self.spec.grids] if self.spec.grids else self.spec.axes
        grid = hashlib.sha256(json.dumps(layout, default=str).encode()).hexdigest()[:8]
        return f"{self.spec.name}.{self.spec.fingerprint()}.{grid}"

    def sampler(self) -> optuna.samplers.BaseSampler:
        return QueuedCells()

    def pruner(self) -> optuna.pruners.BasePruner:
        return optuna.pruners.NopPruner()

    def direction(self) -> str:
        return "minimize"

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        return {k: trial.suggest_categorical(k, v) for k, v in self.spec.axes.items()}

    def distributions(self) -> dict[str, CategoricalDistribution]:
        """What :meth:`suggest` asks for, for a trial entered by hand."""
        return {k: CategoricalDistribution(v) for k, v in self.spec.axes.items()}

    def cell(self, params: dict[str, Any]) -> Cell:
        return self.cells[" ".join(f"{k}={format_value(params[k])}" for k in self.spec.axes)]

    def cell_key(self, trial: FrozenTrial | optuna.Trial) -> str | None:
        """The trial's cell: given when it was queued (a queued trial has its values only once it runs), else read
        from its values (a trial of a study from before cells were queued). None for a trial that found no cell."""
        key = trial.user_attrs.get(CELL)
        if key is None and self.spec.axes.keys() <= trial.params.keys():
            key = self.cell(trial.params).key
        return key

    def point(self, trial: optuna.Trial, params: dict[str, Any]) -> Point:
        cell = self.cell(params)
        tags = {CELL_TAG: cell.key, GROUP_TAG: cell.group, COLOUR_TAG: self.colours[cell.group]}
        return Point(cell.key, cell.slug, cell.label, tags, resume="auto")

    def trials_by_cell(self, study: optuna.Study) -> dict[str, list[FrozenTrial]]:
        """Each cell's trials, less those that do not count (duplicates, superseded)."""
        out: dict[str, list[FrozenTrial]] = {key: [] for key in self.cells}
        superseded = set(study.user_attrs.get(SUPERSEDED, []))
        for trial in study.get_trials(deepcopy=False):
            key = self.cell_key(trial)
            if key is not None and not trial.user_attrs.get(IGNORED) and trial.number not in superseded:
                out[key].append(trial)
        return out

    def recorded_study(self, storage: str | None = None) -> optuna.Study | None:
        """The ablation's study as its storage holds it, or None where it never ran; nothing is created. The study
        is the one record of an ablation's progress (each cell queued, running, finished or failed, why, on which
        host, its log) and names the parent run; MLflow is the record of results, and of which cells finished for
        good (:func:`satlab.studies.engine.reconcile_cells`)."""
        url = storage or self.spec.storage or self.spec.storage_url()
        if missing_sqlite_file(url):
            return None
        try:
            return optuna.load_study(study_name=self.study_name(), storage=open_storage(url, create_tables=False))
        except KeyError:  # no study of this name (a grid that grew has not run yet)
            return None

    def finished_in_earlier_grids(self, storage: str | None = None) -> set[str]:
        """This grid's cells finished in the ablation's studies of an earlier grid (same name and settings, fewer
        seeds or values): a run of this grid adopts them from their MLflow runs. Reads only."""
        url = storage or self.spec.storage or self.spec.storage_url()
        if missing_sqlite_file(url):
            return set()
        rdb = open_storage(url, create_tables=False)
        prefix, done = f"{self.spec.name}.{self.spec.fingerprint()}.", set()
        for name in optuna.get_all_study_names(rdb):
            if name.startswith(prefix) and name != self.study_name():
                trials = self.trials_by_cell(optuna.load_study(study_name=name, storage=rdb))
                done |= {key for key, ts in trials.items() if any(t.state == TrialState.COMPLETE for t in ts)}
        return done

    def cell_status(self, study: optuna.Study | None) -> dict[str, str]:
        """Each cell's state as its latest trial records it: finished, running, failed (with why), queued or
        not run."""
        names = {TrialState.COMPLETE: "finished", TrialState.RUNNING: "running", TrialState.WAITING: "queued",
                 TrialState.FAIL: "failed", TrialState.PRUNED: "pruned"}
        status = dict.fromkeys(self.cells, "not run")
        for key, trials in (self.trials_by_cell(study) if study is not None else {}).items():
            if trials:
                last = max(trials, key=lambda t: t.number)
                why = last.user_attrs.get(REASON) if last.state in (TrialState.FAIL, TrialState.PRUNED) else None
                status[key] = names[last.state] + (f" ({why})" if why else "")
        return status

    def next_action(self, study: optuna.Study, launched: int, starting: int) -> str:
        """``run`` while the queue holds more trials than the ``starting`` workers of this driver are about to pop,
        ``wait`` while trials run (a worker may die and its cell be queued again), else ``done``. A cell is queued
        when the study is set up; a trial that a worker starts on an empty queue would have no cell."""
        states = [t.state for ts in self.trials_by_cell(study).values() for t in ts]
        if states.count(TrialState.WAITING) > starting:
            return "run"
        return "wait" if TrialState.RUNNING in states or TrialState.WAITING in states else "done"

    def is_duplicate(self, study: optuna.Study, trial: optuna.Trial, params: dict[str, Any]) -> bool:
        """Whether another trial has the cell: a finished one, or a running one with a lower number. A cell queued
        twice (two drivers requeueing it at once, say) can have two running trials; the later one steps aside
        whichever of the two checks first, so one of them runs (were each to yield to the other, neither would)."""
        key = self.cell(params).key
        return any(t.state == TrialState.COMPLETE or (t.state == TrialState.RUNNING and t.number < trial.number)
                   for t in self.trials_by_cell(study)[key] if t.number != trial.number)


def group_colours(values: list[dict[str, Any]], groups: list[str]) -> dict[str, str]:
    """A colour per group (``values[i]`` are the axis values of ``groups[i]``): its architecture's, as everywhere
    else, when each group is one architecture; otherwise the groups' own colours in grid order."""
    archs = {group: v.get("model.arch") for v, group in zip(values, groups, strict=True)}
    if None not in archs.values() and len(set(archs.values())) == len(archs):
        return {group: arch_colour(arch) for group, arch in archs.items()}
    return {group: colour(i) for i, group in enumerate(dict.fromkeys(groups))}


def suggest_one(trial: optuna.Trial, name: str, p: Param) -> Any:
    if p.type == "categorical":
        return trial.suggest_categorical(name, p.choices)
    if p.type == "int":
        return trial.suggest_int(name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
    return trial.suggest_float(name, float(p.low), float(p.high), step=p.step, log=p.log)


Plan = SearchPlan | GridPlan
