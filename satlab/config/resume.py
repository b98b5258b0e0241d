"""Which settings a run may change when it resumes: how it runs and how long, never what it computes.

A resumed run continues the weights, optimizer state and data position of its checkpoint. Changing the model, the
data, the optimizer or the seed would continue one experiment as another, so :func:`resume_problems` lists such
changes and the run is refused (a new name starts a new run). Extending the budget (``train.max_tokens``, which
also stretches the cosine schedule from where it is), validation and checkpoint intervals, hardware and
parallelism, precision and compile, evaluation and tracking settings may change, and so may the implementation of
the depth mixing (``model.mixing_impl``: the same formulas computed another way, no weight changes). Where the run
folder lives (``train.out_dir``) is not part of the experiment: a run copied to another disk continues there.
"""

from __future__ import annotations

from satlab.config.display import flatten
from satlab.config.schema import ExperimentConfig

RESUMABLE = (
    "description", "train.max_tokens", "train.max_time_minutes", "train.val_every_tokens", "train.val_tokens",
    "train.ckpt_every_tokens", "train.keep_last_k", "train.log_every_n_steps", "train.max_skipped_steps",
    "train.resume", "train.micro_batch_size", "train.precision", "train.compile", "train.accelerator",
    "train.out_dir", "train.devices", "train.num_nodes", "train.strategy", "train.data_parallel_size",
    "train.activation_checkpointing", "train.deterministic", "data.num_workers", "data.num_proc",
    "data.prepare_per_node", "data.prepare_timeout_s", "data.cache_dir",
    "data.mqar.stop_at_acc", "model.mixing_impl", "eval.", "tracking.",
)
"""Keys (or ``section.`` prefixes) a resumed run may change."""


def resume_problems(saved: ExperimentConfig, new: ExperimentConfig) -> list[str]:
    """``key: old -> new`` for every setting that differs and may not change on resume."""
    before, after = flatten(saved), flatten(new)
    changed = [k for k in sorted(before.keys() | after.keys()) if before.get(k) != after.get(k)]
    return [f"{k}: {before.get(k, '(absent)')} -> {after.get(k, '(absent)')}" for k in changed
            if not any(k == safe or (safe.endswith(".") and k.startswith(safe)) for safe in RESUMABLE)]
