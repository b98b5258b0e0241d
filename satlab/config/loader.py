"""Load an experiment: structured defaults <- preset chain (``base:``) <- command-line overrides, then validate.

Every layer is a plain dict that is merged into the structured :class:`ExperimentConfig` one leaf at a time, so
that an unknown key or a wrong type in one place does not hide the next: all problems end up in one
:class:`ConfigError`, each prefixed with the file or override it came from.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ConfigError, unknown_name
from satlab.config.model import SIZE_PRESETS, resolve_model_config
from satlab.config.schema import BPE_MIN_VOCAB, MIX_SOURCES, SYNTHETIC_PREFIX, SYNTHETIC_TASKS, ExperimentConfig
from satlab.config.specs import existing, named_file, parse_item, read_mapping, short_path, user_path
from satlab.config.structured import Layer, build, field_problems, short_repr

ENV_EXPERIMENTS_DIR = "SATLAB_EXPERIMENTS_DIR"
PRESET_SUFFIX = ".yaml"
MAX_MIX_SHARE = 0.5
"""The largest share of the train tokens one ``data.mix`` source may take."""
RUN_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
"""A run name is one path component under ``train.out_dir``: letters, digits, ``.``, ``_`` and ``-``."""

_TEXT = {"data.source": "an embedded corpus (shakespeare, kjv, pystdlib), a file, folder or glob, or a hub dataset",
         "data.cache_dir": "a folder for the data caches", "train.out_dir": "the folder of the run folders",
         "data.text_field": "the field of a row that holds its text", "data.hub_split": "a split name, e.g. train"}
"""Text settings an empty value would not mean anything for (the empty path would be the working directory)."""
EXPERIMENT_KEYS = (*(f.name for f in dataclasses.fields(ExperimentConfig)), "base")

# The paper presets: ``paper/<size>/<arch>`` is no file but ``paper/<size>/_base`` with ``model.arch=<arch>``
# (:func:`paper_preset`), so the architectures of one size are matched in everything else by construction.
PAPER_DIR = "paper"
SIZE_BASE = "_base"
PAPER = "SATFormer, arXiv 2605.03953"
PAPER_ARCHS = ("transformer", "resformer", "satformer", "denseformer", "hyperconnections", "muddformer")
"""The architectures the paper compared: their presets reproduce its runs; the registry's others came after it."""
PAPER_SIZE_ARCHS: dict[str, tuple[str, ...]] = {"xl": ("transformer", "resformer", "satformer")}
"""Sizes the paper ran for some of its architectures only (no dense baselines at xl): ``paper/<size>/<arch>``
exists for these; at any other size, for every registered architecture."""


def default_experiments_dir() -> Path:
    """``$SATLAB_EXPERIMENTS_DIR``, else the repository's ``experiments/`` (found from the package, so any cwd
    works), else ``./experiments`` for an installed package."""
    if os.environ.get(ENV_EXPERIMENTS_DIR):
        return Path(os.environ[ENV_EXPERIMENTS_DIR]).expanduser()
    repo_dir = Path(__file__).resolve().parents[2] / "experiments"
    return repo_dir if repo_dir.is_dir() else Path.cwd() / "experiments"


def experiment_family(preset: str) -> str | None:
    """The MLflow experiment that runs of a preset share by default, so they can be compared side by side: the
    preset's folder under ``experiments/`` (``tiny/satformer`` -> ``tiny``, ``paper/small/satformer`` ->
    ``paper-small``), the name of a top-level preset (``default``); None for anything else (a YAML file elsewhere,
    or a config built in Python)."""
    root = default_experiments_dir().resolve()
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        path = root / f"{preset}{PRESET_SUFFIX}"
    try:
        relative = path.resolve().relative_to(root).with_suffix("")
    except ValueError:
        return None
    if not _is_preset(path, root):
        return None
    return "-".join(relative.parts[:-1]) or relative.name


def list_experiments(experiments_dir: Path | None = None) -> list[str]:
    """Preset names (``default``, ``tiny/satformer``, ...): every ``*.yaml`` under the experiments folder, and the
    generated ``paper/<size>/<arch>`` (:func:`paper_preset`)."""
    root = Path(experiments_dir) if experiments_dir is not None else default_experiments_dir()
    files = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob(f"*{PRESET_SUFFIX}")}
    generated = {f"{PAPER_DIR}/{size}/{arch}" for size in paper_sizes(root) for arch in paper_archs(size)}
    return sorted(files | generated)


