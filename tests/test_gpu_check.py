"""The GPU check (scripts/gpu_check.sh, docs/gpu-check.md) run on this CPU, so that it cannot rot between the days
someone has a GPU: every step it runs there runs here at tiny shapes and must pass. Also what ``train.precision:
auto`` means on each kind of machine, and the wheelhouse that carries satlab to the GPU image."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from satlab.config.loader import load_experiment
from satlab.config.schema import ExperimentConfig
from satlab.training.machine import auto_precision, resolve_precision

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["setup", "bench", "train", "resume", "one-rank", "sharded", "transfer"]
"""Every step of the check, in its order; on the CPU none is skipped (the sharded one runs on 2 gloo ranks; the
transfer step gets a preset the test writes)."""


FAST_ARCHS = "satformer"
"""The fast suite runs the script's steps for one architecture (a gated value path): what this test guards is the
script, every step of it. ``make test-full`` adds hyperconnections (a depth-mixing stream with its hand-written
fast path). Every architecture compiled at the paper's depth is tests/test_compile.py; every one sharded on two
ranks, tests/test_sharding.py."""


def transferred_preset(folder: Path) -> Path:
    """A preset as `satlab transfer` writes one: the paper's small SATFormer at a transferred learning rate."""
    path = folder / "small-satformer-completep.yaml"
    path.write_text("base: paper/small/satformer\nmodel: {parametrization: completep, base_width: 64, base_depth: 2}\n"
                    "optim: {lr: 0.004}\n")
    return path


@pytest.mark.process
@pytest.mark.parametrize(("archs", "steps"), [
    (FAST_ARCHS, ["setup", "transfer"]),  # the fast suite: the wiring, the summary, the first step (~10 s), a SKIP
    pytest.param(FAST_ARCHS, STEPS, marks=pytest.mark.slow),  # make test-full: every step (~2 min)
    pytest.param("satformer,hyperconnections", STEPS, marks=pytest.mark.slow)])
def test_the_gpu_check_passes_every_step_on_the_cpu(tmp_path: Path, archs: str, steps: list[str]) -> None:
    out = tmp_path / "gpu_check"
    env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "GPU_CHECK_BREAK", "DEEP_ARCHS")}
    full = steps == STEPS  # the fast run has no transferred preset: its transfer step must say so and skip
    env.update(DEVICE="cpu", OUT=str(out), VENV=str(Path(sys.executable).parent.parent), ARCHS=archs,
               STEPS=" ".join(steps), TRANSFER_SLACK="100", TRANSFER_STEPS="2",
               TRANSFER_PRESET=str(transferred_preset(tmp_path) if full else tmp_path / "none.yaml"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=1200)
    printed = proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    rows = dict(re.findall(r"^\| (\S+) \| (PASS|FAIL|SKIP) \|", summary, re.MULTILINE))
    assert list(rows) == steps, f"the summary must list every step once, in order:\n{summary}\n{printed}"
    failed = [step for step, result in rows.items() if result != ("PASS" if full or step != "transfer" else "SKIP")]
    assert not failed, f"steps that did not pass: {failed} (logs in {out / 'logs'})\n{printed}"
    transfer = (out / "logs" / "transfer.log").read_text()
    assert ("3/3 runs passed" in transfer and "transferred LR holds" in transfer) if full else \
        "no transferred preset" in transfer
    assert proc.returncode == 0, printed
    for step in steps:
        assert (out / "logs" / f"{step}.log").is_file()


def test_the_transfer_verdict_holds_when_the_transferred_rate_is_within_the_slack_of_the_best():
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check_runs import TRANSFER_SLACK, transfer_verdict

    assert transfer_verdict({0.5: 3.2, 1.0: 3.1, 2.0: 3.3})[0]
    assert transfer_verdict({0.5: 3.2, 1.0: 3.1 + TRANSFER_SLACK, 2.0: 3.1})[0]  # within the slack of 2x
    passed, note = transfer_verdict({0.5: 3.2, 1.0: 3.15, 2.0: 3.1})
    assert not passed and "does NOT hold" in note and "best 2x" in note
    assert transfer_verdict({0.5: 3.2, 1.0: None, 2.0: 3.1}) == (False, "no val/loss at 1x")


def test_precision_auto_is_the_default_and_a_valid_choice() -> None:
    assert ExperimentConfig().train.precision == "auto"
    assert load_experiment("default", ["train.precision=auto"]).train.precision == "auto"
    assert load_experiment("default").train.precision == "32-true"  # the CPU preset says so itself


@pytest.mark.parametrize(("cuda", "bf16", "accelerator", "expected"), [
    (False, False, "auto", "32-true"),        # a CPU machine
    (True, True, "auto", "bf16-mixed"),       # an A100/H100/H200
    (True, True, "gpu", "bf16-mixed"),
    (True, True, "cpu", "32-true"),           # a GPU machine asked to train on its CPU
    (True, False, "auto", "32-true"),         # a GPU without bf16 arithmetic (V100, T4) would only emulate it
    (False, False, "gpu", "32-true"),         # Lightning itself reports the missing GPU
])
def test_auto_resolves_to_what_the_machine_computes_fast(monkeypatch: pytest.MonkeyPatch, cuda: bool, bf16: bool,
                                                         accelerator: str, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    assert auto_precision(accelerator) == expected
    cfg = load_experiment("default", ["train.precision=auto", f"train.accelerator={accelerator}"])
    assert resolve_precision(cfg).train.precision == expected
    explicit = load_experiment("default", ["train.precision=16-mixed", f"train.accelerator={accelerator}"])
    assert resolve_precision(explicit) is explicit


@pytest.mark.process
def test_the_wheelhouse_carries_what_the_gpu_image_lacks_and_never_its_cuda_stack() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), "--list"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    carried = {line.split("==")[0] for line in proc.stdout.splitlines() if "==" in line and not line.startswith("#")}
    assert {"omegaconf", "optuna", "datasets", "lm-eval", "mlflow-skinny", "sqlalchemy", "alembic"} <= carried
    assert not {name for name in carried if re.match(r"torch|triton|nvidia-|lightning|numpy|pandas", name)}
    assert "# left out mlflow:" in proc.stdout


def test_the_transfer_step_looks_where_satlab_transfer_writes_by_default() -> None:
    """The step's default preset is the file `satlab transfer --target paper/small/satformer` writes under
    completep (a target that resolves to one preset), so a finished study feeds the GPU check without a variable."""
    from satlab.cli.transfer import default_out
    from satlab.config.loader import load_experiment
    from satlab.config.resolve import resolve

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    default = re.search(r"\$\{TRANSFER_PRESET:-([^}]+)\}", script)
    assert load_experiment(resolve("experiment", "paper/small/satformer")).model.arch == "satformer"  # a real target
    assert default is not None and default.group(1) == str(default_out("paper/small/satformer", "satformer",
                                                                       "completep"))
