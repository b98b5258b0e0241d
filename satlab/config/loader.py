"""Load an experiment: structured defaults <- preset chain (``base:``) <- command-line overrides, then validate.

Every layer is a plain dict that is merged into the structured :class:`ExperimentConfig` one leaf at a time, so
that an unknown key or a wrong type in one place does not hide the next: all problems end up in one
:class:`ConfigError`, each prefixed with the file or override it came from.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ECHO_CHARS, ConfigError, quoted, shown, unknown_name
from satlab.config.model import SIZE_PRESETS, resolve_model_config
from satlab.config.schema import BPE_MIN_VOCAB, MIX_SOURCES, SYNTHETIC_PREFIX, SYNTHETIC_TASKS, ExperimentConfig
from satlab.config.specs import existing, named_file, parse_item, read_mapping, short_path, user_path
from satlab.config.structured import Layer, build, field_problems

ENV_EXPERIMENTS_DIR = "SATLAB_EXPERIMENTS_DIR"
PRESET_SUFFIX = ".yaml"
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

FOLDER_BASE = "_base"
"""The file of a folder that makes presets per architecture (:data:`ARCH_FOLDERS`)."""
TINY_DIR = "tiny"
PAPER_DIR = "paper"
PAPER = "SATFormer, arXiv 2605.03953"
PAPER_ARCHS = ("transformer", "resformer", "satformer", "denseformer", "hyperconnections", "muddformer")
"""The architectures the paper compared: their presets reproduce its runs; the registry's others came after it."""
PAPER_XL_ARCHS = ("transformer", "resformer", "satformer")
"""The paper's xl runs: it has no dense baselines at xl."""


def _tiny_description(folder: str, arch: str, setting: str) -> str:
    return f"tiny {ARCH_SPECS[arch].label} on {setting}"


def _paper_description(folder: str, arch: str, setting: str) -> str:
    """Whether ``paper/<size>/<arch>`` reproduces one of the paper's runs, or adds a baseline it did not run."""
    size, label = folder.rpartition("/")[2], ARCH_SPECS[arch].label
    if arch in PAPER_ARCHS:
        return f"reproduces the paper's {size} {label} run ({PAPER}): {setting}"
    return (f"the paper's {size} setting with a baseline the paper did not run, {label} (docs/architectures.md): "
            f"{setting}")


@dataclasses.dataclass(frozen=True)
class ArchFolders:
    """Folders whose ``_base.yaml`` makes a preset per architecture: ``<folder>/<arch>`` is no file but the
    folder's ``_base`` with ``model.arch=<arch>``, ``name=<folder>-<arch>`` (``/`` as ``-``) and a description
    (:func:`generated_preset`), so the architectures of one folder are matched in everything else by construction.
    A file ``<folder>/<arch>.yaml`` still wins over the generated preset."""

    glob: str
    """The folders, relative to the experiments folder: ``tiny``, ``paper/*``; those with a ``_base.yaml`` count."""
    describe: Callable[[str, str, str], str]
    """(folder, arch, the ``_base``'s own description) -> the preset's description."""
    only: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Folders made for these architectures only; any other is made for every registered one."""

    def archs(self, folder: str) -> list[str]:
        """The architectures of ``<folder>/<arch>``, in registry order."""
        only = self.only.get(folder)
        return [arch for arch in ARCH_SPECS if only is None or arch in only]


ARCH_FOLDERS = (
    ArchFolders(TINY_DIR, _tiny_description),
    ArchFolders(f"{PAPER_DIR}/*", _paper_description, {f"{PAPER_DIR}/xl": PAPER_XL_ARCHS}),
)
"""Which folders make which presets per architecture: ``tiny/<arch>`` and ``paper/<size>/<arch>`` for every
registered architecture, except ``paper/xl`` for the paper's xl runs only."""