def paper_sizes(root: Path) -> list[str]:
    """The sizes with a ``paper/<size>/_base.yaml`` under the experiments folder ``root``."""
    return sorted(p.parent.name for p in (root / PAPER_DIR).glob(f"*/{SIZE_BASE}{PRESET_SUFFIX}") if p.is_file())


def paper_archs(size: str) -> list[str]:
    """The architectures with a ``paper/<size>/<arch>`` preset, in registry order (:data:`PAPER_SIZE_ARCHS`)."""
    only = PAPER_SIZE_ARCHS.get(size)
    return [arch for arch in ARCH_SPECS if only is None or arch in only]


def paper_preset(path: Path, root: Path) -> tuple[Path, str, str] | None:
    """``(size file, size, arch)`` when ``path`` is ``<root>/paper/<size>/<arch>.yaml`` of a generated preset: no
    such file, the size's ``_base.yaml`` beside it, and an architecture of :func:`paper_archs`; else None."""
    try:
        parts = path.resolve().relative_to(root.resolve()).parts
    except (ValueError, OSError, RuntimeError):  # elsewhere, or a symbolic link loop (an error for the reader to say)
        return None
    if len(parts) != 3 or parts[0] != PAPER_DIR or not parts[2].endswith(PRESET_SUFFIX) or path.is_file():
        return None
    size, arch = parts[1], parts[2].removesuffix(PRESET_SUFFIX)
    size_file = root / PAPER_DIR / size / f"{SIZE_BASE}{PRESET_SUFFIX}"
    return (size_file, size, arch) if arch in paper_archs(size) and size_file.is_file() else None


def _paper_layer(size_file: Path, size: str, arch: str) -> Layer:
    """What ``paper/<size>/<arch>`` adds to its size's ``_base.yaml``: ``model.arch``, the run name
    ``paper-<size>-<arch>``, and a description of what it reproduces (the registry's label, the size's own
    description)."""
    label = ARCH_SPECS[arch].label
    try:
        setting = str(read_mapping(size_file, short_path(size_file), "experiment").get("description") or size)
    except ConfigError:  # reported when the chain reads the file
        setting = size
    if arch in PAPER_ARCHS:
        description = f"reproduces the paper's {size} {label} run ({PAPER}): {setting}"
    else:
        description = (f"the paper's {size} setting with a baseline the paper did not run, {label} "
                       f"(docs/architectures.md): {setting}")
    layer = {"name": f"{PAPER_DIR}-{size}-{arch}", "description": description, "model": {"arch": arch}}
    return f"preset {PAPER_DIR}/{size}/{arch} ({SIZE_BASE} with model.arch={arch})", layer


def _is_preset(path: Path, root: Path) -> bool:
    return path.is_file() or paper_preset(path, root) is not None


def load_experiment(
    experiment: str | Path = "default",
    overrides: Sequence[str] = (),
    experiments_dir: Path | None = None,
) -> ExperimentConfig:
    """The validated config of a preset name (``tiny/transformer``) or a YAML file, with ``key=value`` overrides.

    Precedence, lowest first: dataclass defaults, the ``base:`` chain from its root, the file itself, overrides.
    The model config is resolved (size preset filled in). Raises :class:`ConfigError` listing every problem.
    """
    root = Path(experiments_dir) if experiments_dir is not None else default_experiments_dir()
    problems: list[str] = []
    layers = _preset_chain(experiment_path(experiment, root), root, problems)
    return _build(layers + _override_layers(overrides, problems), problems)


def config_from_dict(data: Mapping[str, Any], source: str = "config") -> ExperimentConfig:
    """A validated, resolved config from one plain nested dict (for example a saved config)."""
    return _build([(source, data)], [])


def experiment_path(experiment: str | Path, root: Path | None = None) -> Path:
    """The file of a preset name (``tiny/transformer``: looked up inside ``root``, the experiments folder, only) or
    of a path (``./x.yaml``, ``/abs/x.yaml``, ``../x``: see :func:`~satlab.config.specs.user_path`). For a paper
    preset (``paper/small/satformer``) that file is not on disk: :func:`paper_preset` says what it holds."""
    root = default_experiments_dir() if root is None else root
    if not str(experiment).strip():
        raise ConfigError("the experiment is empty: give a preset name (default, tiny/satformer, ...) or the path of "
                          "a YAML file (./my.yaml)")
    if (as_path := user_path(experiment)) is not None:
        generated = paper_preset(as_path, root) is not None  # a trial file's base: /abs/.../paper/small/x.yaml
        return as_path if generated else existing(as_path, "experiment", str(experiment))
    path = named_file(root, str(experiment), PRESET_SUFFIX, "experiment preset")
    if not _is_preset(path, root):
        available = list_experiments(root)
        if not available:
            raise ConfigError(f"unknown experiment preset '{experiment}': no presets in {root} "
                              f"(set ${ENV_EXPERIMENTS_DIR}?)")
        raise ConfigError(_unknown_preset("experiment preset", str(experiment), root) + f" (presets in {root})")
    return path


