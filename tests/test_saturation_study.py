"""The saturation study's analysis (satlab.studies.saturation_study): the guard replayed on saturation histories, the
cells ranked within their sweep groups, the guard scored as a classifier, the loss test, and the whole section read
back from an MLflow store with finished, diverged and crashed cells."""

from __future__ import annotations

import itertools

import mlflow
import numpy as np
import pytest
import yaml

from satlab.config.errors import ConfigError
from satlab.studies.ablation_spec import Cell
from satlab.studies.loader import load_ablation
from satlab.studies.runs import CELL_TAG, PARENT_TAG, STOPPED_TAG, WOULD_PRUNE_TAG
from satlab.studies.saturation_study import (
    CellOutcome,
    GuardSetting,
    load_outcomes,
    loss_test,
    rank_labels,
    saturation_section,
    score_guard,
)

TOKENS_PER_STEP = 1024


def cell(lr: float, seed: int, depth: int = 12, gate_fn: str = "relu") -> Cell:
    values = (("model.n_layers", depth), ("optim.lr", lr), ("model.satformer.gate_fn", gate_fn), ("train.seed", seed))
    return Cell(values, "train.seed", f"{depth}-{lr}-{gate_fn}-{seed}")


def outcome(lr: float, seed: int, loss: float | None, shares: list[float], gate_fn: str = "relu",
            depth: int = 12) -> CellOutcome:
    """A cell whose two gate heads sit at their bound on ``share`` of their values at each analysis (8 steps
    apart)."""
    return CellOutcome(cell(lr, seed, depth, gate_fn), gate_fn, loss, loss is None,
                       [8 * (i + 1) for i in range(len(shares))], [np.full((1, 2), s) for s in shares],
                       TOKENS_PER_STEP, None)


def test_relu_heads_closed_on_99_percent_count_under_the_old_definition_only():
    sparse = outcome(1e-3, 0, 3.0, [0.995, 1.0])
    assert sparse.fractions(0.99) == [1.0, 1.0]
    assert sparse.fractions(1.0) == [0.0, 1.0]
    pinned = outcome(1e-3, 0, 3.0, [0.995], gate_fn="sigmoid")  # a bounded gate: pinned at 99 % under both
    assert pinned.fractions(0.99) == pinned.fractions(1.0) == [1.0]
    assert outcome(1e-3, 0, 3.0, [1.0], gate_fn="identity").fractions(1.0) == [0.0]


def test_the_replayed_guard_needs_patience_validations_in_a_row():
    flickers = outcome(1e-3, 0, 3.0, [1.0, 0.0, 1.0, 0.0, 1.0])
    assert GuardSetting("", "dead", 0.5, 2).prunes_at(flickers) is None
    assert GuardSetting("", "dead", 0.5, 1).prunes_at(flickers) == 8 * TOKENS_PER_STEP
    settles = outcome(1e-3, 0, 3.0, [0.0, 1.0, 1.0, 1.0])
    assert GuardSetting("", "dead", 0.5, 2).prunes_at(settles) == 24 * TOKENS_PER_STEP
    assert GuardSetting("", "dead", 1.0, 1).prunes_at(settles) is None  # strictly above the threshold
    assert GuardSetting("", "dead", 0.5, 2).prunes_at(outcome(1e-3, 0, 3.0, [0.995] * 4)) is None
    assert GuardSetting("", "share", 0.5, 2).prunes_at(outcome(1e-3, 0, 3.0, [0.995] * 4)) == 16 * TOKENS_PER_STEP


def grid() -> list[CellOutcome]:
    """Two sweep groups (12 layers and 24 layers) of 8 cells; at 12 layers the best two saturate (under the old
    definition only: sparse ReLU heads) and the worst diverges; at 24 layers the worst two and a middle one are
    dead."""
    shallow = [outcome(lr, seed, loss, [0.995, 0.995] if loss is not None and loss < 3.15 else [0.1, 0.1])
               for (lr, seed), loss in zip(itertools.product((1e-3, 3e-3, 1e-2, 3e-2), (0, 1)),
                                           (3.3, 3.31, 3.1, 3.12, 3.2, 3.21, 3.25, None), strict=True)]
    deep = [outcome(lr, seed, loss, [1.0, 1.0] if loss in (3.2, 3.6, 3.7) else [0.0, 0.0], depth=24)
            for (lr, seed), loss in zip(itertools.product((1e-3, 3e-3, 1e-2, 3e-2), (0, 1)),
                                        (3.3, 3.31, 3.1, 3.12, 3.2, 3.21, 3.6, 3.7), strict=True)]
    return shallow + deep


def test_cells_rank_within_their_sweep_group_and_a_diverged_cell_is_bad():
    labels = rank_labels(grid())
    by_loss = {(dict(o.cell.values)["model.n_layers"], o.loss): labels[o.cell.key] for o in grid()}
    assert [by_loss[12, loss] for loss in (3.1, 3.12, 3.2, 3.21, 3.25, 3.3, 3.31, None)] == \
        ["best"] * 2 + ["middle"] * 4 + ["bad"] * 2  # a quarter of 8 each way; diverged ranks last
    assert [by_loss[24, loss] for loss in (3.1, 3.12, 3.2, 3.21, 3.3, 3.31, 3.6, 3.7)] == \
        ["best"] * 2 + ["middle"] * 4 + ["bad"] * 2  # its own group: 3.3 is middle here
    assert list(labels.values()).count("best") == 4 and list(labels.values()).count("bad") == 4


