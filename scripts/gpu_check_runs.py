"""The training runs of scripts/gpu_check.sh and the checks of what they wrote.

    python scripts/gpu_check_runs.py train PREFIX RUNS EXPECT_PRECISION key=value ...
    python scripts/gpu_check_runs.py resumed RUN_DIR MLFLOW_DB STEPS_BEFORE STEPS_AFTER
    python scripts/gpu_check_runs.py transfer PRESET EXPECT_PRECISION key=value ...

``train`` runs `satlab train` (the console script's own entry point, ``satlab.cli.main.main``) once per item of
the comma-separated RUNS (an architecture, or ``arch+key=value+...`` with overrides of its own), all in this one
process, as name PREFIX-<arch>[-<value>...]: the Lightning and MLflow
imports are paid once, and every architecture compiles in one process, as the bench does. One architecture's
failure is reported and the next one runs. Under a multi-device strategy Lightning starts the other ranks by running
this same command again; they run the same loop. Each finished run must have recorded EXPECT_PRECISION (the value
``train.precision=auto`` resolves to on this machine) in its config.yaml and its MLflow params. Ends with one
``note:`` line, which gpu_check.sh puts in its summary, and exit code 1 if any architecture failed.

``resumed`` checks that RUN_DIR, trained to STEPS_BEFORE steps and run again with a larger budget, continued its
checkpoint rather than starting over: one MLflow run of that name, the same run id as before, FINISHED, validated at
STEPS_AFTER, the offline evaluation suite's averages logged, and Lightning's log says it restored the checkpoint.
Reads the sqlite store directly (no MLflow import).

``transfer`` trains the preset written by ``satlab transfer`` (a target size at the learning rate an LR-transfer study
found at its base shape) at that learning rate and at 0.5x and 2x, with the same overrides, and passes when the
transferred rate's final validation loss is within :data:`TRANSFER_SLACK` of the best of the three (fixed before any
GPU run): the transferred rate is at least as good as its neighbours an octave away, at this horizon.
"""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the working tree's satlab, also where a wheel of it is installed (the GPU venv)


def rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def say(text: str) -> None:
    if rank_zero():
        print(text, flush=True)


def override(overrides: list[str], key: str, default: str) -> str:
    values = [item.split("=", 1)[1] for item in overrides if item.startswith(f"{key}=")]
    return values[-1] if values else default


def recorded_precision(run_dir: Path) -> str | None:
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text())["train"]["precision"] if path.exists() else None


def precision_problem(name: str, overrides: list[str], expected: str) -> str | None:
    """What is wrong with the precision the run recorded (config.yaml, and the MLflow param in a sqlite store)."""
    precision = recorded_precision(Path(override(overrides, "train.out_dir", "runs")) / name)
    if precision != expected:
        return f"config.yaml records train.precision={precision}, expected {expected}"
    uri = override(overrides, "tracking.uri", "")
    if uri.startswith("sqlite:///"):
        with sqlite3.connect(f"file:{uri.removeprefix('sqlite:///')}?mode=ro", uri=True) as store:
            params = store.execute("select p.value from params p join runs r on r.run_uuid = p.run_uuid "
                                   "where r.name = ? and p.key = 'train.precision'", (name,)).fetchall()
        if [value for (value,) in params] != [expected]:
            return f"MLflow param train.precision of {name}: {params}, expected [{expected!r}]"
    return None


def free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train(prefix: str, runs: list[str], expect_precision: str, overrides: list[str]) -> int:
    """One run per item of ``runs``: an architecture, optionally with ``+key=value`` overrides of its own
    (``satformer+train.strategy=ddp``), named PREFIX-<arch>[-<value>...]."""
    from satlab.cli.main import main

    rows = []
    for item in runs:
        arch, *own = item.split("+")
        name = "-".join([prefix, arch, *(o.split("=", 1)[1] for o in own)])
        args = [f"name={name}", f"model.arch={arch}", *overrides, *own]
        say(f"--- {name}: satlab train --no-progress {' '.join(args)}")
        started = time.perf_counter()
        problem = None
        try:
            code = main(["train", "--no-progress", *args])
            problem = None if code == 0 else f"satlab train exited with {code}"
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # one architecture's failure must not stop the others
            traceback.print_exc()
            problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        if problem is None and rank_zero():
            problem = precision_problem(name, overrides, expect_precision)
        seconds = time.perf_counter() - started
        rows.append((name.removeprefix(f"{prefix}-"), problem, seconds))
        say(f"--- {name}: {'PASS' if problem is None else 'FAIL: ' + problem} ({seconds:.1f} s)")
        free_memory()
    failed = [arch for arch, problem, _ in rows if problem is not None]
    say("\nrun                         result  seconds")
    for label, problem, seconds in rows:
        result = "PASS" if problem is None else "FAIL"
        say(f"{label:26s}  {result:6s}  {seconds:7.1f}" + (f"  {problem}" if problem else ""))
    say(f"note: {len(rows) - len(failed)}/{len(rows)} runs passed" +
        (f"; failed: {', '.join(failed)}" if failed else f", precision {expect_precision}"))
    return 1 if failed else 0


