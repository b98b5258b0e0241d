"""One training run, from a resolved experiment config to a finished, tracked, resumable run."""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from satlab.config.derived import Schedule, derive_schedule
from satlab.config.display import config_from_yaml, to_yaml
from satlab.config.errors import ConfigError, RunStopped
from satlab.config.resolve import experiment_family
from satlab.config.resume import RESUMABLE, resume_problems
from satlab.config.schema import ExperimentConfig
from satlab.data.tokenizer import TextTokenizer
from satlab.data.vocabulary import model_vocabulary
from satlab.models import count_params, flops_per_token, non_embedding_params
from satlab.training.chatter import library_chatter_to
from satlab.training.checkpoint import KEY as CHECKPOINT_KEY
from satlab.training.checkpoint import SHARDED_BY, read_checkpoint_meta, sharded_weights_key
from satlab.training.datamodule import LMDataModule
from satlab.training.machine import resolve_precision
from satlab.training.mlflow_logger import ResumableMLFlowLogger
from satlab.training.module import LMModule
from satlab.training.parallel import make_strategy
from satlab.training.perf import ThroughputCallback, keep_freed_memory
from satlab.training.resilience import (
    AtomicCheckpointIO,
    CheckpointAfterValidation,
    CheckpointOnSigterm,
    RunLock,
    find_resume_checkpoint,
    keep_newest_steps,
    remove_partial_checkpoints,
)
from satlab.training.sigterm import watching_sigterm
from satlab.training.stops import AlignLoggingStep, TimeLimit, TimeLimitReached
from satlab.training.summary import print_summary
from satlab.training.tracking import (
    ensure_reachable,
    experiment_id,
    mark_model_training,
    open_store,
    provenance_tags,
    resolve_tracking,
    run_params,
    safe_uri,
    usable_run,
)
from satlab.training.views import COLOUR_TAG, arch_colour, publish_family_view

RUN_INFO = "run.json"


class TrainingStopped(RunStopped):
    """The run stopped itself (for example after too many non-finite steps); the message says why and where its
    last checkpoint is."""


@dataclass
class RunResult:
    run_dir: Path
    tracking_uri: str
    experiment: str
    mlflow_run_id: str | None
    params: int
    non_embedding_params: int
    tokens: int
    initial_val_loss: float | None
    final_val_loss: float | None
    final_train_loss: float | None
    tokens_per_sec: float | None
    wall_seconds: float
    recall: dict[str, float] = field(default_factory=dict)  # a recall task's recall/* metrics at the end
    fit_seconds: float = 0.0  # the Trainer's fit: training, validation and any evaluation inside it
    eval_seconds: float | None = None  # the end-of-run evaluation inside fit, if a callback ran one
    view_url: str | None = None  # the MLflow UI's comparison of this run's experiment


def run_folder(cfg: ExperimentConfig) -> Path:
    """The run's folder: ``runs/<name>`` under ``resume: auto`` (continued when it holds a run), else the first
    numbered ``runs/<name>-<n>`` without checkpoints, so ``never`` does not touch an earlier run. The folder's place
    is not part of the run: ``runs/<name>`` copied to another ``train.out_dir`` continues there, with its
    ``run.json``."""
    base = Path(cfg.train.out_dir) / cfg.name
    run_dir, n = base, 1
    while cfg.train.resume != "auto" and (run_dir / "checkpoints").exists():
        n += 1
        run_dir = base.with_name(f"{cfg.name}-{n}")
    return run_dir