def test_the_guard_is_scored_against_the_full_budget_outcomes():
    outcomes, labels = grid(), rank_labels(grid())
    old = score_guard(GuardSetting("old", "share", 0.5, 2), outcomes, labels)
    assert (old.flagged, old.flagged_best, old.flagged_bad, old.bad) == (5, 2, 2, 4)
    assert old.precision == 0.4 and old.recall == 0.5
    new = score_guard(GuardSetting("new", "dead", 0.5, 2), outcomes, labels)
    assert (new.flagged, new.flagged_best, new.flagged_bad) == (3, 0, 2)
    assert new.precision == pytest.approx(2 / 3) and new.recall == 0.5


def test_the_loss_test_finds_a_planted_cost_and_not_a_planted_nothing():
    rng = np.random.default_rng(1)
    costly, free = [], []
    for i, (lr, seed) in enumerate(itertools.product((1e-3, 3e-3, 1e-2), range(6))):
        base = 3.0 + 10 * lr + rng.normal(0, 0.01)  # a higher learning rate ends higher here
        saturated = seed % 2 == 0
        costly.append(outcome(lr, seed, base + (0.1 if saturated else 0.0), [1.0 if saturated else 0.0]))
        saturated = seed < 1 + 2 * (i // 6)  # more saturation at a higher learning rate, at no cost
        free.append(outcome(lr, seed, base, [1.0 if saturated else 0.0]))
    found = loss_test(costly, "dead", lambda c: c.group, "cell")
    assert found.mixed_strata == 3 and (found.saturated, found.unsaturated) == (9, 9)
    assert found.difference == pytest.approx(0.1, abs=0.02) and found.p < 0.01
    nothing = loss_test(free, "dead", lambda c: c.group, "cell")
    assert nothing.p > 0.05 and abs(nothing.difference) < 0.02  # not the learning rate's effect on the loss
    none_mixed = loss_test([o for o in costly if o.cell.seed % 2], "dead", lambda c: c.group, "cell")
    assert none_mixed.mixed_strata == 0 and none_mixed.p is None


def test_an_ablation_guard_may_only_observe_and_is_off_unless_set():
    assert load_ablation("gate_fn").saturation.threshold is None
    with pytest.raises(ConfigError, match="must be 'observe' in an ablation"):
        load_ablation("saturation", ["saturation.action=prune"])
    assert load_ablation("saturation").saturation.action == "observe"


def test_the_section_reads_finished_diverged_and_crashed_cells_from_mlflow(tmp_path):
    path = tmp_path / "sat.yml"
    path.write_text(yaml.safe_dump({
        "name": "sat", "base": "ablations/tiny_cell", "saturation": {"threshold": 0.5, "action": "observe"},
        "axes": {"model.n_layers": [12], "optim.lr": [1e-3, 3e-2], "model.satformer.gate_fn": ["relu"],
                 "train.seed": [0, 1]}}, sort_keys=False))
    spec = load_ablation(str(path))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("sat", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id
    cells = {c.key: c for c in spec.cells()}
    plan = {  # cell key -> (status, val/loss, shares per analysis, stopped tag, would-prune tag)
        "model.n_layers=12 optim.lr=0.001 model.satformer.gate_fn=relu train.seed=0":
            ("FINISHED", 3.2, [0.0, 0.0, 0.0], None, None),
        "model.n_layers=12 optim.lr=0.001 model.satformer.gate_fn=relu train.seed=1":
            ("FINISHED", 3.3, [0.0, 1.0, 1.0], None, str(24 * TOKENS_PER_STEP)),
        "model.n_layers=12 optim.lr=0.03 model.satformer.gate_fn=relu train.seed=0":
            ("FAILED", None, [1.0], "nan: training loss nan at 9,216 tokens", None),
        "model.n_layers=12 optim.lr=0.03 model.satformer.gate_fn=relu train.seed=1":
            ("FAILED", None, [0.0], None, None),  # crashed: no outcome
    }
    for key, (status, loss, shares, stopped, would) in plan.items():
        run = client.create_run(experiment, tags={PARENT_TAG: parent, CELL_TAG: key,
                                                  **({STOPPED_TAG: stopped} if stopped else {}),
                                                  **({WOULD_PRUNE_TAG: would} if would else {})}).info.run_id
        client.log_param(run, "derived.tokens_per_step", TOKENS_PER_STEP)
        if loss is not None:
            client.log_metric(run, "val/loss", loss)
        history = [{"step": 0, "share": [[1.0, 1.0]]}] + [  # the analysis before training is not a validation
            {"step": 8 * (i + 1), "share": [[s, s]]} for i, s in enumerate(shares)]
        client.log_dict(run, {"gate_fn": "relu", "history": history}, "gates/saturation_history.json")
        client.set_terminated(run, status)
    outcomes, missing = load_outcomes(spec, client, parent)
    assert missing == ["model.n_layers=12 optim.lr=0.03 model.satformer.gate_fn=relu train.seed=1"]
    assert [(o.loss, o.diverged) for o in outcomes] == [(3.2, False), (3.3, False), (None, True)]
    assert outcomes[1].steps == [8, 16, 24] and outcomes[1].observed_prune_at == 24 * TOKENS_PER_STEP
    assert cells[outcomes[2].cell.key] == outcomes[2].cell
    lines, summary = saturation_section(spec, client, parent)
    assert summary["cells"] == 3 and summary["diverged"] == 1 and summary["replay_agrees"] == 3
    text = "\n".join(lines)
    assert "3 cells with an outcome (1 diverged); 1 without one" in text
    assert "agrees with what they recorded on 3 of 3 cells" in text
    table = summary["tables"]["dead"]
    assert table[1][-4:] == ["50% ± 71%", "1/2", "3.250 ± 0.071", "0/2"]  # lr 1e-3: one of two seeds saturated

