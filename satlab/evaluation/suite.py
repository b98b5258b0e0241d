"""Running lm-eval tasks on a satlab model: the offline suite, the paper's hub groups, or any lm-eval task names.

Results come back as ``{task: {metric: value}}`` with lm-eval's ``,none`` filter suffix dropped (other filters
become ``metric/filter``), one entry per task, per sized task and per group, plus :data:`AVERAGES_KEY` holding
the suite averages. :func:`metric_keys` flattens them to MLflow keys ``zero_shot/<task>/<metric>`` and
``zero_shot/offline_zero_shot_avg``, ``zero_shot/offline_retrieval_avg``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch
from urllib.parse import urlparse

from tqdm import tqdm

from satlab.config.errors import ConfigError
from satlab.data.corpora import CORPORA
from satlab.data.tokenizer import TextTokenizer
from satlab.evaluation.tasks import (
    AVERAGES,
    FAMILIES,
    OFFLINE_SUITE,
    PAPER_GROUPS,
    family_of,
    split_task_names,
    unknown_task_message,
)
from satlab.evaluation.tasks.build import build_offline_tasks, task_stats
from satlab.models import DecoderLM

DEFAULT_CACHE_DIR = ".cache/satlab"
AVERAGES_KEY = "averages"
METRIC_PREFIX = "zero_shot"
"""Every task here runs zero-shot. MLflow orders a run's chart sections by name, and ``eval/`` put the one-point
end-of-run charts in front of the loss curves; ``zero_shot/`` sorts after ``train/`` and ``val/``."""
"""The results entry with the suite averages; :func:`metric_keys` logs them without a task part."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_/. -]")


def run_offline_suite(model: DecoderLM, tokenizer: TextTokenizer, tasks: list[str] | None = None,
                      limit: int | None = None, cache_dir: str | Path = DEFAULT_CACHE_DIR, seed: int = 0,
                      corpus: str = "shakespeare", val_fraction: float = 0.05,
                      batch_size: int | None = None) -> dict[str, dict[str, float]]:
    """The offline suite (or the offline ``tasks`` named) on a model in memory; no network needed.

    ``limit`` is the number of items per task (defaults in :data:`satlab.evaluation.tasks.FAMILIES`), ``seed``
    picks the generated items, ``corpus``/``val_fraction`` the embedded corpus whose test split feeds the text
    tasks (pass the model's training corpus so that split is truly held out; see :func:`eval_corpus`).
    """
    tasks = tasks or [OFFLINE_SUITE]
    _, hub = split_task_names(tasks)
    if hub:
        raise ConfigError(f"run_offline_suite runs offline tasks only, not {', '.join(hub)}; use run_tasks for "
                          "lm-eval hub tasks.")
    return run_tasks(model, tokenizer, tasks, limit, cache_dir, seed, corpus, val_fraction, batch_size)


def run_tasks(model: DecoderLM, tokenizer: TextTokenizer, tasks: Sequence[str], limit: int | None = None,
              cache_dir: str | Path = DEFAULT_CACHE_DIR, seed: int = 0, corpus: str = "shakespeare",
              val_fraction: float = 0.05, batch_size: int | None = None,
              bootstrap_iters: int = 0, progress: bool = True) -> dict[str, dict[str, float]]:
    """Any mix of offline task names, ``paper_zero_shot``/``paper_retrieval`` and lm-eval task names.

    For hub tasks ``limit`` is lm-eval's items per task; they need the Hugging Face hub unless their datasets are
    cached and ``HF_DATASETS_OFFLINE=1`` is set. ``bootstrap_iters`` > 0 adds lm-eval's ``*_stderr`` metrics.
    ``progress=False`` hides the progress bars (lm-eval's included).
    The model is left in the train/eval mode it came in, and the global random generators are not reseeded (so
    a training run that evaluates midway keeps its random streams; the scoring itself draws no random numbers).
    lm-eval is imported here, not with the module: it brings ``datasets`` and pandas, about a second and a half
    in every training process, most of which never evaluate (``eval.at_end: false``).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from satlab.evaluation.lm_adapter import SatlabLM

    offline, hub = split_task_names(list(tasks))
    folder = None
    if offline:
        folder = build_offline_tasks(tokenizer, cache_dir, seed, limit, corpus, val_fraction)
        _check_fit(task_stats(folder), offline, model.cfg.max_seq_len)
    if hub:
        _require_hub(hub)
        manager = TaskManager(include_path=folder)
        missing = [name for name in hub if name not in manager.all_tasks]
        if missing:
            raise ConfigError(" ".join(unknown_task_message(name, manager.all_tasks) for name in missing))
    else:
        manager = TaskManager(include_path=folder, include_defaults=False)
    was_training = model.training
    try:
        lm = SatlabLM(model=model, tokenizer=tokenizer, batch_size=batch_size)
        with progress_bars(progress):
            output = simple_evaluate(lm, tasks=offline + hub, task_manager=manager, limit=limit, log_samples=False,
                                     bootstrap_iters=bootstrap_iters, random_seed=None, numpy_random_seed=None,
                                     torch_random_seed=None)
    except OSError as error:  # datasets' ConnectionError and the hub client's errors are all OSErrors
        if not hub:
            raise
        raise ConfigError(f"loading the lm-eval hub tasks {', '.join(hub)} failed ({type(error).__name__}: "
                          f"{error}); they download their datasets from the Hugging Face hub. Without the network, "
                          f"run the offline suite instead: tasks={OFFLINE_SUITE}.") from error
    finally:
        model.train(was_training)
    return with_seconds(with_averages(collect_results(output["results"])), lm.task_seconds)


@contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """Hide the evaluation's progress bars unless ``shown``. lm-eval draws one while building each task's requests
    (``lm_eval.api.task``) with no switch to turn it off, so the ``tqdm`` that its modules and the adapter call is
    replaced by a disabled one for the evaluation only; tqdm's ``TQDM_DISABLE`` is read once, at its import."""
    if shown:
        yield
        return
    import lm_eval.api.model
    import lm_eval.api.task

    from satlab.evaluation import lm_adapter

    def quiet(*args, **kwargs) -> tqdm:  # not functools.partial: a caller's own disable=False would win
        return tqdm(*args, **{**kwargs, "disable": True})

    with patch.object(lm_eval.api.task, "tqdm", quiet), patch.object(lm_eval.api.model, "tqdm", quiet), \
            patch.object(lm_adapter, "tqdm", quiet):
        yield