def resume_point(run_dir: Path, cfg: ExperimentConfig) -> tuple[Path | None, dict]:
    """(checkpoint to resume from or None, saved run info) of the run in ``run_dir``. Call it holding the run's
    lock: choosing renames unreadable checkpoints and restores cut-off replaces, which must not race a process that
    trains the run (its rotation deletes checkpoints while they are read).

    ``resume: auto`` continues from the last readable checkpoint, or starts when there is none; a run whose every
    checkpoint is unreadable is refused (they are kept as ``*.corrupt``), never silently restarted. The saved info
    (``run.json``: the MLflow run and its store) is returned whether or not there is a checkpoint: a run killed
    before its first checkpoint starts again from step 0 in the same MLflow run, which already holds the points it
    redoes."""
    if cfg.train.resume != "auto":
        return None, {}
    info_path = run_dir / RUN_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    resume_from = find_resume_checkpoint(run_dir / "checkpoints")
    if resume_from is not None:
        return resume_from, info
    # what is left under a checkpoint's name now is unusable: files renamed *.corrupt, directories left as they are
    unusable = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if not p.name.startswith(".")
                      and p.name.endswith((".corrupt", ".ckpt")))
    if unusable:
        raise ConfigError(
            f"run '{cfg.name}' cannot resume: every checkpoint in {run_dir / 'checkpoints'} is unreadable or "
            f"incomplete ({', '.join(unusable)}). Nothing was changed: to start it over, remove the folder {run_dir} "
            "(its MLflow run stays as it is), or train under another name (name=...)")
    return None, info


def tracking_target(cfg: ExperimentConfig, info: dict) -> tuple[str, str | None] | None:
    """(tracking URI, artifact location) on global rank 0 when tracking is on, checked to be reachable before
    anything is written; None elsewhere. The other ranks of a DDP/FSDP run re-execute this script before the Trainer
    exists and must not open MLflow runs of their own."""
    if not cfg.tracking.enabled or rank_zero_only.rank != 0:
        return None
    uri, artifacts = resolve_tracking(cfg.tracking.uri, cfg.tracking.artifact_dir)
    return ensure_reachable(info.get("tracking_uri", uri), cfg.tracking.fallback_local,
                            cfg.tracking.artifact_dir), artifacts


def refuse_other_settings(cfg: ExperimentConfig, saved_yaml: str, where: str) -> None:
    """Raises ConfigError when ``cfg`` differs from the config a run was started with (``saved_yaml``, from ``where``)
    in a setting a resume may not change (``config.resume``)."""
    changes = resume_problems(config_from_yaml(saved_yaml), cfg)
    if changes:
        raise ConfigError(
            f"run '{cfg.name}' has {where} made with other settings, and resuming it would "
            f"continue one experiment as another: {'; '.join(changes)}. Nothing of that run was changed. Start a new "
            "run under another name (name=...) or with train.resume=never; a resume may change only "
            f"{', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in RESUMABLE)}")


def restart_step(run_dir: Path, ckpt_path: Path | None, info: dict, cfg: ExperimentConfig, tokenizer) -> int | None:
    """The step a continued run's MLflow history is redone from: the checkpoint's (checked by
    :func:`check_resumable`), 0 for a run that recorded itself but was stopped before its first checkpoint (its
    config checked against the ``config.yaml`` it wrote), None for a new run."""
    if ckpt_path is not None:
        return check_resumable(ckpt_path, cfg, tokenizer)
    if not info.get("mlflow_run_id"):
        return None
    saved = run_dir / "config.yaml"
    if saved.exists():
        refuse_other_settings(cfg, saved.read_text(), f"a config ({saved}) but no checkpoint yet,")
    return 0


