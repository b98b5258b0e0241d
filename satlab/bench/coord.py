"""The coordinate check: does a parametrisation keep every module's output the same size as the model grows?

Each architecture is built at a series of widths (at the base depth) and of depths (at the base width), with the
head dim fixed, and trained a few AdamW steps on real text (an embedded corpus, byte tokens: one fixed batch, or a
new one at every step), deterministically in fp32 on the CPU. The model, its optimizer groups and its loss are the
training code's own (:class:`satlab.training.module.LMModule` and its ``configure_optimizers``), so whatever the
parametrisation changes there (initialisation, per-group learning rates, multipliers) is what is measured; another
code base's models can be measured the same way (:class:`Implementation`). Forward hooks
(:mod:`satlab.bench.coord_probes`) record the RMS of every probed output at every step; per probe and step, the
slope of log RMS against log width and against log depth says how that output scales: 0 is what μP (width) and
CompleteP (width and depth) promise, the standard parametrisation's outputs grow with width once training has moved
the weights. ``docs/coord-check.md`` explains the probes and how to read the numbers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from satlab.bench.coord_probes import Probes
from satlab.bench.coord_settings import (
    FIRST_CHECKED_STEP,
    NOT_COMPARED,
    SP_SLOPE_SIGNAL,
    TRANSFER_SLOPE_LIMIT,
    CoordSettings,
    Shape,
    shapes,
)
from satlab.config.loader import load_experiment
from satlab.config.schema import ExperimentConfig
from satlab.data.corpora import corpus_documents
from satlab.data.tokenizer import BYTE_VOCAB, byte_tokenizer

CORPUS = "shakespeare"
SECONDS_PER_GFLOP, SECONDS_PER_LAYER_STEP = 0.08, 0.028
"""One core's cost of the check, fitted to the default grid's 100 models on the development machine (shared, so an
upper estimate): per GFLOP of training (forward and backward) and per layer and step (hooks, AdamW, small ops).
Only for ``--dry-run``'s estimate."""


@dataclass
class Measurement:
    """RMS per probe per step (steps 0..S: 0 the initial model, s after s updates) and the loss per step."""

    rms: dict[str, list[float]]
    losses: list[float]
    seconds: float
    params: int


def shape_config(shape: Shape, settings: CoordSettings, seed: int | None = None) -> ExperimentConfig:
    """The experiment config of one shape: the default experiment with byte tokens, the fixed batch, a constant
    learning rate (no warmup, no decay: the check looks at the first steps), ``seed`` (else the first of the
    settings') and the user's overrides last."""
    w, b, t = shape.width, settings.batch, settings.seq_len
    heads = w // settings.head_dim
    fixed = [f"model.arch={shape.arch}", f"model.d_model={w}", f"model.n_layers={shape.depth}",
             f"model.n_heads={heads}", f"model.n_kv_heads={heads}", f"model.mlp_hidden={4 * w}",
             f"model.vocab_size={BYTE_VOCAB}", "data.tokenizer.kind=byte", f"data.seq_len={t}",
             f"train.micro_batch_size={b}", f"train.global_batch_tokens={b * t}",
             f"train.max_tokens={b * t * max(1, settings.steps)}", "train.precision=32-true",
             "optim.warmup_fraction=0", "optim.min_lr_ratio=1",
             f"train.seed={settings.seeds[0] if seed is None else seed}"]
    return load_experiment("default", [*fixed, *settings.overrides])


def parametrization(cfg: ExperimentConfig) -> str:
    """The config's parametrisation (``sp`` where the config has no such field)."""
    return getattr(cfg.model, "parametrization", "sp")


Batches = list[tuple[torch.Tensor, torch.Tensor]]
"""(inputs, targets) per probed forward pass: steps + 1 of them (step s's forward, then one after the last update)."""


