"""Gate saturation as each gate function defines it (issue 31): pinned at a bound for bounded gates, dead (closed on
every element) for ReLU, never for identity; the per-(layer, head) history a run keeps across a resume; and the
saturation guard's two actions, ``prune`` (stops the trial) and ``observe`` (records the would-be prune, trains on,
stays feasible). Hand-built gate tensors and a fake trainer: no training."""

from __future__ import annotations

import csv
import io
import json
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from rich.console import Console
from torch import nn

from satlab.config.errors import ConfigError
from satlab.config.gate_functions import GATE_FUNCTIONS, GateFunction
from satlab.evaluation.callback import EvaluationCallback
from satlab.evaluation.gates import analyze_gates, gate_bounds, head_saturation
from satlab.studies.attrs import RUN_ID, SATURATION, WOULD_PRUNE_AT, WOULD_PRUNE_REASON
from satlab.studies.best import is_feasible
from satlab.studies.callbacks import TrialCallback, TrialStopped
from satlab.studies.loader import load_sweep
from satlab.studies.plans import SearchPlan
from satlab.studies.runs import STOPPED_TAG, WOULD_PRUNE_REASON_TAG, WOULD_PRUNE_TAG
from satlab.studies.spec import SaturationGuard
from satlab.studies.sweep_report import parent_results, saturation_figure, write_report

RULES = {"relu": "dead", "sigmoid": "pinned", "2sigmoid": "pinned", "tanh": "pinned", "softmax": "pinned",
         "softmax_sigmoid": "pinned", "identity": "never"}
T, G = 200, 5  # elements per head, gate heads
VAL = 49_152


class HandGates(nn.Module):
    """A stand-in model whose layer 1 returns the given gates (B, T, G, C); layer 0 never has a gate."""

    def __init__(self, gates: torch.Tensor):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # analyze_gates reads the device off a parameter
        self.gates = gates
        self.cfg = SimpleNamespace(arch="satformer")

    def forward(self, idx: torch.Tensor, return_gates: bool = False) -> SimpleNamespace:
        return SimpleNamespace(gates=[None, self.gates])

    def mixing_weights(self) -> dict:
        return {}