def check_resumable(ckpt_path: Path, cfg: ExperimentConfig, tokenizer) -> int:
    """The checkpoint's global step, once checked: a run resumes only with the config it was started with, but for
    what may change (``config.resume``), and with the same tokenizer (else its embeddings would mean other
    tokens), and a sharded checkpoint only with the strategy that reads its layout."""
    state = read_checkpoint_meta(ckpt_path)
    refuse_other_settings(cfg, state[CHECKPOINT_KEY]["config"], f"a checkpoint ({ckpt_path})")
    saved = TextTokenizer.from_dict(state[CHECKPOINT_KEY]["tokenizer"])
    if saved.fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"checkpoint {ckpt_path} was trained with tokenizer {saved.fingerprint} ({saved.kind}, vocab "
            f"{saved.vocab_size}) but this config gives {tokenizer.fingerprint} ({tokenizer.kind}, vocab "
            f"{tokenizer.vocab_size}); resume with the same data.tokenizer and data.source settings, or start a new "
            "run (another name, or train.resume=never)"
        )
    writer = SHARDED_BY[sharded_weights_key(ckpt_path)] if ckpt_path.is_dir() else None
    if writer is not None and cfg.train.strategy != writer:
        raise ConfigError(
            f"checkpoint {ckpt_path} is a sharded checkpoint directory as train.strategy={writer} writes it, which "
            f"only that strategy can resume, but this run asks for train.strategy={cfg.train.strategy}. Nothing of "
            f"that run was changed; resume it with train.strategy={writer} (any number of devices), or start a new "
            "run under another name (name=...)")
    return int(state.get("global_step", 0))


def make_logger(cfg: ExperimentConfig, run_dir: Path, info: dict, preset: str,
                target: tuple[str, str | None] | None, resume_step: int | None,
                tokens_seen: Callable[[], int] | None = None) -> ResumableMLFlowLogger | None:
    """The run's MLflow logger (None without tracking, and off rank 0); ``tokens_seen`` gives the ``tokens_seen``
    point it adds at every logged step."""
    if target is None:
        return None
    uri, artifacts = target
    description = {"mlflow.note.content": cfg.description} if cfg.description else {}
    name = cfg.tracking.experiment or experiment_family(preset) or cfg.name
    import mlflow

    client = mlflow.MlflowClient(open_store(uri))
    experiment_id(client, name, artifacts)  # made here: two runs of a family race
    run_id = info.get("mlflow_run_id")
    if run_id and usable_run(client, run_id) is None:
        print(f"satlab: the MLflow run {run_id} named in {run_dir / RUN_INFO} is not in {safe_uri(uri)} (deleted?); "
              "this run is recorded in a new one", file=sys.stderr)
        run_id, resume_step = None, None
    return ResumableMLFlowLogger(
        experiment_name=name,
        run_name=cfg.tracking.run_name or cfg.name,
        tracking_uri=open_store(uri),
        artifact_location=artifacts,
        run_id=run_id,
        resume_step=resume_step,
        run_dir=run_dir,
        store=safe_uri(uri),
        tokens_seen=tokens_seen,
        tags=provenance_tags(cfg.model.arch, preset) | {"run_dir": str(run_dir.resolve())} | description
        | {COLOUR_TAG: arch_colour(cfg.model.arch)} | dict(cfg.tracking.tags),  # a study colours by its groups
    )


