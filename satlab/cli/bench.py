"""`satlab bench`: training throughput, memory and MFU of several architectures side by side (`make bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from satlab.cli.devices import device_problem
from satlab.config.errors import ConfigError, unknown_name
from satlab.console import console as make_console
from satlab.models import ARCHITECTURES, SIZE_PRESETS


def run(args: argparse.Namespace) -> int:
    archs = list(ARCHITECTURES) if args.archs == "all" else [a.strip() for a in args.archs.split(",") if a.strip()]
    problems = [unknown_name("architecture", a, ARCHITECTURES) for a in archs if a not in ARCHITECTURES]
    if args.size not in SIZE_PRESETS:
        problems.append(unknown_name("size", args.size, SIZE_PRESETS))
    for name, value, least in (("--rounds", args.rounds, 1), ("--max-rounds", args.max_rounds, 1),
                               ("--warmup", args.warmup, 0), ("--ci-target", args.ci_target, 0)):
        if value < least:
            problems.append(f"{name} must be >= {least}, got {value}")
    depths = parse_depths(args.depths, problems)
    if problem := device_problem(args.device, "--device"):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    if args.recall:
        return run_recall(args)
    args.batch, args.seq_len = args.batch or 8, args.seq_len or 256
    from satlab.bench.depth import depth_sweep
    from satlab.bench.host import describe_host, host_line, remeasure
    from satlab.bench.throughput import bench_device

    host = describe_host(bench_device(args.device))
    bench_args = dict(size=args.size, batch=args.batch, seq_len=args.seq_len, rounds=args.rounds, warmup=args.warmup,
                      device=args.device, precision=args.precision, compile=args.compile,
                      ci_target=args.ci_target or None, max_rounds=max(args.max_rounds, args.rounds))
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if not args.no_mlflow:
        print(f"MLflow run {log_to_mlflow(report, out)} in experiment 'bench'")
    return 0


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


def results_table(results, overhead: dict | None, args) -> Table:
    base = next((r for r in results if r.ratio is None), results[0])
    rounds = max((len(r.ratio.ratios) for r in results if r.ratio is not None), default=len(base.step_times))
    compiled = ", compiled" if args.compile else ""
    table = Table(title=f"training throughput at size '{args.size}', batch {args.batch} x {args.seq_len}, "
                        f"{args.precision}{compiled} ({rounds} paired rounds)")
    compile_columns = ("compile s", "graphs") if args.compile else ()  # graphs: new ones (0: reused another's)
    for column in ("arch", "params", "step ms", "spread", "tokens/s", f"vs {base.arch} [95 % CI]", "mem GB",
                   "mem ratio", "TFLOP/s", "MFU", *compile_columns):
        table.add_column(column, justify="left" if column == "arch" else "right", no_wrap=True)
    for r in results:
        compiled_cells = (f"{r.compile_seconds:.1f}", str(r.graphs)) if args.compile else ()
        table.add_row(r.arch, f"{r.params / 1e6:.2f}M", f"{1e3 * r.median_step:.1f}", f"{100 * r.spread:.1f} %",
                      f"{r.tokens_per_sec:,.0f}", "1" if r.ratio is None else
                      f"{r.ratio.mean:.3f} [{r.ratio.low:.3f}, {r.ratio.high:.3f}]",
                      f"{r.peak_mem_gb:.3f}", f"{r.peak_mem_gb / base.peak_mem_gb:.3f}", f"{r.tflops:.3f}",
                      "—" if r.mfu is None else f"{100 * r.mfu:.1f} %", *compiled_cells)
    if overhead:
        table.caption = overhead_line(overhead)
    return table


def overhead_line(overhead: dict) -> str:
    return (f"Lightning / bare PyTorch loop step time, same work: {overhead['ratio']:.3f} "
            f"[{overhead['low']:.3f}, {overhead['high']:.3f}] over {overhead['rounds']} paired rounds "
            f"({1e3 * overhead['lightning_step_s']:.1f} ms vs {1e3 * overhead['bare_step_s']:.1f} ms)")


def parse_depths(text: str | None, problems: list[str]) -> list[int]:
    """``--depths 6,12,24`` as layer counts; what is not a positive integer goes to ``problems``."""
    if not text:
        return []
    try:
        depths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        depths = []
    if not depths or any(d < 1 for d in depths):
        problems.append(f"--depths takes comma-separated layer counts >= 1 (e.g. 6,12,24), got {text!r}")
        return []
    return sorted(set(depths))


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
