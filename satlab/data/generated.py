"""A FineWeb-shaped parquet corpus made on this machine, for measuring and testing the data path at scale offline.

FineWeb-Edu's parquet files hold one web page per row: ``text`` plus ``id``, ``dump``, ``url``, ``date``,
``file_path``, ``language``, ``language_score``, ``token_count``, ``score`` and ``int_score``, in row groups of
a thousand or so rows, pages of a few kilobytes with a long tail. :func:`write_fineweb_like` writes files of that
shape whose texts are runs of consecutive lines of the embedded corpora (King James Bible chapters, Shakespeare),
so the text is English prose with a realistic bytes-per-token ratio for a BPE tokenizer. Lengths are log-normal
(median :data:`MEDIAN_BYTES`), clipped to [200 B, 100 kB]; everything follows from the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from satlab.data.common import SPLITS
from satlab.data.corpora import ensure_corpus

MEDIAN_BYTES = 2_500
"""Median document size; with the log-normal spread the mean is ~3.3 kB, about FineWeb-Edu's."""
ROW_GROUP = 1_000
COLUMNS = ("text", "id", "dump", "url", "date", "file_path", "language", "language_score", "token_count", "score",
           "int_score")


def _lines(cache_dir: Path) -> list[str]:
    """The non-blank lines of the embedded corpora, in order."""
    lines: list[str] = []
    for corpus in ("kjv", "shakespeare"):
        folder, _ = ensure_corpus(corpus, cache_dir, 0.05)
        for split in SPLITS:
            with open(folder / f"{split}.jsonl", encoding="utf-8") as f:
                lines += [line for row in f for line in json.loads(row)["text"].splitlines() if line.strip()]
    return lines


def write_fineweb_like(directory: str | Path, documents: int, files: int = 1, seed: int = 0,
                       cache_dir: str | Path = ".cache/satlab") -> list[Path]:
    """Write ``documents`` FineWeb-shaped rows into ``files`` parquet files under ``directory``; returns the paths.

    ``cache_dir`` is where the embedded corpora the text is drawn from are prepared (a few seconds, once).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = _lines(Path(cache_dir))
    ends = np.cumsum([len(line) + 1 for line in lines])
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(MEDIAN_BYTES), 0.75, documents), 200, 100_000).astype(np.int64)
    starts = rng.integers(0, len(lines), documents)
    paths = []
    for index, rows in enumerate(np.array_split(np.arange(documents), files)):
        texts = []
        for row in rows:
            first = int(starts[row])
            offset = ends[first - 1] if first else 0
            last = int(np.searchsorted(ends, offset + sizes[row])) + 1
            texts.append("\n".join(lines[first:max(last, first + 1)]))
        n = len(texts)
        table = pa.table({
            "text": texts,
            "id": [f"<urn:uuid:{seed:04x}-{row:012x}>" for row in rows],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{seed}/{row}" for row in rows],
            "date": ["2024-02-21T00:00:00Z"] * n,
            "file_path": [f"s3://commoncrawl/generated/{index:05d}.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": rng.uniform(0.65, 1.0, n),
            "token_count": [len(t) // 4 for t in texts],
            "score": rng.uniform(2.5, 5.0, n),
            "int_score": rng.integers(3, 6, n),
        })
        path = directory / f"{index:03d}_00000.parquet"
        pq.write_table(table, path, row_group_size=ROW_GROUP)
        paths.append(path)
    return paths
