"""What the coordinate check writes: ``coord.json`` (everything), ``coord.csv`` (RMS per architecture, series, size,
probe and step), ``coord_slopes.csv`` (slope per architecture, series, probe and step), one plot per architecture
(``coord_<arch>.png``: RMS against width and against depth, log-log, one line per step), and an MLflow run with
them as artifacts and the slopes as metrics (step = training step)."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure

from satlab.bench.coord_settings import display_name

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
    """One row per probe, log10 RMS against width (left) and depth (right) on a log2 axis, a line per step (dark:
    step 0, yellow: the last); each panel's title gives the slope after step 1 and at the last step. The logs are
    plotted on linear axes (matplotlib's log axes took ten times as long for forty panels)."""
    probes = sorted({p for series in SERIES for rms in entry["series"][series]["rms"] for p in rms})
    steps = max(len(v) for series in SERIES for rms in entry["series"][series]["rms"] for v in rms.values())
    colors = colormaps["viridis"]
    fig = Figure(figsize=(9, 1.9 * len(probes) + 1.0))
    axes = fig.subplots(len(probes), 2, squeeze=False)
    for row, probe in enumerate(probes):
        for col, series in enumerate(SERIES):
            ax, data = axes[row][col], entry["series"][series]
            for step in range(steps):
                ys = [log10(rms.get(probe, [math.nan] * steps)[step]) for rms in data["rms"]]
                if any(math.isfinite(y) for y in ys):
                    label = f"step {step}" if row == 0 and col == 0 else None
                    ax.plot([math.log2(x) for x in data["x"]], ys, marker=".", linewidth=1,
                            color=colors(step / max(1, steps - 1)), label=label)
            slopes = data["slopes"].get(probe, [math.nan] * steps)
            ax.set_xticks([math.log2(x) for x in data["x"]], [str(x) for x in data["x"]])
            ax.set_title(f"{probe} vs {series}: slope {slopes[min(1, steps - 1)]:+.2f} at step 1, "
                         f"{slopes[-1]:+.2f} at step {steps - 1}", fontsize=7)
            ax.tick_params(labelsize=6)
            if col == 0:
                ax.set_ylabel("log10 RMS", fontsize=7)
    fig.legend(loc="upper center", ncol=min(steps, 11), fontsize=7,
               bbox_to_anchor=(0.5, 1 - 0.3 / fig.get_figheight()))
    fig.suptitle(f"coordinate check: {display_name(arch, entry)} ({entry['parametrization']}), RMS of each probed "
                 "output", fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.02, top=1 - 1.2 / fig.get_figheight(), hspace=0.55,
                        wspace=0.2)
    fig.savefig(path, dpi=72)
    return path


def log10(value: float) -> float:
    """log10 of an RMS, NaN where there is none (zero, a probe the shape lacks)."""
    return math.log10(value) if math.isfinite(value) and value > 0 else math.nan


def log_to_mlflow(report: dict, paths: list[Path]) -> str:
    """One run ``coord-<parametrization>`` (with ``-<implementation>`` for another code base's models) in experiment
    'coord': the settings as parameters, every slope as metric ``coord/<arch>/<series>/<probe>`` at step = training
    step, each architecture's worst |slope| and verdict, the files as artifacts."""
    import mlflow
    from mlflow.entities import Metric, Param, RunTag

    from satlab.training.tracking import experiment_id, open_store, provenance_tags, resolve_tracking

    uri, artifacts = resolve_tracking(None, None)
    open_store(uri)
    client = mlflow.MlflowClient(uri)
    param = report.get("parametrization", "sp")
    implementation = report.get("implementation", "satlab")
    name = f"coord-{param}" + ("" if implementation == "satlab" else f"-{implementation}")
    run = client.create_run(experiment_id(client, "coord", artifacts), run_name=name,
                            tags=provenance_tags("+".join(report["archs"]), "coord"))
    run_id = run.info.run_id
    params = {**report["settings"], **report["thresholds"], "parametrization": param,
              "implementation": implementation}
    metrics, tags, now = [], [], int(time.time() * 1000)
    for arch, entry in report["archs"].items():
        for series in SERIES:
            data = entry["series"][series]
            for probe, values in data["slopes"].items():
                name = f"coord/{arch}/{series}/{safe_key(probe)}"
                metrics += [Metric(name, v, now, step) for step, v in enumerate(values) if math.isfinite(v)]
            if data["worst"] is not None:
                metrics.append(Metric(f"coord/{arch}/{series}/worst_abs_slope", abs(data["worst"]["slope"]), now, 0))
        tags.append(RunTag(f"coord.{arch}.verdict", entry["verdict"]["result"]))
    client.log_batch(run_id, params=[Param(k, ",".join(map(str, v)) if isinstance(v, list) else str(v))
                                     for k, v in params.items()], tags=tags)
    for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run_id, metrics=metrics[start:start + 1000])
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
