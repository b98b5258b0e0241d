"""A scaling ladder as an ablation (docs/ladder.md): the ``ladder:`` block (:mod:`satlab.config.ladder`) planned
rung by rung from parameter counts of models built on the meta device (no weights), and expanded into the spec's
axes and one ``grids:`` sub-grid per rung, so that the study engine runs, resumes and shares its cells unchanged.

Every architecture of a rung trains on the same token budgets, computed from the reference architecture's
parameter count and rounded to whole optimizer steps; each budget is its own run with its own cosine schedule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from satlab.config.errors import ConfigError, shown
from satlab.config.ladder import MIN_DECADES
from satlab.config.schema import ExperimentConfig
from satlab.studies.ablation_spec import AblationSpec
from satlab.studies.spec import format_value

CPU_SECONDS_PER_GFLOP = 0.0187
CPU_SECONDS_PER_TOKEN = 1.35e-5
"""The CPU time of a run of the tiny family, fp32 on one thread of this machine: CPU_SECONDS_PER_RUN + tokens x
CPU_SECONDS_PER_TOKEN + analytic FLOPs (:func:`satlab.models.flops_per_token`) x CPU_SECONDS_PER_GFLOP / 1e9, the
tokens and FLOPs of training and of validation (a third of a training token each). Fitted by least squares to the
117 runs of experiments/ablations/ladder_cpu_tuned.yml (user + system CPU time per run, two workers of one thread
on the 2-core development machine, 2026-12-07): the fit gives its 2.88 hours exactly, each rung's total within
8 %, and the median run within 3 %; it predicts ladder_cpu's 3.27 measured hours (the same cells at other rates,
partly on an earlier machine and beside other work) as 2.88. The first constants (0.0376 s per GFLOP, 1.18e-5 s
per token, 15.5 s per run) came from a pilot of three runs beside two other studies, and put both ladders at 4.8
hours. The per-token term is Python and kernel launches, which do not shrink with the model."""
CPU_SECONDS_PER_RUN = 6.6
"""Start-up, data, MLflow and the final checkpoint of one run (the least-squares intercept of the fit above)."""
GPU_PEAK_FLOPS = 989e12
GPU_PEAK_LABEL = "H100/H200 SXM dense bf16, 989 TFLOP/s"
GPU_MFU = 0.40
"""No ladder, and no satlab run at all, has been timed on a GPU: the GPU cost is at this ASSUMED model-FLOPs
utilisation of the peak above, a common figure for dense bf16 training of models of this size; replace it with the
GPU check's bench (docs/gpu-check.md) once a GPU has run it."""


@dataclass(frozen=True)
class Size:
    """A model's parameter counts and training FLOPs per token (attention and the output layer included)."""

    params: int
    non_embedding_params: int
    flops_per_token: float

    def count(self, per: str) -> int:
        return self.params if per == "total" else self.non_embedding_params


def model_sizes(cfg: ExperimentConfig) -> tuple[Size, ExperimentConfig]:
    """The sizes a run of ``cfg`` would have (its vocabulary sized as the run sizes it) from a model on the meta
    device, which allocates nothing; and the sized config."""
    from satlab.data.vocabulary import model_vocabulary
    from satlab.models import build_model, count_params, flops_per_token, non_embedding_params

    vocabulary = model_vocabulary(cfg)
    cfg = vocabulary.sized(cfg)
    model = build_model(cfg.model, device="meta")
    return Size(count_params(model), non_embedding_params(model),
                flops_per_token(model, cfg.data.seq_len, vocabulary.head_fraction)), cfg