def _unknown_preset(kind: str, name: str, root: Path) -> str:
    """The message for a preset name that is not one: under ``paper/<size>/`` the architectures of that size (and
    the sizes that have the one asked for), else every preset."""
    parts = name.removesuffix(PRESET_SUFFIX).split("/")
    if len(parts) != 3 or parts[0] != PAPER_DIR or parts[1] not in (sizes := paper_sizes(root)):
        return unknown_name(kind, name, list_experiments(root))
    size, arch = parts[1:]
    which = f"the architectures the paper ran at {size}" if size in PAPER_SIZE_ARCHS else "every architecture"
    elsewhere = [f"{PAPER_DIR}/{s}/{arch}" for s in sizes if arch in paper_archs(s)]
    return (unknown_name(kind, name, [f"{PAPER_DIR}/{size}/{a}" for a in paper_archs(size)])
            + f" ({PAPER_DIR}/{size}/<arch> is {PAPER_DIR}/{size}/{SIZE_BASE} with model.arch=<arch>, for {which}"
            + (f"; {arch} is at {', '.join(elsewhere)}" if elsewhere else "") + ")")


def _preset_chain(path: Path, root: Path, problems: list[str]) -> list[Layer]:
    """The layers of ``path`` and its ``base:`` ancestors, root first. A broken link ends the chain (reported)."""
    layers: list[Layer] = []
    seen: list[Path] = []
    current: Path | None = path
    while current is not None:
        resolved = current.resolve()
        if resolved in seen:
            cycle = " -> ".join(short_path(p) for p in [*seen, resolved])
            problems.append(f"cycle in 'base:' chain: {cycle}")
            break
        seen.append(resolved)
        if (generated := paper_preset(current, root)) is not None:
            layers.append(_paper_layer(*generated))
            current = generated[0]
            continue
        data = _read_yaml(current, problems)
        if data is None:
            break
        base = data.pop("base", None)
        layers.append((short_path(current), data))
        current = None if base is None else _base_path(base, current, root, problems)
    return layers[::-1]


def _base_path(base: Any, child: Path, root: Path, problems: list[str]) -> Path | None:
    """``./x`` and ``../x`` are relative to the file that names them; a bare name is a preset under ``root``."""
    if not isinstance(base, str) or not base:
        problems.append(f"{short_path(child)}: 'base' must be a preset name or a relative path, got {base!r}")
        return None
    name = base if base.endswith((".yaml", ".yml")) else f"{base}{PRESET_SUFFIX}"
    relative = base.startswith(("./", "../")) or Path(base).is_absolute()
    try:
        path = (child.parent / name) if relative else named_file(root, name, "", "base preset")
    except ConfigError as e:
        problems.append(f"{short_path(child)}: {e}")
        return None
    if not _is_preset(path, root):
        problems.append(f"{short_path(child)}: base {_unknown_preset('preset', base, root)} (looked for {path})")
        return None
    return path


def _read_yaml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        return read_mapping(path, short_path(path), "experiment", EXPERIMENT_KEYS)
    except ConfigError as e:
        problems.extend(e.problems)
        return None


def _override_layers(overrides: Sequence[str], problems: list[str]) -> list[Layer]:
    """One layer per ``key=value`` override (:func:`~satlab.config.specs.parse_item`)."""
    layers: list[Layer] = []
    for item in overrides:
        try:
            key, value = parse_item(item, "override", "optim.lr=1e-3")
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        for part in reversed(key.split(".")):
            value = {part: value}
        layers.append((f"override '{item}'", value))
    return layers


