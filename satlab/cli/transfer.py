"""`satlab transfer <study> --target <preset>`: the best learning rate of a finished learning-rate transfer study at
its base shape, written with the parametrisation's fields into a preset that builds on ``--target``
(docs/lr-transfer.md). The study is read from its report's summary.json (in its folder, also under ``report/`` on
its MLflow parent run): its ``lr_transfer`` entry, written by the report's Learning-rate transfer section."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import yaml

from satlab.config.errors import ConfigError
from satlab.studies.lr_transfer_summary import read_summary

DEFAULT_FOLDER = Path("experiments") / "transferred"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", metavar="STUDY",
                        help="a finished LR-transfer ablation: its spec name (lr_transfer) or file, its report folder, "
                             "or its summary.json")
    parser.add_argument("--target", required=True, metavar="PRESET",
                        help="the experiment preset the learning rate is for (e.g. paper/small/satformer)")
    parser.add_argument("--arch", help="the series' architecture (default: the target's model.arch)")
    parser.add_argument("--parametrization", default="completep",
                        help="the series' parametrisation (default completep)")
    parser.add_argument("--out", metavar="FILE", help=f"the preset to write (default {DEFAULT_FOLDER}/<target>-"
                                                      "<arch>-<parametrization>.yaml)")
    parser.add_argument("--dry-run", action="store_true", help="print the preset; write nothing")


def pick_series(summary: dict[str, Any], arch: str, parametrization: str) -> dict[str, Any]:
    series = summary["lr_transfer"]["series"]
    found = [s for s in series if s["values"].get("model.arch", arch) == arch
             and s["values"].get("model.parametrization", parametrization) == parametrization]
    if not found:
        have = "; ".join(f"{s['values'].get('model.arch')} under {s['values'].get('model.parametrization')}"
                         for s in series) or "none"
        raise ConfigError(f"the study has no series of {arch} under {parametrization} (it has: {have}); choose one "
                          "with --arch and --parametrization")
    chosen = found[0]
    if chosen["base_log2_lr"] is None:
        raise ConfigError(f"{chosen['label']}: the base shape ({chosen['base']}) has no optimum inside the swept "
                          "range, so there is no learning rate to transfer; widen the study's learning rates")
    return chosen


FIT_NAMES = {"all": "a quadratic over every learning rate", "local": "a parabola through the best learning rate and "
             "its two neighbours"}


def default_out(target: str, arch: str, parametrization: str) -> Path:
    """Where a preset is written without --out, named by the target preset and the parametrisation, with the
    architecture added when the target's name does not end in it: ``--target paper/small/satformer`` writes
    ``experiments/transferred/paper_small_satformer-completep.yaml``, ``--target default --arch transformer``
    ``default-transformer-completep.yaml``."""
    name = target.replace("/", "_") + ("" if Path(target).name == arch else f"-{arch}")
    return DEFAULT_FOLDER / f"{name}-{parametrization}.yaml"


def swept_head_dim(base: dict[str, Any]) -> int | None:
    """The head dim of the study's base shape, where its spec names both the width and the head count."""
    width, heads = base.get("model.d_model"), base.get("model.n_heads")
    return int(width) // int(heads) if width and heads else None


def preset(summary: dict[str, Any], series: dict[str, Any], target: str, parametrization: str) -> tuple[dict, str]:
    """(the preset's YAML data, its header comment)."""
    transfer = summary["lr_transfer"]
    sweep, plan = transfer["sweep"], transfer["plan"]
    base = series["shapes"][series["base"]]
    fixed = sweep.get("fixed", {})
    model = {"parametrization": parametrization,
             "base_width": fixed.get("model.base_width", plan["base"].get("model.d_model")),
             "base_depth": fixed.get("model.base_depth", plan["base"].get("model.n_layers")),
             "depth_alpha": fixed.get("model.depth_alpha", 1.0)}
    head_dim = fixed.get("model.base_head_dim") or swept_head_dim(plan["base"])
    if head_dim:  # μP's attention rule then follows the target's head dim from the swept one
        model["base_head_dim"] = head_dim
    lr = float(f"{2 ** series['base_log2_lr']:.3g}")
    interval = base["interval"]
    shown_interval = "none" if interval is None else ", ".join(
        "beyond the sweep" if math.isinf(v) else f"{2 ** v:.2e}" for v in interval)
    per_param = sweep.get("tokens_per_param")
    header = "\n".join(f"# {line}" for line in (
        f"Written by `satlab transfer` from ablation '{summary['name']}' (MLflow parent run "
        f"{summary.get('parent_run_id')}, commit {sweep.get('commit') or 'unknown'}).",
        f"{series['label']}: optimum learning rate at the base shape ({series['base']}; "
        f"{FIT_NAMES[series.get('fit', 'all')]}) {lr:.3g}, "
        f"{plan['level'] * 100:g} % bootstrap interval [{shown_interval}]; verdict over the shapes: "
        f"{series['outcome']}.",
        f"The sweep: {sweep['max_tokens']:,} tokens per run in batches of {sweep['global_batch_tokens']:,} tokens"
        + (f", {per_param:.1f} tokens per parameter at the base shape." if per_param else "."),
        "muP and CompleteP carry the learning rate across width and depth only. They do not cover another",
        "token horizon (tokens per parameter) or another batch size: retune, or check at 0.5x and 2x, if the target",
        "trains much longer or with other batches than the sweep."))
    data = {"base": target, "name": f"{Path(target).name}-transferred",
            "description": f"{target} at the learning rate transferred from {summary['name']} ({series['label']})",
            "model": model, "optim": {"lr": lr}}
    return data, header


def run(args: argparse.Namespace) -> int:
    from satlab.config.loader import load_experiment
    from satlab.config.resolve import resolve

    summary = read_summary(args.study)
    try:
        target = load_experiment(resolve("experiment", args.target))
    except ConfigError as e:
        raise ConfigError([f"--target {args.target}: {p}" for p in e.problems]) from None
    arch = args.arch or target.model.arch
    series = pick_series(summary, arch, args.parametrization)
    data, header = preset(summary, series, args.target, args.parametrization)
    text = header + "\n" + yaml.safe_dump(data, sort_keys=False)
    out = Path(args.out) if args.out else default_out(args.target, arch, args.parametrization)
    if args.dry_run:
        print(f"would write {out}:\n{text}", end="")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: optim.lr={data['optim']['lr']:.3g} under {args.parametrization} "
          f"(base width {data['model']['base_width']}, depth {data['model']['base_depth']})")
    return 0