@dataclass(frozen=True)
class Rung:
    """One rung planned: its config values, each architecture's size, the budgets in tokens (whole steps)."""

    index: int
    values: dict[str, Any]
    sizes: dict[str, Size]
    counted: int  # the reference's parameter count the budgets multiply
    tokens: tuple[int, ...]
    steps: tuple[int, ...]
    tokens_per_step: int
    warmup_tokens: int
    seeds: int
    lr: float
    val_tokens: int
    val_every_tokens: int

    @property
    def runs(self) -> int:
        return len(self.sizes) * len(self.tokens) * self.seeds

    def compute(self, arch: str) -> list[float]:
        """Training FLOPs of each budget's run of ``arch``."""
        return [self.sizes[arch].flops_per_token * t for t in self.tokens]

    def processed(self, tokens: int) -> float:
        """Training tokens plus validation tokens as training-token equivalents (a validation is a forward pass: a
        third of a training step's FLOPs)."""
        return tokens + max(1, tokens // self.val_every_tokens) * self.val_tokens / 3

    def run_flops(self, arch: str, tokens: int) -> float:
        """Training and validation FLOPs of one run of ``arch`` on ``tokens``."""
        return self.sizes[arch].flops_per_token * self.processed(tokens)

    def run_cpu_seconds(self, arch: str, tokens: int) -> float:
        return (CPU_SECONDS_PER_RUN + self.processed(tokens) * CPU_SECONDS_PER_TOKEN
                + self.run_flops(arch, tokens) / 1e9 * CPU_SECONDS_PER_GFLOP)

    def flops(self) -> float:
        """Training and validation FLOPs of all the rung's runs."""
        return self.seeds * sum(self.run_flops(a, t) for a in self.sizes for t in self.tokens)

    def cpu_seconds(self) -> float:
        return self.seeds * sum(self.run_cpu_seconds(a, t) for a in self.sizes for t in self.tokens)

    def run_gpu_hours(self, arch: str, tokens: int) -> float:
        return self.run_flops(arch, tokens) / (GPU_MFU * GPU_PEAK_FLOPS) / 3600

    def gpu_hours(self) -> float:
        return self.seeds * sum(self.run_gpu_hours(a, t) for a in self.sizes for t in self.tokens)


def rung_of(rungs: Sequence[Rung], values: Mapping[str, Any]) -> Rung | None:
    """The rung whose config values a cell or group has."""
    return next((r for r in rungs if all(values.get(k) == v for k, v in r.values.items())), None)


def rung_overrides(values: dict[str, Any]) -> list[str]:
    return [f"{k}={format_value(v)}" for k, v in values.items()]


def plan(spec: AblationSpec) -> list[Rung]:
    """Each rung of ``spec.ladder`` planned against the base config; raises :class:`ConfigError` with every problem:
    a rung the config refuses, rungs out of order, too little compute span, a budget too short to train."""
    ladder = spec.ladder
    archs = list(spec.axes["model.arch"])
    rungs, problems = [], []
    for i, values in enumerate(ladder.rungs):
        sizes, cfg = {}, None
        for arch in [ladder.reference, *[a for a in archs if a != ladder.reference]]:
            try:
                sizes[arch], sized = model_sizes(spec.base_config([*rung_overrides(values), f"model.arch={arch}"]))
            except ConfigError as e:
                problems.extend(f"ladder.rungs[{i}] ({arch}): {p}" for p in e.problems)
                break
            cfg = cfg or sized
        if cfg is None or len(sizes) < len(archs):
            continue
        step = cfg.train.global_batch_tokens
        counted = sizes[ladder.reference].count(ladder.per)
        steps = tuple(max(1, round(b * counted / step)) for b in ladder.budgets)
        rungs.append(Rung(i, dict(values), {a: sizes[a] for a in archs}, counted, tuple(s * step for s in steps),
                          steps, step, round(ladder.warmup * counted / step) * step, ladder.seeds[i],
                          ladder.lr_of(i), cfg.train.val_tokens, cfg.train.val_every_tokens))
    if problems:
        raise ConfigError(problems)
    problems = order_problems(spec, rungs) + budget_problems(rungs) + span_problems(spec, rungs)
    if problems:
        raise ConfigError(problems)
    return rungs


def order_problems(spec: AblationSpec, rungs: list[Rung]) -> list[str]:
    per = spec.ladder.per
    for arch in rungs[0].sizes:
        counts = [r.sizes[arch].count(per) for r in rungs]
        if any(b <= a for a, b in zip(counts, counts[1:], strict=False)):
            return [f"ladder.rungs must be in increasing order of parameters (smallest first), but {arch}'s "
                    f"{per.replace('_', '-')} parameter counts by rung are {', '.join(f'{n:,}' for n in counts)}: "
                    "reorder the rungs, or make each larger than the one before"]
    return []


def budget_problems(rungs: list[Rung]) -> list[str]:
    """The rule: every run trains at least one validation interval (``train.val_every_tokens``: its loss curve has
    a point before the end) and at least warmup + 1 optimizer steps (its cosine decay has a step)."""
    problems = []
    for rung in rungs:
        warmup = rung.warmup_tokens // rung.tokens_per_step
        shortest, steps = rung.tokens[0], rung.steps[0]
        if shortest < rung.val_every_tokens or steps < warmup + 1:
            problems.append(
                f"ladder.budgets: rung {rung.index}'s smallest budget is {shortest:,} tokens ({steps} steps of "
                f"{rung.tokens_per_step:,}), but a run must train at least one validation interval "
                f"(train.val_every_tokens = {rung.val_every_tokens:,}) and at least warmup + 1 steps "
                f"({warmup} + 1): raise the budgets or the rung's size, or lower train.val_every_tokens, "
                "train.global_batch_tokens or ladder.warmup")
    return problems


def span_problems(spec: AblationSpec, rungs: list[Rung]) -> list[str]:
    problems = []
    for arch in rungs[0].sizes:
        compute = [c for r in rungs for c in r.compute(arch)]
        if (decades := math.log10(max(compute) / min(compute))) < MIN_DECADES:
            problems.append(f"ladder: {arch}'s runs span {decades:.2f} decades of training compute "
                            f"({min(compute):.3g} to {max(compute):.3g} FLOPs), fewer than the {MIN_DECADES} a fit "
                            "of L(N, D) needs to extrapolate from: add larger or smaller rungs, or widen the budgets")
    return problems


def expand(spec: AblationSpec) -> AblationSpec:
    """``spec`` with its ladder's axes and sub-grids: rung keys, ``train.max_tokens``, then the spec's own axes
    (``model.arch``), the learning rate and warmup, the seeds; one sub-grid per rung. A spec already expanded (the
    stored spec of a study) expands to itself; any other value of an axis or sub-grid the ladder sets is refused."""
    ladder, seed = spec.ladder, spec.seed_key
    rungs = plan(spec)
    owned: dict[str, list[Any]] = {k: _unique(r.values[k] for r in rungs) for k in ladder.rung_keys()}
    owned["train.max_tokens"] = _unique(t for r in rungs for t in r.tokens)
    tail = {"optim.lr": _unique(r.lr for r in rungs), "optim.warmup_tokens": _unique(r.warmup_tokens for r in rungs),
            seed: list(range(max(r.seeds for r in rungs)))}
    grids = [{**{k: [r.values[k]] for k in ladder.rung_keys()}, "train.max_tokens": list(r.tokens),
              "optim.lr": [r.lr], "optim.warmup_tokens": [r.warmup_tokens], seed: list(range(r.seeds))}
             for r in rungs]
    own = {k: v for k, v in spec.axes.items() if k not in owned and k not in tail}
    axes = {**owned, **own, **tail}
    problems = [f"axis {k} = {shown(spec.axes[k])} is set by the ladder ({shown(axes[k])}): remove it from 'axes'"
                for k in [*owned, *tail] if k in spec.axes and _text(spec.axes[k]) != _text(axes[k])]
    if spec.grids and _text(spec.grids) != _text(grids):
        problems.append("'grids' cannot be given with a ladder: the ladder writes one sub-grid per rung")
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(spec, axes=axes, grids=grids)


def ladder_problems(spec: AblationSpec) -> list[str]:
    """The block's own checks, and what a ladder cannot be combined with."""
    parametrization = spec.overrides.get("model.parametrization")
    if parametrization is None:
        try:
            parametrization = spec.base_config().model.parametrization
        except ConfigError:
            parametrization = None  # the base's own problems are reported by check_against_config
    problems = spec.ladder.problems(spec.axes, spec.seed_key, parametrization)
    if "model.parametrization" in spec.axes:
        problems.append("ladder: model.parametrization cannot be an axis of a ladder (each rung's learning rate "
                        "depends on it): set it in 'overrides'")
    if spec.sequential.enabled:
        problems.append("ladder: a sequential plan cannot be combined with a ladder (its looks add seeds to whole "
                        "axes; the ladder's seeds are per rung)")
    return problems


def _unique(values: Any) -> list[Any]:
    return list({format_value(v): v for v in values}.values())


def _text(value: Any) -> str:
    return format_value(value)
