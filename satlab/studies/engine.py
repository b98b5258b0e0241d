"""Running a study (``satlab sweep``, ``satlab ablate``): its storage, study and MLflow parent run, the workers
(:mod:`satlab.studies.workers`) and the report.

The same command on another host with the same storage joins the study: a sweep adds its trials, an ablation takes
the next cell nobody has and waits while others run (a cell whose worker dies is failed by heartbeat and retried).
A re-run resumes: killed cells continue from their checkpoint in the same MLflow run, failed ones and those whose
MLflow record was deleted run again, finished ones are skipped.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlflow
import optuna
from optuna.exceptions import DuplicatedStudyError, ExperimentalWarning
from optuna.trial import TrialState
from rich.console import Console

from satlab.config.errors import ConfigError
from satlab.config.schema import ExperimentConfig
from satlab.config.stores import missing_sqlite_file, sqlite_file
from satlab.studies import attrs as A
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.dashboard import write_note
from satlab.studies.plans import GridPlan, Plan, SearchPlan
from satlab.studies.runs import (
    FEASIBLE_TAG,
    GROUP_TAG,
    PARENT_TAG,
    create_parent_run,
    find_parent_run,
    finished_cells,
    save_spec,
    usable_run,
)
from satlab.studies.sequential_looks import check_plan, look, store_plan
from satlab.studies.spec import StudySpec, SweepSpec
from satlab.studies.storage import open_storage, safe_url
from satlab.studies.workers import StaleTrialRetry, TrialRunner, fail_dead_local_trials
from satlab.training.chatter import library_chatter_to
from satlab.training.tracking import ensure_reachable, open_store, resolve_tracking
from satlab.training.views import (
    comparison_state,
    comparison_url,
    open_lines,
    param_column,
    publish,
    run_url,
    tag_column,
)

STUDY_LOG = "study.log"  # the libraries' notices of the driver; each trial's are in its run folder's train.log


@dataclass
class StudyResult:
    name: str
    storage: str
    tracking_uri: str
    parent_run_id: str
    interrupted: bool
    skipped: list[str] = field(default_factory=list)  # finished before this run
    finished: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    report: dict[str, Path] | None = None


def run_study(spec: StudySpec, workers: int = 1, n_trials: int | None = None, storage: str | None = None,
              console: Console | None = None, report: bool = True) -> StudyResult:
    """Run (or resume, or join) the study and write the report. The data, the storage and the MLflow store are
    prepared here, before any trial process opens them (two processes creating one sqlite database race)."""
    console = console or Console()
    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeats, retries, constraints
    base = spec.base_config()
    if not base.tracking.enabled:
        raise ConfigError(f"{spec.kind} '{spec.name}': tracking.enabled is false, but the trials' MLflow runs are "
                          "the study's record (what resuming skips, what the report reads); remove the override")
    named = storage or spec.storage  # a storage the user names is used as it is; satlab's default may be made
    spec = replace(spec, storage=named or spec.storage_url(), out_dir=str(spec.out_path().resolve()))
    if isinstance(spec, AblationSpec) and (problems := spec.sequential.seed_problems(spec.axes, spec.seed_key)):
        raise ConfigError(problems)
    if n_trials == 0 and missing_sqlite_file(spec.storage):
        raise ConfigError(f"--n-trials 0 rewrites the report of a study, but {spec.kind} '{spec.name}' has none yet "
                          f"(no {sqlite_file(spec.storage)}); run it with n_trials >= 1 first")
    if isinstance(spec, SweepSpec):
        spec = replace(spec, pruner=replace(spec.pruner, min_tokens=spec.pruner.min_tokens
                                            or base.train.val_every_tokens))
        plan: Plan = SearchPlan(spec, base.model.arch, spec.n_trials if n_trials is None else n_trials)
    else:
        plan = GridPlan(spec)
    uri, artifacts = resolve_tracking(base.tracking.uri, base.tracking.artifact_dir)  # both stores are checked
    uri = ensure_reachable(uri, base.tracking.fallback_local, base.tracking.artifact_dir)  # before anything is made
    retry = StaleTrialRetry(spec.trial.max_retry)
    rdb = open_storage(spec.storage, spec.trial, retry,  # a bad or unreachable storage fails before anything is made
                       create_folder=named is None)
    with library_chatter_to(Path(spec.out_dir), STUDY_LOG):  # MLflow's migrations, Optuna's "study created"
        return _run(spec, plan, base, rdb, retry, workers, console, report, (uri, artifacts))


def _run(spec: StudySpec, plan: Plan, base: ExperimentConfig, rdb: optuna.storages.RDBStorage,
         retry: StaleTrialRetry, workers: int, console: Console, report: bool,
         tracking: tuple[str, str | None]) -> StudyResult:
    uri, artifacts = tracking
    client = mlflow.MlflowClient(open_store(uri))
    sequential = isinstance(spec, AblationSpec) and spec.sequential.enabled
    if sequential:  # before anything is written: a changed plan is refused
        check_recorded_plan(spec, plan, rdb, client)
    prepare_data_once(spec, base, console)
    study, parent_id, done = set_up_study(spec, plan, rdb, client, tracking, retry, console)
    view_url = publish_study_view(client, spec, parent_id, uri)
    runner = TrialRunner(spec, plan, study, rdb, client, parent_id, uri, workers, console)
    grid = isinstance(plan, GridPlan)
    wanted = f"{len(plan.wanted)} wanted by the plan's looks so far, " if grid and plan.wanted is not None else ""
    before = f"{len(plan.cells)} cells, {wanted}{len(done)} finished before, " if grid else \
        f"{plan.n_trials} trial(s) to add, "
    console.print(f"[bold]{spec.kind}[/] [cyan]{spec.name}[/]: {before}{workers} worker(s), "
                  f"{runner.threads} thread(s) each; storage {safe_url(spec.storage)}; MLflow {uri}, experiment "
                  f"'{spec.experiment_name}', parent run {parent_id}; logs in {runner.logs}", soft_wrap=True)
    interrupted = runner.run_all(retry)
    if sequential:
        interrupted = run_looks(spec, plan, study, client, parent_id, runner, retry, console, interrupted)
    finished = finished_cells(client, parent_id) if grid else {}
    wanted = plan.wanted if grid and plan.wanted is not None else plan.cells if grid else {}
    complete = not grid or (all(k in finished for k in wanted) and (not sequential or looks_decided(plan)))
    client.set_terminated(parent_id, "FINISHED" if complete and not interrupted else
                          "KILLED" if interrupted else "FAILED")
    result = StudyResult(spec.name, spec.storage, uri, parent_id, interrupted, list(done), runner.finished,
                         runner.failures)
    if isinstance(spec, SweepSpec):
        from satlab.studies.sweep_report import write_report

        result.report = write_report(study, spec, base.model.arch, client, parent_id, console)
    elif report and not interrupted and finished:
        from satlab.studies.ablation_report import write_report

        result.report = write_report(spec, client, parent_id, console=console)
    parent = client.get_run(parent_id)
    rows = open_lines(uri, view_url) + [("the study's results", run_url(uri, parent.info.experiment_id, parent_id))]
    for label, value in rows:
        console.print(f"{label}: {value}", soft_wrap=True)
    return result


def check_recorded_plan(spec: AblationSpec, plan: GridPlan, rdb: optuna.storages.RDBStorage,
                        client: mlflow.MlflowClient) -> None:
    """Refuse a sequential plan that differs from the one the study fixed, once a look is recorded; reads only (the
    study as its storage holds it, else the parent run from before)."""
    try:
        study = optuna.load_study(study_name=plan.study_name(), storage=rdb)
    except KeyError:
        study = None
    parent_id = study.user_attrs.get(A.PARENT_RUN) if study is not None else None
    if parent_id is None and (found := find_parent_run(client, spec)) is not None:
        parent_id = found.info.run_id
    check_plan(spec, study, client, parent_id)


def run_looks(spec: AblationSpec, plan: GridPlan, study: optuna.Study, client: mlflow.MlflowClient, parent_id: str,
              runner: TrialRunner, retry: StaleTrialRetry, console: Console, interrupted: bool) -> bool:
    """Look after each drained queue and queue the next look's cells (the runner runs them as any queued cell),
    until every comparison is decided, a wanted cell failed, or the records disagree with the cells; whether it was
    interrupted."""
    while not interrupted:
        state = look(spec, study, client, parent_id, console)
        plan.wanted, plan.looks = (set() if state.problem else state.wanted), state
        if state.problem:
            runner.failures["sequential"] = state.problem
            return False
        reconcile_cells(study, plan, client, parent_id, retry_failed=False)  # a failed cell waits for a rerun
        states = [t.state for key in plan.wanted for t in plan.trials_by_cell(study)[key]]
        if TrialState.WAITING not in states and TrialState.RUNNING not in states:
            return False
        next_look = max((k for k in state.schedule.waiting_for.values() if k), default=None)
        console.print(f"sequential: the cells of look {next_look} queued ({len(plan.wanted)} cells wanted so far)",
                      soft_wrap=True)
        interrupted = runner.run_all(retry)
    return True


def looks_decided(plan: GridPlan) -> bool:
    return plan.looks is not None and plan.looks.problem is None and plan.looks.schedule.decided


def set_up_study(spec: StudySpec, plan: Plan, rdb: optuna.storages.RDBStorage, client: mlflow.MlflowClient,
                 tracking: tuple[str, str | None], retry: StaleTrialRetry,
                 console: Console | None = None) -> tuple[optuna.Study, str, dict[str, str]]:
    """Create or join the study and its MLflow parent run, fail this host's dead trials and (an ablation) queue the
    cells; returns the study, the parent run and the cells finished before (key -> run id).

    A new study's parent run is recorded on it last, and a host that joins waits for that record
    (:func:`ensure_parent_run`): it then finds the cells queued and queues none again. Were both to queue them at
    once, each cell would be queued twice (``enqueue_trial``'s ``skip_if_exists`` reads, then writes)."""
    uri, artifacts = tracking
    study, created = open_study(spec, plan, rdb)
    parent_id, recorded = ensure_parent_run(client, study, rdb, spec, uri, artifacts, created)
    retry.client, retry.parent_run_id = client, parent_id
    fail_dead_local_trials(study, rdb, retry)
    if isinstance(spec, AblationSpec) and isinstance(plan, GridPlan) and spec.sequential.enabled:
        store_plan(spec, study)  # fixed before the first look; the cells of the looks so far are wanted
        state = look(spec, study, client, parent_id, console)
        plan.wanted, plan.looks = (set() if state.problem else state.wanted), state
    done = reconcile_cells(study, plan, client, parent_id) if isinstance(plan, GridPlan) else {}
    if not recorded:
        study.set_user_attr(A.PARENT_RUN, parent_id)
        study.set_user_attr(A.TRACKING_URI, uri)
    return study, parent_id, done


def publish_study_view(client: mlflow.MlflowClient, spec: StudySpec, parent_id: str, tracking_uri: str) -> str:
    """The comparison of the study's runs (the parent's children), named by their values and coloured by group:
    the loss curves, then (an ablation's) end-of-run accuracies; the table shows each run's group or searched
    values. Returns its URL."""
    run_filter = f"tags.`{PARENT_TAG}` = '{parent_id}'"
    if isinstance(spec, AblationSpec):
        columns = [tag_column(GROUP_TAG)]
        bars = ("zero_shot/offline_zero_shot_avg", "zero_shot/offline_retrieval_avg", "recall/acc")
    else:
        columns = [param_column(name) for name in spec.space if name != "model.arch"] + [tag_column(FEASIBLE_TAG)]
        bars = ()
        if spec.saturation.records_constraint():  # MLflow sorts by one key: the top row must be able to be the best
            run_filter += f" and tags.`{FEASIBLE_TAG}` = 'true'"
    key = f"satlab-study-{parent_id}"
    state = comparison_state(run_filter, bars=bars, columns=columns)
    experiment = client.get_run(parent_id).info.experiment_id
    publish(client, experiment, key, state)
    return comparison_url(tracking_uri, experiment, key)


def prepare_data_once(spec: StudySpec, base: ExperimentConfig, console: Console) -> None:
    """Tokenize and pack each distinct data config once, here, rather than in every parallel trial."""
    from satlab.data.prepare import prepare_data

    configs = [spec.base_config(c.overrides()) for c in spec.cells()] if isinstance(spec, AblationSpec) else [base]
    for data in {repr(c.data): c.data for c in configs if not c.data.synthetic_task}.values():
        console.print(f"preparing data: {data.source} ({data.tokenizer.kind} tokenizer, seq_len {data.seq_len})")
        prepare_data(data, progress=False)


def open_study(spec: StudySpec, plan: Plan, storage: optuna.storages.RDBStorage) -> tuple[optuna.Study, bool]:
    """Create the study or join the one of the same name; whether this process created it (then it makes the parent
    run: creating a study is atomic in the storage)."""
    kwargs = dict(study_name=plan.study_name(), storage=storage, sampler=plan.sampler(), pruner=plan.pruner())
    try:
        study, created = optuna.create_study(direction=plan.direction(), **kwargs), True
    except DuplicatedStudyError:
        study, created = optuna.load_study(**kwargs), False
    if study.direction.name.lower() != plan.direction():
        raise ConfigError(f"study '{study.study_name}' in this storage was created to "
                          f"{study.direction.name.lower()}, but the spec says {plan.direction()}; use another name")
    if isinstance(spec, SweepSpec):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            study.set_metric_names([spec.objective.metric])  # the dashboard's axis says "val/loss", not "Objective 0"
        for point in spec.enqueue:
            study.enqueue_trial(point, skip_if_exists=True)
    recorded = study.user_attrs.get(A.FINGERPRINT)
    if recorded is not None and recorded != spec.fingerprint():
        raise ConfigError(f"study '{study.study_name}' in this storage was run with another base, overrides, objective "
                          f"or search space than this spec's; its trials would not compare with new ones: give this "
                          f"spec another name (name=...) or another --storage")
    if created or recorded is None:
        study.set_user_attr(A.KIND, spec.kind)
        study.set_user_attr(A.SPEC, replace(spec, storage=None).to_dict())
        study.set_user_attr(A.FINGERPRINT, spec.fingerprint())
    if isinstance(spec, SweepSpec):
        write_note(study, spec)  # how to read the dashboard: steps are tokens, what infeasible and best mean
    return study, created


def ensure_parent_run(client: mlflow.MlflowClient, study: optuna.Study, storage: optuna.storages.BaseStorage,
                      spec: StudySpec, tracking_uri: str, artifacts: str | None, created: bool) -> tuple[str, bool]:
    """The parent run recorded on the study (a joining host waits for the creator to record it), else one from before
    or a new one, for the caller to record once the study is set up (:func:`set_up_study`); and whether it is
    recorded. Each look loads the study anew from ``storage``: the creator's attributes, not a copy of ours."""
    deadline = time.monotonic() + (0 if created else 60)
    while True:
        attrs = optuna.load_study(study_name=study.study_name, storage=storage).user_attrs
        run_id = attrs.get(A.PARENT_RUN)
        recorded = bool(run_id) and attrs.get(A.TRACKING_URI) == tracking_uri and usable_run(client, run_id) is not None
        if recorded:
            break
        if run_id or time.monotonic() >= deadline:  # recorded for another store, deleted, or never recorded
            found = find_parent_run(client, spec) if isinstance(spec, AblationSpec) else None  # one from before
            run_id = found.info.run_id if found is not None else create_parent_run(client, spec, artifacts)
            break
        time.sleep(1.0)
    client.update_run(run_id, status="RUNNING")
    save_spec(client, run_id, spec)
    return run_id, recorded


def reconcile_cells(study: optuna.Study, plan: GridPlan, client: mlflow.MlflowClient,
                    parent_id: str, retry_failed: bool = True) -> dict[str, str]:
    """The ablation's queue, cell by cell in run order (seeds slowest, so an interrupted ablation leaves whole
    replicates): workers pop the oldest waiting trial, and a queued trial's values are fixed, never sampled
    (:class:`satlab.studies.plans.QueuedCells`). A cell with no trial yet is queued (``enqueue_trial``; its cell key
    as a user attr, its values being set only once it runs). MLflow's FINISHED cell runs are the record: a finished
    cell the study has no complete trial for (a parent run from before the study existed, or a grid that grew, whose
    study is new) is entered as COMPLETE; a cell that ran but has no FINISHED run (failed, interrupted, or its run
    deleted to redo it) is queued again, as Optuna's retry does (``failed_trial``). Returns the finished cells
    (key -> run id). With a sequential plan only the cells its looks want by now are queued (``plan.wanted``), and
    between looks (``retry_failed`` false) a failed cell is left for the next run of the command."""
    done = finished_cells(client, parent_id)
    by_cell = plan.trials_by_cell(study)
    for cell in plan.spec.run_order():
        key, trials, params = cell.key, by_cell[cell.key], dict(cell.values)
        if key in done:
            if not any(t.state == TrialState.COMPLETE for t in trials):
                loss = client.get_run(done[key]).data.metrics.get("val/loss")
                study.add_trial(optuna.trial.create_trial(  # the value is not what a grid reads; keep it finite
                    state=TrialState.COMPLETE, value=loss if loss is not None and loss == loss else 0.0, params=params,
                    distributions=plan.distributions(), user_attrs={A.CELL: key, A.RUN_ID: done[key]}))
            continue
        if plan.wanted is not None and key not in plan.wanted:
            continue
        if not trials:
            study.enqueue_trial(params, user_attrs={A.CELL: key}, skip_if_exists=True)
            continue
        if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials) or not retry_failed:
            continue
        last = trials[-1]
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.WAITING, params=params, distributions=plan.distributions(), user_attrs={A.CELL: key},
            system_attrs={**last.system_attrs, "failed_trial": last.number}))
        superseded = set(study.user_attrs.get(A.SUPERSEDED, [])) | {t.number for t in trials}
        study.set_user_attr(A.SUPERSEDED, sorted(superseded))  # finished trials cannot be marked themselves
    return done
