"""A study's results on its MLflow parent run (:func:`record_results`; a sweep's are named in
:mod:`satlab.studies.sweep_report`). An ablation's, made from the report's summary.json, so that the experiment's
charts and runs table show them and not only the report artifact:

- metrics, once each at step 0: ``variants/<group>/<measure>_<stat>`` per group of cells (``mean``, ``std``, ``n``
  over seeds, and the table's p-values ``p`` or ``p_vs_<arch>``), ``variants/<group>/cells`` and ``model_params``;
  ``verdicts/<claim>/<better>_vs_<worse>_p`` (the test the verdict used) and ``_p_holm`` per comparison of a claim;
- params ``variant.<group>``: the group's axis values (``model.arch=satformer``);
- tags ``verdict.<claim>``: the claim's outcome (``held``, ``not resolved``...), and with a sequential plan
  ``verdict.sequential.<a>_vs_<b>`` per comparison (a_better, b_better, equivalent, undecided, open).

MLflow's chart view makes a section of everything before a key's last ``/``, so each group and each claim gets one,
its charts named by the measure; sections sort by name, and ``variants``/``verdicts`` come after ``train`` and
``val`` (before ``zero_shot``). A later report (``satlab report``, a resumed ablation) replaces these values: MLflow
appends a metric logged again rather than replacing it, so a value that did not change is not logged again (no
second point in its history), a changed one is logged at a later timestamp (the newest is the run's value), one the
summary no longer has is set to NaN, and a verdict tag the summary no longer has is deleted.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping

import mlflow
from mlflow.entities import Metric, Param, RunTag

GROUP_SECTION = "variants"
CLAIM_SECTION = "verdicts"
GROUP_PARAM = "variant."
VERDICT_TAG = "verdict."


def mlflow_name(label: str) -> str:
    """A label as one part of an MLflow key (``source=kjv, arch=satformer`` -> ``source-kjv arch-satformer``): MLflow
    takes letters, digits, ``_ - .``, spaces and ``/`` (which here would start another section) only, and no part
    that is ``.`` or ``..``."""
    name = re.sub(r"[^\w.\- ]", "-", label.replace(", ", " ")).strip()
    return name if name.strip(".") else "_"


def result_metrics(summary: Mapping) -> dict[str, float]:
    """The metrics of the module docstring, from summary.json's ``groups`` and ``verdicts``; None values left out."""
    metrics: dict[str, float | None] = {}
    for key, group in summary["groups"].items():
        for name in ("cells", "model_params"):
            metrics[f"{GROUP_SECTION}/{key}/{name}"] = group[name]
        for measure, stats in group["measures"].items():
            metrics.update({f"{GROUP_SECTION}/{key}/{measure}_{stat}": value for stat, value in stats.items()})
    for verdict in summary["verdicts"]:
        for c in verdict["comparisons"]:
            pair = f"{CLAIM_SECTION}/{verdict['key']}/{mlflow_name(c['better'])}_vs_{mlflow_name(c['worse'])}"
            metrics.update({f"{pair}_p": c["p"], f"{pair}_p_holm": c["p_adjusted"]})
    return {k: float(v) for k, v in metrics.items() if v is not None}


def result_params(summary: Mapping) -> dict[str, str]:
    return {f"{GROUP_PARAM}{key}": group["group"] for key, group in summary["groups"].items()}


def verdict_tags(summary: Mapping) -> dict[str, str]:
    """The claims' outcomes and, with a sequential plan, each comparison's (``verdict.sequential.<a>_vs_<b>``)."""
    sequential = (summary.get("sequential") or {}).get("verdicts", [])
    return {f"{VERDICT_TAG}{v['key']}": v["outcome"] for v in summary["verdicts"]} | \
        {v["tag"]: v["outcome"] for v in sequential}


def log_results(client: mlflow.MlflowClient, run_id: str, summary: Mapping) -> None:
    """Put the summary's results on the parent run, replacing those of an earlier report (module docstring). A param
    already there stays (MLflow refuses to change one): a group's key always names the same axis values."""
    record_results(client, run_id, result_metrics(summary), verdict_tags(summary), params=result_params(summary),
                   owned=(f"{GROUP_SECTION}/", f"{CLAIM_SECTION}/"), owned_tags=VERDICT_TAG)


def record_results(client: mlflow.MlflowClient, run_id: str, metrics: Mapping[str, float], tags: Mapping[str, str],
                   params: Mapping[str, str] | None = None, step: int = 0, owned: tuple[str, ...] = (),
                   owned_tags: str | None = None) -> None:
    """A study's results on its parent run (an ablation's here, a sweep's from :mod:`satlab.studies.sweep_report`),
    such that writing the same results again adds nothing. MLflow appends every metric point logged, so a metric gets
    a point at ``step`` unless its latest point already has this value at this step (an ablation logs at 0, a sweep
    at the trials finished so far: its history is the study's progress). A logged metric under an ``owned`` prefix
    that ``metrics`` no longer has is set to NaN; a tag starting with ``owned_tags`` that ``tags`` no longer has is
    deleted; a param already there stays."""
    run = client.get_run(run_id)
    logged = run.data.metrics
    gone = {k: math.nan for k in logged if owned and k.startswith(owned) and k not in metrics}

    def recorded(key: str, value: float) -> bool:
        if not same(logged.get(key), value):
            return False
        latest = max(client.get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))
        return latest.step == step

    now = int(time.time() * 1000)
    new_metrics = [Metric(k, v, now, step) for k, v in (dict(metrics) | gone).items() if not recorded(k, v)]
    new_params = [Param(k, v) for k, v in (params or {}).items() if k not in run.data.params]
    new_tags = [RunTag(k, v[:5000]) for k, v in tags.items() if run.data.tags.get(k) != v]
    for start in range(0, max(len(new_metrics), len(new_params), len(new_tags)), 100):  # MLflow's batch limits
        client.log_batch(run_id, metrics=new_metrics[start:start + 100], params=new_params[start:start + 100],
                         tags=new_tags[start:start + 100])
    for key in run.data.tags.keys() - tags.keys():
        if owned_tags and key.startswith(owned_tags):
            client.delete_tag(run_id, key)


def same(old: float | None, new: float) -> bool:
    """Whether a logged value already says ``new`` (NaN included)."""
    return old is not None and (old == new or (math.isnan(old) and math.isnan(new)))
