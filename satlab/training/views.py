"""The MLflow UI views satlab hands over at the end of a run or a study: one URL that opens the experiment's runs
in model-training mode on the chart comparison, loss curves first, each architecture (or study group) in its own
colour, and the runs table showing the architecture, the final val/loss and tokens/s.

How, in MLflow 3's own terms (read off its UI, not guessed):

- ``mlflow.sharedViewState.<key>``, an experiment tag holding the runs view's state as JSON, is what the UI's
  "share" button writes; ``?viewStateShareKey=<key>`` in the URL loads it. It carries the chart sections and cards,
  the table's columns, the run filter and order. Charts for metrics the state does not name are still generated,
  in sections after ours (``isAccordionReordered`` keeps our order).
- ``mlflow.runColor``, a run tag, is the colour the UI draws that run with (otherwise a hash of its id, where two
  runs can get near-identical shades).
- ``compareRunsMode=CHART`` opens the chart view rather than the table.
- ``workflowType=machine_learning`` opens the experiment in model-training mode: without it MLflow 3.17 uses the
  mode last chosen in that browser, by default GenAI, whose sidebar (traces, judges, prompts, an assistant) takes
  the place of the runs. The UI reads it from the route's query, on every experiment page.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from satlab.config.archs import ARCH_SPECS
from satlab.config.stores import sqlite_file

if TYPE_CHECKING:
    import mlflow

SHARE_TAG = "mlflow.sharedViewState."
COLOUR_TAG = "mlflow.runColor"
UI_ADDRESS = "http://127.0.0.1:5000"  # where `make ui` serves a local store (its UI_HOST and UI_PORT defaults)

# Distinct on a white background and for the common colour-vision deficiencies (Okabe-Ito, then Tableau's extras).
# In registry order the Transformer gets the blue and SATFormer (third) the vermillion: the paper's comparison in
# the two most distinct colours.
PALETTE = ("#0072B2", "#009E73", "#D55E00", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
           "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF")

LOSS_CURVES = ("val/loss", "train/loss")
TABLE_METRICS = ("val/loss", "system/tokens_per_sec")


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def arch_colour(arch: str) -> str:
    """An architecture's colour: its place in the registry, so the Transformer is the same blue in every
    experiment."""
    names = list(ARCH_SPECS)
    return colour(names.index(arch)) if arch in names else colour(len(names) + sum(map(ord, arch)))


X_AXIS = "tokens_seen"
"""The loss curves' x-axis: runs of different batch sizes (or experiments) line up on tokens, not on steps. Every
step a run logs at has one ``tokens_seen`` point (:mod:`satlab.training.mlflow_logger`), which is how MLflow pairs
a metric with the metric on its x-axis."""


def _line(key: str, section: str) -> dict:
    """A line-chart card as the UI's ``RunsChartsLineCardConfig`` serialises it, against :data:`X_AXIS`."""
    return {"uuid": f"satlab-{key}", "type": "LINE", "metricSectionId": section, "deleted": False,
            "isGenerated": True, "displayName": key, "metricKey": key, "selectedMetricKeys": [key],
            "runsCountToCompare": 100, "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
            "range": {}, "xAxisKey": "metric", "selectedXAxisMetricKey": X_AXIS, "yAxisKey": "metric",
            "yAxisExpressions": [], "ignoreOutliers": False, "useGlobalXaxisKey": False,
            "useGlobalLineSmoothing": True}


def _bar(key: str, section: str) -> dict:
    """A bar-chart card: one bar per run, its last value. Not marked ``isGenerated``: the UI turns a generated bar
    card into a line chart as soon as a run has the metric at a step above 0 (an end-of-run result is logged at the
    last step), which draws one dot per run."""
    return {"uuid": f"satlab-{key}", "type": "BAR", "metricSectionId": section, "deleted": False,
            "isGenerated": False, "displayName": key, "metricKey": key, "runsCountToCompare": 100}


def _section(uuid: str, name: str) -> dict:
    """A chart section, two cards a row (the UI's default is three small ones)."""
    return {"uuid": uuid, "name": name, "display": True, "isReordered": True, "deleted": False,
            "isGenerated": False, "columns": 2, "cardHeight": 420}


def _column(kind: str, key: str) -> str:
    """A runs-table column as the UI names it: ``metrics.`val/loss```."""
    return f"{kind}.`{key}`"


