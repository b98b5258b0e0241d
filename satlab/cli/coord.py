"""`satlab coord`: the coordinate check of a parametrisation: how each module's output RMS scales with width and
depth over the first training steps, per architecture (``docs/coord-check.md``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from satlab.bench.coord_settings import (
    BATCH,
    DEFAULT_DEPTHS,
    DEFAULT_SEEDS,
    DEFAULT_STEPS,
    DEFAULT_WIDTHS,
    FIRST_CHECKED_STEP,
    HEAD_DIM,
    NOT_COMPARED,
    SEQ_LEN,
    CoordSettings,
    display_name,
    shapes,
)
from satlab.cli.numbers import number_list
from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ConfigError, shown, unknown_name
from satlab.config.model import SIZE_PRESETS
from satlab.console import console as make_console

MEASUREMENTS = "measurements"
"""The folder under ``--out`` where each model's measurement is kept as it finishes; a rerun with the same settings
reuses them, so a killed check resumes."""
MAX_SEQ_LEN = SIZE_PRESETS["tiny"]["max_seq_len"]
"""The longest sequence of the check: the context of the tiny preset, which every model of the check is built from."""
DEFAULTS = {"widths": ",".join(map(str, DEFAULT_WIDTHS)), "depths": ",".join(map(str, DEFAULT_DEPTHS))}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", default="all", help="comma-separated architectures (default: all ten)")
    parser.add_argument("--widths", default=DEFAULTS["widths"],
                        help=f"widths at the base depth (default {DEFAULTS['widths']}); multiples of --head-dim")
    parser.add_argument("--depths", default=DEFAULTS["depths"],
                        help=f"depths at the base width (default {DEFAULTS['depths']})")
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)),
                        help="comma-separated seeds; each RMS is their geometric mean (default: 0,1,2)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"AdamW steps (default {DEFAULT_STEPS})")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"sequences per batch (default {BATCH})")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN,
                        help=f"byte tokens per sequence (default {SEQ_LEN}, at most {MAX_SEQ_LEN})")
    parser.add_argument("--fresh-batches", action="store_true",
                        help="a new batch of the corpus at every step (as training and CompleteP's reference check "
                             "see them) instead of the one fixed batch")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM,
                        help=f"fixed head dim: heads = width / head dim (default {HEAD_DIM})")
    parser.add_argument("--parametrization", default=None,
                        help="passed on as the override model.parametrization=<value> (default: the config's, sp)")
    parser.add_argument("--reference", default=None, metavar="DIR",
                        help="measure CompleteP's reference implementation instead of satlab's models: DIR is a "
                             "checkout of EleutherAI/nanoGPT-mup at branch completep (its plain GPT-2 block, so "
                             "--archs transformer only; docs/coord-check.md)")
    parser.add_argument("--out", default="reports/coord", help="output folder (default: reports/coord)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not record an MLflow run")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the models it would build (sizes, parameters, estimated time) and stop")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="further config overrides for every model, e.g. optim.lr=1e-2")


def settings_of(args: argparse.Namespace) -> CoordSettings:
    """The check's settings from the command line, every shape's config built (so a bad override, or a
    parametrisation the config does not know, is refused before anything runs); raises ConfigError."""
    problems: list[str] = []
    reference = getattr(args, "reference", None)
    archs = list(ARCH_SPECS) if args.archs == "all" else [a.strip() for a in args.archs.split(",") if a.strip()]
    if reference is not None:
        archs = ["transformer"] if args.archs == "all" else archs
        if archs != ["transformer"]:
            problems.append(f"--reference measures the reference's plain Transformer only: leave --archs out or "
                            f"pass --archs transformer, got {shown(args.archs)}")
        if args.parametrization not in (None, "completep"):
            problems.append(f"--reference measures CompleteP's reference implementation: leave --parametrization "
                            f"out or pass completep, got {shown(args.parametrization)}")
        args.parametrization = "completep"
    problems += [unknown_name("architecture", a, ARCH_SPECS) for a in archs if a not in ARCH_SPECS]
    if not archs:
        problems.append(f"--archs names no architecture; valid: all or a list of {', '.join(ARCH_SPECS)}")
    if args.head_dim < 2 or args.head_dim % 2:
        problems.append(f"--head-dim must be an even integer >= 2 (RoPE rotates pairs), got {args.head_dim}")
    widths = sorted(set(number_list("--widths", args.widths, problems, example="64,128,256", at_least=2,
                                    multiple=max(2, args.head_dim), why="two for a slope, whole heads of --head-dim")))
    depths = sorted(set(number_list("--depths", args.depths, problems, example="2,4,8", at_least=2,
                                    why="a slope needs two")))
    seeds = number_list("--seeds", args.seeds, problems, example="0,1,2", low=0, distinct=True)
    if not FIRST_CHECKED_STEP <= args.steps <= 1000:
        problems.append(f"--steps must be in [{FIRST_CHECKED_STEP}, 1000] (the verdict reads steps "
                        f"{FIRST_CHECKED_STEP} on, and the check looks at the first steps), got {args.steps}")
    if args.batch < 1 or not 2 <= args.seq_len <= MAX_SEQ_LEN:
        problems.append(f"--batch must be >= 1 and --seq-len in [2, {MAX_SEQ_LEN}] (the models' context), got "
                        f"{args.batch} and {args.seq_len}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {shown(args.out)} is a file; it names the folder the check writes into")
    if problems:
        raise ConfigError(problems)
    from satlab.bench.coord import shape_config

    extra = [f"model.parametrization={args.parametrization}"] if args.parametrization is not None else []
    settings = CoordSettings(archs=archs, seeds=seeds, widths=widths, depths=depths, steps=args.steps,
                             overrides=[*extra, *args.overrides], head_dim=args.head_dim,
                             batch=args.batch, seq_len=args.seq_len, fresh_batches=args.fresh_batches)
    for shape in shapes(settings):
        shape_config(shape, settings)  # raises ConfigError with every problem of the overrides
    return settings


def implementation_of(args: argparse.Namespace, settings: CoordSettings):
    """Whose models the check measures: satlab's, or with ``--reference`` the reference's (ConfigError when the
    folder does not hold it)."""
    from satlab.bench.coord import SATLAB

    if args.reference is None:
        return SATLAB
    from satlab.bench.coord_reference import reference_implementation

    try:
        return reference_implementation(Path(args.reference), settings.head_dim, settings.seq_len)
    except ValueError as error:
        raise ConfigError([f"--reference {error}"]) from None


def run(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    implementation = implementation_of(args, settings)
    console = make_console()
    out = Path(args.out)
    if args.dry_run:
        from satlab.bench.coord import plan

        console.print(plan_table(plan(settings, out / MEASUREMENTS, implementation), settings, implementation.name))
        return 0
    from satlab.bench.coord import coord_check
    from satlab.bench.coord_report import log_to_mlflow, write_outputs

    report = coord_check(settings, progress=lambda line: console.print(line, highlight=False),
                         store=out / MEASUREMENTS, implementation=implementation)
    paths = write_outputs(report, out)
    console.print(verdict_table(report))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    if not args.no_mlflow:
        print(f"MLflow run {log_to_mlflow(report, paths)} in experiment 'coord'")
    return 0 if all(e["verdict"]["result"] == "PASS" for e in report["archs"].values()) else 1


def plan_table(rows: list[dict], settings: CoordSettings, implementation: str = "satlab") -> Table:
    total, kept = sum(r["estimated_seconds"] for r in rows), sum(r["kept"] for r in rows)
    reused = f", {kept} of {len(rows) * len(settings.seeds)} already measured in --out and reused" if kept else ""
    whose = "" if implementation == "satlab" else f" of {implementation}"
    table = Table(title=f"coordinate check plan{whose}: {len(rows)} models x {len(settings.seeds)} seed(s), "
                        f"{settings.steps} steps each on {'a new' if settings.fresh_batches else 'one fixed'} "
                        f"batch of "
                        f"{settings.batch} x {settings.seq_len} byte tokens, one CPU thread, fp32 "
                        f"(estimated {total / 60:.1f} min{reused})")
    for column in ("arch", "series", "width", "depth", "heads", "mlp", "params", "param.", "kept", "est. s"):
        table.add_column(column, justify="left" if column in ("arch", "series") else "right")
    for r in rows:
        table.add_row(r["arch"], r["series"], str(r["width"]), str(r["depth"]), str(r["heads"]),
                      str(r["mlp_hidden"]), f"{r['params'] / 1e6:.2f}M", r["parametrization"],
                      str(r["kept"]), f"{r['estimated_seconds']:.1f}")
    return table


def verdict_table(report: dict) -> Table:
    thresholds = report["thresholds"]
    table = Table(title=f"coordinate check ({report.get('parametrization', 'sp')}): the largest |slope| of log RMS "
                        f"from step {thresholds['first_checked_step']} on")
    for column in ("arch", "vs width (probe, step)", "vs depth (probe, step)", "rule", "result"):
        table.add_column(column, justify="left")
    for arch, entry in report["archs"].items():
        cells = []
        for series in ("width", "depth"):
            w = entry["series"][series]["worst"]
            cells.append("—" if w is None else f"{abs(w['slope']):.2f} ({escape(w['probe'])}, {w['step']})")
        table.add_row(escape(display_name(arch, entry)), *cells, entry["verdict"]["rule"], entry["verdict"]["result"])
    table.caption = (f"thresholds fixed in satlab/bench/coord_settings.py: mup/completep |slope| < "
                     f"{thresholds['transfer_slope_limit']}; the sp control needs some |slope| > "
                     f"{thresholds['sp_slope_signal']}; took {report['seconds']:.0f} s"
                     + "".join(f"; left out of the {series} verdict: {escape(probe)} ({escape(why)})"
                               for series, probes in NOT_COMPARED.items() for probe, why in probes.items()))
    return table
