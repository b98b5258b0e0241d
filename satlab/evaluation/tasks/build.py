"""Writes the offline suite into ``<cache_dir>/eval_tasks/<key>/``: one ``<task>.jsonl`` of items and one
``<task>.yaml`` lm-eval config per task, a group config per sized family and ``meta.json``.

The task configs ``include`` the templates next to this file (by absolute path) and name their data file, so the
folder is an lm-eval ``include_path`` as it stands (``lm_eval --include_path <folder> --tasks satlab_mqar``). The key
hashes everything the files depend on: the sources of this package (generators, catalog and templates), the
tokenizer fingerprint, seed, item counts, the held-out split's sha256 and the folder's own path; the same inputs
always give byte-identical files, and editing a generator regenerates them.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from satlab.config.errors import ConfigError
from satlab.data.common import META_FILE, atomic_directory, read_json, stable_hash, write_json
from satlab.data.tokenizer import TextTokenizer
from satlab.evaluation.tasks import FAMILIES, Family
from satlab.evaluation.tasks.recall import make_items, mqar_item, phonebook_item, swde_item
from satlab.evaluation.tasks.text import held_out_documents, make_cloze, make_cloze_choice, make_mc_continuation

TEMPLATE_DIR = Path(__file__).resolve().parent


def build_offline_tasks(tokenizer: TextTokenizer, cache_dir: str | Path = ".cache/satlab", seed: int = 0,
                        limit: int | None = None, corpus: str = "shakespeare", val_fraction: float = 0.05) -> Path:
    """The folder of the offline suite for this tokenizer, generating it when it is not cached yet.

    ``limit`` is the number of items per task (default: each family's ``docs``); ``corpus`` and ``val_fraction``
    pick the embedded corpus whose test split feeds the text tasks (use the model's own, so that split is held out).
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"limit is {limit}; it must be a positive number of items per task, e.g. 50.")
    cache_dir = Path(cache_dir).resolve()
    docs, corpus_sha = held_out_documents(corpus, str(cache_dir), val_fraction)
    counts = {name: limit or family.docs for name, family in FAMILIES.items()}
    sources = sorted([*TEMPLATE_DIR.glob("*.py"), *TEMPLATE_DIR.glob("*.yaml")])
    spec = {
        "tokenizer": tokenizer.fingerprint, "seed": seed, "counts": counts, "corpus": corpus,
        "corpus_test_sha256": corpus_sha, "package_dir": str(TEMPLATE_DIR),
        "sources": stable_hash({p.name: p.read_text(encoding="utf-8") for p in sources}),
    }
    target = cache_dir / "eval_tasks" / stable_hash(spec)
    if (target / META_FILE).exists():
        return target
    with atomic_directory(target) as tmp:
        tasks = {}
        for family in FAMILIES.values():
            for size, task in zip(family.sizes or (None,), family.tasks, strict=True):
                items = _items(family, size, docs, tokenizer, counts[family.name], seed)
                if not items:
                    raise ConfigError(f"the test split of corpus '{corpus}' yields no items for {task}; evaluate "
                                      "with a larger embedded corpus (shakespeare or kjv).")
                _write_task(tmp, target, family, task, items)
                tasks[task] = {"docs": len(items), "max_tokens": _max_tokens(items, tokenizer)}
            if family.sizes:
                _write_yaml(tmp / f"{family.name}.yaml", {
                    "group": family.name, "task": family.tasks,
                    "aggregate_metric_list": [{"metric": family.primary, "aggregation": "mean",
                                               "weight_by_size": False}],
                    "metadata": {"version": 1.0}})
        write_json(tmp / META_FILE, {"spec": spec, "tasks": tasks})
    return target


def task_stats(folder: Path) -> dict[str, dict[str, int]]:
    """Per task of a built folder: ``docs`` (items) and ``max_tokens`` (longest context + choice)."""
    meta = read_json(Path(folder) / META_FILE)
    if meta is None:
        raise ConfigError(f"'{folder}' is not a built offline task folder (no {META_FILE}).")
    return meta["tasks"]


def _items(family: Family, size: int | None, docs: list[list[str]], tokenizer: TextTokenizer, n: int,
           seed: int) -> list[dict]:
    text_tasks = {"satlab_cloze": make_cloze, "satlab_cloze_choice": make_cloze_choice,
                  "satlab_mc_continuation": make_mc_continuation}
    if family.name in text_tasks:
        return text_tasks[family.name](docs, tokenizer, n, seed)
    make = {
        "satlab_mqar": lambda rng: mqar_item(rng, size),
        "satlab_swde_like": lambda rng: swde_item(rng, size),
        "satlab_phonebook": lambda rng: phonebook_item(rng, size, tokenizer),
    }[family.name]
    return make_items(make, n, seed, f"{family.name}_{size}")


def _write_task(tmp: Path, target: Path, family: Family, task: str, items: list[dict]) -> None:
    """The data file and the task config; the config names the data where ``tmp`` will end up (``target``)."""
    with open(tmp / f"{task}.jsonl", "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    _write_yaml(tmp / f"{task}.yaml", {
        "include": str(TEMPLATE_DIR / family.template),
        "task": task,
        "dataset_kwargs": {"data_files": {"test": str(target / f"{task}.jsonl")},
                           "cache_dir": str(target / "hf_datasets")},
    })


def _write_yaml(path: Path, config: dict) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8")


def _max_tokens(items: list[dict], tokenizer: TextTokenizer) -> int:
    texts = [item["context"] + c for item in items for c in item.get("choices", [item.get("target", "")])]
    return max(len(ids) for ids in tokenizer.encode_batch(texts))
