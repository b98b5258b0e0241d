"""The MLflow views a run or a study hands over: names, colours, the shared comparison view, where its UI is, and
the screenshot tool that proves a page rendered (with Chromium, where installed)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs

import pytest

from satlab.studies.loader import load_ablation, load_sweep
from satlab.studies.plans import GridPlan, SearchPlan
from satlab.studies.runs import CELL_TAG, GROUP_TAG
from satlab.studies.spec import readable_value, short_label
from satlab.training.tracking import default_tracking_uri
from satlab.training.views import (
    COLOUR_TAG,
    PALETTE,
    SHARE_TAG,
    arch_colour,
    comparison_state,
    comparison_url,
    open_lines,
    param_column,
    publish,
    run_url,
    serve_command,
    tag_column,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("value", "shown"), [(3.1e-3, "3.1e-3"), (0.0031415, "3.1e-3"), (0.25, "0.25"),
                                             (1.0, "1"), (2e5, "2e5"), (0.0, "0"), (3, "3"), ("satformer", "satformer"),
                                             (True, "true")])
def test_values_read_as_a_person_writes_them(value, shown):
    assert readable_value(value) == shown


def test_labels_use_the_last_part_of_a_key_unless_two_keys_share_it():
    assert short_label([("model.arch", "satformer"), ("train.seed", 1)]) == "arch=satformer seed=1"
    assert short_label([("model.satformer.gate_fn", "relu"), ("model.resformer.gate_fn", "x")]) == \
        "model.satformer.gate_fn=relu model.resformer.gate_fn=x"


def test_ablation_cells_are_named_by_their_values_and_coloured_by_group():
    spec = load_ablation("arch_tiny", ["axes.data.source=[shakespeare]", "axes.train.seed=[0,1]"])
    plan = GridPlan(spec)
    points = [plan.point(SimpleNamespace(number=i), dict(cell.values)) for i, cell in enumerate(plan.cells.values())]
    labels = {p.label for p in points}
    assert "source=shakespeare arch=satformer seed=1" in labels and len(labels) == len(points)
    colours: dict[str, set[str]] = {}
    for point in points:
        colours.setdefault(point.tags[GROUP_TAG], set()).add(point.tags[COLOUR_TAG])
        assert point.tags[CELL_TAG] == point.key
    assert all(len(c) == 1 for c in colours.values())  # the seeds of a group share their colour
    assert len({c.pop() for c in colours.values()}) == len(colours) == 10  # and the groups differ
    satformer = next(p for p in points if "arch=satformer" in p.label)
    assert satformer.tags[COLOUR_TAG] == arch_colour("satformer")  # one group per architecture: its colour


def test_groups_that_are_not_architectures_get_colours_of_their_own():
    plan = GridPlan(load_ablation("granularity"))
    points = [plan.point(SimpleNamespace(number=i), dict(cell.values)) for i, cell in enumerate(plan.cells.values())]
    by_group = {p.tags[GROUP_TAG]: p.tags[COLOUR_TAG] for p in points}
    assert len(set(by_group.values())) == len(by_group) > 1


def test_sweep_trials_are_named_by_architecture_and_values():
    spec = load_sweep("lr_tiny")
    plan = SearchPlan(spec, "transformer", 3)
    point = plan.point(SimpleNamespace(number=7), {"model.arch": "satformer", "optim.lr": 0.0031})
    assert point.label == "satformer lr=3.1e-3 (trial 7)" and point.tags[COLOUR_TAG] == arch_colour("satformer")
    fixed = plan.point(SimpleNamespace(number=2), {"optim.lr": 0.02})
    assert fixed.label == "transformer lr=0.02 (trial 2)"


def test_architectures_keep_one_colour_each_and_the_papers_pair_is_blue_against_vermillion():
    from satlab.models import ARCHITECTURES

    colours = [arch_colour(name) for name in ARCHITECTURES]
    assert len(set(colours)) == len(colours) <= len(PALETTE)
    assert (arch_colour("transformer"), arch_colour("satformer")) == ("#0072B2", "#D55E00")


def test_the_comparison_state_leads_with_the_loss_curves_and_shows_every_run():
    state = comparison_state("tags.`x` = 'y'", bars=["zero_shot/offline_zero_shot_avg"],
                             columns=[tag_column("satlab.ablation.group"), param_column("optim.lr")])
    sections = [s["uuid"] for s in state["compareRunSections"]]
    assert sections == ["satlab-curves", "satlab-results"] and state["isAccordionReordered"]
    charts = [(c["metricSectionId"], c["type"], c["metricKey"]) for c in state["compareRunCharts"]]
    assert charts == [("satlab-curves", "LINE", "val/loss"), ("satlab-curves", "LINE", "train/loss"),
                      ("satlab-results", "BAR", "zero_shot/offline_zero_shot_avg")]
    assert state["selectedColumns"] == ["tags.`arch`", "tags.`satlab.ablation.group`", "params.`optim.lr`",
                                        "metrics.`val/loss`", "metrics.`system/tokens_per_sec`"]
    assert state["runsHiddenMode"] == "CUSTOM" and state["searchFilter"] == "tags.`x` = 'y'"
    json.dumps(state)  # what the experiment tag holds


def test_results_are_bars_and_loss_curves_are_drawn_against_tokens_seen():
    """docs/views.md promises bars for a study's end-of-run results: MLflow's UI redraws a bar card it thinks it
    generated as a line (one dot per run) once the metric has a point past step 0, so the card is the view's own.
    The loss curves use tokens seen as their x-axis, each card on its own (not the UI's global step axis)."""
    charts = comparison_state(bars=["zero_shot/offline_zero_shot_avg"])["compareRunCharts"]
    (bar,) = [c for c in charts if c["type"] == "BAR"]
    assert bar["isGenerated"] is False and bar["deleted"] is False
    for line in (c for c in charts if c["type"] == "LINE"):
        assert (line["xAxisKey"], line["selectedXAxisMetricKey"], line["useGlobalXaxisKey"]) == \
            ("metric", "tokens_seen", False)


def test_the_url_points_at_the_ui_that_serves_the_store_and_says_how_to_start_it(tmp_path):
    assert comparison_url("http://mlflow.lab:5000/", "3", "k") == \
        "http://mlflow.lab:5000/#/experiments/3/runs?compareRunsMode=CHART&viewStateShareKey=k" \
        "&workflowType=machine_learning"
    assert comparison_url(default_tracking_uri(), "3", "k").startswith("http://127.0.0.1:5000/#/experiments/3/")
    assert serve_command(default_tracking_uri()) == "make ui"
    other = f"sqlite:///{tmp_path}/mlflow.db"
    assert serve_command(other) == f"make ui STORE={other}"
    assert serve_command("http://mlflow.lab:5000") is None
    assert [label for label, _ in open_lines("http://mlflow.lab:5000", "u")] == ["compare in MLflow"]


@pytest.mark.process
def test_every_printed_url_opens_the_experiment_in_model_training_mode_not_genai():
    """Without ``workflowType=machine_learning`` in the route's query MLflow 3.17 opens its GenAI sidebar."""
    for url in (comparison_url("http://h:5000", "3", "k"), run_url(default_tracking_uri(), "3", "abc")):
        route, query = url.split("#/", 1)[1].split("?", 1)
        assert route.startswith("experiments/3/runs") and parse_qs(query)["workflowType"] == ["machine_learning"]
    assert run_url("http://h:5000", "3", "abc").startswith("http://h:5000/#/experiments/3/runs/abc?")


def test_make_ui_serves_the_store_it_is_given_and_refuses_a_server_url(tmp_path):
    store = f"sqlite:///{tmp_path}/mlflow.db"
    dry = subprocess.run(["make", "-n", "ui", f"STORE={store}", "PY=true", "STAMP="], cwd=ROOT, capture_output=True,
                         text=True)
    assert f"--backend-store-uri {store}" in dry.stdout and f"{tmp_path}/artifacts" in dry.stdout, dry.stdout
    refused = subprocess.run(["make", "ui", "STORE=http://mlflow.lab:5000", "STAMP="], cwd=ROOT, capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "tracking server is its own UI" in refused.stderr


needs_chromium = pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium: apt-get install chromium")


@pytest.mark.slow  # make test-full
@needs_chromium
@pytest.mark.process
def test_the_screenshot_tool_saves_a_rendered_page_and_fails_on_one_that_never_renders(tmp_path):
    """A page that fills itself in after a second passes its check; a skeleton that never does is saved as
    ``*.failed.png`` and makes the tool exit 1. The check also looks inside a sandboxed iframe, as MLflow shows an
    HTML artifact."""
    (tmp_path / "late.html").write_text(
        "<html><body><div id=chart></div><iframe sandbox srcdoc=\"<title>report</title><img id=i src='data:image/"
        "gif;base64,R0lGODlhAQABAAAAACw='>\"></iframe><script>setTimeout(() => document.getElementById('chart')"
        ".textContent = 'drawn', 1000)</script></body></html>")
    (tmp_path / "skeleton.html").write_text("<html><body><div class=skeleton></div></body></html>")
    tool = [sys.executable, str(ROOT / "scripts" / "cdp_screenshot.py"), "--wait", "6"]
    drawn = "document.getElementById('chart')?.textContent === 'drawn'"
    in_frame = "document.title === 'report' && document.images.length === 1"
    ok = subprocess.run([*tool, str(tmp_path / "a.png"), (tmp_path / "late.html").as_uri(), drawn,
                         str(tmp_path / "b.png"), (tmp_path / "late.html").as_uri(), in_frame],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "b.png").exists()
    bad = subprocess.run([*tool, str(tmp_path / "c.png"), (tmp_path / "skeleton.html").as_uri(), drawn],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "FAILED" in bad.stderr and "not rendered" in bad.stderr
    assert not (tmp_path / "c.png").exists() and (tmp_path / "c.failed.png").exists()


@pytest.fixture
def silent_port():
    """A port that takes connections (the kernel completes them into the backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        yield server.getsockname()[1]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


SCREENSHOT = [sys.executable, str(ROOT / "scripts" / "cdp_screenshot.py")]


@needs_chromium
@pytest.mark.process
def test_the_screenshot_tool_gives_up_on_a_server_that_never_answers_within_its_deadline(tmp_path, silent_port):
    """The navigation is inside ``--wait``: a server that accepts and never answers fails, not hangs."""
    started = time.monotonic()
    proc = subprocess.run([*SCREENSHOT, "--wait", "3", str(tmp_path / "a.png"), f"http://127.0.0.1:{silent_port}/",
                           "true"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no answer from the server within 3 s" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 45 and not (tmp_path / "a.png").exists()


@needs_chromium
@pytest.mark.process
def test_the_screenshot_tool_fails_on_an_error_page_whatever_the_check(tmp_path):
    """A check that holds on any page ("true") still fails on nothing listening (Chromium's "site can't be reached"
    page) and on an HTTP error status; a page served with 200 passes."""
    (tmp_path / "ok.html").write_text("<html><body>fine</body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        proc = subprocess.run([*SCREENSHOT, "--wait", "10", str(tmp_path / "refused.png"),
                               f"http://127.0.0.1:{free_port()}/", "true", str(tmp_path / "missing.png"),
                               f"{base}/missing.html", "true", str(tmp_path / "ok.png"), f"{base}/ok.html", "true"],
                              capture_output=True, text=True, timeout=120)
        server.shutdown()
    assert proc.returncode == 1, proc.stderr
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2 and "net::ERR_CONNECTION_REFUSED" in failed[0] and "HTTP status 404" in failed[1]
    assert (tmp_path / "ok.png").exists() and not (tmp_path / "refused.png").exists()
    assert not (tmp_path / "missing.png").exists()


def process_groups() -> dict[int, int]:
    """pid -> process group of every live process (from /proc; a zombie has ended, only not been reaped)."""
    groups = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                groups[int(stat.parent.name)] = int(fields[2])
    return groups


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@needs_chromium
@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_screenshot_tool_takes_its_chromium_with_it_when_stopped(tmp_path, silent_port, signum):
    """Stopped while a page loads, the tool ends and leaves no process of its browser's group behind."""
    proc = subprocess.Popen([*SCREENSHOT, "--wait", "120", str(tmp_path / "a.png"),
                             f"http://127.0.0.1:{silent_port}/", "true"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    group = None
    try:
        deadline = time.monotonic() + 60
        while not (browser := children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no chromium started"
            time.sleep(0.2)
        (group,) = browser  # Chromium leads a process group of its own
        while sum(g == group for g in process_groups().values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # its renderer and helpers up, the page loading
        time.sleep(2)
        proc.send_signal(signum)
        returncode = proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while (left := [pid for pid, g in process_groups().items() if g == group]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [] and returncode == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
        if group is not None:  # what a failing tool left behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


@pytest.mark.slow
@needs_chromium
@pytest.mark.process
def test_the_screenshot_script_shows_every_view_rendered(tmp_path):
    """scripts/ui_screenshots.sh end to end (about 3 minutes here): two runs, an ablation and a sweep, five pages,
    each saved only once its check held (the comparison's lines, the parent's metrics, the report's images, the
    dashboard's best trial equal to satlab's)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "ui_screenshots.sh"), str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "PY": sys.executable}, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in ("runs_comparison", "ablation_comparison", "ablation_parent", "ablation_report", "dashboard"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.failed.png"))


def test_a_view_published_by_two_hosts_at_once_is_written_by_the_slower_one_too(tmp_path):
    """The race two hosts of one study run: between the slower writer's check and its insert the faster one
    writes the same view, so the insert fails on the unique key; the slower one's state must still land."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("race")
    store = client._tracking_client.store
    insert = store.set_experiment_tag
    calls = []

    def faster_host_wins_first(experiment_id, tag):  # the other host's row appears, then ours fails as MLflow's does
        calls.append(tag.value)
        if len(calls) == 1:
            insert(experiment_id, type(tag)(tag.key, '{"other": "host"}'))
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: experiment_tags.key")
        insert(experiment_id, tag)

    store.set_experiment_tag = faster_host_wins_first
    publish(client, experiment, "satlab-study-x", {"ours": 1})
    assert json.loads(client.get_experiment(experiment).tags[SHARE_TAG + "satlab-study-x"]) == {"ours": 1}
    assert len(calls) == 2

    def store_down(experiment_id, tag):  # any other failure is neither retried nor swallowed
        calls.append(tag.value)
        raise MlflowException("database is locked")

    calls.clear()
    store.set_experiment_tag = store_down
    with pytest.raises(MlflowException, match="locked"):
        publish(client, experiment, "satlab-study-y", {"ours": 2})
    assert len(calls) == 1


def test_the_run_summary_prints_the_whole_url_on_one_line_however_narrow_the_console():
    """In a table cell rich cut the URL to the column ("...workflowType=ma…"), which opened the wrong view."""
    import io

    from rich.console import Console

    from satlab.config.loader import load_experiment
    from satlab.training.summary import print_summary

    url = comparison_url(default_tracking_uri(), "12", "satlab-runs")
    result = SimpleNamespace(params=1, non_embedding_params=1, tokens=1, initial_val_loss=None, final_val_loss=None,
                             final_train_loss=None, recall={}, tokens_per_sec=None, wall_seconds=1.0, eval_seconds=None,
                             run_dir=Path("runs/x"), mlflow_run_id="abc", experiment="tiny",
                             tracking_uri=default_tracking_uri(), view_url=url)
    for width in (80, 140):
        out = Console(file=io.StringIO(), width=width)
        print_summary(load_experiment("default"), result, console=out)
        assert f"compare in MLflow: {url}\n" in out.file.getvalue()
