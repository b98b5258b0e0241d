"""Step counts derived from the token budgets of an :class:`ExperimentConfig`.

Configs speak in tokens so that a run means the same thing whatever the batch shape or the number of devices;
the trainer needs optimizer steps. Everything here is computed once, up front, by :func:`derive_schedule`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from satlab.config.errors import ConfigError
from satlab.config.loader import batch_problems
from satlab.config.schema import ExperimentConfig


@dataclass(frozen=True)
class Schedule:
    """Optimizer-step view of a config's token budgets.

    Attributes:
        tokens_per_step: tokens per optimizer step over all ranks (``train.global_batch_tokens``).
        micro_batch_tokens: tokens in one forward/backward on one rank (``micro_batch_size * seq_len``).
        grad_accum_steps: micro-batches accumulated per optimizer step on each rank:
            ``tokens_per_step / (micro_batch_tokens * world_size)``, a whole number.
        max_steps: optimizer steps in the run, ``max_tokens // tokens_per_step`` (at least 1); a final partial
            step is dropped, so a run trains on ``max_steps * tokens_per_step`` tokens.
        warmup_steps: linear-warmup steps: ``optim.warmup_tokens / tokens_per_step`` when set, else
            ``optim.warmup_fraction * max_steps``; rounded, between 0 and ``max_steps``.
        val_every_steps: steps between validations (``train.val_every_tokens``), in ``[1, max_steps]``.
        ckpt_every_steps: steps between checkpoints (``train.ckpt_every_tokens``), rounded to the nearest multiple
            of ``val_every_steps`` (at least one): a checkpoint is written after its step's validation, so that it
            follows everything the step logs (see ``satlab.training.resilience.CheckpointAfterValidation``).
        val_batches: micro-batches per validation, ``val_tokens // micro_batch_tokens`` (at least 1); for a
            synthetic task, enough to cover its whole held-out set (``train.val_tokens`` does not apply).
        eval_every_steps: steps between downstream evaluations (``eval.every_tokens``), or ``None`` for none
            during training.
    """

    tokens_per_step: int
    micro_batch_tokens: int
    grad_accum_steps: int
    max_steps: int
    warmup_steps: int
    val_every_steps: int
    ckpt_every_steps: int
    val_batches: int
    eval_every_steps: int | None

    def eval_due(self, step: int) -> bool:
        """Whether the validation after ``step`` runs the downstream evaluation: the first validation at or after
        each multiple of ``eval_every_steps`` (the two intervals need not divide each other)."""
        every = self.eval_every_steps
        if not every or step <= 0:
            return False
        return step // every > max(0, step - self.val_every_steps) // every

    def as_dict(self) -> dict[str, int | None]:
        """Field name to value, in declaration order (for logs and MLflow params)."""
        return dataclasses.asdict(self)


def derive_schedule(cfg: ExperimentConfig, world_size: int = 1) -> Schedule:
    """The :class:`Schedule` of a validated config on ``world_size`` ranks.

    Raises :class:`ConfigError` when the global batch is not a whole number of micro-batches on every rank: the
    loader checks this for ``train.devices * train.num_nodes``, but the launcher may run on another world size.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    train = cfg.train
    seq_len = cfg.data.seq_len
    problems = batch_problems(train.global_batch_tokens, train.micro_batch_size, seq_len, world_size)
    if problems:
        raise ConfigError(problems)
    tokens_per_step = train.global_batch_tokens
    micro_batch_tokens = train.micro_batch_size * seq_len
    max_steps = max(1, train.max_tokens // tokens_per_step)

    def every(tokens: int) -> int:
        return min(max_steps, max(1, tokens // tokens_per_step))

    val_every = every(train.val_every_tokens)
    ckpt_every = min(max_steps, val_every * max(1, round(every(train.ckpt_every_tokens) / val_every)))
    if cfg.optim.warmup_tokens is not None:
        warmup = round(cfg.optim.warmup_tokens / tokens_per_step)
    else:
        warmup = round(cfg.optim.warmup_fraction * max_steps)
    return Schedule(
        tokens_per_step=tokens_per_step,
        micro_batch_tokens=micro_batch_tokens,
        grad_accum_steps=tokens_per_step // (micro_batch_tokens * world_size),
        max_steps=max_steps,
        warmup_steps=min(max_steps, max(0, warmup)),
        val_every_steps=val_every,
        ckpt_every_steps=ckpt_every,
        val_batches=(math.ceil(cfg.data.mqar.eval_sequences / train.micro_batch_size) if cfg.data.synthetic_task
                     else max(1, train.val_tokens // micro_batch_tokens)),
        eval_every_steps=None if cfg.eval.every_tokens is None else every(cfg.eval.every_tokens),
    )
