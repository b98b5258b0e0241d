"""``data.mix``: synthetic associative-recall documents mixed into the train split only, in the requested share,
deterministically, in formats and with keys the evaluation never uses, each query answerable only by looking back."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from satlab.config.display import config_from_yaml, to_yaml
from satlab.config.errors import ConfigError
from satlab.config.loader import load_experiment
from satlab.config.schema import MIX_SOURCES, DataConfig, TokenizerConfig
from satlab.data import PreparedData, prepare_data
from satlab.data.synthetic import GENERATORS, KEYS, synthetic_document
from satlab.evaluation.tasks.recall import CITIES, EMPLOYERS, FIRST_NAMES, LAST_NAMES

WORDS = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake", "the", "darling",
         "buds", "of", "may", "summer", "lease", "hath", "all", "too", "short", "a", "date"]
SEPARATOR = r"\s*(?:=>|->|is)\s*"


def write_corpus(root: Path, files: int = 60, lines: int = 40) -> Path:
    """Small plain-text files (one document each, ~4 KB): about 220 KB of train text."""
    rng = np.random.default_rng(0)
    folder = root / "corpus"
    folder.mkdir()
    for i in range(files):
        text = "\n".join(" ".join(rng.choice(WORDS, size=16)) for _ in range(lines))
        (folder / f"doc{i:02d}.txt").write_text(text + "\n", encoding="utf-8")
    return folder


def config(root: Path, corpus: Path, mix: dict[str, float] | None = None, kind: str = "byte",
           cache: str = "cache") -> DataConfig:
    return DataConfig(source=str(corpus), cache_dir=str(root / cache), val_fraction=0.1, mix=mix or {},
                      tokenizer=TokenizerConfig(kind=kind, vocab_size=300))


def documents(data: PreparedData, split: str) -> list[tuple[int, ...]]:
    """The documents of a packed split, as tuples of token ids (EOS dropped)."""
    tokens = np.asarray(data.open(split))
    ends = np.flatnonzero(tokens == data.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tuple(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, PreparedData, PreparedData]:
    root = tmp_path_factory.mktemp("mix")
    corpus = write_corpus(root)
    plain = prepare_data(config(root, corpus), progress=False)
    mixed = prepare_data(config(root, corpus, {"recall": 0.1}), progress=False)
    return root, corpus, plain, mixed


def test_share_and_only_train_is_mixed(prepared: tuple[Path, Path, PreparedData, PreparedData]) -> None:
    _, _, plain, mixed = prepared
    mix = mixed.meta["mix"]
    assert "mix" not in plain.meta and mixed.directory != plain.directory
    assert mix["requested"] == {"recall": 0.1}
    assert abs(mix["share"]["recall"] - 0.1) < 0.01
    assert mix["tokens"]["corpus"] == plain.meta["tokens"]["train"]
    assert mixed.meta["tokens"]["train"] == sum(mix["tokens"].values()) == len(mixed.open("train"))
    assert mixed.paths["train"].read_bytes() != plain.paths["train"].read_bytes()
    for split in ("validation", "test"):
        assert mixed.paths[split].read_bytes() == plain.paths[split].read_bytes()
        assert mixed.meta["tokens"][split] == plain.meta["tokens"][split]
    assert sorted(p.name for p in mixed.directory.iterdir()) == sorted(p.name for p in plain.directory.iterdir())

    # The mixed train split is the corpus, in its own order and untouched, with recall documents 0..n-1 (in index
    # order) interleaved between its documents, not appended.
    docs = documents(mixed, "train")
    synthetic = [tuple(mixed.tokenizer.encode(synthetic_document("recall", i).text))
                 for i in range(mix["documents"]["recall"])]
    is_synthetic = [d in set(synthetic) for d in docs]
    assert [d for d, s in zip(docs, is_synthetic, strict=True) if not s] == documents(plain, "train")
    assert [d for d, s in zip(docs, is_synthetic, strict=True) if s] == synthetic
    first, last = is_synthetic.index(True), len(is_synthetic) - 1 - is_synthetic[::-1].index(True)
    assert not all(is_synthetic[first:last + 1])


def test_mix_is_deterministic_and_cached(prepared: tuple[Path, Path, PreparedData, PreparedData]) -> None:
    root, corpus, _, mixed = prepared
    again = prepare_data(config(root, corpus, {"recall": 0.1}, cache="other"), progress=False)
    assert again.directory.name == mixed.directory.name
    assert again.paths["train"].read_bytes() == mixed.paths["train"].read_bytes()
    assert again.meta["mix"] == mixed.meta["mix"]
    assert prepare_data(config(root, corpus, {"recall": 0.1}), progress=False).directory == mixed.directory
    other_share = prepare_data(config(root, corpus, {"recall": 0.2}), progress=False)
    assert other_share.directory != mixed.directory and abs(other_share.meta["mix"]["share"]["recall"] - 0.2) < 0.01


def test_bpe_is_trained_on_the_corpus_only(prepared: tuple[Path, Path, PreparedData, PreparedData]) -> None:
    root, corpus, _, _ = prepared
    plain = prepare_data(config(root, corpus, kind="bpe", cache="bpe"), progress=False)
    mixed = prepare_data(config(root, corpus, {"recall": 0.05}, kind="bpe", cache="bpe"), progress=False)
    assert mixed.tokenizer.fingerprint == plain.tokenizer.fingerprint
    assert mixed.paths["validation"].read_bytes() == plain.paths["validation"].read_bytes()
    assert mixed.meta["mix"]["tokenizer_trained_on"] == "corpus only"


def test_mix_config_is_validated(tmp_path: Path) -> None:
    cfg = load_experiment("tiny/transformer", ["data.mix.recall=0.1"])
    assert cfg.data.mix == {"recall": 0.1}
    assert config_from_yaml(to_yaml(cfg)).data.mix == {"recall": 0.1}
    assert load_experiment("tiny/transformer").data.mix == {}

    with pytest.raises(ConfigError) as excinfo:
        load_experiment("tiny/transformer", ["data.mix.recal=0.1"])
    assert "unknown data.mix source 'recal' (did you mean 'recall'?); valid: copy, recall" in excinfo.value.problems
    for bad in ("0.7", "0", "-0.1"):
        with pytest.raises(ConfigError, match=re.escape("data.mix.recall must be in (0, 0.5]")):
            load_experiment("tiny/transformer", [f"data.mix.recall={bad}"])
    with pytest.raises(ConfigError, match="data.mix"):
        load_experiment("tiny/transformer", ["data.mix.recall=lots"])
    with pytest.raises(ConfigError, match="did you mean 'recall'"):
        prepare_data(DataConfig(cache_dir=str(tmp_path), mix={"recal": 0.1}), progress=False)
    assert set(MIX_SOURCES) == set(GENERATORS)


@pytest.mark.parametrize("source", sorted(GENERATORS))
def test_synthetic_documents_never_use_evaluation_formats_or_words(source: str) -> None:
    docs = [synthetic_document(source, i) for i in range(400)]
    text = "\n".join(d.text for d in docs)
    for name in (*FIRST_NAMES, *LAST_NAMES, *CITIES, *EMPLOYERS):
        assert name not in text
    eval_words = {w.lower() for n in (*FIRST_NAMES, *LAST_NAMES, *CITIES, *EMPLOYERS) for w in re.findall(r"\w+", n)}
    assert not eval_words & {w.lower() for w in re.findall(r"[A-Za-z]+", text)}
    assert not eval_words & set(KEYS)
    assert not re.search(r"[A-Za-z]{2}\s*:\s*\d{3}", text)  # MQAR pairs such as ab:417
    assert not re.search(r"\d{3}", text)  # 3-digit values, phone numbers and birth years alike
    assert not re.search(r"look\s*up|phone", text, re.IGNORECASE)
    assert not re.search(r"^(name|city|employer|born)\s*:", text, re.MULTILINE)  # SWDE-like records
    layouts = {"recall": {"pairs", "inline", "sentences", "setget"}, "copy": {"copy"}}[source]
    assert {d.layout for d in docs} == layouts
    assert synthetic_document(source, 7).text == docs[7].text


def test_copy_documents_repeat_their_sequence() -> None:
    for i in range(100):
        first, again = synthetic_document("copy", i).text.split("\nagain:\n")
        assert again == first + "\n" and 12 <= len(first.split()) <= 40


def test_recall_queries_need_look_back() -> None:
    repeated, layouts = 0, set()
    for i in range(300):
        doc = synthetic_document("recall", i)
        layouts.add(doc.layout)
        text = doc.text
        assert 100 < len(text) < 2000 and doc.queries
        assert len(set(doc.pairs.values())) == len(doc.pairs)
        repeated += len({q.key for q in doc.queries}) < len(doc.queries)
        for q in doc.queries:
            assert doc.pairs[q.key] == q.value and text.startswith(q.value, q.start)
            assert not re.match(r"\w", text[q.start + len(q.value):])  # the whole value, not a prefix
            before = text[:q.start]
            asked = re.search(rf"\b{q.key}(?:{SEPARATOR}|\? )$", before)
            assert asked, (text, q)
            # The key's first occurrence is earlier, with its value right after it: the only place to copy from.
            first = re.search(rf"\b{q.key}\b", text)
            assert first and first.start() < asked.start()
            assert re.match(rf"{SEPARATOR}{re.escape(q.value)}\b", text[first.end():])
    assert repeated > 100
    assert layouts == {"pairs", "inline", "sentences", "setget"}
