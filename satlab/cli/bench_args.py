"""Arguments of `satlab bench` (kept apart so `satlab --help` does not import torch)."""

from __future__ import annotations

import argparse


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