def eval_corpus(source: str) -> str:
    """The embedded corpus to draw held-out text from for a model trained on ``source`` (``cfg.data.source``):
    that corpus itself when it is an embedded one, else shakespeare."""
    return source if source in CORPORA else "shakespeare"


def collect_results(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """lm-eval's ``results`` section as ``{task: {metric: value}}``: the ``metric,filter`` entries with a number
    (not alias, sample counts or ``N/A`` stderr), ``,none`` dropped, other filters as ``metric/filter``, names
    limited to what MLflow accepts."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        clean = {}
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name in ("", "none") else f"{metric}/{filter_name}"
            clean[_UNSAFE.sub("_", name)] = float(value)
        if clean:
            out[_UNSAFE.sub("_", task)] = clean
    return out


def with_averages(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Adds :data:`AVERAGES_KEY`: each average of :data:`satlab.evaluation.tasks.AVERAGES` whose member families
    all ran (the mean of their primary metrics, a sized family's being lm-eval's mean over its sizes)."""
    averages = {}
    for name, members in AVERAGES.items():
        values = [results.get(m, {}).get(FAMILIES[m].primary) for m in members]
        if all(v is not None for v in values):
            averages[name] = sum(values) / len(values)
    return {**results, AVERAGES_KEY: averages} if averages else results


def with_seconds(results: dict[str, dict[str, float]], task_seconds: dict[str, float]) -> dict[str, dict[str, float]]:
    """Adds each task's model time as its metric ``seconds`` (a sized family's: the sum over its sizes)."""
    out = {task: dict(metrics) for task, metrics in results.items()}
    for task, seconds in task_seconds.items():
        out.setdefault(task, {})["seconds"] = seconds
        family = family_of(task)
        if family is not None and family.sizes and family.name in out:
            out[family.name]["seconds"] = out[family.name].get("seconds", 0.0) + seconds
    return out


def metric_keys(results: dict[str, dict[str, float]], prefix: str = METRIC_PREFIX) -> dict[str, float]:
    """Flat MLflow metric keys: ``<prefix>/<task>/<metric>``, and ``<prefix>/<average>`` for the averages."""
    flat = {}
    for task, metrics in results.items():
        for metric, value in metrics.items():
            flat[f"{prefix}/{metric}" if task == AVERAGES_KEY else f"{prefix}/{task}/{metric}"] = value
    return flat


def _check_fit(stats: dict[str, dict[str, int]], names: list[str], max_seq_len: int) -> None:
    """Offline items longer than the model's context would be cut from the left by lm-eval, losing what the
    retrieval tasks ask for; refuse rather than report a meaningless number."""
    tasks = [t for name in names for t in (FAMILIES[name].tasks if name in FAMILIES else [name])]
    too_long = [f"{t} ({stats[t]['max_tokens']} tokens)" for t in tasks if stats[t]["max_tokens"] > max_seq_len]
    if too_long:
        raise ConfigError(f"the model's context holds {max_seq_len} tokens (model.max_seq_len) but these tasks "
                          f"have longer items: {', '.join(too_long)}; leave them out, e.g. name the smaller sizes.")


def _require_hub(hub: list[str]) -> None:
    """Fails fast offline: the datasets library otherwise retries each download for about half a minute."""
    if any(os.environ.get(flag, "0") not in ("0", "") for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        return
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as error:
        groups = "; ".join(f"{group} = {', '.join(members)}" for group, members in PAPER_GROUPS.items())
        raise ConfigError(
            f"the lm-eval tasks {', '.join(hub)} download their datasets from the Hugging Face hub, which is not "
            f"reachable ({host}: {error}). Without the network, run the offline suite instead: "
            f"tasks={OFFLINE_SUITE} (or set HF_DATASETS_OFFLINE=1 to use datasets cached earlier). The paper "
            f"groups: {groups}.") from error
