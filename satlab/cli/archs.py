"""`satlab archs`: every architecture and variant with its parameter count at a chosen size."""

from __future__ import annotations

import argparse

from rich.table import Table

from satlab.console import console as make_console


def variants() -> list[tuple[str, dict]]:
    """(label, model-config overrides) for every registered architecture and its named variants."""
    from satlab.models import ARCHITECTURES

    rows = []
    for arch in ARCHITECTURES.values():
        rows.append((arch.name, {"arch": arch.name}))
        rows += [(name, {"arch": arch.name, arch.name: dict(options)}) for name, options in arch.variants]
    return rows


def archs_table(size: str, seq_len: int | None = None, all_functions: bool = False) -> Table:
    """A rich table of parameter counts (built on the meta device: no memory is allocated)."""
    from satlab.config.errors import ConfigError
    from satlab.models import build_model, count_params, flops_per_token, non_embedding_params

    table = Table(title=f"satlab architectures at size '{size}'")
    for column in ("architecture / variant", "params", "non-embedding", "vs transformer", "GFLOPs/token"):
        table.add_column(column, justify="left" if column.startswith("arch") else "right", no_wrap=True)
    base = None
    for label, overrides in variants():
        gate_fn = next((o["gate_fn"] for o in overrides.values() if isinstance(o, dict) and "gate_fn" in o), "relu")
        if not all_functions and gate_fn != "relu":
            continue
        try:
            model = build_model(dict(size=size, **overrides), device="meta")
        except ConfigError:  # a variant that does not exist at this depth (last_k=2 of a 2-layer model)
            table.add_row(label, "—", "—", "—", "—")
            continue
        total = count_params(model)
        base = base or total
        seq = seq_len or model.cfg.max_seq_len
        table.add_row(label, f"{total:,}", f"{non_embedding_params(model):,}", f"{100 * (total / base - 1):+.3f} %",
                      f"{flops_per_token(model, seq) / 1e9:.4f}")
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="tiny", help="size preset (default: tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="context length for FLOPs (default: the preset's)")
    parser.add_argument("--all-gate-functions", action="store_true",
                        help="list every SATFormer granularity x gate function (default: relu only)")


def run(args: argparse.Namespace) -> int:
    from satlab.config.errors import ConfigError, unknown_name
    from satlab.config.model import SIZE_PRESETS

    if args.size not in SIZE_PRESETS:
        raise ConfigError(unknown_name("size (--size)", args.size, SIZE_PRESETS))
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1, got {args.seq_len} (the context length in tokens)")
    make_console().print(archs_table(args.size, args.seq_len, args.all_gate_functions))
    return 0