def token_batch(batch: int, seq_len: int, corpus: str = CORPUS) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``batch`` consecutive windows of ``seq_len`` + 1 byte tokens from the start of the
    embedded corpus: the same real text for every model of the check."""
    tokenizer, need, ids = byte_tokenizer(), batch * (seq_len + 1), []
    for doc in corpus_documents(corpus):
        ids += tokenizer.encode(doc["text"])
        if len(ids) >= need:
            break
    windows = torch.tensor(ids[:need], dtype=torch.long).view(batch, seq_len + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def check_batches(settings: CoordSettings) -> Batches:
    """The batch of each probed forward pass: the one fixed batch every time, or with ``settings.fresh_batches`` the
    next ``batch`` windows of the corpus at every step (as a training run and CompleteP's reference check see them)."""
    count = settings.steps + 1
    if not settings.fresh_batches:
        return [token_batch(settings.batch, settings.seq_len)] * count
    inputs, targets = token_batch(settings.batch * count, settings.seq_len)
    return list(zip(inputs.split(settings.batch), targets.split(settings.batch), strict=True))


def measure(cfg: ExperimentConfig, batches: Batches, prepare: Callable[[nn.Module], None] | None = None
            ) -> Measurement:
    """Train ``len(batches) - 1`` AdamW steps of the training code's own module and optimizer; the RMS of every probe
    at steps 0..steps (the last a forward after the last update). ``prepare`` may alter the built model first (the
    tests plant a wrongly scaled module with it)."""
    from satlab.config.derived import derive_schedule
    from satlab.training.module import LMModule

    torch.manual_seed(cfg.train.seed)
    module = LMModule(cfg, derive_schedule(cfg))
    if prepare is not None:
        prepare(module.model)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    module.train()

    def update() -> None:
        optimizer.step()
        scheduler.step()

    return probed_steps(module.model, Probes(module.model), module.loss, update, batches)


def probed_steps(model: nn.Module, probes: Probes, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 update: Callable[[], None], batches: Batches) -> Measurement:
    """The check's loop: ``len(batches) - 1`` updates, with the probes recording a forward pass before each and one
    after the last. ``loss_of(inputs, targets)`` is the forward pass, ``update`` the optimizer step after the
    backward pass (no clipping: AdamW's update does not depend on the gradient's scale). The probes are removed at
    the end."""
    rms: dict[str, list[float]] = {}
    losses: list[float] = []
    steps = len(batches) - 1
    start = time.perf_counter()
    try:
        for step, (inputs, targets) in enumerate(batches):
            with probes, torch.set_grad_enabled(step < steps):
                loss = loss_of(inputs, targets)
            losses.append(float(loss.detach()))
            for key, value in probes.collect().items():
                rms.setdefault(key, [math.nan] * step).append(value)
            if step < steps:
                model.zero_grad(set_to_none=True)
                loss.backward()
                update()
    finally:
        probes.remove()
    params = sum(p.numel() for p in model.parameters())
    return Measurement(rms, losses, time.perf_counter() - start, params)


@dataclass(frozen=True)
class Implementation:
    """Whose code builds and trains the models the check measures: satlab's own (:data:`SATLAB`) or another code
    base's (:mod:`satlab.bench.coord_reference`), measured through the same loop, probes and slopes.
    ``measure(cfg, shape, batches)``: one shape at the seed and optimizer settings of ``cfg``."""

    name: str
    measure: Callable[[ExperimentConfig, Shape, Batches], Measurement]
    params: Callable[[ExperimentConfig, Shape], int]
    """The parameter count of one shape's model (for ``--dry-run``), built on the meta device."""


def satlab_params(cfg: ExperimentConfig, shape: Shape) -> int:
    """The parameter count of satlab's model of ``cfg``, built on the meta device (no memory, no init)."""
    from satlab.models import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg.model).parameters())


SATLAB = Implementation("satlab", lambda cfg, shape, batches: measure(cfg, batches), satlab_params)


def stored_path(store: Path, shape: Shape, seed: int, settings: CoordSettings,
                implementation: Implementation = SATLAB) -> Path:
    """Where one shape's measurement at one seed is kept: named by the shape and seed, and by a hash of every setting
    that changes what is measured (steps, the batch, the head dim, the overrides, an implementation other than
    satlab's), so a run with other settings never reads it."""
    measured_by = {"shape": asdict(shape), "seed": seed, "steps": settings.steps, "batch": settings.batch,
                   "seq_len": settings.seq_len, "head_dim": settings.head_dim, "overrides": settings.overrides}
    if implementation is not SATLAB:
        measured_by["implementation"] = implementation.name
    if settings.fresh_batches:
        measured_by["fresh_batches"] = True
    digest = hashlib.sha256(json.dumps(measured_by, sort_keys=True).encode()).hexdigest()[:12]
    return store / f"{shape.arch}-{shape.series}-w{shape.width}-d{shape.depth}-seed{seed}-{digest}.json"


