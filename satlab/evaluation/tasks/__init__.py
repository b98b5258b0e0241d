"""The catalog of evaluation task names: satlab's offline suite and the paper's two lm-eval groups.

Only names and sizes live here (no lm-eval, torch or data imports), so the CLI can list and check them cheaply.

The offline suite (``satlab_offline``) is six families of lm-eval tasks over data that
:func:`satlab.evaluation.tasks.build.build_offline_tasks` generates locally; every one is scored by loglikelihood
(lm-eval ``multiple_choice`` or ``loglikelihood``): cheap (the choices of an item share one pass over their
context) and still telling a tiny model's preferences apart where greedy generation would score zero everywhere.
Contexts are sized in the model's own tokens; the text tasks take what the held-out split offers (with the byte
tokenizer's short contexts, ~150 cloze passages of shakespeare rather than 200).

* ``satlab_cloze``: LAMBADA-style last word of a held-out line (acc = the whole word is the greedy continuation,
  perplexity of the word); chance ~0.
* ``satlab_cloze_choice``: the same passages as multiple choice, the word vs 3 other uncommon words of the
  passage (acc, acc_norm); chance 0.25.
* ``satlab_mc_continuation``: the next line of a held-out passage vs 3 lines of similar length from other
  documents (acc, acc_norm); chance 0.25.
* ``satlab_mqar_<pairs>``: multi-query associative recall, ``key:value`` pairs then half of the keys already
  queried and answered, then one new key (acc); chance 0.25.
* ``satlab_swde_like_<records>``: a field of one entity among semi-structured records (acc); chance 0.25.
* ``satlab_phonebook_<tokens>``: one person's number in a phone book of about that many tokens (acc); chance 0.25.

The retrieval families always offer 4 choices (the answer and 3 values of the same kind from the same context,
each present exactly once), so chance stays 0.25 at every size and accuracy can be compared across sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from satlab.config.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    """The YAML in this folder that the family's generated task configs include."""
    sizes: tuple[int, ...]
    """One task ``<name>_<size>`` per size (grouped under ``<name>``); empty for a single task ``<name>``."""
    docs: int
    """Items per task by default (``limit`` overrides it)."""
    primary: str
    """The metric that goes into the suite averages."""
    chance: float

    @property
    def tasks(self) -> list[str]:
        return [f"{self.name}_{size}" for size in self.sizes] or [self.name]


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("satlab_cloze", "cloze.yaml", (), 200, "acc", 0.0),
    Family("satlab_cloze_choice", "choice.yaml", (), 200, "acc", 0.25),
    Family("satlab_mc_continuation", "choice.yaml", (), 100, "acc_norm", 0.25),
    Family("satlab_mqar", "recall.yaml", (8, 16, 32), 50, "acc", 0.25),
    Family("satlab_swde_like", "recall.yaml", (4, 8, 12), 50, "acc", 0.25),
    Family("satlab_phonebook", "recall.yaml", (192, 384, 768), 50, "acc", 0.25),
)}

OFFLINE_SUITE = "satlab_offline"
ZERO_SHOT = ("satlab_cloze", "satlab_cloze_choice", "satlab_mc_continuation")
RETRIEVAL = ("satlab_mqar", "satlab_swde_like", "satlab_phonebook")
AVERAGES = {"offline_zero_shot_avg": ZERO_SHOT, "offline_retrieval_avg": RETRIEVAL}
"""Mean of each member family's primary metric (acc; acc_norm for mc_continuation; recall acc averaged over
sizes)."""

PAPER_GROUPS: dict[str, tuple[str, ...]] = {
    "paper_zero_shot": ("lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge"),
    "paper_retrieval": ("swde", "fda", "squad_completion", "triviaqa", "nq_open", "drop"),
}
"""The paper's suites as lm-eval 0.4.13 names them; they download their datasets from the Hugging Face hub.

``swde``, ``fda`` and ``squad_completion`` are the Based/"Just read twice" versions (HazyResearch's datasets).
lm-eval ships no Based versions of TriviaQA, NQ and DROP (the JRT harness's cloze-style ``based_triviaqa``,
``based_nq``, ``based_drop`` do not exist in it), so ``triviaqa``, ``nq_open`` and ``drop`` are lm-eval's standard
generative tasks: comparable between satlab models, not with the numbers printed in the JRT paper.
"""


def offline_task_names() -> list[str]:
    """Every name the offline suite answers to: the suite, each family and each sized task."""
    names = [OFFLINE_SUITE]
    for family in FAMILIES.values():
        names += [family.name] if not family.sizes else [family.name, *family.tasks]
    return names


def family_of(task: str) -> Family | None:
    """The family of an offline task or family name."""
    return next((f for f in FAMILIES.values() if task == f.name or task in f.tasks), None)


def chance_level(task: str) -> float | None:
    family = family_of(task)
    return None if family is None else family.chance


def split_task_names(names: list[str]) -> tuple[list[str], list[str]]:
    """(offline names, lm-eval hub names) for ``names``, with ``satlab_offline`` and the paper groups expanded.

    A ``satlab_`` name that is not in the catalog is an error here; other names are checked against lm-eval's own
    task index later, which takes seconds to build.
    """
    offline, hub = [], []
    for name in names:
        if name == OFFLINE_SUITE:
            offline += list(FAMILIES)
        elif name in PAPER_GROUPS:
            hub += PAPER_GROUPS[name]
        elif family_of(name) is not None:
            offline.append(name)
        elif name.startswith("satlab_"):
            raise ConfigError(unknown_task_message(name))
        else:
            hub.append(name)
    if not offline and not hub:
        raise ConfigError(f"no tasks given; {valid_names_hint()}")
    return list(dict.fromkeys(offline)), list(dict.fromkeys(hub))


def valid_names_hint() -> str:
    return (f"valid: {', '.join(offline_task_names())} (offline, no network), {', '.join(PAPER_GROUPS)} (groups of "
            "lm-eval hub tasks), or any lm-eval task name (`lm_eval ls tasks`; these need the network once)")


def unknown_task_message(name: str, known: list[str] | None = None) -> str:
    candidates = offline_task_names() + list(PAPER_GROUPS) + (known or [])
    return f"unknown task '{name}'{did_you_mean(name, candidates)}; {valid_names_hint()}."
