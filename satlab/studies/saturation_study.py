"""Gate saturation against outcome, from an ablation whose cells ran with an observing saturation guard
(``saturation: {action: observe, ...}``, e.g. ``experiments/ablations/saturation.yml``): where saturation occurs,
whether saturated runs end worse than unsaturated ones at the same learning rate, and the guard as a classifier.

Every cell logged its per-(layer, head) saturation history (``gates/saturation_history.json``: at each analysis, the
share of each head's gate values at its most frequent bound), so the guard can be replayed here at any definition,
threshold and patience, not only at the one the cells observed with; the replay at that one must agree with what the
cells recorded (``guard.would_prune_at``), which the report checks.

Outcomes: a cell that finished has its last validation loss; one stopped because its loss or gradient went non-finite
(MLflow tag ``trial.stopped: nan ...``) *diverged*; anything else (crashed, still running) is left out and counted.
Within each *sweep group* (the cells a learning-rate sweep would compare: same values of every axis but the learning
rate and the seed), a cell is **among the best** when its loss is in the best quarter of the group's cells, and
**finished badly** when it diverged or its loss is in the worst quarter.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd

from satlab.evaluation.gates import required_share
from satlab.studies.ablation_spec import AblationSpec, Cell
from satlab.studies.runs import CELL_TAG, STOPPED_TAG, WOULD_PRUNE_TAG, child_runs
from satlab.studies.spec import SaturationGuard, format_value
from satlab.studies.stats import format_p, mean_std

LR_KEY = "optim.lr"
DEPTH_KEY = "model.n_layers"
SATURATED_RUN = 0.5  # a run is saturated when more than this share of its heads is saturated at its last analysis
HISTORY_ARTIFACT = "gates/saturation_history.json"
DEFINITIONS = {"share": 0.99, "dead": 1.0}
"""How a ReLU head counts as saturated (its ``dead_share``): ``share``, the old definition, at 0 on 99 % of its gate
values (which counts a sparse head); ``dead``, the table's rule now, at 0 on all of them. Bounded gates: pinned at one
bound on 99 % under both."""
PERMUTATIONS = 20_000


@dataclass
class CellOutcome:
    cell: Cell
    gate_fn: str
    loss: float | None  # the last validation loss; None when diverged
    diverged: bool
    steps: list[int]  # the training step of each analysis inside training
    shares: list[np.ndarray]  # per analysis: [gated layer, head] share of gate values at the most frequent bound
    tokens_per_step: float
    observed_prune_at: int | None  # tokens seen when the cells' own observing guard would have pruned

    def fractions(self, dead_share: float) -> list[float]:
        """``val/gates/saturated_frac`` at each analysis under a ReLU definition (bounded gates: pinned on 99 %)."""
        need = required_share(self.gate_fn, dead_share=dead_share)  # bounded gates: the analysis's default share
        return [0.0 if need is None else float((share >= need).mean()) for share in self.shares]


@dataclass(frozen=True)
class GuardSetting:
    label: str
    definition: str  # a key of DEFINITIONS
    threshold: float
    patience: int

    def prunes_at(self, outcome: CellOutcome) -> int | None:
        """Tokens seen at the validation where the guard would prune ``outcome`` (as TrialCallback decides: the
        saturated share above the threshold for ``patience`` validations in a row); None if never."""
        streak = 0
        for step, fraction in zip(outcome.steps, outcome.fractions(DEFINITIONS[self.definition]), strict=True):
            streak = streak + 1 if fraction > self.threshold else 0
            if streak >= self.patience:
                return int(step * outcome.tokens_per_step)
        return None


def load_outcomes(spec: AblationSpec, client: mlflow.MlflowClient, parent_run_id: str) -> tuple[list[CellOutcome],
                                                                                                    list[str]]:
    """The cells with an outcome, in grid order, and the keys of those without one (not run, crashed, running)."""
    runs = {}
    for run in child_runs(client, client.get_run(parent_run_id), finished_only=False):  # oldest first: newest wins
        if CELL_TAG in run.data.tags:
            runs[run.data.tags[CELL_TAG]] = run
    outcomes, missing = [], []
    for cell in spec.cells():
        run = runs.get(cell.key)
        stopped = run.data.tags.get(STOPPED_TAG, "") if run else ""
        diverged = stopped.startswith("nan")
        if run is None or not (run.info.status == "FINISHED" or diverged):
            missing.append(cell.key)
            continue
        history = _history(client, run.info.run_id)
        loss = run.data.metrics.get("val/loss")
        if loss is not None and not math.isfinite(loss):
            diverged = True
        gate_fn = history.get("gate_fn") or run.data.params.get("model.satformer.gate_fn", "relu")
        entries = [e for e in history.get("history", []) if e["step"] > 0]  # not the analysis before training
        would = run.data.tags.get(WOULD_PRUNE_TAG)
        outcomes.append(CellOutcome(
            cell=cell, gate_fn=gate_fn, loss=None if diverged else loss, diverged=diverged,
            steps=[e["step"] for e in entries], shares=[np.asarray(e["share"], dtype=float) for e in entries],
            tokens_per_step=float(run.data.params.get("derived.tokens_per_step") or 0),
            observed_prune_at=int(would) if would else None))
    return outcomes, missing


def _history(client: mlflow.MlflowClient, run_id: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, HISTORY_ARTIFACT, folder)
        except Exception:  # noqa: BLE001 - MLflow raises several kinds for "no such artifact": a run with no gates
            return {}
        return json.loads(Path(path).read_text())


def sweep_group(cell: Cell) -> str:
    """The cells a learning-rate sweep would compare: the group without the learning rate."""
    return _without(cell, LR_KEY) or "all"


def rank_labels(outcomes: Sequence[CellOutcome]) -> dict[str, str]:
    """Cell key -> ``best`` (best quarter of its sweep group by loss), ``bad`` (diverged or worst quarter) or
    ``middle``. Diverged cells rank below every finished one."""
    labels = {}
    groups: dict[str, list[CellOutcome]] = {}
    for outcome in outcomes:
        groups.setdefault(sweep_group(outcome.cell), []).append(outcome)
    for members in groups.values():
        ordered = sorted(members, key=lambda o: math.inf if o.diverged else o.loss)
        quarter = max(1, len(ordered) // 4)
        for rank, outcome in enumerate(ordered):
            labels[outcome.cell.key] = "bad" if outcome.diverged or rank >= len(ordered) - quarter else \
                "best" if rank < quarter else "middle"
    return labels


@dataclass
class GuardScore:
    setting: GuardSetting
    flagged: int
    flagged_best: int
    flagged_bad: int
    bad: int
    caught_before_divergence: int

    @property
    def precision(self) -> float | None:
        return self.flagged_bad / self.flagged if self.flagged else None

    @property
    def recall(self) -> float | None:
        return self.flagged_bad / self.bad if self.bad else None


def score_guard(setting: GuardSetting, outcomes: Sequence[CellOutcome], labels: dict[str, str]) -> GuardScore:
    flagged = [o for o in outcomes if setting.prunes_at(o) is not None]
    return GuardScore(
        setting, flagged=len(flagged), flagged_best=sum(labels[o.cell.key] == "best" for o in flagged),
        flagged_bad=sum(labels[o.cell.key] == "bad" for o in flagged),
        bad=sum(label == "bad" for label in labels.values()),
        caught_before_divergence=sum(o.diverged for o in flagged))


def final_fraction(outcome: CellOutcome, definition: str) -> float | None:
    fractions = outcome.fractions(DEFINITIONS[definition])
    return fractions[-1] if fractions else None


def saturated_run(outcome: CellOutcome, definition: str) -> bool:
    fraction = final_fraction(outcome, definition)
    return fraction is not None and fraction > SATURATED_RUN


def _without(cell: Cell, key: str) -> str:
    return " ".join(f"{k}={format_value(v)}" for k, v in cell.group_values.items() if k != key)


def cell_table(outcomes: Sequence[CellOutcome], definition: str) -> list[list[str]]:
    """One row per group: the share of saturated heads at the last analysis and the final loss, mean ± std over
    seeds, with the count of diverged seeds and of saturated runs."""
    groups: dict[str, list[CellOutcome]] = {}
    for outcome in outcomes:
        groups.setdefault(outcome.cell.group, []).append(outcome)
    keys = list(next(iter(groups.values()))[0].cell.group_values) if groups else []
    rows = [[k.rsplit(".", 1)[-1] for k in keys] + ["saturated heads", "saturated runs", "final loss", "diverged"]]
    for members in groups.values():
        fractions = [f for o in members if (f := final_fraction(o, definition)) is not None]
        losses = [o.loss for o in members if o.loss is not None]
        rows.append([format_value(members[0].cell.group_values[k]) for k in keys] + [
            _mean_std(fractions, "{:.0%}"), f"{sum(saturated_run(o, definition) for o in members)}/{len(members)}",
            _mean_std(losses, "{:.3f}"), f"{sum(o.diverged for o in members)}/{len(members)}"])
    return rows


def _mean_std(values: Sequence[float], fmt: str) -> str:
    mean, std = mean_std(values)
    if mean is None:
        return "—"
    return fmt.format(mean) + ("" if std is None else f" ± {fmt.format(std)}")


@dataclass
class LossTest:
    """Saturated against unsaturated runs within strata: the mean loss difference over the strata that hold both
    (each stratum's residuals about its own mean) and a two-sided permutation p (labels shuffled within strata)."""

    strata: str
    mixed_strata: int
    saturated: int
    unsaturated: int
    difference: float | None
    p: float | None


def loss_test(outcomes: Sequence[CellOutcome], definition: str, stratum: Callable[[Cell], str],
              description: str, seed: int = 0) -> LossTest:
    strata: dict[str, list[tuple[float, bool]]] = {}
    for o in outcomes:
        if o.loss is not None and final_fraction(o, definition) is not None:
            strata.setdefault(stratum(o.cell), []).append((o.loss, saturated_run(o, definition)))
    mixed = [np.array(v) for v in strata.values() if 0 < sum(s for _, s in v) < len(v)]
    if not mixed:
        return LossTest(description, 0, 0, 0, None, None)
    residuals = np.concatenate([m[:, 0] - m[:, 0].mean() for m in mixed])
    labels = [m[:, 1].astype(bool) for m in mixed]

    def statistic(flags: list[np.ndarray]) -> float:
        joined = np.concatenate(flags)
        return float(residuals[joined].mean() - residuals[~joined].mean())

    observed = statistic(labels)
    rng = np.random.default_rng(seed)
    extreme = sum(abs(statistic([rng.permutation(f) for f in labels])) >= abs(observed) - 1e-12
                  for _ in range(PERMUTATIONS))
    joined = np.concatenate(labels)
    return LossTest(description, len(mixed), int(joined.sum()), int((~joined).sum()), observed,
                    (extreme + 1) / (PERMUTATIONS + 1))


def settings_to_score(observed: SaturationGuard) -> list[GuardSetting]:
    """The old sweep default, the cells' own setting, and a grid of definitions, thresholds and patiences."""
    settings = [GuardSetting("old default", "share", 0.5, 2)]
    if observed.threshold is not None:
        settings.append(GuardSetting("as observed", "dead", observed.threshold, observed.patience))
    for definition in DEFINITIONS:
        for threshold in (0.1, 0.25, 0.5, 0.75):
            for patience in (1, 2, 4):
                settings.append(GuardSetting("", definition, threshold, patience))
    return settings


def guard_rows(scores: Sequence[GuardScore]) -> list[list[str]]:
    rows = [["setting", "definition", "threshold", "patience", "would prune", "of them among the best",
             "of them finished badly", "precision", "recall", "finished badly"]]
    for s in scores:
        rows.append([s.setting.label, s.setting.definition, f"{s.setting.threshold:g}", str(s.setting.patience),
                     str(s.flagged), str(s.flagged_best), str(s.flagged_bad), _share(s.precision),
                     _share(s.recall), str(s.bad)])
    return rows


def _share(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def saturation_section(spec: AblationSpec, client: mlflow.MlflowClient, parent_run_id: str) \
        -> tuple[list[str], dict[str, Any]]:
    """The report's "Gate saturation" section (markdown lines) and its numbers for ``summary.json``."""
    outcomes, missing = load_outcomes(spec, client, parent_run_id)
    labels = rank_labels(outcomes)
    scores = [score_guard(s, outcomes, labels) for s in settings_to_score(spec.saturation)]
    observed = next((s for s in scores if s.setting.label == "as observed"), None)
    agree = [o for o in outcomes if observed and observed.setting.prunes_at(o) == o.observed_prune_at]
    without_lr = [k for k in spec.group_axes() if k != LR_KEY]
    tests = {d: [loss_test(outcomes, d, lambda c: c.group, "same values of every axis"),
                 loss_test(outcomes, d, lambda c: _without(c, DEPTH_KEY), "same values but the depth")]
             for d in DEFINITIONS}
    lines = ["## Gate saturation", "",
             f"{len(outcomes)} cells with an outcome ({sum(o.diverged for o in outcomes)} diverged); "
             f"{len(missing)} without one. A run is *saturated* when more than {SATURATED_RUN:.0%} of its heads are "
             "saturated at its last analysis. Definitions of a saturated ReLU head: " + "; ".join(
                 f"`{d}`: at 0 on {share:.0%} of its gate values" for d, share in DEFINITIONS.items()) +
             " (bounded gates: pinned at one bound on 99 % under both).", ""]
    for definition in DEFINITIONS:
        rows = cell_table(outcomes, definition)
        lines += [f"### Where saturation occurs (definition `{definition}`)", "",
                  pd.DataFrame(rows[1:], columns=rows[0]).to_markdown(index=False, disable_numparse=True), ""]
    lines += ["### Do saturated runs end worse?", "",
              "Mean loss of saturated minus unsaturated runs, each about the mean of its stratum, over the strata "
              f"holding both; p: two-sided permutation test ({PERMUTATIONS:,} shuffles of the labels within strata). "
              "Diverged runs are left out (their loss is not a number).", "",
              "| definition | strata | mixed strata | saturated | unsaturated | difference (nats) | p |",
              "|---|---|---|---|---|---|---|"]
    for definition, pair in tests.items():
        for t in pair:
            diff = "—" if t.difference is None else f"{t.difference:+.3f}"
            lines.append(f"| `{definition}` | {t.strata} | {t.mixed_strata} | {t.saturated} | {t.unsaturated} | "
                         f"{diff} | {format_p(t.p)} |")
    rows = guard_rows(scores)
    lines += ["", "### The guard as a classifier", "",
              f"Sweep groups: {', '.join(f'`{k}`' for k in without_lr) or 'the whole grid'} (a learning-rate sweep "
              "compares the cells of one group). Among the best: the best quarter of a group by final loss; "
              "finished badly: diverged or the worst quarter. Precision: the share of the cells the guard would "
              "prune that finished badly; recall: the share of the cells that finished badly that it would prune.",
              "", pd.DataFrame(rows[1:], columns=rows[0]).to_markdown(index=False, disable_numparse=True), ""]
    if observed is not None:
        lines += [f"The replay of the cells' own guard agrees with what they recorded on {len(agree)} of "
                  f"{len(outcomes)} cells.", ""]
    summary = {"cells": len(outcomes), "missing": missing, "diverged": sum(o.diverged for o in outcomes),
               "tables": {d: cell_table(outcomes, d) for d in DEFINITIONS},
               "loss_tests": {d: [vars(t) for t in pair] for d, pair in tests.items()},
               "guard": guard_rows(scores), "replay_agrees": len(agree)}
    return lines, summary