def train(cfg: ExperimentConfig, preset: str = "custom", progress: bool = True,
          callbacks: Sequence[L.Callback] = ()) -> RunResult:
    """Train ``cfg`` to its token budget (or resume it) and return what happened.

    ``callbacks`` are added to the Trainer's (a sweep trial adds its pruning callback here); one with an
    ``end_eval_seconds`` attribute (the evaluation callback) has that time reported apart from training.
    """
    started = time.perf_counter()
    cfg = resolve_precision(cfg)  # before anything records the config: config.yaml and MLflow name the real one
    keep_freed_memory()
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    run_dir = run_folder(cfg)
    with ExitStack() as held:
        sigterm_watch = held.enter_context(watching_sigterm())  # a SIGTERM before the fit stops its first batch
        if rank_zero_only.rank == 0:  # the lock comes before the checkpoint choice, which renames files
            held.enter_context(RunLock(run_dir, cfg.name))
        ckpt_path, info = resume_point(run_dir, cfg)
        target = tracking_target(cfg, info)  # a bad store or server fails before any data is prepared
        data = LMDataModule(cfg, progress=progress)
        vocabulary = model_vocabulary(cfg, data.tokenizer)  # what the dry run derives, from the prepared tokenizer
        cfg = vocabulary.sized(cfg)
        resume_step = restart_step(run_dir, ckpt_path, info, cfg, data.tokenizer)
        if ckpt_path is not None:
            warnings.filterwarnings("ignore", message=".*exists and is not empty")  # expected when resuming
            warnings.filterwarnings("ignore", message="The dirpath has changed")  # a moved run: keep_newest_steps
        held.enter_context(library_chatter_to(run_dir))
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        if rank_zero_only.rank == 0:
            remove_partial_checkpoints(run_dir / "checkpoints")  # only now: the lock makes them leftovers
            keep_newest_steps(run_dir / "checkpoints", cfg.train.keep_last_k, ckpt_path)
            (run_dir / "config.yaml").write_text(to_yaml(cfg))

        schedule = derive_schedule(cfg, world_size=cfg.train.devices * cfg.train.num_nodes)
        data.set_schedule(schedule)
        module = LMModule(cfg, schedule, data.tokenizer)
        flops = flops_per_token(module.model, cfg.data.seq_len, vocabulary.head_fraction)

        logger = make_logger(cfg, run_dir, info, preset, target, resume_step, lambda: module.tokens_seen)
        if logger is not None:
            mark_model_training(logger.experiment, logger.experiment_id)
            if logger.continues:
                logger.reopen()
            info = {"mlflow_run_id": logger.run_id, "tracking_uri": logger._tracking_uri,
                    "experiment": logger._experiment_name}
            (run_dir / RUN_INFO).write_text(json.dumps(info, indent=2))
            if not (logger.continues and logger.experiment.get_run(logger.run_id).data.params):
                logger.log_hyperparams(run_params(cfg) | {"derived." + k: v for k, v in schedule.as_dict().items()}
                                       | {"model.params": count_params(module.model),
                                          "model.non_embedding_params": non_embedding_params(module.model),
                                          "model.flops_per_token": flops} | data.provenance())
                logger.experiment.log_text(logger.run_id, to_yaml(cfg), "config.yaml")
            info["view_url"] = publish_family_view(logger.experiment, logger.experiment_id, logger._tracking_uri)

        throughput = ThroughputCallback(flops, schedule.tokens_per_step)
        sigterm = CheckpointOnSigterm(run_dir / "checkpoints", sigterm_watch)
        time_limit = TimeLimit(cfg.train.max_time_minutes)
        trainer = make_trainer(cfg, schedule, run_dir, logger, [throughput, sigterm, time_limit, *callbacks], progress)
        initial_val = None
        try:
            if ckpt_path is None:
                initial_val = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"])
            fit_started = time.perf_counter()
            last = run_dir / "checkpoints" / "last.ckpt"  # saved whole: weights, optimizer, loops and RNG states
            try:
                trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
            except SIGTERMException:
                if not time_limit.reached:
                    raise
                raise TimeLimitReached(
                    f"run '{cfg.name}' reached train.max_time_minutes={cfg.train.max_time_minutes:g} at step "
                    f"{trainer.global_step} of {schedule.max_steps}; its state is saved in {last}: run the same "
                    f"command to continue (exit code {TimeLimitReached.exit_code})") from None
            fit_seconds = time.perf_counter() - fit_started
            for callback in callbacks:  # a fit Lightning skipped (resumed at its last step) ran no on_train_end
                if (finish := getattr(callback, "finish_skipped_fit", None)) is not None:
                    finish(trainer, module)
            if module.stop_reason is not None:
                trainer.save_checkpoint(last, weights_only=False)
                raise TrainingStopped(f"run '{cfg.name}' stopped at step {trainer.global_step}: {module.stop_reason}; "
                                      f"its last checkpoint is {run_dir / 'checkpoints' / 'last.ckpt'}")
            trainer.save_checkpoint(last, weights_only=False)  # the final state, whatever the interval
            train_loss = trainer.callback_metrics.get("train/loss")
            final = final_validation(trainer, module, data) | end_of_run_record(trainer, module, logger)
            final_val = float(final["val/loss"])
        except BaseException as error:
            if logger is not None:  # the run stays in MLflow, marked; its checkpoints stay for resume=auto
                stopped = isinstance(error, (KeyboardInterrupt, SIGTERMException, TimeLimitReached))
                logger.close("KILLED" if stopped else "FAILED", f"{type(error).__name__}: {error}".rstrip(": "),
                             trainer.global_step)
            raise
        result = RunResult(
            run_dir=run_dir,
            tracking_uri=info.get("tracking_uri", ""),
            experiment=info.get("experiment", ""),
            mlflow_run_id=info.get("mlflow_run_id"),
            params=count_params(module.model),
            non_embedding_params=non_embedding_params(module.model),
            tokens=trainer.global_step * schedule.tokens_per_step,
            initial_val_loss=initial_val,
            final_val_loss=final_val,
            final_train_loss=None if train_loss is None else float(train_loss),
            tokens_per_sec=throughput.mean_tokens_per_sec,
            wall_seconds=time.perf_counter() - started,
            view_url=info.get("view_url"),
            recall={k: float(v) for k, v in final.items() if k.startswith("recall/")},
            fit_seconds=fit_seconds,
            eval_seconds=next((cb.end_eval_seconds for cb in callbacks if getattr(cb, "end_eval_seconds", None)),
                              None),
        )
        if logger is not None:
            logger.close("FINISHED", f"trained {result.tokens:,} tokens", trainer.global_step)
        if trainer.is_global_zero:
            print_summary(cfg, result)
        return result


