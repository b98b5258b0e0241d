"""A name or a path -> a file: the one place that finds what a user names on a command line or in a file.

Three kinds of file are named (:data:`KINDS`): experiment presets (``satlab train experiment=tiny/satformer``, a
spec's ``base:``, a preset's ``base:``), sweep specs (``satlab sweep lr_tiny``) and ablation specs (``satlab ablate
arch_tiny``, ``satlab report arch_tiny``, an ablation's ``compare_with:``). Each is either a *name*, looked up inside
its kind's folder only, or a *path* (:func:`user_path`: ``./x.yaml``, ``/abs/x.yml``, ``~/x.yaml``,
``configs/x.yaml``). A name that is not one, a missing path, a folder or a file of another kind is a
:class:`ConfigError` that says which names are valid (cut to a readable length) or which command the file is for.

Experiment presets include generated ones: ``<folder>/<arch>`` of :data:`ARCH_FOLDERS` is no file but the folder's
``_base.yaml`` with ``model.arch=<arch>`` (what that adds, :mod:`satlab.config.loader` builds).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ConfigError, did_you_mean, listing, quoted, shown, unknown_name
from satlab.config.schema import ExperimentConfig
from satlab.config.specs import read_mapping, short_path

ENV_EXPERIMENTS_DIR = "SATLAB_EXPERIMENTS_DIR"
ENV_SWEEPS_DIR = "SATLAB_SWEEPS_DIR"
PRESET_SUFFIX = ".yaml"
YAML_SUFFIXES = (".yaml", ".yml")
PATH_PREFIXES = ("/", "./", "../", "~")
"""What makes a name a path: ``/abs/x``, ``./x``, ``../x``, ``~/x``, or a YAML suffix (``configs/x.yaml``)."""
REPO_DIR = Path(__file__).resolve().parents[2]
"""The repository of a source checkout (an installed package has no ``experiments/`` or ``sweeps/`` beside it)."""

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
    if not is_preset(path, root):
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


def is_preset(path: Path, root: Path) -> bool:
    return path.is_file() or generated_preset(path, root) is not None

def default_experiments_dir() -> Path:
    """``$SATLAB_EXPERIMENTS_DIR``, else the repository's ``experiments/`` (found from the package, so any cwd
    works), else ``./experiments`` for an installed package."""
    return _project_folder(ENV_EXPERIMENTS_DIR, "experiments")


def default_sweeps_dir() -> Path:
    """``$SATLAB_SWEEPS_DIR``, else the repository's ``sweeps/``, else ``./sweeps`` for an installed package."""
    return _project_folder(ENV_SWEEPS_DIR, "sweeps")


def _project_folder(variable: str, name: str) -> Path:
    if os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    return REPO_DIR / name if (REPO_DIR / name).is_dir() else Path.cwd() / name


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of file a user names: where its names are looked up, and how to tell its files from the others'."""

    name: str
    """``experiment``, ``sweep`` or ``ablation``: the key of :data:`KINDS`."""
    noun: str
    """What it is called in messages: ``experiment preset``, ``sweep spec``."""
    suffix: str
    """The suffix of its files in its folder (a name is given without it)."""
    folder: Callable[[], Path]
    """Its folder (read when asked, so the environment variables may change in between)."""
    variable: str
    """The environment variable that moves its folder."""
    command: str
    """The command that runs such a file."""
    marks: tuple[str, ...]
    """Top-level keys only this kind's files have: a file with another kind's marks and none of these is that
    kind's (``satlab ablate sweeps/lr_tiny.yaml``), which is said instead of its keys being called unknown."""


_SHARED = ("name", "description", "base")
KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind("experiment", "experiment preset", PRESET_SUFFIX, default_experiments_dir, ENV_EXPERIMENTS_DIR,
         "satlab train experiment=",
         tuple(f.name for f in dataclasses.fields(ExperimentConfig) if f.name not in _SHARED)),
    Kind("sweep", "sweep spec", ".yaml", default_sweeps_dir, ENV_SWEEPS_DIR, "satlab sweep ",
         ("space", "objective", "n_trials", "sampler", "pruner", "enqueue")),
    Kind("ablation", "ablation spec", ".yml", lambda: default_experiments_dir() / "ablations", ENV_EXPERIMENTS_DIR,
         "satlab ablate ",
         ("axes", "baseline", "seed_key", "compare_with")),
)}
"""Experiment presets, sweep specs and ablation specs. A test checks the spec kinds' marks against the spec
classes' fields (:mod:`satlab.studies.spec` is above this package)."""


def folder(kind: str) -> Path:
    """Where names of ``kind`` (a key of :data:`KINDS`) are looked up."""
    return KINDS[kind].folder()