def tag_column(key: str) -> str:
    return _column("tags", key)


def param_column(key: str) -> str:
    return _column("params", key)


def comparison_state(run_filter: str = "", lines: Sequence[str] = LOSS_CURVES, bars: Sequence[str] = (),
                     columns: Iterable[str] = ()) -> dict:
    """The runs view: a first section with ``lines`` (the loss curves), a second with ``bars`` (one-point results,
    e.g. a study's accuracies), the table with the architecture, ``columns`` (from :func:`tag_column`,
    :func:`param_column`) and final val/loss and tokens/s, every run shown (the UI's default hides all but the
    first ten), ordered by val/loss. ``run_filter`` is a search as typed in the UI's search box."""
    sections = [_section("satlab-curves", "loss curves")]
    charts = [_line(key, "satlab-curves") for key in lines]
    if bars:
        sections.append(_section("satlab-results", "results"))
        charts += [_bar(key, "satlab-results") for key in bars]
    return {
        "searchFilter": run_filter,
        "orderByKey": _column("metrics", "val/loss"),
        "orderByAsc": True,
        "selectedColumns": [tag_column("arch"), *columns, *(_column("metrics", m) for m in TABLE_METRICS)],
        "compareRunSections": sections,
        "compareRunCharts": charts,
        "isAccordionReordered": True,
        "runsHiddenMode": "CUSTOM",  # with no run listed as hidden: all shown
        "hideEmptyCharts": True,
        "useGroupedValuesInCharts": True,
        "columnWidths": {"run_name": 260, **{_column("metrics", m): 170 for m in TABLE_METRICS}},
    }


def publish(client: mlflow.MlflowClient, experiment_id: str, key: str, state: dict) -> None:
    """Write the view ``key``. Several hosts of one study publish the same view at the same moment; MLflow's SQL
    store writes a new tag by insert, so the slower of two first writers fails on the unique key the faster one
    just wrote. That loser retries once, now as an update of the existing row."""
    from mlflow.exceptions import MlflowException

    tag, value = SHARE_TAG + key, json.dumps(state)
    try:
        client.set_experiment_tag(experiment_id, tag, value)
    except MlflowException:
        if tag not in client.get_experiment(experiment_id).tags:
            raise  # not the race: nobody else wrote this view
        client.set_experiment_tag(experiment_id, tag, value)


FAMILY_VIEW = "satlab-runs"


def publish_family_view(client: mlflow.MlflowClient, experiment_id: str, tracking_uri: str) -> str:
    """The comparison of every run of the experiment (a preset family: ``tiny`` holds tiny/transformer,
    tiny/satformer...); returns its URL."""
    publish(client, experiment_id, FAMILY_VIEW, comparison_state())
    return comparison_url(tracking_uri, experiment_id, FAMILY_VIEW)


def ui_address(tracking_uri: str) -> str:
    """Where the UI of this store is: the server itself, or where ``make ui`` serves a sqlite store."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else UI_ADDRESS


def ui_url(tracking_uri: str, route: str, **query: str) -> str:
    """The UI's page ``route`` (``experiments/<id>/runs``...) in model-training mode: every URL satlab prints."""
    return f"{ui_address(tracking_uri)}/#/{route}?{urlencode({**query, 'workflowType': 'machine_learning'})}"


def comparison_url(tracking_uri: str, experiment_id: str, key: str) -> str:
    return ui_url(tracking_uri, f"experiments/{experiment_id}/runs", compareRunsMode="CHART", viewStateShareKey=key)


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return ui_url(tracking_uri, f"experiments/{experiment_id}/runs/{run_id}")


def serve_command(tracking_uri: str) -> str | None:
    """The command that serves this store's UI at :func:`ui_address`; None for a tracking server (it is its own
    UI)."""
    if sqlite_file(tracking_uri) is None:
        return None
    from satlab.training.tracking import default_tracking_uri

    if sqlite_file(tracking_uri) == sqlite_file(default_tracking_uri()):
        return "make ui"
    return f"make ui STORE={tracking_uri}"


def open_lines(tracking_uri: str, url: str) -> list[tuple[str, str]]:
    """Summary-table rows: the comparison URL and, for a local store, the command to run first."""
    serve = serve_command(tracking_uri)
    return [("compare in MLflow", url)] + ([("  (serve it first)", serve)] if serve else [])
