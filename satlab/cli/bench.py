"""`satlab bench`: training throughput, memory and MFU of several architectures side by side (`make bench`);
with `--data`, the data preparation's rate, memory and disk; with `--recall`, the synthetic-recall path."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import yaml
from rich.table import Table

from satlab.cli.devices import device_problem
from satlab.cli.numbers import number_list
from satlab.config.archs import ARCH_SPECS
from satlab.config.errors import ConfigError, shown, unknown_name
from satlab.config.model import SIZE_PRESETS
from satlab.console import console as make_console


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", default="all",
                        help="comma-separated architectures (default: all registered; satlab archs lists them)")
    parser.add_argument("--size", default="tiny", help="model size preset (default: tiny)")
    parser.add_argument("--depths", default=None,
                        help="comma-separated layer counts, e.g. 6,12,24: the bench at each depth at the preset's "
                             "width, a table of ratios by depth and a plot (<out>_depth.png)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8; --recall: 512)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 256; --recall: 64)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="measured rounds at least (each: the reference's step, then each architecture's)")
    parser.add_argument("--ci-target", type=float, default=0.01,
                        help="go on until every ratio's 95%% interval is within ± this (default 0.01); 0: off")
    parser.add_argument("--max-rounds", type=int, default=60, help="stop there even if the target is not reached")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per architecture first")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda[:N]")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"],
                        help="fp32 (the CPU default) or bf16 autocast (GPUs)")
    parser.add_argument("--compile", action="store_true", help="per-block torch.compile; compile time reported apart")
    parser.add_argument("--no-overhead", action="store_true", help="skip the Lightning vs bare-loop measurement")
    parser.add_argument("--compare", default=None, metavar="FIELD=V1,V2",
                        help="build each architecture once per value of a model field and pair each with itself at "
                             "the first value, e.g. parametrization=sp,completep: the runtime cost of an option")
    parser.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                        help="a model field for every model (repeatable), e.g. --model base_width=64: a "
                             "parametrisation compared at its base shape is sp, so move the base off it")
    parser.add_argument("--census", action="store_true",
                        help="with --compare: count each step's ops, elements written and matmul FLOPs instead of "
                             "timing it (exact on any host; satlab/bench/census.py)")
    parser.add_argument("--out", default="reports/bench.json", help="JSON output (default: reports/bench.json)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not record an MLflow run")
    parser.add_argument("--data", action="store_true",
                        help="instead: data preparation (documents and tokens per second at --procs processes, "
                             "memory, disk) on a generated FineWeb-shaped parquet, extrapolated to the paper presets")
    parser.add_argument("--documents", type=int, default=40_000, help="--data: rows of the generated corpus")
    parser.add_argument("--procs", default="1,2", help="--data: process counts to measure (default: 1,2)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="--data: tries per process count, interleaved; the fastest counts (default: 2)")
    parser.add_argument("--recall", action="store_true",
                        help="instead: the synthetic-recall path (experiments/recall/mqar) against a plain PyTorch "
                             "loop, with the time per phase")


def run(args: argparse.Namespace) -> int:
    archs = list(ARCH_SPECS) if args.archs == "all" else [a.strip() for a in args.archs.split(",") if a.strip()]
    problems = [unknown_name("architecture", a, ARCH_SPECS) for a in archs if a not in ARCH_SPECS]
    if args.size not in SIZE_PRESETS:
        problems.append(unknown_name("size", args.size, SIZE_PRESETS))
    for name, value, least in (("--rounds", args.rounds, 1), ("--max-rounds", args.max_rounds, 1),
                               ("--warmup", args.warmup, 0), ("--ci-target", args.ci_target, 0),
                               ("--batch", args.batch, 1), ("--seq-len", args.seq_len, 1)):
        if value is not None and value < least:  # --batch and --seq-len: None is the default
            problems.append(f"{name} must be >= {least}, got {value}")
    depths = sorted(set(number_list("--depths", args.depths, problems, example="6,12,24"))) if args.depths else []
    compare = parse_compare(args.compare, problems)
    model = parse_model_fields(args.model, problems)
    if args.census and compare is None:
        problems.append("--census counts what a model option adds to a step: give it --compare FIELD=V1,V2, e.g. "
                        "--compare parametrization=sp,completep")
    if problem := device_problem(args.device, "--device"):
        problems.append(problem)
    procs = sorted(set(number_list("--procs", args.procs, problems, example="1,2"))) if args.data and args.procs else []
    if args.data and args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    if args.data and args.documents < 100:
        problems.append(f"--documents must be >= 100 (three splits need documents), got {args.documents}")
    if problems:
        raise ConfigError(problems)
    if args.data:
        return run_data(args, procs)
    if args.recall:
        return run_recall(args)
    args.batch, args.seq_len = args.batch or 8, args.seq_len or 256
    if compare is not None and compare[0] == "parametrization" and at_base_shape(args.size, model):
        print(f"note: size '{args.size}' is the parametrisations' base shape (model.base_width, base_depth), where "
              "mup and completep change nothing; --model base_width=... base_depth=... moves the base off it")
    if args.census:
        return run_census(args, archs, compare, model)
    from satlab.bench.depth import depth_sweep
    from satlab.bench.host import describe_host, host_line, remeasure
    from satlab.bench.throughput import bench_device

    host = describe_host(bench_device(args.device))
    bench_args = dict(size=args.size, batch=args.batch, seq_len=args.seq_len, rounds=args.rounds, warmup=args.warmup,
                      device=args.device, precision=args.precision, compile=args.compile,
                      ci_target=args.ci_target or None, max_rounds=max(args.max_rounds, args.rounds),
                      compare=compare, overrides=model)
    sweep = depth_sweep(archs, depths or [SIZE_PRESETS[args.size]["n_layers"]], **bench_args)
    report = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "host": remeasure(host)}
    out = Path(args.out)
    console = make_console()
    if depths:
        from satlab.bench.depth import overheads, plot_depth_sweep

        report["depth_sweep"] = {str(d): [r.as_dict() for r in rs] for d, rs in sweep.items()}
        report["overheads"] = overheads(sweep)
        report["plot"] = str(plot_depth_sweep(sweep, out.with_name(f"{out.stem}_depth.png"),
                                              f"training tokens/s vs depth at size '{args.size}' width "
                                              f"(batch {args.batch} x {args.seq_len}, {args.precision})"))
        console.print(depth_table(sweep, report["overheads"], args))
    else:
        report["results"] = [r.as_dict() for r in sweep[next(iter(sweep))]]
    if not args.no_overhead:
        from satlab.bench.overhead import lightning_overhead
        from satlab.training.chatter import library_chatter_to

        with library_chatter_to(out.parent, "bench.log"):
            report["lightning_overhead"] = lightning_overhead(size=args.size, batch=args.batch, seq_len=args.seq_len,
                                                              ci_target=args.ci_target or None,
                                                              max_rounds=args.max_rounds)
    widths = [r.ratio.half_width for rs in sweep.values() for r in rs if r.ratio is not None]
    widest = max([*widths, report.get("lightning_overhead", {}).get("half_width", 0.0)], default=0.0)
    report["ci"] = {"target": args.ci_target, "widest_half_width": widest,
                    "reached": not args.ci_target or widest <= args.ci_target}
    if not depths:
        console.print(results_table(sweep[next(iter(sweep))], report.get("lightning_overhead"), args))
    elif "lightning_overhead" in report:
        console.print(overhead_line(report["lightning_overhead"]))
    print(host_line(host))
    if args.ci_target and widest > args.ci_target:
        print(f"the widest ratio interval is ± {100 * widest:.1f} %, not the ± {100 * args.ci_target:g} % asked for, "
              f"after {args.max_rounds} rounds (--max-rounds); a busy machine widens it, more rounds narrow it")
    save_report(report, out, None if args.no_mlflow else log_to_mlflow)
    return 0


def save_report(report: dict, out: Path, log=None) -> None:
    """Write the bench JSON and, with ``log`` (a function of the report and the JSON's path), its MLflow run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if log is not None:
        print(f"MLflow run {log(report, out)} in experiment 'bench'")


def run_data(args: argparse.Namespace, procs: list[int]) -> int:
    """`satlab bench --data`: preparation rate, memory and disk at each process count, and the paper presets' time."""
    from satlab.bench.data import CORES, data_bench

    out = Path(args.out if args.out != "reports/bench.json" else "reports/bench_data.json")
    report = data_bench(out.parent / "bench_data", documents=args.documents, procs=tuple(procs),
                        repeats=args.repeats)
    console = make_console()
    table = Table(title=f"data preparation: {report['documents']:,} FineWeb-shaped documents "
                        f"({report['text_bytes'] / 1e6:,.0f} MB of text), BPE {report['vocab_size']}, "
                        f"{report['tokens'] / 1e6:,.1f} M tokens")
    for column in ("processes", "seconds (best)", "docs/s", "tokens/s", "speed-up [range]", "peak GB",
                   "GB 2nd → 4th quarter"):
        table.add_column(column, justify="right")
    for run in report["runs"]:
        table.add_row(str(run["num_proc"]), f"{run['seconds']:.1f}", f"{run['docs_per_s']:,.0f}",
                      f"{run['tokens_per_s']:,.0f}",
                      f"{run['speedup']:.2f} [{run['speedup_range'][0]:.2f}, {run['speedup_range'][1]:.2f}]",
                      f"{run['peak_gb']:.2f}",
                      f"{run['second_quarter_gb']:.2f} → {run['last_quarter_gb']:.2f}")
    table.caption = (f"cold (BPE training + {report['cold']['num_proc']} processes): {report['cold']['seconds']:.0f} s;"
                     f" token files identical at every count: {'yes' if report['identical'] else 'NO'}; reading "
                     f"alone: {report['read']['rows_per_s']:,.0f} rows/s; text {report['text_bytes'] / 1e6:,.0f} MB "
                     f"-> token files {report['token_bytes'] / 1e6:,.0f} MB")
    console.print(table)
    extrapolation = report["extrapolation"]
    presets = Table(title=f"paper presets: hours to prepare at {extrapolation['per_core_tokens_per_s']:,.0f} tokens/s "
                          f"per core, {100 * extrapolation['efficiency']:.0f} % scaling efficiency, at most "
                          f"{extrapolation['reader_core_ceiling']:,.0f} cores fed by one reader")
    presets.add_column("preset")
    presets.add_column("Llama-2 tokens", justify="right")
    for cores in CORES:
        presets.add_column(f"{cores} cores", justify="right")
    for size, row in extrapolation["presets"].items():
        presets.add_row(size, f"{row['tokens'] / 1e9:.1f} B", *(f"{row['hours'][c]:.1f} h" for c in CORES))
    console.print(presets)
    save_report(report, out, None if args.no_mlflow else log_data_to_mlflow)
    return 0


def log_data_to_mlflow(report: dict, json_path: Path) -> str:
    """One MLflow run 'bench-data' in experiment 'bench': every rate at step = processes, the presets' hours at
    step = cores, the JSON as an artifact."""
    import mlflow

    from satlab.training.tracking import experiment_id, open_store, provenance_tags, resolve_tracking

    uri, artifacts = resolve_tracking(None, None)
    open_store(uri)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(experiment_id(client, "bench", artifacts), run_name="bench-data",
                            tags=provenance_tags("data", "bench"))
    run_id = run.info.run_id
    for key in ("documents", "vocab_size"):
        client.log_param(run_id, key, report[key])
    for key in ("text_bytes", "tokens", "token_bytes", "parquet_bytes"):
        client.log_metric(run_id, f"bench/data/{key}", float(report[key]))
    client.log_metric(run_id, "bench/data/cold_seconds", report["cold"]["seconds"])
    client.log_metric(run_id, "bench/data/read_rows_per_s", report["read"]["rows_per_s"])
    for r in report["runs"]:
        for key in ("seconds", "docs_per_s", "tokens_per_s", "speedup", "peak_gb", "last_quarter_gb"):
            client.log_metric(run_id, f"bench/data/{key}", float(r[key]), step=r["num_proc"])
    for size, row in report["extrapolation"]["presets"].items():
        for cores, hours in row["hours"].items():
            client.log_metric(run_id, f"bench/data/hours_{size}", hours, step=cores)
    client.log_artifact(run_id, str(json_path))
    client.set_terminated(run_id)
    return run_id


def run_recall(args: argparse.Namespace) -> int:
    """`satlab bench --recall`: plain loop, zoo in a bare loop, and satlab's trainer on MQAR batches."""
    from satlab.bench.recall_path import PHASES, recall_path_bench

    report = recall_path_bench(batch=args.batch or 512, seq_len=args.seq_len or 64, steps=args.rounds,
                               warmup=args.warmup)
    table = Table(title=f"synthetic recall step, batch {report['batch']} x {report['seq_len']}, head at the answers "
                        f"(median of {args.rounds} steps)")
    for column in ("loop", "step ms", "vs plain", *(f"{p} ms" for p in PHASES)):
        table.add_column(column, justify="left" if column == "loop" else "right")
    plain = report["plain"]["step_s"]
    for name, label in (("plain", "plain PyTorch model"), ("zoo_bare", "satlab zoo, bare loop"),
                        ("satlab_trainer", "satlab trainer (Lightning)")):
        row = report[name]
        table.add_row(label, f"{1e3 * row['step_s']:.1f}", f"{row['step_s'] / plain:.2f}",
                      *(f"{1e3 * row[f'{p}_s']:.1f}" if f"{p}_s" in row else "—" for p in PHASES))
    make_console().print(table)
    out = Path(args.out if args.out != "reports/bench.json" else "reports/bench_recall.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


def model_field(text: str, option: str, problems: list[str]) -> tuple[str | None, str]:
    """``FIELD=REST`` (``model.`` optional) as (field, rest); (None, rest) with a problem when no model field has
    that name."""
    from dataclasses import fields

    from satlab.config.schema import ModelConfig

    name, _, rest = text.partition("=")
    name = name.strip().removeprefix("model.")
    valid = {f.name for f in fields(ModelConfig)}
    if name not in valid:
        problems.append(unknown_name(f"model field for {option}", name, valid))
        return None, rest
    return name, rest


def parse_model_fields(items: list[str], problems: list[str]) -> dict:
    """``--model base_width=64 --model base_depth=3`` as {field: value}; a problem for anything else."""
    chosen = {}
    for item in items:
        name, raw = model_field(item, "--model", problems)
        if name is None:
            continue
        if "=" not in item or not raw.strip():
            problems.append(f"--model takes FIELD=VALUE, as base_width=64; got {shown(item)}")
        else:
            chosen[name] = yaml.safe_load(raw.strip())
    return chosen


def at_base_shape(size: str, model: dict) -> bool:
    from satlab.config.schema import ModelConfig

    shape = {**SIZE_PRESETS[size], **model}
    defaults = ModelConfig()
    return (shape["d_model"] == model.get("base_width", defaults.base_width)
            and shape["n_layers"] == model.get("base_depth", defaults.base_depth))


def run_census(args: argparse.Namespace, archs: list[str], compare: tuple[str, list], model: dict) -> int:
    """``--census``: each architecture's step at each value counted against the first value."""
    from satlab.bench.census import compare_census

    pairs = compare_census(archs, *compare, size=args.size, batch=args.batch, seq_len=args.seq_len, model=model)
    table = Table(title=f"one training step counted (size '{args.size}', batch {args.batch} x {args.seq_len}, fp32, "
                        f"CPU{', ' + ', '.join(f'{k}={v}' for k, v in model.items()) if model else ''})")
    for column in ("model", "op calls", "elements written", "matmul GFLOP", "ratio calls", "ratio elements",
                   "ratio FLOPs", "ops added (calls, elements)"):
        table.add_column(column, justify="left" if column in ("model", "ops added (calls, elements)") else "right")
    for reference, other in pairs:
        ratios = other.ratios(reference)
        added = ", ".join(f"{op} {c:+d} ({e:+,})" for op, (c, e) in other.added_ops(reference).items()) or "none"
        table.add_row(other.label, f"{other.calls:,}", f"{other.elements:,}", f"{other.flops / 1e9:.2f}",
                      f"{ratios['calls']:.4f}", f"{ratios['elements']:.4f}", f"{ratios['flops']:.4f}", added)
    make_console().print(table)
    out = Path(args.out if args.out != "reports/bench.json" else "reports/bench_census.json")
    report = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
              "pairs": [{"reference": asdict(r), "other": asdict(o), "ratios": o.ratios(r),
                         "added_ops": o.added_ops(r)} for r, o in pairs]}
    save_report(report, out)
    return 0


def parse_compare(text: str | None, problems: list[str]) -> tuple[str, list] | None:
    """``--compare parametrization=sp,completep`` as (field, values); a problem for anything else."""
    if text is None:
        return None
    name, raw = model_field(text, "--compare", problems)
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if name is None:
        return None
    if len(values) < 2 or len(set(values)) < len(values):
        problems.append(f"--compare needs a model field and two or more distinct values, as "
                        f"parametrization=sp,completep; got {shown(text)}")
        return None
    return name, [yaml.safe_load(v) for v in values]  # numbers and booleans as such


def results_table(results, overhead: dict | None, args) -> Table:
    base = next((r for r in results if r.ratio is None), results[0])
    by_name = {r.arch: r for r in results}
    references = {r.ratio.reference for r in results if r.ratio is not None}
    against = f"vs {base.arch}" if len(references) <= 1 else "vs its first value"
    rounds = max((len(r.ratio.ratios) for r in results if r.ratio is not None), default=len(base.step_times))
    compiled = ", compiled" if args.compile else ""
    table = Table(title=f"training throughput at size '{args.size}', batch {args.batch} x {args.seq_len}, "
                        f"{args.precision}{compiled} ({rounds} paired rounds)")
    compile_columns = ("compile s", "graphs") if args.compile else ()  # graphs: new ones (0: reused another's)
    for column in ("arch", "params", "step ms", "spread", "tokens/s", f"{against} [95 % CI]", "mem GB",
                   "mem ratio", "TFLOP/s", "MFU", *compile_columns):
        table.add_column(column, justify="left" if column == "arch" else "right", no_wrap=True)
    for r in results:
        compiled_cells = (f"{r.compile_seconds:.1f}", str(r.graphs)) if args.compile else ()
        table.add_row(r.arch, f"{r.params / 1e6:.2f}M", f"{1e3 * r.median_step:.1f}", f"{100 * r.spread:.1f} %",
                      f"{r.tokens_per_sec:,.0f}", "1" if r.ratio is None else
                      f"{r.ratio.mean:.3f} [{r.ratio.low:.3f}, {r.ratio.high:.3f}]",
                      f"{r.peak_mem_gb:.3f}", f"{r.peak_mem_gb / by_name[reference_name(r)].peak_mem_gb:.3f}",
                      f"{r.tflops:.3f}",
                      "—" if r.mfu is None else f"{100 * r.mfu:.1f} %", *compiled_cells)
    if overhead:
        table.caption = overhead_line(overhead)
    return table


def reference_name(result) -> str:
    return result.ratio.reference if result.ratio is not None else result.arch


def overhead_line(overhead: dict) -> str:
    return (f"Lightning / bare PyTorch loop step time, same work: {overhead['ratio']:.3f} "
            f"[{overhead['low']:.3f}, {overhead['high']:.3f}] over {overhead['rounds']} paired rounds "
            f"({1e3 * overhead['lightning_step_s']:.1f} ms vs {1e3 * overhead['bare_step_s']:.1f} ms)")


def depth_table(sweep: dict, overheads: dict, args) -> Table:
    depths = sorted(sweep)
    reference = next(r.arch for r in sweep[depths[0]] if r.ratio is None)
    table = Table(title=f"tokens/s and memory relative to {reference} by depth at size '{args.size}' width, "
                        f"batch {args.batch} x {args.seq_len}, {args.precision} (95 % CI)")
    table.add_column("arch", no_wrap=True)
    for depth in depths:
        table.add_column(f"L={depth} tokens/s", justify="right", no_wrap=True)
        table.add_column(f"L={depth} mem", justify="right")
    table.add_column("time overhead x per doubling", justify="right")
    for arch, row in overheads.items():
        cells = []
        for depth in depths:
            r = next(r for r in sweep[depth] if r.arch == arch)
            cells += [f"{r.ratio.mean:.3f} [{r.ratio.low:.3f}, {r.ratio.high:.3f}]",
                      f"{1 + row['memory'][depth]:.3f}"]
        growth = row["growth_per_doubling"]
        table.add_row(arch, *cells, "—" if growth is None else f"{growth:.2f}")
    table.caption = ("overhead = reference tokens/s / its tokens/s - 1; an O(L²) depth-mixing term on an O(L) "
                     "backbone doubles it per doubling of depth, a per-layer cost keeps it (x1)")
    return table


def log_to_mlflow(report: dict, json_path: Path) -> str:
    """One MLflow run in experiment 'bench' with every number of the table (a depth sweep's at step = depth), the
    JSON and the depth plot as artifacts."""
    import mlflow

    from satlab.training.tracking import experiment_id, open_store, provenance_tags, resolve_tracking

    uri, artifacts = resolve_tracking(None, None)
    open_store(uri)
    client = mlflow.MlflowClient(uri)
    by_depth = ({int(d): rs for d, rs in report["depth_sweep"].items()} if "depth_sweep" in report
                else {0: report["results"]})
    archs = "+".join(r["arch"] for r in next(iter(by_depth.values())))
    run = client.create_run(experiment_id(client, "bench", artifacts), run_name=f"bench-{report['settings']['size']}",
                            tags=provenance_tags(archs, "bench"))
    for key, value in report["settings"].items():
        client.log_param(run.info.run_id, key, value)
    for step, results in by_depth.items():
        for r in results:
            for key in ("mean", "low", "high", "half_width"):
                if r["ratio"] is not None:
                    client.log_metric(run.info.run_id, f"bench/{r['arch']}/ratio_{key}", float(r["ratio"][key]),
                                      step=step)
            for key in ("tokens_per_sec", "median_step", "spread", "peak_mem_gb", "tflops", "mfu",
                        "compile_seconds", "graphs", "flops_per_token", "params"):
                if r[key] is not None:
                    client.log_metric(run.info.run_id, f"bench/{r['arch']}/{key}", float(r[key]), step=step)
    host = report["host"]  # its device is the run's provenance tag "device"
    for when, gbps in zip(("before", "after"), host.get("memory_gbps", ()), strict=False):
        client.log_metric(run.info.run_id, f"bench/host/memory_gbps_{when}", gbps)
    if "matmul_gflops" in host:
        client.log_metric(run.info.run_id, "bench/host/matmul_gflops", host["matmul_gflops"])
    for key, value in (report.get("lightning_overhead") or {}).items():
        client.log_metric(run.info.run_id, f"bench/lightning_overhead/{key}", float(value))
    client.log_artifact(run.info.run_id, str(json_path))
    if "plot" in report:
        client.log_artifact(run.info.run_id, report["plot"])
    client.set_terminated(run.info.run_id)
    return run.info.run_id
