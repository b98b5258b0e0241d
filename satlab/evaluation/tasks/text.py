"""Tasks over held-out text (the test split of an embedded corpus, never seen in training).

* Cloze (LAMBADA-style): the last word of a line, given the lines before it. LAMBADA keeps passages whose last
  word humans can guess only from the whole passage; the cheap proxy here keeps words that already occur in the
  context (as most LAMBADA targets do) and are not among the split's COMMON_WORDS most frequent words, so the
  word is predictable from the passage rather than from local syntax.
* The same passages as multiple choice between the word and 3 other uncommon words of the passage.
* Next-line multiple choice: the line that follows a passage vs 3 lines of similar length from other documents
  (from far away in the same document when the split holds only one).

Items are drawn from a seeded shuffle of every candidate position, so the first k items are the same whatever the
number asked for, and contexts are cut at line boundaries to a token budget in the model's own tokenizer.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from satlab.data.corpora import ensure_corpus
from satlab.data.tokenizer import TextTokenizer

CLOZE_CONTEXT_TOKENS = 192
MC_CONTEXT_TOKENS = 160
MC_CHOICES = 4
MIN_CONTEXT_LINES = 2
FAR_LINES = 200
"""Distractors from the same document come from at least this many lines away."""
COMMON_WORDS = 100

_LAST_WORD = re.compile(r" ([A-Za-z]{3,})[^A-Za-z0-9]*$")


def held_out_documents(corpus: str, cache_dir: str, val_fraction: float) -> tuple[list[list[str]], str]:
    """The lines of every test-split document of an embedded corpus, and the sha256 of that split."""
    folder, meta = ensure_corpus(corpus, cache_dir, val_fraction)
    with open(folder / "test.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line)["text"].splitlines() for line in f]
    return [d for d in docs if d], meta["sha256"]["test"]


def is_content_line(line: str) -> bool:
    """A line of running text: 4 to 40 words with lower-case letters (not a speaker name or a heading)."""
    return 4 <= len(line.split()) <= 40 and any(c.islower() for c in line)


@dataclass
class _Contexts:
    """Preceding lines of a position, as many as fit in a token budget (per-line token counts are cached)."""

    tokenizer: TextTokenizer
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, text: str) -> int:
        if text not in self.counts:
            self.counts[text] = len(self.tokenizer.encode(text + "\n"))
        return self.counts[text]

    def before(self, lines: list[str], index: int, tail: str, budget: int) -> str | None:
        """``lines[:index]`` cut from the left to fit ``budget`` tokens together with ``tail`` (appended after a
        newline when non-empty); None when fewer than MIN_CONTEXT_LINES lines fit."""
        used, start = self.count(tail), index
        while start > 0 and used + self.count(lines[start - 1]) <= budget:
            start -= 1
            used += self.count(lines[start])
        if index - start < MIN_CONTEXT_LINES:
            return None
        return "\n".join(lines[start:index] + ([tail] if tail else []))


def _shuffled_positions(docs: list[list[str]], seed: int, salt: str) -> list[tuple[int, int]]:
    positions = [(d, i) for d, lines in enumerate(docs) for i, line in enumerate(lines)
                 if i >= MIN_CONTEXT_LINES and is_content_line(line)]
    random.Random(f"{seed}:{salt}").shuffle(positions)
    return positions


def _cloze_passages(docs: list[list[str]], tokenizer: TextTokenizer, seed: int) -> Iterator[tuple[str, str, list[str]]]:
    """(context, target word, the other uncommon words of the context) for the cloze positions, in seeded order."""
    counts = Counter(w.lower() for lines in docs for line in lines for w in re.findall(r"[A-Za-z]+", line))
    common = {w for w, _ in counts.most_common(COMMON_WORDS)}
    contexts = _Contexts(tokenizer)
    for d, i in _shuffled_positions(docs, seed, "cloze"):
        line = docs[d][i]
        match = _LAST_WORD.search(line)
        if match is None or match.group(1).lower() in common:
            continue
        word = match.group(1)
        context = contexts.before(docs[d], i, line[: match.start()], CLOZE_CONTEXT_TOKENS)
        if context is None or not re.search(rf"\b{word}\b", context):
            continue
        # Speaker names in capitals would be easy to rule out, so distractors are ordinary words.
        others = {w.lower(): w for w in re.findall(r"\b[A-Za-z]{3,}\b", context) if not w.isupper()}
        yield context, word, sorted(w for low, w in others.items() if low not in common and low != word.lower())


def make_cloze(docs: list[list[str]], tokenizer: TextTokenizer, n: int, seed: int) -> list[dict]:
    """Items ``{"context", "target"}``: the context stops before the space that precedes the target word."""
    passages = _cloze_passages(docs, tokenizer, seed)
    return [{"context": context, "target": " " + word} for context, word, _ in itertools.islice(passages, n)]


def make_cloze_choice(docs: list[list[str]], tokenizer: TextTokenizer, n: int, seed: int) -> list[dict]:
    """The cloze passages as multiple choice: the word vs 3 other uncommon words of the same context, so every
    choice occurs in the passage and chance is exactly 0.25 (greedy cloze accuracy is ~0 for tiny models)."""
    items = []
    for k, (context, word, others) in enumerate(_cloze_passages(docs, tokenizer, seed)):
        if len(others) < MC_CHOICES - 1:
            continue
        rng = random.Random(f"{seed}:cloze_choice:{k}")
        choices, gold = rng.sample(others, MC_CHOICES - 1), rng.randrange(MC_CHOICES)
        choices.insert(gold, word)
        items.append({"context": context, "choices": [" " + c for c in choices], "gold": gold})
        if len(items) == n:
            break
    return items


def make_mc_continuation(docs: list[list[str]], tokenizer: TextTokenizer, n: int, seed: int) -> list[dict]:
    """Items ``{"context", "choices", "gold"}``; every choice starts with the newline that ends the context."""
    contexts, items = _Contexts(tokenizer), []
    content = [[i for i, line in enumerate(lines) if is_content_line(line)] for lines in docs]
    for k, (d, i) in enumerate(_shuffled_positions(docs, seed, "mc")):
        context = contexts.before(docs[d], i, "", MC_CONTEXT_TOKENS)
        if context is None:
            continue
        rng = random.Random(f"{seed}:mc:{k}")
        distractors = _distractors(docs, content, d, i, rng)
        if distractors is None:
            continue
        gold = rng.randrange(MC_CHOICES)
        choices = distractors[:gold] + [docs[d][i]] + distractors[gold:]
        items.append({"context": context, "choices": ["\n" + c for c in choices], "gold": gold})
        if len(items) == n:
            break
    return items


def _distractors(docs: list[list[str]], content: list[list[int]], d: int, i: int,
                 rng: random.Random) -> list[str] | None:
    """MC_CHOICES - 1 distinct content lines from other documents, each between 2/3 and 3/2 of the true line's
    length (so length alone gives little away); None when no such lines are found."""
    true = docs[d][i]
    others = [e for e in range(len(docs)) if e != d] or [d]
    found: list[str] = []
    for _ in range(200):
        e = rng.choice(others)
        if not content[e]:
            continue
        j = rng.choice(content[e])
        line = docs[e][j]
        if e == d and abs(j - i) < FAR_LINES:
            continue
        if line != true and line not in found and 2 / 3 <= len(line) / len(true) <= 3 / 2:
            found.append(line)
            if len(found) == MC_CHOICES - 1:
                return found
    return None
