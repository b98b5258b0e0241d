"""What the coordinate check writes: ``coord.json`` (everything), ``coord.csv`` (RMS per architecture, series, size,
probe and step), ``coord_slopes.csv`` (slope per architecture, series, probe and step), one plot per architecture
(``coord_<arch>.png``: RMS against width and against depth, log-log, one line per step), and an MLflow run with
them as artifacts and the slopes as metrics (step = training step)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure

SERIES = ("width", "depth")


def write_outputs(report: dict, out: Path) -> list[Path]:
    """Write the JSON, the two CSVs and the plots under ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "coord.json", out / "coord.csv", out / "coord_slopes.csv"]
    paths[0].write_text(json.dumps(finite(report), indent=1, allow_nan=False))
    with paths[1].open("w", newline="") as rms_file, paths[2].open("w", newline="") as slope_file:
        rms_rows, slope_rows = csv.writer(rms_file), csv.writer(slope_file)
        rms_rows.writerow(["arch", "series", "size", "probe", "step", "rms"])
        slope_rows.writerow(["arch", "series", "probe", "step", "slope"])
        for arch, entry in report["archs"].items():
            for series in SERIES:
                data = entry["series"][series]
                for x, rms in zip(data["x"], data["rms"], strict=True):
                    for probe, values in sorted(rms.items()):
                        rms_rows.writerows([arch, series, x, probe, s, v] for s, v in enumerate(values))
                for probe, values in data["slopes"].items():
                    slope_rows.writerows([arch, series, probe, s, v] for s, v in enumerate(values))
    for arch, entry in report["archs"].items():
        paths.append(plot_arch(arch, entry, out / f"coord_{arch}.png"))
    return paths


def plot_arch(arch: str, entry: dict, path: Path) -> Path:
    """One row per probe, RMS against width (left) and depth (right), log-log, a line per step (dark: early)."""
    probes = sorted({p for series in SERIES for rms in entry["series"][series]["rms"] for p in rms})
    steps = max(len(v) for series in SERIES for rms in entry["series"][series]["rms"] for v in rms.values())
    colors = colormaps["viridis"]
    fig = Figure(figsize=(9, 2.1 * len(probes) + 0.6))
    axes = fig.subplots(len(probes), 2, squeeze=False)
    for row, probe in enumerate(probes):
        for col, series in enumerate(SERIES):
            ax, data = axes[row][col], entry["series"][series]
            for step in range(steps):
                ys = [rms.get(probe, [math.nan] * steps)[step] for rms in data["rms"]]
                slope = data["slopes"].get(probe, [math.nan] * steps)[step]
                if any(math.isfinite(y) and y > 0 for y in ys):
                    ax.plot(data["x"], ys, marker=".", color=colors(step / max(1, steps - 1)),
                            label=f"step {step} ({slope:+.2f})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{probe} vs {series}", fontsize=8)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel("RMS", fontsize=7)
            ax.legend(fontsize=5, ncol=2)
    fig.suptitle(f"coordinate check: {arch} ({entry['parametrization']}); legend: step (slope of log RMS)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return path


def log_to_mlflow(report: dict, paths: list[Path]) -> str:
    """One run ``coord-<parametrization>`` in experiment 'coord': the settings as parameters, every slope as metric
    ``coord/<arch>/<series>/<probe>`` at step = training step, each architecture's worst |slope| and verdict, the
    files as artifacts."""
    import mlflow

    from satlab.training.tracking import experiment_id, open_store, provenance_tags, resolve_tracking

    uri, artifacts = resolve_tracking(None, None)
    open_store(uri)
    client = mlflow.MlflowClient(uri)
    param = report.get("parametrization", "sp")
    run = client.create_run(experiment_id(client, "coord", artifacts), run_name=f"coord-{param}",
                            tags=provenance_tags("+".join(report["archs"]), "coord"))
    run_id = run.info.run_id
    for key, value in {**report["settings"], **report["thresholds"], "parametrization": param}.items():
        client.log_param(run_id, key, ",".join(map(str, value)) if isinstance(value, list) else value)
    for arch, entry in report["archs"].items():
        for series in SERIES:
            data = entry["series"][series]
            for probe, values in data["slopes"].items():
                name = f"coord/{arch}/{series}/{safe_key(probe)}"
                for step, value in enumerate(values):
                    if math.isfinite(value):
                        client.log_metric(run_id, name, value, step=step)
            if data["worst"] is not None:
                client.log_metric(run_id, f"coord/{arch}/{series}/worst_abs_slope", abs(data["worst"]["slope"]))
        client.set_tag(run_id, f"coord.{arch}.verdict", entry["verdict"]["result"])
    for path in paths:
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id)
    return run_id


def finite(value):
    """``value`` with every NaN or infinity as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def safe_key(probe: str) -> str:
    """An MLflow metric name for a probe: ``attn_logits[last]`` -> ``attn_logits.last``."""
    return probe.replace("[", ".").replace("]", "")
