"""`satlab bench --data`: how fast the data is prepared, in how much memory and disk, at 1, 2, ... processes, and
what that means for the paper presets' corpora.

The corpus is a generated FineWeb-shaped parquet (:mod:`satlab.data.generated`), the tokenizer a byte-level BPE
trained on it (the first, cold preparation, timed apart). Every later preparation starts from the same trained
tokenizer with the token files removed, so it times reading, tokenizing and writing only; each process count is
tried ``repeats`` times, interleaved with the others, and its fastest try counts (all are in the JSON). Memory is
the resident set of this process and its workers together, sampled from ``/proc`` four times a second.

The extrapolation takes the one-process rate as the rate of a core, the measured speed-up at the most processes
as the scaling efficiency, and no more cores than the one reading process can feed (its rows per second over a
core's documents per second), and assumes the Llama-2 tokenizer costs what this BPE does per token (both are byte-level
BPEs in ``tokenizers``; not measured here, the hub being offline).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from satlab.config.schema import DataConfig, TokenizerConfig
from satlab.data.generated import write_fineweb_like
from satlab.data.prepare import prepare_data
from satlab.data.sources import document_segments, resolve_source

PAPER_DOCUMENTS = {"small": 6_000_000, "medium": 11_500_000, "large": 22_500_000, "xl": 33_500_000}
"""``data.hub_max_documents`` of experiments/paper/<size>/_base.yaml."""
LLAMA_TOKENS_PER_DOCUMENT = 1_100
"""FineWeb-Edu's mean document in Llama-2 tokens, as the paper presets assume."""
CORES = (8, 32, 64)


class TreeMemory:
    """Peak and median resident memory of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.25):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    @staticmethod
    def _tree_rss() -> int:
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        tree, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
            tree.update(children)
            frontier += children
        total = 0
        for pid in tree:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in status.splitlines()
                           if line.startswith("VmRSS:")), 0)
        return total

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.samples.append(self._tree_rss())

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        """Peak, and the medians of the second and last quarters of the samples (equal when memory is flat)."""
        samples = self.samples or [self._tree_rss()]
        quarter = max(len(samples) // 4, 1)

        def median(values: list[int]) -> float:
            return float(sorted(values)[len(values) // 2])

        return {"peak_gb": max(samples) / 1e9, "second_quarter_gb": median(samples[quarter:2 * quarter] or samples)
                / 1e9, "last_quarter_gb": median(samples[-quarter:]) / 1e9}


def _files_sha256(paths: dict[str, Path]) -> str:
    digest = hashlib.sha256()
    for split in sorted(paths):
        with open(paths[split], "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def read_rate(cfg: DataConfig) -> dict[str, float]:
    """Rows per second that the reading process alone gets through (no tokenizing): the ceiling on the cores one
    preparation can feed."""
    segments, _, _ = document_segments(resolve_source(cfg), cfg)
    start, rows, text_bytes = time.perf_counter(), 0, 0
    for segment in segments:
        for batch in segment.batches(256):
            rows += len(batch)
            text_bytes += sum(len(text) for text in batch if isinstance(text, str))
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "chars_per_s": text_bytes / seconds}


def data_bench(workdir: str | Path, documents: int = 40_000, files: int = 4, procs: tuple[int, ...] = (1, 2),
               vocab_size: int = 8192, seed: int = 0, repeats: int = 2) -> dict[str, Any]:
    """Measure preparation at each of ``procs`` processes on ``documents`` generated rows, the fastest of
    ``repeats`` interleaved tries per count; see the module docstring."""
    workdir = Path(workdir)
    corpus = workdir / f"fineweb-like-{documents}-{files}-{seed}"
    if not corpus.is_dir():
        write_fineweb_like(corpus.with_suffix(".tmp"), documents, files, seed, cache_dir=workdir / "cache")
        os.replace(corpus.with_suffix(".tmp"), corpus)
    cache = workdir / "cache"
    cfg = DataConfig(source=str(corpus), cache_dir=str(cache), num_proc=max(procs),
                     tokenizer=TokenizerConfig(kind="bpe", vocab_size=vocab_size))
    shutil.rmtree(cache / "tokens", ignore_errors=True)
    shutil.rmtree(cache / "tokenizers", ignore_errors=True)
    report: dict[str, Any] = {"documents": documents, "files": files, "vocab_size": vocab_size,
                              "parquet_bytes": sum(p.stat().st_size for p in corpus.iterdir())}
    report["read"] = read_rate(cfg)
    start = time.perf_counter()
    cold = prepare_data(cfg, progress=False)
    report["cold"] = {"num_proc": max(procs), "seconds": time.perf_counter() - start}
    meta = cold.meta
    report.update(text_bytes=sum(meta["text_bytes"].values()), tokens=sum(meta["tokens"].values()),
                  token_bytes=sum(p.stat().st_size for p in cold.paths.values()))
    attempts: dict[int, list[dict[str, Any]]] = {n: [] for n in procs}
    for _ in range(repeats):  # interleaved, so a slow spell of a shared machine does not land on one count only
        for n in procs:
            shutil.rmtree(cold.directory)
            with TreeMemory() as memory:
                start = time.perf_counter()
                data = prepare_data(replace(cfg, num_proc=n), progress=False)
                seconds = time.perf_counter() - start
            attempts[n].append({"seconds": seconds, **memory.summary(), "sha256": _files_sha256(data.paths)})
    runs = []
    for n, tries in attempts.items():
        best = min(tries, key=lambda t: t["seconds"])
        runs.append({"num_proc": n, **best, "docs_per_s": sum(meta["documents"].values()) / best["seconds"],
                     "tokens_per_s": report["tokens"] / best["seconds"],
                     "all_seconds": [t["seconds"] for t in tries], "sha256": {t["sha256"] for t in tries}})
    for run in runs:
        run["sha256"] = sorted(run["sha256"])
    one = runs[0]["tokens_per_s"]
    for run in runs:  # the best try against the best, and the range over every pairing of tries
        run["speedup"] = run["tokens_per_s"] / one
        run["speedup_range"] = [min(runs[0]["all_seconds"]) / max(run["all_seconds"]),
                                max(runs[0]["all_seconds"]) / min(run["all_seconds"])]
    report["runs"] = runs
    report["identical"] = len({h for r in runs for h in r["sha256"]}) == 1
    widest = runs[-1]
    efficiency = min(widest["speedup"] / widest["num_proc"], 1.0)  # above 1 is the machine's noise, not a gain
    per_core_docs = runs[0]["docs_per_s"]
    ceiling = report["read"]["rows_per_s"] / per_core_docs
    report["extrapolation"] = {
        "per_core_tokens_per_s": one,
        "efficiency": efficiency,
        "reader_core_ceiling": ceiling,
        "presets": {size: {"tokens": docs * LLAMA_TOKENS_PER_DOCUMENT,
                           "hours": {c: docs * LLAMA_TOKENS_PER_DOCUMENT / (one * min(c, ceiling) * efficiency) / 3600
                                     for c in CORES}}
                    for size, docs in PAPER_DOCUMENTS.items()},
    }
    return report