def measure_stored(measure_now: Callable[[], Measurement], path: Path | None) -> tuple[Measurement, bool]:
    """``measure_now()``, kept at ``path`` once done (written whole, then renamed) and read back instead of measured
    when it is there: a check killed part way resumes at the first model it had not finished. (measurement, read
    back?); ``path`` None measures without keeping."""
    if path is not None and path.exists():
        return Measurement(**json.loads(path.read_text())), True
    measurement = measure_now()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(measurement)))  # NaN kept as NaN: Python's json reads it back
        os.replace(partial, path)
    return measurement, False


def seed_mean(measured: Sequence[Measurement]) -> Measurement:
    """One shape's measurements over seeds as one: per probe and step the geometric mean of the RMS (a slope of
    log RMS is then the mean of the seeds' slopes), the mean loss, the summed time. A value missing or not positive
    in any seed makes the mean NaN (left out of the fit)."""
    probes = sorted({p for m in measured for p in m.rms})
    steps = max(len(v) for m in measured for v in m.rms.values())

    def geometric(values: list[float]) -> float:
        ok = all(math.isfinite(v) and v > 0 for v in values)
        return math.exp(sum(map(math.log, values)) / len(values)) if ok else math.nan

    rms = {p: [geometric([m.rms[p][s] if p in m.rms and s < len(m.rms[p]) else math.nan for m in measured])
               for s in range(steps)] for p in probes}
    losses = [sum(values) / len(values) for values in zip(*(m.losses for m in measured), strict=True)]
    return Measurement(rms, losses, sum(m.seconds for m in measured), measured[0].params)


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x over the points with a finite, positive y (NaN with fewer than
    two such points at distinct x)."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if math.isfinite(y) and y > 0]
    if len({p[0] for p in points}) < 2:
        return math.nan
    lx, ly = np.array(points).T
    return float(np.polyfit(lx, ly, 1)[0])