class GeneratedPreset(typing.NamedTuple):
    """``<folder>/<arch>`` of :data:`ARCH_FOLDERS`: the folder's ``_base.yaml``, and what to add to it."""

    base_file: Path
    folder: str
    arch: str
    family: ArchFolders


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
    generated ``<folder>/<arch>`` (:data:`ARCH_FOLDERS`)."""
    root = Path(experiments_dir) if experiments_dir is not None else default_experiments_dir()
    files = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob(f"*{PRESET_SUFFIX}")}
    generated = {f"{folder}/{arch}" for folder, family in arch_folders(root).items() for arch in family.archs(folder)}
    return sorted(files | generated)


def arch_folders(root: Path) -> dict[str, ArchFolders]:
    """The folders under the experiments folder ``root`` that make presets per architecture (``tiny``,
    ``paper/small``, ...: those of :data:`ARCH_FOLDERS` with a ``_base.yaml``), each with its entry there."""
    base = f"{FOLDER_BASE}{PRESET_SUFFIX}"
    return {path.parent.relative_to(root).as_posix(): family for family in ARCH_FOLDERS
            for path in sorted(root.glob(f"{family.glob}/{base}")) if path.is_file()}


def generated_preset(path: Path, root: Path) -> GeneratedPreset | None:
    """What ``path`` holds when it is ``<root>/<folder>/<arch>.yaml`` of a generated preset: no such file, a folder
    of :func:`arch_folders` and one of its architectures; else None."""
    try:
        relative = path.resolve().relative_to(root.resolve())
    except (ValueError, OSError, RuntimeError):  # elsewhere, or a symbolic link loop (an error for the reader to say)
        return None
    folder, arch = relative.parent.as_posix(), relative.name.removesuffix(PRESET_SUFFIX)
    family = arch_folders(root).get(folder)
    if family is None or relative.suffix != PRESET_SUFFIX or arch not in family.archs(folder) or path.is_file():
        return None
    return GeneratedPreset(root / folder / f"{FOLDER_BASE}{PRESET_SUFFIX}", folder, arch, family)


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


def _is_preset(path: Path, root: Path) -> bool:
    return path.is_file() or generated_preset(path, root) is not None


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
    of a path (``./x.yaml``, ``/abs/x.yaml``, ``../x``: see :func:`~satlab.config.specs.user_path`). For a generated
    preset (``tiny/satformer``, ``paper/small/satformer``) that file is not on disk: :func:`generated_preset` says
    what it holds."""
    root = default_experiments_dir() if root is None else root
    if not str(experiment).strip():
        raise ConfigError("the experiment is empty: give a preset name (default, tiny/satformer, ...) or the path of "
                          "a YAML file (./my.yaml)")
    if (as_path := user_path(experiment)) is not None:
        generated = generated_preset(as_path, root) is not None  # a trial file's base: /abs/.../paper/small/x.yaml
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
    """The message for a preset name that is not one: in a folder of :func:`arch_folders`, that folder's presets (and
    where its family, such as the paper's sizes, has the architecture asked for), else every preset."""
    folder, _, arch = name.removesuffix(PRESET_SUFFIX).rpartition("/")
    folders = arch_folders(root)
    if folder not in folders:
        return unknown_name(kind, name, list_experiments(root))
    family, archs = folders[folder], folders[folder].archs(folder)
    which = "every architecture" if len(archs) == len(ARCH_SPECS) else f"{', '.join(archs)} only"
    elsewhere = [f"{other}/{arch}" for other, f in folders.items() if f is family and arch in f.archs(other)]
    return (unknown_name(kind, name, [f"{folder}/{a}" for a in archs])
            + f" ({folder}/<arch> is {folder}/{FOLDER_BASE} with model.arch=<arch>, for {which}"
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
        if (generated := generated_preset(current, root)) is not None:
            layers.append(_generated_layer(generated))
            current = generated.base_file
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
        problems.append(f"{short_path(child)}: 'base' must be a preset name or a relative path, got {shown(base)}")
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