def five_heads(gate_fn: str) -> torch.Tensor:
    """Gates (1, T, G, 1), one case per head: 0 all at the low bound; 1 all at the high bound; 2 switching between
    the two on alternate tokens; 3 at the low bound but for one open token (99.5 %); 4 sparse, 80 % zeros and 20 %
    open. Bounds from the table (relu: 0 and an open 1.0; identity: 0 and 1)."""
    bounds = gate_bounds(gate_fn, G)
    low, high = (bounds[0], bounds[-1]) if len(bounds) == 2 else (0.0, 1.0)
    open_ = low + 0.75 * (high - low)
    heads = torch.full((T, G), low)
    heads[:, 1] = high
    heads[1::2, 2] = high
    heads[0, 3] = open_
    heads[:, 4] = 0.0
    heads[: T // 5, 4] = open_
    return heads.reshape(1, T, G, 1)


def report_of(gates: torch.Tensor, gate_fn: str, **settings):
    return analyze_gates(HandGates(gates), torch.zeros(gates.shape[:2], dtype=torch.long), gate_fn=gate_fn,
                         **settings)


def test_every_gate_function_declares_its_rule_and_a_rule_must_fit_the_bounds():
    assert {name: fn.saturates for name, fn in GATE_FUNCTIONS.items()} == RULES
    assert [name for name, fn in GATE_FUNCTIONS.items() if not fn.can_saturate] == ["identity"]
    with pytest.raises(ValueError, match="does not fit"):
        GateFunction(F.relu, lambda heads: (0.0, 1.0), "dead")
    with pytest.raises(ValueError, match="does not fit"):
        GateFunction(lambda x: x, lambda heads: (), "pinned")


@pytest.mark.parametrize("gate_fn", list(RULES))
def test_pinned_sparse_switching_and_dead_heads_by_rule(gate_fn):
    bounds = gate_bounds(gate_fn, G) or (None,)
    expected = {"pinned": [bounds[0], bounds[-1], None, bounds[0], None],  # 99.5 % at one bound: pinned
                "dead": [0.0, None, None, None, None],  # one open token out of 200: sparse, not dead
                "never": [None] * G}[RULES[gate_fn]]
    report = report_of(five_heads(gate_fn), gate_fn)
    assert report.rule == RULES[gate_fn] and report.saturated_at == [expected]
    assert head_saturation(five_heads(gate_fn), gate_fn)[1] == expected  # the helper judges as the analysis does
    scalars = report.scalars()
    assert scalars["val/gates/saturated_frac"] == pytest.approx(sum(b is not None for b in expected) / G)
    assert report.to_json()["rule"] == RULES[gate_fn] and report.settings["dead_share"] == 1.0


def test_relu_sparsity_and_dead_heads_are_reported_apart_from_saturation():
    report = report_of(five_heads("relu"), "relu")
    np.testing.assert_allclose(report.sparsity[0], [1.0, 0.0, 0.5, 0.995, 0.8])
    assert report.dead[0].tolist() == [True, False, False, True, False]  # ~0 on >= 99 %: a dead head ...
    assert report.saturated[0].tolist() == [True, False, False, False, False]  # ... saturated only on all
    scalars = report.scalars()
    assert scalars["val/gates/dead_head_frac"] == 0.4 and scalars["val/gates/saturated_frac"] == 0.2
    assert scalars["val/gates/sparsity"] == pytest.approx(np.mean([1.0, 0.0, 0.5, 0.995, 0.8]))
    loose = report_of(five_heads("relu"), "relu", dead_share=0.99)  # the rule's share is a setting, explicit
    assert loose.saturated[0].tolist() == [True, False, False, True, False]


class Recorder:
    """An MLflow client and logger in one: records tags, dicts and figures (the saturation figure rendered)."""

    def __init__(self):
        self.run_id, self.experiment = "run", self
        self.tags: dict[str, str] = {}
        self.dicts: dict[str, dict] = {}
        self.figures: dict = {}

    def set_tag(self, run_id, key, value):
        self.tags[key] = value

    def log_dict(self, run_id, data, path):
        self.dicts[path] = json.loads(json.dumps(data))

    def log_figure(self, run_id, figure, path, save_kwargs=None):
        if path == "gates/saturation.png":
            figure.savefig(io.BytesIO(), format="png", dpi=40)
        self.figures[path] = figure

    def log_metrics(self, metrics, step):
        pass


def analyse(callback: EvaluationCallback, gates: torch.Tensor, step: int, recorder: Recorder,
            artifacts: bool = True) -> None:
    callback._gate_batch = torch.zeros(gates.shape[:2], dtype=torch.long)
    trainer = SimpleNamespace(global_step=step, is_global_zero=True, logger=recorder,
                              datamodule=SimpleNamespace(tokenizer=None))
    callback._gates(trainer, SimpleNamespace(model=HandGates(gates), device=torch.device("cpu")), artifacts=artifacts)


def test_the_saturation_history_is_logged_and_survives_a_resume():
    sparse, dead = five_heads("relu"), torch.zeros(1, T, G, 1)
    recorder = Recorder()
    callback = EvaluationCallback(SimpleNamespace())
    analyse(callback, sparse, 4, recorder)
    analyse(callback, dead, 8, recorder)
    assert [e["step"] for e in callback.saturation_history] == [4, 8]
    assert callback.saturation_history[0]["saturated"] == [[True, False, False, False, False]]
    assert callback.saturation_history[1]["saturated"] == [[True] * G]
    assert callback.saturation_history[0]["share"][0][3] == pytest.approx(0.995)
    logged = recorder.dicts["gates/saturation_history.json"]
    assert logged["rule"] == "dead" and logged["layers"] == [1] and logged["history"] == callback.saturation_history
    figure = recorder.figures["gates/saturation.png"]
    assert figure.axes[0].images[0].get_array().shape == (1, 2)  # layers x analyses
    np.testing.assert_allclose(figure.axes[0].images[0].get_array(), [[0.2, 1.0]])  # share of saturated heads
    assert figure.get_size_inches()[0] * 120 <= 900

    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)  # as in a checkpoint, read back as a resume reads it
    buffer.seek(0)
    resumed = EvaluationCallback(SimpleNamespace())
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.saturation_history == callback.saturation_history
    assert resumed.layer_history == callback.layer_history
    analyse(resumed, sparse, 12, recorder)
    assert [e["step"] for e in recorder.dicts["gates/saturation_history.json"]["history"]] == [4, 8, 12]
    assert recorder.figures["gates/saturation.png"].axes[0].images[0].get_array().shape == (1, 3)
    analyse(resumed, dead, 16, recorder, artifacts=False)  # a validation between the periodic evaluations:
    assert [e["step"] for e in recorder.dicts["gates/saturation_history.json"]["history"]] == [4, 8, 12, 16]
    assert recorder.figures["gates/saturation.png"].axes[0].images[0].get_array().shape == (1, 3)  # no figure
    old = EvaluationCallback(SimpleNamespace())
    old.load_state_dict({"layer_history": [(4, [0.1])]})  # a checkpoint from before the history
    assert old.saturation_history == []


def fake_trainer(logger=None) -> SimpleNamespace:
    return SimpleNamespace(callback_metrics={}, state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False,
                           is_global_zero=True, strategy=SimpleNamespace(broadcast=lambda obj, src: obj),
                           logger=logger)


