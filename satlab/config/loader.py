"""Load an experiment: structured defaults <- preset chain (``base:``) <- command-line overrides, then validate.

Every layer is a plain dict that is merged into the structured :class:`ExperimentConfig` one leaf at a time, so
that an unknown key or a wrong type in one place does not hide the next: all problems end up in one
:class:`ConfigError`, each prefixed with the file or override it came from.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

from satlab.config.errors import ECHO_CHARS, ConfigError, quoted, shown, unknown_name
from satlab.config.model import SIZE_PRESETS, resolve_model_config
from satlab.config.resolve import (
    FOLDER_BASE,
    GeneratedPreset,
    base_path,
    default_experiments_dir,
    generated_preset,
    read_file,
    resolve,
)
from satlab.config.schema import BPE_MIN_VOCAB, MIX_SOURCES, SYNTHETIC_PREFIX, SYNTHETIC_TASKS, ExperimentConfig
from satlab.config.specs import parse_item, read_mapping, short_path
from satlab.config.structured import Layer, build, field_problems

MAX_MIX_SHARE = 0.5
"""The largest share of the train tokens one ``data.mix`` source may take."""
RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
"""A run name is one path component under ``train.out_dir``: ASCII letters, digits, ``.``, ``_`` and ``-``
(``fullmatch``: a trailing newline is no part of a name)."""
RUN_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]")
RUN_NAME_RULE = ("letters, digits, '.', '_' and '-' of ASCII only (a-z, A-Z, 0-9: no accented or other non-ASCII "
                 "letters, no spaces), 1 to 200 of them, not '.' or '..'")

_TEXT = {"data.source": "an embedded corpus (shakespeare, kjv, pystdlib), a file, folder or glob, or a hub dataset",
         "data.cache_dir": "a folder for the data caches", "train.out_dir": "the folder of the run folders",
         "data.text_field": "the field of a row that holds its text", "data.hub_split": "a split name, e.g. train"}
"""Text settings an empty value would not mean anything for (the empty path would be the working directory)."""
EXPERIMENT_KEYS = (*(f.name for f in dataclasses.fields(ExperimentConfig)), "base")

def _generated_layer(preset: GeneratedPreset) -> Layer:
    """What ``<folder>/<arch>`` adds to its folder's ``_base.yaml``: ``model.arch``, the run name and a description
    (from the registry's label and the ``_base``'s own description)."""
    base_file, folder, arch, family = preset
    try:
        setting = str(read_mapping(base_file, short_path(base_file), "experiment").get("description") or folder)
    except ConfigError:  # reported when the chain reads the file
        setting = folder
    name = f"{folder.replace('/', '-')}-{arch}"
    layer = {"name": name, "description": family.describe(folder, arch, setting), "model": {"arch": arch}}
    return f"preset {folder}/{arch} ({FOLDER_BASE} with model.arch={arch})", layer


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
    layers = _preset_chain(resolve("experiment", experiment, root), root, problems)
    return _build(layers + _override_layers(overrides, problems), problems)


def config_from_dict(data: Mapping[str, Any], source: str = "config") -> ExperimentConfig:
    """A validated, resolved config from one plain nested dict (for example a saved config)."""
    return _build([(source, data)], [])


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
        if (generated := generated_preset(current, root)) is not None:
            layers.append(_generated_layer(generated))
            current = generated.base_file
            continue
        data = _read_yaml(current, problems)
        if data is None:
            break
        base = data.pop("base", None)
        layers.append((short_path(current), data))
        current = None if base is None else base_path(base, current, root, problems)
    return layers[::-1]


def _read_yaml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        return read_file("experiment", path, short_path(path), EXPERIMENT_KEYS)
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
        layers.append((override_source(item), value))
    return layers


def override_source(item: str) -> str:
    """How messages name the command-line override ``item`` (cut when long)."""
    return f"override {quoted(item, ECHO_CHARS // 2)}"


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
    if not RUN_NAME.fullmatch(cfg.name) or cfg.name in (".", ".."):
        problems.append(f"name {shown(cfg.name)} is not a run name{name_characters(cfg.name, RUN_NAME_CHARS)}: it "
                        f"names the folder {cfg.train.out_dir}/<name>, so it must be {RUN_NAME_RULE}")
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
                            f"got {shown(share)}; leave it out to mix nothing")
    total = sum(v for v in mix.values() if isinstance(v, int | float))
    if len(mix) > 1 and not total < 1:
        problems.append(f"the shares of data.mix must sum to < 1 (the rest is the corpus), got {shown(total)}")
    return problems


def name_characters(name: str, allowed: re.Pattern[str]) -> str:
    """`` ('é' (U+00E9) and ' ' are not allowed)``: the first characters of ``name`` that ``allowed`` (a pattern of
    one character) refuses, for a message that states a naming rule; empty when there are none."""
    bad = list(dict.fromkeys(c for c in name if not allowed.fullmatch(c)))[:3]
    return f" ({' and '.join(f'{c!r} (U+{ord(c):04X})' for c in bad)} {'is' if len(bad) == 1 else 'are'} not " \
           "allowed)" if bad else ""


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
