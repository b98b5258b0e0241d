"""Synthetic retrieval tasks: the answer must be copied from earlier in the context.

Every item is ``{"context", "choices", "gold", "query"}``: 4 choices, the answer and 3 values of the same kind
that occur in the same context, each exactly once, so neither a prior over values nor their frequency helps and
chance is 0.25 at every size. ``query`` is the string the context looks the answer up by (a key or a name); its
first occurrence in the context is where the answer sits, which the tests use as a cheating oracle.

* MQAR (Zoology's multi-query associative recall): ``ab:417 xk:052 ...`` pairs, a line of half of the keys
  queried and answered in random order, then one key not queried yet.
* SWDE-like: blocks of ``name``/``city``/``employer``/``born`` records (fields after the name in random order),
  then ``<name>, <field>:``; the distractors are the same field of other records.
* Phonebook: ``First Last: 123-4567`` lines filling about the given number of tokens, then
  ``Look up First Last:``.

Each item has its own seeded generator, so the first k items do not depend on how many are asked for. Keys, names
and formats are invented here and never appear in the training corpora.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from satlab.data.tokenizer import TextTokenizer

CHOICES = 4
FIRST_NAMES = (
    "Ada", "Alma", "Boris", "Carmen", "Dalia", "Emil", "Farah", "Gideon", "Hana", "Ivo", "Jonas", "Kira", "Luca",
    "Mira", "Nadia", "Oskar", "Petra", "Quinn", "Rosa", "Selim", "Tamar", "Ugo", "Vera", "Wanda", "Xavi", "Yara",
    "Zeno", "Anouk", "Bruno", "Cleo", "Dario", "Elin", "Fedor", "Greta", "Hugo", "Ines",
)
LAST_NAMES = (
    "Abara", "Bellweather", "Castellano", "Dunmore", "Eklund", "Fairbanks", "Galvani", "Halloran", "Ibarra",
    "Jansky", "Kowalczyk", "Lindqvist", "Moravec", "Nakamura", "Okonkwo", "Pellegrini", "Quiroga", "Rasmussen",
    "Szabo", "Thornbury", "Ulloa", "Varga", "Whitlock", "Yilmaz", "Zamora", "Achterberg", "Brodsky", "Cavanagh",
    "Delacroix", "Esposito", "Frobisher", "Gutierrez", "Haverford", "Iwasaki", "Jovanovic", "Kettering",
)
CITIES = (
    "Aberdeen", "Bergamo", "Coimbra", "Dubrovnik", "Eindhoven", "Fresno", "Gdansk", "Hobart", "Izmir", "Jaipur",
    "Krakow", "Leipzig", "Mombasa", "Nantes", "Oaxaca", "Perth", "Quito", "Rotterdam", "Salta", "Tampere", "Utrecht",
    "Valencia", "Windhoek", "Zagreb",
)
EMPLOYERS = (
    "Acme Foundry", "Bluepeak", "Cobalt Labs", "Driftwood Press", "Emberline", "Foxglove Bank", "Granite Rail",
    "Harbor Mills", "Ironbark", "Juniper Health", "Kestrel Air", "Lumen Works", "Meridian Farms", "Northwind",
    "Orchid Textiles", "Pinecrest", "Quarry Hill", "Redwood Tools", "Silverline", "Tidewater", "Umber Glass",
    "Vantage Ports", "Willow Print", "Zephyr Motors",
)
FIELDS = ("city", "employer", "born")


def _pick(rng: random.Random, values: list[str], gold: int) -> tuple[list[str], int]:
    """The answer ``values[gold]`` among CHOICES - 1 others of ``values``, shuffled: (choices, gold index)."""
    others = rng.sample([v for j, v in enumerate(values) if j != gold], CHOICES - 1)
    where = rng.randrange(CHOICES)
    return others[:where] + [values[gold]] + others[where:], where


def _names(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(f, s) for f in FIRST_NAMES for s in LAST_NAMES], n)
    return [f"{f} {s}" for f, s in pairs]


def mqar_item(rng: random.Random, pairs: int) -> dict:
    keys = rng.sample([a + b for a in string.ascii_lowercase for b in string.ascii_lowercase], pairs)
    values = [str(v) for v in rng.sample(range(100, 1000), pairs)]
    order = rng.sample(range(pairs), pairs)
    asked, query, unasked = order[: pairs // 2], order[pairs // 2], order[pairs // 2 :]
    context = (" ".join(f"{keys[j]}:{values[j]}" for j in range(pairs)) + "\n"
               + " ".join(f"{keys[j]}:{values[j]}" for j in asked) + f" {keys[query]}:")
    # Distractors come from the keys not asked yet, so every choice occurs exactly once in the context.
    pool = [values[j] for j in unasked]
    choices, gold = _pick(rng, pool, 0)
    return {"context": context, "choices": choices, "gold": gold, "query": f"{keys[query]}:"}


def swde_item(rng: random.Random, records: int) -> dict:
    names = _names(rng, records)
    columns = {"city": rng.sample(CITIES, records), "employer": rng.sample(EMPLOYERS, records),
               "born": [str(y) for y in rng.sample(range(1940, 2006), records)]}
    blocks = []
    for r, name in enumerate(names):
        fields = rng.sample(FIELDS, len(FIELDS))
        blocks.append("\n".join([f"name: {name}", *(f"{f}: {columns[f][r]}" for f in fields)]))
    target, field = rng.randrange(records), rng.choice(FIELDS)
    choices, gold = _pick(rng, columns[field], target)
    context = "\n\n".join(blocks) + f"\n\n{names[target]}, {field}:"
    return {"context": context, "choices": [" " + c for c in choices], "gold": gold, "query": names[target]}


def phonebook_item(rng: random.Random, tokens: int, tokenizer: TextTokenizer) -> dict:
    """Entries are added while the book, the query and the answer fit in ``tokens`` tokens."""
    names = _names(rng, len(FIRST_NAMES) * len(LAST_NAMES) // 4)
    numbers = [f"{v // 10000}-{v % 10000:04d}" for v in rng.sample(range(2_000_000, 10_000_000), len(names))]
    header = "Phone book\n"
    used = len(tokenizer.encode(header)) + len(tokenizer.encode("\nLook up First Last: 123-4567"))
    count = 0
    while count < len(names):
        used += len(tokenizer.encode(f"{names[count]}: {numbers[count]}\n"))
        if used > tokens:
            break
        count += 1
    if count < CHOICES:
        raise ValueError(f"a phone book of {tokens} tokens holds fewer than {CHOICES} entries")
    target = rng.randrange(count)
    choices, gold = _pick(rng, numbers[:count], target)
    book = "".join(f"{names[j]}: {numbers[j]}\n" for j in range(count))
    context = header + book + f"\nLook up {names[target]}:"
    return {"context": context, "choices": [" " + c for c in choices], "gold": gold, "query": f"{names[target]}:"}


def make_items(item: Callable[[random.Random], dict], n: int, seed: int, salt: str) -> list[dict]:
    """``n`` items, item ``i`` drawn from its own generator seeded by (seed, salt, i)."""
    return [item(random.Random(f"{seed}:{salt}:{i}")) for i in range(n)]