def validate(callback: TrialCallback, gates: SimpleNamespace, trainer, scalars: list[dict], losses: list[float],
             first: int = 1) -> None:
    """One validation per entry: the gate scalars as EvaluationCallback leaves them, the loss as Lightning does."""
    for n, (gate_scalars, loss) in enumerate(zip(scalars, losses, strict=True), start=first):
        gates.last_gate_scalars = gate_scalars
        trainer.callback_metrics = {"val/loss": torch.tensor(loss)}
        callback.on_validation_end(trainer, SimpleNamespace(tokens_seen=n * VAL))


def pinned_scalars() -> dict[str, float]:
    scalars = report_of(torch.full((1, T, G, 1), 1.0), "sigmoid").scalars()  # every head pinned open
    assert scalars["val/gates/saturated_frac"] == 1.0
    return scalars


def guarded_trial(action: str) -> tuple[optuna.Study, TrialCallback, SimpleNamespace, Recorder]:
    """A trial's callback with a guard at 0.5, patience 2, its gate source and its MLflow stand-in."""
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    gates = SimpleNamespace(last_gate_scalars={})
    callback = TrialCallback(study.ask(), SaturationGuard(threshold=0.5, patience=2, action=action), gates)
    return study, callback, gates, Recorder()


def test_a_pruning_guard_stops_a_trial_whose_gates_are_pinned():
    study, callback, gates, recorder = guarded_trial("prune")
    trainer = fake_trainer(recorder)
    validate(callback, gates, trainer, [pinned_scalars()], [4.0])  # one validation: the streak is 1 of 2
    with pytest.raises(TrialStopped) as stopped:
        validate(callback, gates, trainer, [pinned_scalars()], [3.9], first=2)
    assert stopped.value.reason == "gate_saturation" and stopped.value.pruned
    assert WOULD_PRUNE_AT not in study.trials[0].user_attrs
    assert list(recorder.tags) == [STOPPED_TAG] and recorder.tags[STOPPED_TAG].startswith("gate_saturation: 100%")


def test_a_diverged_trial_says_so_on_its_mlflow_run():
    recorder = Recorder()
    callback = TrialCallback(None, SaturationGuard(threshold=None), SimpleNamespace(last_gate_scalars={}))
    trainer = SimpleNamespace(world_size=1, is_global_zero=True, logger=recorder)
    with pytest.raises(TrialStopped) as stopped:
        callback.on_train_batch_end(trainer, SimpleNamespace(tokens_seen=1024, skipped_steps=0),
                                    {"loss": torch.tensor(float("nan"))}, None, 0)
    assert stopped.value.reason == "nan"
    assert recorder.tags[STOPPED_TAG] == "nan: training loss nan at 1,024 tokens"


def test_an_observing_guard_records_the_would_be_prune_and_the_trial_trains_on():
    study, callback, gates, recorder = guarded_trial("observe")
    sparse = report_of(five_heads("relu"), "relu").scalars()  # 20 % saturated: below the threshold
    pinned = pinned_scalars()
    validate(callback, gates, fake_trainer(recorder), [sparse, pinned, pinned, sparse, pinned, pinned],
             [4.0, 3.8, 3.6, 3.5, 3.4, 3.3])
    attrs = study.trials[0].user_attrs
    assert attrs[WOULD_PRUNE_AT] == 3 * VAL  # the first time the streak reached patience, not the second
    assert attrs[WOULD_PRUNE_REASON].startswith("gate_saturation: 100% of gates saturated for 2 validations")
    assert recorder.tags == {WOULD_PRUNE_TAG: str(3 * VAL), WOULD_PRUNE_REASON_TAG: attrs[WOULD_PRUNE_REASON]}
    assert study.trials[0].intermediate_values[6 * VAL] == pytest.approx(3.3)  # trained on to the end
    assert attrs[SATURATION] == 1.0


def run_observed(study: optuna.Study, plan: SearchPlan, params: dict, saturation: list[dict], value: float) -> None:
    """One trial as the driver and the trial process run it, without training: suggest, the callback over the given
    validations, record_constraint, tell."""
    study.enqueue_trial(params)
    trial = study.ask()
    plan.suggest(trial)
    gates = SimpleNamespace(last_gate_scalars={})
    callback = TrialCallback(trial, plan.spec.saturation, gates)
    validate(callback, gates, fake_trainer(), saturation, [value + 0.5, value + 0.2, value])
    plan.record_constraint(trial, study.trials[trial.number].user_attrs.get(SATURATION))
    study.tell(trial, value)


