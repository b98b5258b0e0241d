"""Build (and check) a folder of wheels that installs satlab on the GPU image, which has no network.

The GPU machine's Python (CPython 3.12, Linux x86_64) already holds torch 2.11+cu130, Lightning, numpy, pandas and
about two hundred other packages (IMAGE_PACKAGES below). This script takes satlab's runtime requirements, walks
them through the distributions installed in the venv that runs it, evaluates their markers for the GPU machine's
Python, and keeps what the image lacks, at the versions this venv runs (the versions the test suite passed with).
It downloads those as CPython 3.12 manylinux wheels (pip download --no-deps --only-binary=:all:), builds a wheel
of any pure-Python dependency that PyPI only has as an sdist, adds a wheel of satlab itself, and checks the
result: every wheel installable on cp312 manylinux x86_64, every requirement of every wheel met by a wheel or by
the image (pip resolves satlab against the folder plus stand-ins of the image's packages), the total under the
carry limit. On the GPU machine:

    python3 -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/pip install --no-index --no-deps .whl/*.whl

(scripts/gpu_check.sh does that itself when .venv/bin/satlab is missing and .whl/ exists).

    python scripts/wheelhouse.py [--dest .whl] [--list] [--check-only]
"""

from __future__ import annotations

import argparse
import email
import re
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 60.0
"""The wheels travel with the working tree to the GPU machine, whose limit is 64 MiB for everything."""

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
"""pip matches a wheel's glibc tag exactly, so every tag up to the image's glibc (2.39; 2.28 is what torch needs)
that wheels of the carried packages use is named."""

TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
"""The GPU machine's Python, for requirement markers."""

NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")
"""The image's CUDA stack is what the check is about: never carried, whatever the versions."""

_IMAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
"""
IMAGE_PACKAGES = _IMAGE_LIST.split()
"""What the GPU image ('cuda') holds, as read on a machine running it on 2026-11-17 (the device's KINDS.md)."""

IMAGE_VERSIONS = {"numpy": "2.5.2", "tokenizers": "0.23.2", "torch": "2.11.0", "torchmetrics": "1.9.0",
                  "pytorch-lightning": "2.6.6", "lightning": "2.6.6", "huggingface-hub": "1.33.0",
                  "transformers": "5.17.0", "safetensors": "0.8.0", "accelerate": "1.15.0"}
"""The image's versions that a session read there; the others are taken to be this venv's for the check."""

LEAVE_OUT = {
    # mlflow proper is the tracking server and its web UI (a 25 MB wheel of JavaScript, plus Flask, gunicorn,
    # docker, graphene, huey, skops, cryptography): satlab logs through the client in mlflow-skinny (the same
    # `mlflow` package) into a sqlite store, which needs only SQLAlchemy and alembic besides. Browse the store with
    # `make ui` on a machine with the full install. (databricks-sdk, which only Databricks workspaces use, is carried:
    # `import mlflow` looks for `databricks.agents` and fails without the `databricks` package.)
    "mlflow": "server and web UI only; the client (mlflow-skinny, carried) writes the sqlite store",
    # lm-eval's own dependencies for metrics that the offline suite does not compute (BLEU/ROUGE/word-number
    # scoring and the `evaluate` metric hub); the check trains with eval.at_end=false, and satlab's tasks score
    # with acc/exact match. They are imported lazily by lm-eval.
    "rouge-score": "lm-eval's ROUGE metric (lazy import)",
    "word2number": "lm-eval's number parsing for some online tasks (lazy import)",
    "nltk": "rouge-score's tokenizer",
    "pytablewriter": "lm-eval's markdown tables (satlab prints its own)",
}
"""Dependencies not carried although the image lacks them, each because the check runs without it (gpu_check.sh
imports every module it runs on the GPU machine in its setup step, so a wrong entry fails there, loudly)."""

INSTEAD = {"mlflow": ["mlflow-skinny", "mlflow-tracing", "sqlalchemy", "alembic"]}
"""What is carried in place of a left-out distribution: mlflow's client and its sqlite store."""


def normalized(name: str) -> str:
    return canonicalize_name(name)


def requirements(dist: Distribution, extras: set[str]) -> list[Requirement]:
    """``dist``'s requirements that apply on the GPU machine's Python with ``extras`` asked for."""
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate(default_environment() | TARGET | {"extra": e})
                                     for e in (extras or {""})):
            out.append(req)
    return out