def _build(layers: Sequence[Layer], problems: list[str]) -> ExperimentConfig:
    """Merge the layers into the structured defaults, validate the result, raise if anything was wrong."""
    cfg = build(ExperimentConfig, layers, problems)
    if cfg is None:
        raise ConfigError(problems)
    try:
        cfg = dataclasses.replace(cfg, model=resolve_model_config(cfg.model))
    except ConfigError as e:
        problems.extend(e.problems)
    problems.extend(_value_problems(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def _value_problems(cfg: ExperimentConfig) -> list[str]:
    """Every out-of-range value, unknown choice and inconsistency of a merged config (model resolved)."""
    problems = []
    if not RUN_NAME.match(cfg.name) or cfg.name in (".", ".."):
        problems.append(f"name {short_repr(cfg.name)} is not a run name: it names the folder {cfg.train.out_dir}/"
                        "<name>, so it must be letters, digits, '.', '_' and '-' only (1 to 200 of them, not '.' or "
                        "'..')")
    problems.extend(field_problems(cfg, skip=("model",)))  # declared ranges and choices; resolve_model_config's: model
    problems.extend(f"{key} is empty; it needs {what}" for key, what in _TEXT.items() if not attrgetter(key)(cfg))
    if cfg.data.tokenizer.kind == "bpe" and cfg.data.tokenizer.vocab_size < BPE_MIN_VOCAB:
        problems.append(f"data.tokenizer.vocab_size={cfg.data.tokenizer.vocab_size} is too small for a byte-level BPE: "
                        f"it needs >= {BPE_MIN_VOCAB} (256 bytes, end-of-text and a merge), e.g. 8192")
    if not all(0 <= b < 1 for b in cfg.optim.betas):
        problems.append(f"optim.betas must both be in [0, 1), got {list(cfg.optim.betas)}")
    problems.extend(mix_problems(cfg.data.mix))
    task = cfg.data.synthetic_task
    if task is not None and task not in SYNTHETIC_TASKS:
        problems.append(unknown_name("synthetic task (data.source)", task, SYNTHETIC_TASKS)
                        + f"; write it as data.source={SYNTHETIC_PREFIX}{SYNTHETIC_TASKS[0]}")
    elif task is not None:
        problems.extend(cfg.data.mqar.problems(cfg.data.seq_len))
        if cfg.data.mix:
            problems.append("data.mix mixes documents into a text corpus; it does not apply to a synthetic source")
    if cfg.data.tokenizer.kind == "hub" and not cfg.data.tokenizer.name:
        problems.append("data.tokenizer.name is required when data.tokenizer.kind is 'hub'")
    max_seq_len = cfg.model.max_seq_len or SIZE_PRESETS.get(cfg.model.size, {}).get("max_seq_len")
    if max_seq_len is not None and cfg.data.seq_len > max_seq_len:
        problems.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={max_seq_len} (the RoPE table)")
    train = cfg.train
    problems.extend(batch_problems(train.global_batch_tokens, train.micro_batch_size, cfg.data.seq_len,
                                   train.devices * train.num_nodes))
    return problems


def mix_problems(mix: Mapping[str, float]) -> list[str]:
    """``data.mix``: known source names only, each share in (0, MAX_MIX_SHARE], all together < 1."""
    problems = []
    for name, share in mix.items():
        if name not in MIX_SOURCES:
            problems.append(unknown_name("data.mix source", name, MIX_SOURCES))
        elif isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= MAX_MIX_SHARE:
            problems.append(f"data.mix.{name} must be in (0, {MAX_MIX_SHARE}] (its share of the train tokens), "
                            f"got {share!r}; leave it out to mix nothing")
    total = sum(v for v in mix.values() if isinstance(v, int | float))
    if len(mix) > 1 and not total < 1:
        problems.append(f"the shares of data.mix must sum to < 1 (the rest is the corpus), got {total!r}")
    return problems


def safe_run_name(text: str) -> str:
    """``text`` made into a valid run name: every other character becomes ``-`` (for generated names)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:200].strip(".") or "run"


def batch_problems(global_batch_tokens: int, micro_batch_size: int, seq_len: int, world_size: int) -> list[str]:
    """The global batch must be a whole number of micro-batches on every rank (for gradient accumulation)."""
    unit = micro_batch_size * seq_len * world_size
    if min(global_batch_tokens, micro_batch_size, seq_len, world_size) <= 0 or global_batch_tokens % unit == 0:
        return []
    lower = max(unit, global_batch_tokens // unit * unit)
    return [
        f"train.global_batch_tokens={global_batch_tokens} is not a multiple of micro_batch_size*seq_len*world_size"
        f" = {micro_batch_size}*{seq_len}*{world_size} = {unit}; nearest valid: {lower} or {lower + unit}"
    ]
