"""Evaluation inside a training run: gate statistics at every validation; the lm-eval suite, the gate heatmaps and
the mixing-weight plots at the end (and every ``eval.every_tokens``), all in the run's own MLflow run. The figures
over time, ``gates/layer_means.png`` and ``gates/saturation.png`` (saturated heads per layer at every analysis), are
replaced at each of those; the saturation data, ``gates/saturation_history.json``, at every validation."""

from __future__ import annotations

import sys
import time

import lightning as L
import torch

from satlab.config.schema import ExperimentConfig
from satlab.evaluation.gate_logging import log_gate_analysis
from satlab.evaluation.gates import GateReport, analyze_gates
from satlab.evaluation.plots import plot_layer_means, plot_saturation
from satlab.evaluation.suite import eval_corpus, metric_keys, run_tasks

EVAL_SECONDS = "system/eval_wall_seconds"
"""Logged at the final step once the end-of-run evaluation is done: its wall time, and the mark that it was."""


class EvaluationCallback(L.Callback):
    """Runs on every rank (a sharded model needs all of them for its forward pass) and logs from rank 0. The lm-eval
    suite needs the whole model in one process, so distributed runs skip it and say so: evaluate their checkpoint
    with `satlab eval` afterwards."""

    def __init__(self, cfg: ExperimentConfig, progress: bool = True):
        self.cfg = cfg
        self.progress = progress  # the suite's progress bars
        self._gate_batch: torch.Tensor | None = None
        self.last_results: dict[str, float] = {}
        self.last_gate_scalars: dict[str, float] = {}
        self.end_eval_seconds: float | None = None  # wall time of the evaluation at the end of training
        self.layer_history: list[tuple[int, list[float]]] = []  # (step, mean gate per layer) at every analysis
        self.saturation_history: list[dict] = []
        """At every analysis ``{"step", "share", "saturated"}``, the last two [gated layer][head]: the share of the
        head's elements at its most frequent bound, and whether it is saturated by its gate function's rule."""

    def state_dict(self) -> dict:
        """Saved in checkpoints: a resumed run's per-layer figures keep the analyses before the restart."""
        return {"layer_history": self.layer_history, "saturation_history": self.saturation_history}

    def load_state_dict(self, state: dict) -> None:
        self.layer_history = [(int(step), list(means)) for step, means in state.get("layer_history", [])]
        self.saturation_history = [
            {"step": int(entry["step"]), "share": [[float(v) for v in row] for row in entry["share"]],
             "saturated": [[bool(v) for v in row] for row in entry["saturated"]]}
            for entry in state.get("saturation_history", [])]

    def saturation_json(self, report: GateReport) -> dict:
        """The saturation history with what it needs to be read: the gate function, its rule, the analysis's
        settings and the gated layers (the rows of each matrix)."""
        return {"gate_fn": report.gate_fn, "rule": report.rule, "settings": report.settings, "layers": report.layers,
                "heads": report.heads, "history": self.saturation_history}

    def _client(self, trainer):
        logger = trainer.logger
        return (logger.experiment, logger.run_id) if logger is not None and hasattr(logger, "run_id") else (None, None)

    def _batch(self, trainer, pl_module) -> torch.Tensor:
        """The first ``eval.gate_windows`` validation windows: the same tokens at every analysis and for every
        architecture."""
        if self._gate_batch is None:
            windows = trainer.datamodule.val_dataloader().dataset
            count = min(self.cfg.eval.gate_windows, len(windows))
            self._gate_batch = torch.stack([windows[i][0] for i in range(count)])
        return self._gate_batch.to(pl_module.device)

    def _gates(self, trainer, pl_module, artifacts: bool) -> None:
        with torch.compiler.set_stance("force_eager"):
            report = analyze_gates(pl_module.model, self._batch(trainer, pl_module), trainer.datamodule.tokenizer)
        self.last_gate_scalars = report.scalars() if report is not None else {}  # every rank: a sweep's guard
        if report is not None and (not self.layer_history or self.layer_history[-1][0] < trainer.global_step):
            self.layer_history.append((trainer.global_step, report.layer_means()))
        if report is not None and (not self.saturation_history
                                   or self.saturation_history[-1]["step"] < trainer.global_step):
            self.saturation_history.append({"step": trainer.global_step, "share": report.saturation.tolist(),
                                            "saturated": report.saturated.tolist()})
        client, run_id = self._client(trainer)
        if not trainer.is_global_zero or client is None:
            return
        if artifacts:  # metrics through the run's logger, which a resumed run does not repeat
            self.last_results |= log_gate_analysis(client, run_id, report, pl_module.model, trainer.global_step,
                                                   log_metrics=trainer.logger.log_metrics)
            if report is not None:  # one chart for all layers, replaced at every analysis
                figure = plot_layer_means(report.layers, self.layer_history, report.label)
                client.log_figure(run_id, figure, "gates/layer_means.png", save_kwargs={"dpi": 120})
                figure = plot_saturation(report.layers, self.saturation_history, report.label, report.rule)
                client.log_figure(run_id, figure, "gates/saturation.png", save_kwargs={"dpi": 120})
        elif report is not None:
            trainer.logger.log_metrics(report.scalars(), step=trainer.global_step)
        if report is not None:  # at every analysis (a few kB): what a saturation study replays its guard on
            client.log_dict(run_id, self.saturation_json(report), "gates/saturation_history.json")

    def _suite(self, trainer, pl_module) -> None:
        if trainer.world_size > 1:
            if trainer.is_global_zero:
                print("satlab: the lm-eval suite runs in one process; evaluate this distributed run's checkpoint "
                      "with `satlab eval ckpt=...`", file=sys.stderr)
            return
        if not self.cfg.eval.tasks or self.cfg.data.synthetic_task:  # text tasks mean nothing to a synthetic-token
            return                                                        # model: its held-out recall is its score
        with torch.compiler.set_stance("force_eager"):
            results = run_tasks(pl_module.model, trainer.datamodule.tokenizer, self.cfg.eval.tasks,
                                limit=self.cfg.eval.limit, cache_dir=self.cfg.data.cache_dir,
                                corpus=eval_corpus(self.cfg.data.source), val_fraction=self.cfg.data.val_fraction,
                                progress=self.progress)
        pl_module.model.train()
        metrics = metric_keys(results)
        self.last_results |= metrics
        client, run_id = self._client(trainer)
        if client is not None:  # the suite averages as metrics; every task's numbers as one table per evaluation
            averages = {k: float(v) for k, v in metrics.items() if k.count("/") == 1}
            trainer.logger.log_metrics(averages, step=trainer.global_step)
            for table, timing in (("results", False), ("seconds", True)):  # scores apart from timings
                rows = [(task, name, round(float(value), 4)) for task, values in results.items()
                        for name, value in values.items() if ("seconds" in name) == timing]
                if rows:
                    client.log_table(run_id, {"task": [r[0] for r in rows], "metric": [r[1] for r in rows],
                                              "value": [r[2] for r in rows]},
                                     f"eval/step_{trainer.global_step}/{table}.json")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        periodic = pl_module.schedule.eval_due(trainer.global_step)
        self._gates(trainer, pl_module, artifacts=periodic)
        if periodic:
            self._suite(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.end_of_run(trainer, pl_module)

    def finish_skipped_fit(self, trainer, pl_module) -> None:
        """Called by ``train`` after every fit. A run resumed from the checkpoint of its last step (its earlier attempt
        killed after the training, in the end-of-run evaluation) has no step left: Lightning skips that fit, and
        with it ``on_train_end``. The evaluation then runs here, unless the run's record holds it already (an
        earlier attempt finished it: a finished run started again)."""
        if self.end_eval_seconds is not None or not self.cfg.eval.at_end:
            return
        logger = trainer.logger
        recorded = trainer.is_global_zero and hasattr(logger, "has_recorded") and \
            logger.has_recorded(EVAL_SECONDS, trainer.global_step)
        if not trainer.strategy.broadcast(recorded, src=0):  # every rank the same way: the gates need them all
            self.end_of_run(trainer, pl_module)

    def end_of_run(self, trainer, pl_module) -> None:
        if self.cfg.eval.at_end:
            started = time.perf_counter()
            self._gates(trainer, pl_module, artifacts=True)
            self._suite(trainer, pl_module)
            self.end_eval_seconds = time.perf_counter() - started
            self.last_results[EVAL_SECONDS] = self.end_eval_seconds
            if trainer.is_global_zero and self._client(trainer)[0] is not None:
                trainer.logger.log_metrics({EVAL_SECONDS: self.end_eval_seconds},
                                           step=trainer.global_step)