def closure(root: str = "satlab") -> tuple[dict[str, Distribution], list[str], dict[str, str]]:
    """(carried name -> installed distribution, requirements this venv cannot provide, left out name -> why)."""
    image = {normalized(n) for n in IMAGE_PACKAGES}
    carried: dict[str, Distribution] = {}
    missing: list[str] = []
    left_out: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, set[str]]] = [(root, set())]
    while todo:
        name, extras = todo.pop()
        key = normalized(name)
        if (key, frozenset(extras)) in seen:
            continue
        seen.add((key, frozenset(extras)))
        if key != root and (key in image or NEVER.match(key)):
            continue
        if key in LEAVE_OUT:
            left_out[key] = LEAVE_OUT[key]
            todo.extend((instead, set()) for instead in INSTEAD.get(key, []))
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            missing.append(name)
            continue
        if key != root:
            carried[key] = dist
        todo.extend((req.name, set(req.extras)) for req in requirements(dist, extras))
    return carried, sorted(set(missing)), left_out


def pip(*args: str) -> None:
    """pip, without the line per unreachable local index that this machine's pip config prints."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    noise = "WARNING: Location"
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.strip() and not line.startswith(noise):
            print(f"    pip: {line}")
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)


def download(carried: dict[str, Distribution], dest: Path) -> None:
    """cp312 manylinux wheels of the pinned versions; a pure-Python sdist-only one built into a wheel here."""
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    target = ["--python-version", "3.12", "--implementation", "cp", *platform_args]
    pins = [f"{name}=={dist.version}" for name, dist in sorted(carried.items())]
    sdist_only = []
    for pin in pins:  # one at a time: a failure names its package, and the others still come
        try:
            pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(dest), pin)
        except subprocess.CalledProcessError:
            sdist_only.append(pin)
    for pin in sdist_only:
        print(f"{pin}: no wheel on the index; building one from its sdist (must be pure Python)")
        pip("wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", str(dest), pin)
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(ROOT))


def supported_tags() -> set[Tag]:
    return set(cpython_tags((3, 12), platforms=PLATFORMS)) | set(compatible_tags((3, 12), "cp312", PLATFORMS))


def wheels(dest: Path) -> dict[str, Path]:
    return {normalized(parse_wheel_filename(w.name)[0]): w for w in sorted(dest.glob("*.whl"))}


def prune(dest: Path, keep: set[str]) -> None:
    """Stale wheels (another version, or a package no longer carried) go: two versions of one stop the install."""
    for wheel in sorted(dest.glob("*.whl")):
        name, version, *_ = parse_wheel_filename(wheel.name)
        key = normalized(name)
        if key not in keep or (key != "satlab" and version != Version(distribution(name).version)):
            print(f"removing {wheel.name} (not in the set)")
            wheel.unlink()


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name))


def check(dest: Path, carried: dict[str, Distribution]) -> list[str]:
    """Problems of the wheelhouse: wrong tags, missing or doubled wheels, a requirement neither the folder nor the
    image meets, pip failing to resolve satlab for the GPU machine's Python against the folder and the image."""
    problems = []
    found = wheels(dest)
    tags = supported_tags()
    counts: dict[str, int] = {}
    for wheel in dest.glob("*.whl"):
        name, _, _, wheel_tags = parse_wheel_filename(wheel.name)
        counts[normalized(name)] = counts.get(normalized(name), 0) + 1
        if not wheel_tags & tags:
            problems.append(f"{wheel.name}: no tag installable on CPython 3.12 manylinux x86_64")
    problems += [f"{n}: {c} wheels (one version each, or the install stops)" for n, c in counts.items() if c > 1]
    problems += [f"{n}: no wheel in {dest}" for n in [*carried, "satlab"] if n not in found]
    image = {normalized(n) for n in IMAGE_PACKAGES}
    for key, wheel in found.items():
        meta = metadata(wheel)
        for text in meta.get_all("Requires-Dist") or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(default_environment() | TARGET | {"extra": ""}):
                continue
            dep = normalized(req.name)
            if dep in found:
                version = parse_wheel_filename(found[dep].name)[1]
                if not req.specifier.contains(version, prereleases=True):
                    problems.append(f"{key} needs {req}, the folder has {dep} {version}")
            elif dep in image:
                known = IMAGE_VERSIONS.get(dep)
                if known and not req.specifier.contains(known, prereleases=True):
                    problems.append(f"{key} needs {req}, the image has {dep} {known}")
            elif dep not in LEAVE_OUT:
                problems.append(f"{key} needs {req}: neither in {dest} nor in the image")
    if not problems:
        problems += resolve_with_pip(dest, image)
    return problems