def resumed(run_dir: Path, db: Path, steps_before: int, steps_after: int) -> int:
    problems = []
    name = run_dir.name
    info = json.loads((run_dir / "run.json").read_text())
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as store:
        runs = store.execute("select run_uuid, status from runs where name = ?", (name,)).fetchall()
        if len(runs) != 1:
            problems.append(f"{len(runs)} MLflow runs named {name}, expected one continued run")
        else:
            run_id, status = runs[0]
            if run_id != info["mlflow_run_id"]:
                problems.append(f"MLflow run {run_id} is not the first run's {info['mlflow_run_id']}")
            if status != "FINISHED":
                problems.append(f"MLflow run {run_id} is {status}, expected FINISHED")
            steps = sorted(s for (s,) in store.execute(
                "select distinct step from metrics where run_uuid = ? and key = 'val/loss'", (run_id,)))
            # each end's validation is logged once: at its last step, or one before when the fit validated there
            # (Lightning logs a validation inside fit at the step counter of the batch it followed)
            ends = [end for end in (steps_before, steps_after) if not {end - 1, end} & set(steps)]
            if ends:
                problems.append(f"val/loss logged at steps {steps}, expected the ends of the first run "
                                f"({steps_before - 1} or {steps_before}) and of the resumed one ({steps_after - 1} "
                                f"or {steps_after})")
            evaluated = store.execute("select count(*) from metrics where run_uuid = ? and key in "
                                      "('zero_shot/offline_zero_shot_avg', 'zero_shot/offline_retrieval_avg')",
                                      (run_id,)).fetchone()[0]
            if not evaluated:
                problems.append("no zero_shot/offline_*_avg metrics: the evaluation at the end did not log")
    log = (run_dir / "train.log").read_text(errors="replace") if (run_dir / "train.log").exists() else ""
    if "Restored all states from the checkpoint" not in log:
        problems.append(f"{run_dir / 'train.log'} has no 'Restored all states from the checkpoint' line")
    for problem in problems:
        print(f"resume check: {problem}")
    print(f"note: {'resumed' if not problems else 'NOT resumed'}: steps {steps_before} -> {steps_after}, one MLflow "
          f"run ({info['mlflow_run_id'][:8]}), offline suite evaluated")
    return 1 if problems else 0


TRANSFER_FACTORS = (0.5, 1.0, 2.0)
TRANSFER_SLACK = float(os.environ.get("TRANSFER_SLACK", "0.01"))
"""Nats: how far above the best of the three the transferred rate's final validation loss may be (seed noise of a
short run). The CPU test of the script's wiring sets it high: a few steps at tiny shapes say nothing of transfer."""


def final_val_loss(db: Path, name: str) -> float | None:
    """The last val/loss of the newest MLflow run named ``name`` in the sqlite store ``db``."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as store:
        row = store.execute("select m.value from metrics m join runs r on r.run_uuid = m.run_uuid where r.name = ? "
                            "and m.key = 'val/loss' order by r.start_time desc, m.step desc, m.timestamp desc "
                            "limit 1", (name,)).fetchone()
    return None if row is None else float(row[0])


def transfer_verdict(losses: dict[float, float | None]) -> tuple[bool, str]:
    """(passed, note) from the final validation loss at each factor of the transferred learning rate."""
    missing = [f for f, loss in losses.items() if loss is None]
    if missing:
        return False, f"no val/loss at {', '.join(f'{f:g}x' for f in missing)}"
    best = min(losses, key=lambda f: losses[f])
    shown = ", ".join(f"{f:g}x {loss:.4f}" for f, loss in losses.items())
    passed = losses[1.0] <= losses[best] + TRANSFER_SLACK
    return passed, (f"transferred LR {'holds' if passed else 'does NOT hold'}: final val/loss {shown} (best "
                    f"{best:g}x, slack {TRANSFER_SLACK} nats)")


def transfer(preset: Path, expect_precision: str, overrides: list[str]) -> int:
    import yaml

    from satlab.config.loader import load_experiment

    arch = load_experiment(str(preset)).model.arch
    lr = float(yaml.safe_load(preset.read_text())["optim"]["lr"])
    runs = [f"{arch}+optim.lr={lr * f:.6g}" for f in TRANSFER_FACTORS]  # named transfer-<arch>-<lr>
    code = train("transfer", runs, expect_precision, [f"experiment={preset}", *overrides])
    if not rank_zero():
        return code
    db = Path(override(overrides, "tracking.uri", "sqlite:///mlflow.db").removeprefix("sqlite:///"))
    losses = {f: final_val_loss(db, f"transfer-{arch}-{lr * f:.6g}") for f in TRANSFER_FACTORS}
    passed, note = transfer_verdict(losses)
    say(f"note: {note}")
    return 1 if code or not passed else 0


def main(argv: list[str]) -> int:
    usage = __doc__.split("\n\n")[1]
    if len(argv) >= 4 and argv[0] == "train":
        return train(argv[1], [a for a in argv[2].split(",") if a], argv[3], argv[4:])
    if len(argv) >= 3 and argv[0] == "transfer":
        return transfer(Path(argv[1]), argv[2], argv[3:])
    if len(argv) == 5 and argv[0] == "resumed":
        return resumed(Path(argv[1]), Path(argv[2]), int(argv[3]), int(argv[4]))
    print(f"usage:\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