def final_validation(trainer: L.Trainer, module: LMModule, data: LMDataModule) -> dict[str, float]:
    """The validation metrics of the final weights, logged once: the fit's own validation when it ran at the last
    step (validating again would log each ``val/`` point a second time and end every curve flat), else a new one."""
    if module.validated_at == trainer.global_step:
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "recall/"))}
    return trainer.validate(module, datamodule=data, verbose=False)[0]


def end_of_run_record(trainer: L.Trainer, module: LMModule, logger) -> dict[str, float]:
    """A recall run's time-to-bind (:meth:`LMModule.bind_record`), logged once at the final step: a resumed run that
    had finished logs it at the same step, which the logger sees recorded already and skips."""
    record = module.bind_record()
    if record and logger is not None:
        logger.log_metrics(record, step=trainer.global_step)
    return record


def make_trainer(cfg: ExperimentConfig, schedule: Schedule, run_dir: Path, logger, callbacks: list,
                 progress: bool) -> L.Trainer:
    t = cfg.train
    checkpoint = CheckpointAfterValidation(
        schedule.val_every_steps,
        dirpath=run_dir / "checkpoints",
        filename="step{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=schedule.ckpt_every_steps,
        save_top_k=t.keep_last_k,
        monitor="step",
        mode="max",
        save_last=True,
    )
    callbacks = [checkpoint, AlignLoggingStep(), *callbacks] + ([RichProgressBar(leave=True)] if progress else [])
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=make_strategy(cfg),
        precision=t.precision,
        max_steps=schedule.max_steps,
        accumulate_grad_batches=schedule.grad_accum_steps,
        gradient_clip_val=cfg.optim.grad_clip or None,
        val_check_interval=schedule.val_every_steps * schedule.grad_accum_steps,
        check_val_every_n_epoch=None,
        limit_val_batches=schedule.val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        deterministic=t.deterministic,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        enable_progress_bar=progress,
        enable_model_summary=False,
        # no_grad rather than inference mode: the validation run before fit would otherwise leave the torchmetrics
        # state as inference tensors, which the validations during fit may not update.
        inference_mode=False,
        default_root_dir=run_dir,
        plugins=[AtomicCheckpointIO()],
    )