def resolve_with_pip(dest: Path, image: set[str]) -> list[str]:
    """pip's own resolution of satlab for the GPU machine's Python, from the folder plus empty stand-in wheels of
    the image's packages (at the versions known for the image, else this venv's) and of what LEAVE_OUT drops."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp) / "image"
        stubs.mkdir()
        for name in sorted(image | set(LEAVE_OUT)):
            try:
                version = IMAGE_VERSIONS.get(name) or distribution(name).version
            except PackageNotFoundError:
                version = "9999"  # not installed here: any version the folder's wheels ask for
            stub_wheel(stubs, name, version)
        platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index", "--find-links", str(dest),
             "--find-links", str(stubs), "--python-version", "3.12", "--implementation", "cp", *platform_args,
             "--only-binary=:all:", "--ignore-installed", "--target", str(Path(tmp) / "target"), "--report",
             str(Path(tmp) / "report.json"), "satlab", *sorted(wheels(dest))],
            capture_output=True, text=True)
        if proc.returncode != 0:
            return [f"pip could not resolve satlab from {dest} and the image:\n{proc.stderr[-3000:]}"]
        import json

        report = json.loads((Path(tmp) / "report.json").read_text())
        chosen = {normalized(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
        from_folder = {k for k, v in chosen.items() if k not in image and k not in LEAVE_OUT}
        print(f"pip resolves satlab and every wheel of the folder together for CPython 3.12 manylinux x86_64: "
              f"{len(chosen)} distributions, {len(from_folder)} from the folder, the rest from the image")
    return []


def stub_wheel(folder: Path, name: str, version: str) -> None:
    """An empty wheel that only says `name version` (a stand-in for a package the image has)."""
    dist = re.sub(r"[-_.]+", "_", name)
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        info = f"{dist}-{version}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def report(dest: Path) -> float:
    total = 0
    for wheel in sorted(dest.glob("*.whl"), key=lambda w: -w.stat().st_size):
        total += wheel.stat().st_size
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"  {total / 2**20:6.2f} MiB  in {len(list(dest.glob('*.whl')))} wheels ({dest})")
    return total / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"), help="the folder of wheels (default: .whl)")
    parser.add_argument("--list", action="store_true", help="print what would be carried, and why not the rest")
    parser.add_argument("--check-only", action="store_true", help="check an existing folder, download nothing")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    carried, missing, left_out = closure()
    if missing:
        print(f"wheelhouse: error: this venv lacks {', '.join(missing)}, which satlab needs on CPython 3.12; "
              "run `make setup` (or install them) first, then build the wheelhouse again", file=sys.stderr)
        return 2
    if args.list:
        for name, dist in sorted(carried.items()):
            print(f"{name}=={dist.version}")
        for name, why in sorted(left_out.items()):
            print(f"# left out {name}: {why}")
        return 0
    if not args.check_only:
        dest.mkdir(parents=True, exist_ok=True)
        prune(dest, set(carried) | {"satlab"})
        download(carried, dest)
    elif not dest.is_dir():
        print(f"wheelhouse: error: {dest} does not exist; build it with `make wheelhouse`", file=sys.stderr)
        return 2
    size = report(dest)
    problems = check(dest, carried)
    if size > LIMIT_MIB:
        problems.append(f"{size:.1f} MiB is over the {LIMIT_MIB:g} MiB that can travel with the working tree")
    for problem in problems:
        print(f"wheelhouse: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"wheelhouse ok: {dest} installs satlab on the GPU image ({size:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