def series_slopes(xs: Sequence[int], rms: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per probe, the slope at each step over the series (``rms[i]`` measured at ``xs[i]``); a probe that some
    shape lacks is fitted over the shapes that have it."""
    probes = sorted({p for r in rms for p in r})
    steps = max(len(v) for r in rms for v in r.values())
    return {p: [fit_slope(xs, [r[p][s] if p in r else math.nan for r in rms]) for s in range(steps)]
            for p in probes}


def worst(slopes: dict[str, list[float]], series: str = "width") -> dict | None:
    """The largest |slope| from :data:`FIRST_CHECKED_STEP` on, over the probes the series compares
    (:data:`NOT_COMPARED`): {slope, probe, step}, or None when none is finite."""
    found = [(abs(v), p, s, v) for p, values in slopes.items() for s, v in enumerate(values)
             if s >= FIRST_CHECKED_STEP and math.isfinite(v) and p not in NOT_COMPARED.get(series, {})]
    if not found:
        return None
    _, probe, step, value = max(found)
    return {"slope": value, "probe": probe, "step": step}


def verdict(param: str, width: dict | None, depth: dict | None) -> dict:
    """PASS/FAIL of one architecture under its parametrisation. μP claims width only, CompleteP width and depth,
    each |slope| < :data:`TRANSFER_SLOPE_LIMIT`; under sp the check is that it can fail: some |slope| (width or
    depth) above :data:`SP_SLOPE_SIGNAL` (PASS: the control shows the drift)."""
    size = {"width": abs(width["slope"]) if width else math.nan, "depth": abs(depth["slope"]) if depth else math.nan}
    if param == "sp":
        moved = max((v for v in size.values() if math.isfinite(v)), default=math.nan)
        return {"rule": f"sp control: some |slope| > {SP_SLOPE_SIGNAL}",
                "result": "PASS" if moved > SP_SLOPE_SIGNAL else "FAIL"}
    claimed = ["width"] if param == "mup" else ["width", "depth"]
    ok = all(math.isfinite(size[c]) and size[c] < TRANSFER_SLOPE_LIMIT for c in claimed)
    return {"rule": f"{param}: |slope| < {TRANSFER_SLOPE_LIMIT} vs {' and '.join(claimed)}",
            "result": "PASS" if ok else "FAIL"}


def coord_check(settings: CoordSettings, progress: Callable[[str], None] = print,
                prepare: Callable[[nn.Module], None] | None = None, store: Path | None = None,
                implementation: Implementation = SATLAB) -> dict:
    """Measure every shape, fit the slopes and judge each architecture; the report as plain data (coord.json).
    With ``store`` each measurement is kept there as it finishes and reused by a later call with the same settings
    (not with ``prepare``, which alters the models). ``implementation`` says whose models are measured."""
    torch.set_num_threads(1)
    batches = check_batches(settings)
    report: dict = {"settings": asdict(settings), "implementation": implementation.name, "thresholds": {
        "transfer_slope_limit": TRANSFER_SLOPE_LIMIT, "sp_slope_signal": SP_SLOPE_SIGNAL,
        "first_checked_step": FIRST_CHECKED_STEP}, "archs": {}}
    total = time.perf_counter()
    for arch in settings.archs:
        entry: dict = {"series": {}, "implementation": implementation.name}
        for series in ("width", "depth"):
            runs = [s for s in shapes(settings) if s.arch == arch and s.series == series]
            measured = []
            for shape in runs:
                seeds, reused = [], 0
                for seed in settings.seeds:
                    cfg = shape_config(shape, settings, seed)
                    entry["parametrization"] = report["parametrization"] = parametrization(cfg)
                    if prepare is not None:
                        seeds.append(measure(cfg, batches, prepare))
                        continue
                    path = None if store is None else stored_path(store, shape, seed, settings, implementation)
                    measurement, read_back = measure_stored(
                        functools.partial(implementation.measure, cfg, shape, batches), path)
                    seeds.append(measurement)
                    reused += read_back
                m = seed_mean(seeds)
                progress(f"{arch} width {shape.width} depth {shape.depth}: {m.params / 1e6:.2f}M params, "
                         f"{len(seeds)} seed(s) in {m.seconds:.1f} s, loss {m.losses[0]:.3f} -> {m.losses[-1]:.3f}"
                         + (f" ({reused} measured by an earlier run)" if reused else ""))
                measured.append(m)
            xs = [s.x for s in runs]
            slopes = series_slopes(xs, [m.rms for m in measured])
            entry["series"][series] = {"x": xs, "rms": [m.rms for m in measured],
                                       "losses": [m.losses for m in measured], "params": [m.params for m in measured],
                                       "seconds": [m.seconds for m in measured], "slopes": slopes,
                                       "worst": worst(slopes, series)}
        entry["verdict"] = verdict(entry["parametrization"], entry["series"]["width"]["worst"],
                                   entry["series"]["depth"]["worst"])
        report["archs"][arch] = entry
    report["seconds"] = time.perf_counter() - total
    return report


def plan(settings: CoordSettings, store: Path | None = None, implementation: Implementation = SATLAB) -> list[dict]:
    """What the check would build, without training: per shape its sizes, parameter count (built on the meta
    device), how many of its seeds ``store`` already holds, and the estimated seconds of the rest
    (:data:`SECONDS_PER_GFLOP`, :data:`SECONDS_PER_LAYER_STEP`)."""
    rows = []
    for shape in shapes(settings):
        cfg = shape_config(shape, settings)
        params = implementation.params(cfg, shape)
        tokens = settings.batch * settings.seq_len
        gflop = (6 * settings.steps + 2) * params * tokens / 1e9
        seconds = gflop * SECONDS_PER_GFLOP + shape.depth * settings.steps * SECONDS_PER_LAYER_STEP
        kept = 0 if store is None else sum(stored_path(store, shape, seed, settings, implementation).exists()
                                           for seed in settings.seeds)
        rows.append({**asdict(shape), "heads": cfg.model.n_heads, "mlp_hidden": cfg.model.mlp_hidden,
                     "params": params, "parametrization": parametrization(cfg), "kept": kept,
                     "estimated_seconds": seconds * (len(settings.seeds) - kept)})
    return rows