def test_an_observed_sweep_keeps_the_trial_feasible_and_its_report_shows_the_would_be_prune(tmp_path):
    spec = load_sweep("lr_tiny", [f"out_dir={tmp_path}", "saturation.action=observe"])
    plan = SearchPlan(spec, "satformer", 2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    run_observed(study, plan, {"model.arch": "satformer", "optim.lr": 1e-3}, [pinned_scalars()] * 3, 3.3)
    run_observed(study, plan, {"model.arch": "transformer", "optim.lr": 3e-3}, [{}] * 3, 3.4)
    flagged = study.trials[0]
    assert flagged.constraints == {} and is_feasible(flagged) and study.best_trial.number == 0
    console = Console(file=io.StringIO(), width=200)
    files = write_report(study, spec, "satformer", console=console)
    out = console.file.getvalue()
    assert f"best: trial 0, val/loss 3.3000 (optim.lr=0.001) — the saturation guard would have pruned it at " \
           f"{2 * VAL:,} tokens" in out
    assert "would have pruned 1 of 2 finished trials" in out and f"trial 0 (satformer): at {2 * VAL:,} tokens" in out
    rows = list(csv.DictReader(files["trials.csv"].open()))
    columns = list(rows[0])
    assert columns.index("would_prune_at") == columns.index("val/loss") + 1  # beside the loss
    assert rows[0]["would_prune_at"] == str(2 * VAL) and rows[1]["would_prune_at"] == ""
    metrics, _ = parent_results(study, spec, "satformer")
    assert metrics["variants/satformer/n_would_prune"] == 1 and metrics["variants/transformer/n_would_prune"] == 0

    pruning = SearchPlan(load_sweep("lr_tiny", [f"out_dir={tmp_path}", "saturation.action=prune"]), "satformer", 1)
    other = optuna.create_study()
    trial = other.ask()
    pruning.record_constraint(trial, 0.9)
    frozen = other.tell(trial, 3.2)
    assert frozen.constraints["gate_saturation"] == pytest.approx(0.4) and not is_feasible(frozen)


def test_the_guard_action_is_checked_like_the_other_fields():
    with pytest.raises(ConfigError, match="stop"):
        load_sweep("lr_tiny", ["saturation.action=stop"])


class CurveStore:
    """The two MLflow calls the sweep report's saturation figure makes, over hand-made runs."""

    def __init__(self, curves: dict[str, list[float]]):
        self.curves = curves

    def get_run(self, run_id):
        return SimpleNamespace(data=SimpleNamespace(params={"derived.tokens_per_step": "1024"}))

    def get_metric_history(self, run_id, key):
        assert key == "val/gates/saturated_frac"
        before = [SimpleNamespace(step=0, value=0.0)]  # the check before training
        inside = [SimpleNamespace(step=8 * i, value=v) for i, v in enumerate(self.curves[run_id], start=1)]
        after = inside[-1:]  # the validation after training, at the same step
        return before + inside + after if inside else []


def test_the_sweep_report_draws_each_trials_saturation_curve_and_the_would_be_prune(tmp_path):
    spec = load_sweep("lr_tiny", [f"out_dir={tmp_path}", "saturation.action=observe"])
    study = optuna.create_study()
    for number, would in enumerate((3 * 8192, None)):
        trial = study.ask()
        for i in range(4):
            trial.report(3.0 - 0.1 * i + number, step=(i + 1) * 8192)
        trial.set_user_attr(RUN_ID, f"run{number}")
        if would:
            trial.set_user_attr(WOULD_PRUNE_AT, would)
        study.tell(trial, 2.7 + number)
    study.ask()  # a trial without a run yet: no curve
    figure = saturation_figure(study, spec, CurveStore({"run0": [0.1, 0.9, 0.9, 0.9], "run1": [0.0, 0.0, 0.1, 0.0]}))
    top, bottom = figure.axes
    assert [list(line.get_xdata()) for line in top.lines] == [[8192, 16384, 24576, 32768]] * 2
    curves = [line for line in bottom.lines if len(line.get_xdata()) == 4]
    assert [list(line.get_ydata()) for line in curves] == [[0.1, 0.9, 0.9, 0.9], [0.0, 0.0, 0.1, 0.0]]
    assert [list(line.get_xdata()) for line in curves][0] == [8192, 16384, 24576, 32768]  # 8 steps of 1,024 apart
    rings = [c for c in bottom.collections if len(c.get_offsets())]
    assert len(rings) == 1 and list(rings[0].get_offsets()[0]) == [3 * 8192, 0.9]  # only the would-be prune
    assert any(line.get_ydata()[0] == 0.5 for line in bottom.lines)  # the guard's threshold
    assert saturation_figure(study, spec, CurveStore({"run0": [], "run1": []})) is None  # no gated trial