def user_path(name_or_path: str | Path) -> Path | None:
    """The path of a file a user names as one (see :data:`PATH_PREFIXES`; any :class:`Path`), else None: a name,
    which is looked up inside its kind's folder only (:func:`named_file`)."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.startswith(PATH_PREFIXES) or Path(text).suffix in YAML_SUFFIXES:
        return Path(text).expanduser()
    return None


def resolve(kind: str, name_or_path: str | Path, root: Path | None = None) -> Path:
    """The file of a name or a path of ``kind`` (a key of :data:`KINDS`); ``root`` instead of the kind's folder.
    For a generated experiment preset (``tiny/satformer``) that file is not on disk: :func:`generated_preset` says
    what it holds. Anything that is not a file of the kind is a :class:`ConfigError` (see the module)."""
    spec = KINDS[kind]
    root = folder(kind) if root is None else root
    if not str(name_or_path).strip():
        raise ConfigError(f"the {kind} is empty: give {_a(spec.noun)} name ({_some_names(kind, root)}) or the "
                          "path of a YAML file (./my.yaml)")
    if (as_path := user_path(name_or_path)) is not None:
        if kind == "experiment" and generated_preset(as_path, root) is not None:  # a trial file's base
            return as_path
        return existing(as_path, spec.noun, str(name_or_path))
    path = named_file(root, str(name_or_path), spec.suffix, spec.noun)
    if (path.is_file() if kind != "experiment" else is_preset(path, root)):
        return path
    raise ConfigError(unknown(kind, str(name_or_path), root))


def find(kind: str, name_or_path: str | Path, root: Path | None = None) -> Path | None:
    """:func:`resolve`, or None for a name that is no file of ``kind``'s folder (a path must still exist), for a
    caller that looks for the name elsewhere next (``satlab report``: the ablation's record)."""
    root = folder(kind) if root is None else root
    if user_path(name_or_path) is None:
        path = named_file(root, str(name_or_path), KINDS[kind].suffix, KINDS[kind].noun)
        if not (path.is_file() if kind != "experiment" else is_preset(path, root)):
            return None
    return resolve(kind, name_or_path, root)


def names(kind: str, root: Path | None = None) -> list[str]:
    """The names of ``kind`` in its folder (or ``root``): every preset (:func:`list_experiments`), or the specs'
    files ending in its suffix, without it; none if the folder is missing."""
    root = folder(kind) if root is None else root
    if kind == "experiment":
        return list_experiments(root)
    suffix = KINDS[kind].suffix
    return sorted(p.stem for p in root.glob(f"*{suffix}") if p.is_file()) if root.is_dir() else []


def unknown(kind: str, name: str, root: Path) -> str:
    """The message for a name of ``kind`` that is no file in ``root``: a folder there lists what it holds; an
    experiment preset in a folder of :func:`arch_folders` lists that folder's presets; else the valid names."""
    spec = KINDS[kind]
    if name.strip("/") and (root / name).is_dir():
        inside = [n.removeprefix(f"{name.strip('/')}/") for n in names(kind, root)
                  if n.startswith(f"{name.strip('/')}/")]
        example = next((n for n in inside if not n.startswith("_")), inside[0] if inside else "")
        return (f"{spec.noun} {quoted(name)} is a folder{f' of {spec.noun}s' if inside else ''} in {root}, not one "
                f"{spec.noun}: " + (f"name one of its files, e.g. {name.strip('/')}/{example} (it holds "
                                    f"{listing(inside)})" if inside else f"it holds no {spec.suffix} file"))
    if not names(kind, root):
        return (f"unknown {spec.noun} {quoted(name)}: there are none in {root} (set ${spec.variable}?); or give the "
                "path of a YAML file (./my.yaml)")
    if kind == "experiment":
        return _unknown_preset(spec.noun, name, root) + f" (presets in {root})"
    return unknown_name(spec.noun, name, names(kind, root)) + f" (specs in {root})"


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _some_names(kind: str, root: Path) -> str:
    return listing(names(kind, root), 3) or f"none in {root}"


def existing(path: Path, noun: str, given: str) -> Path:
    """``path`` when it is a file (what else may be wrong with it, :func:`read_mapping` says), else a ConfigError:
    not found, a folder (with the YAML files in it), a symbolic link loop, no permission."""
    try:
        if path.is_dir():
            inside = sorted(p.name for p in path.glob("*") if p.suffix in YAML_SUFFIXES)
            raise ConfigError(f"{noun} {quoted(given)} is a folder, not a YAML file"
                              + (f": name one of its files ({listing(inside)})" if inside else
                                 " (it holds no .yaml or .yml file)"))
        path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{noun} file not found: {quoted(given)}") from None
    except OSError as e:
        raise ConfigError(f"{noun} file {quoted(given)}: cannot read it: {e.strerror or e}") from None
    return path


def named_file(root: Path, name: str, suffix: str, noun: str) -> Path:
    """``<root>/<name><suffix>``, refused when the name climbs out of ``root`` (``../../etc/passwd``): names are
    looked up inside the kind's folder only; a file elsewhere is given as a path."""
    relative = os.path.normpath(name)
    if relative == ".." or relative.startswith(("../", "/")):
        raise ConfigError(f"{noun} name {quoted(name)} leaves {root}: names are looked up inside that folder only; "
                          "give a file elsewhere as a path to it (./x.yaml, /abs/path/x.yaml)")
    return root / f"{name}{suffix}"


def read_file(kind: str, path: Path, label: str | None = None,
              known: Collection[str] | None = None) -> dict[str, Any]:
    """A file of ``kind`` as a plain dict (:func:`~satlab.config.specs.read_mapping`; ``known``: its top-level
    keys). A file of another kind (its keys are another kind's :attr:`Kind.marks` and none of this one's) is refused
    with what it is and the command that runs it."""
    spec, label = KINDS[kind], str(path) if label is None else label
    data = read_mapping(path, label, spec.noun)
    keys = set(data)
    if not keys & set(spec.marks):
        for other in KINDS.values():
            if other is not spec and (theirs := sorted(keys & set(other.marks))):
                raise ConfigError(f"{label} is {_a(other.noun)} (it has {', '.join(theirs[:4])}), not "
                                  f"{_a(spec.noun)}: run it with {other.command}{short_path(path)}")
    if known is not None and data and not keys & set(known):
        raise ConfigError(f"{label} is not a satlab {spec.noun}: none of its {len(data)} top-level key(s) is one of "
                          f"{', '.join(known)}")
    return data


def read_spec(kind: str, name_or_path: str | Path, known: Collection[str] | None = None,
              root: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """(file, plain dict) of a sweep or ablation spec's name or file (:func:`resolve`, :func:`read_file`); ``name``
    defaults to the file's stem."""
    path = resolve(kind, name_or_path, root)
    data = read_file(kind, path, known=known)
    data.setdefault("name", path.stem)
    return path, data


def base_path(base: Any, child: Path, root: Path, problems: list[str]) -> Path | None:
    """A preset's ``base:``: ``./x`` and ``../x`` relative to the file that names it, a bare name a preset under
    ``root``; a problem (appended) and None when it is neither."""
    if not isinstance(base, str) or not base:
        problems.append(f"{short_path(child)}: 'base' must be a preset name or a relative path, got {shown(base)}")
        return None
    name = base if base.endswith(YAML_SUFFIXES) else f"{base}{PRESET_SUFFIX}"
    relative = base.startswith(("./", "../")) or Path(base).is_absolute()
    try:
        path = (child.parent / name) if relative else named_file(root, name, "", "base preset")
    except ConfigError as e:
        problems.append(f"{short_path(child)}: {e}")
        return None
    if not is_preset(path, root):
        problems.append(f"{short_path(child)}: base {_unknown_preset('preset', base, root)} (looked for {path})")
        return None
    return path


def _unknown_preset(kind: str, name: str, root: Path) -> str:
    """The message for a preset name that is not one: in a folder of :func:`arch_folders`, that folder's presets (and
    where its family, such as the paper's sizes, has the architecture asked for), else every preset."""
    folder, _, arch = name.removesuffix(PRESET_SUFFIX).rpartition("/")
    folders = arch_folders(root)
    if folder not in folders:
        every = list_experiments(root)
        generated = {f"{f}/{a}" for f, family in folders.items() for a in family.archs(f)}
        shown_names = sorted({n for n in every if n not in generated} | {f"{f}/<arch>" for f in folders})
        archs = f" (<arch>: {', '.join(ARCH_SPECS)})" if folders else ""
        return f"unknown {kind} {quoted(name)}{did_you_mean(name, every)}; valid: {listing(shown_names)}{archs}"
    family, archs = folders[folder], folders[folder].archs(folder)
    which = "every architecture" if len(archs) == len(ARCH_SPECS) else f"{', '.join(archs)} only"
    elsewhere = [f"{other}/{arch}" for other, f in folders.items() if f is family and arch in f.archs(other)]
    return (unknown_name(kind, name, [f"{folder}/{a}" for a in archs])
            + f" ({folder}/<arch> is {folder}/{FOLDER_BASE} with model.arch=<arch>, for {which}"
            + (f"; {arch} is at {', '.join(elsewhere)}" if elsewhere else "") + ")")
