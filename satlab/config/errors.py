"""The one error type for bad user input, with "did you mean" help."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ECHO_CHARS = 200
"""The most characters of a user's value that a message echoes (:func:`shown`)."""
MAX_PROBLEM_CHARS = 4000
"""The longest problem a :class:`ConfigError` keeps: a message that echoes input through some path that does not
use :func:`shown` is cut in its middle, so it keeps what was wrong and what is valid."""


def shown(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters with an ellipsis and the full length:
    ``'xxxx...' (1,048,578 characters)``. Never builds the whole text, so a value of a gigabyte (one string aliased
    a thousand times in a YAML file) costs no more than a short one."""
    head = _head(value, limit + 1, 0)
    if len(head) <= limit:
        return head
    return f"{head[:limit]}... ({_length(value, 0):,} characters)"


def _head(value: Any, budget: int, depth: int) -> str:
    """The first ``budget`` (or a few more) characters of ``repr(value)``."""
    if isinstance(value, str):
        return repr(value[:budget]) if len(value) > budget else repr(value)
    if depth > 20:
        return "..."
    if isinstance(value, Mapping):
        items, opening, closing = value.items(), "{", "}"
    elif isinstance(value, list | tuple | set | frozenset):
        items, opening, closing = value, *(("[", "]") if isinstance(value, list) else ("(", ")"))
    else:
        return repr(value)[:budget]
    parts, used = [], 1
    for item in items:
        text = (f"{_head(item[0], budget - used, depth + 1)}: {_head(item[1], budget - used, depth + 1)}"
                if isinstance(value, Mapping) else _head(item, budget - used, depth + 1))
        parts.append(text)
        used += len(text) + 2
        if used > budget:
            break
    return opening + ", ".join(parts) + (closing if used <= budget else "")


def _length(value: Any, depth: int) -> int:
    """The length of ``repr(value)``, counted without building it (strings as quoted, without escapes)."""
    if isinstance(value, str):
        return len(value) + 2
    if depth > 20:
        return 3
    if isinstance(value, Mapping):
        return 2 + sum(_length(k, depth + 1) + 2 + _length(v, depth + 1) for k, v in value.items()) + 2 * max(
            0, len(value) - 1)
    if isinstance(value, list | tuple | set | frozenset):
        return 2 + sum(_length(v, depth + 1) for v in value) + 2 * max(0, len(value) - 1)
    return len(repr(value))


def clipped(text: str, limit: int = MAX_PROBLEM_CHARS) -> str:
    """``text`` cut in its middle to about ``limit`` characters: for a message made by a library (that may quote
    a whole value), it keeps what went wrong at its start and what is valid at its end."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half:,} characters left out ...] {text[-half:]}"


def excerpt(text: Any, limit: int = 120) -> str:
    """``text`` on one line, cut at its end to ``limit`` characters: a line of a user's file, or a library's
    message, quoted in a message of ours."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(ValueError):
    """Bad user input (config key, value, name or path). The CLI prints it and exits with code 2.

    ``problems`` holds every problem found, so one run reports them all at once.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [clipped(p) for p in ([problems] if isinstance(problems, str) else problems)]
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the configuration:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


ABBREVIATIONS = {
    "lr": "learning rate", "n": "number", "num": "number", "nb": "number", "ckpt": "checkpoint", "val": "validation",
    "eval": "evaluation", "seq": "sequence", "len": "length", "length": "length", "max": "maximum",
    "min": "minimum", "wd": "weight decay", "bs": "batch size", "dim": "dimension", "d": "dimension",
    "hidden": "hidden", "mlp": "mlp", "ffn": "mlp", "feedforward": "mlp", "intermediate": "mlp", "layer": "layer",
    "depth": "layer", "kv": "kv", "embd": "dimension", "embed": "embedding", "emb": "embedding", "grad": "gradient",
    "clip": "clip", "norm": "norm", "dir": "directory", "folder": "directory", "gpu": "device", "nodes": "node",
    "epsilon": "eps", "context": "sequence", "block": "sequence", "tok": "token", "every": "every",
}
"""Words and abbreviations that name the same thing in settings (``learning_rate`` is ``lr``, ``n_head`` and
``num_heads`` are ``n_heads``), for :func:`did_you_mean`."""


SYNONYMS = {
    "d_model": ("hidden_size", "hidden_dim", "n_embd", "dim", "model_dim", "width", "embed_dim", "d_embed"),
    "mlp_hidden": ("ffn_dim", "ffn_hidden", "intermediate_size", "mlp_dim", "d_ff", "ffn_hidden_size"),
    "max_tokens": ("max_steps", "steps", "train_steps", "total_tokens", "budget"),
    "micro_batch_size": ("batch_size", "per_device_batch_size", "micro_batch"),
    "seq_len": ("block_size", "max_len", "max_length", "n_ctx", "ctx_len"),
}
"""Whole names other libraries give a setting (Hugging Face, nanoGPT, Megatron), by satlab's name."""
_SYNONYM_OF = {alias: name for name, aliases in SYNONYMS.items() for alias in aliases}


def _words(name: str) -> frozenset[str]:
    """The words of a dotted, snake or kebab name, abbreviations spelt out and plurals made singular."""
    words = set()
    for part in re.split(r"[._\-\s]+", name.lower()):
        if not part:
            continue
        part = part[:-1] if len(part) > 3 and part.endswith("s") and not part.endswith("ss") else part
        words.update(ABBREVIATIONS.get(part, part).split())
    return frozenset(words)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """A short hint naming the closest valid spelling, or an empty string: the name that shares most of its words
    with ``name`` (abbreviations spelt out: ``learning_rate`` -> ``lr``, ``batch_size`` -> ``micro_batch_size``),
    else the closest spelling (a typo: ``optimm`` -> ``optim``)."""
    name, candidates = str(name), [str(v) for v in valid]
    if not candidates or len(name) > ECHO_CHARS:
        return ""
    prefix, _, last = name.rpartition(".")
    if (synonym := _SYNONYM_OF.get(last.lower())) and (target := f"{prefix}.{synonym}" if prefix else synonym) \
            in candidates:
        return f" (did you mean '{target}'?)"
    words = _words(name)

    def overlap(candidate: str) -> float:
        theirs = _words(candidate)
        return len(words & theirs) / len(words | theirs) if words and theirs else 0.0

    scored = max(candidates, key=lambda c: (overlap(c), difflib.SequenceMatcher(None, name, c).ratio()))
    if overlap(scored) >= 0.5:
        return f" (did you mean '{scored}'?)"
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> str:
    """One-line message for an unknown name, listing what is valid (:func:`listing`)."""
    valid = sorted(valid)
    return f"unknown {kind} {quoted(name)}{did_you_mean(name, valid)}; valid: {listing(valid)}"


LISTED_CHARS = 2 * ECHO_CHARS
"""How much of a list of valid names a message shows: the rest is counted, not listed."""


def listing(names: Sequence[str], most: int | None = None, limit: int = LISTED_CHARS) -> str:
    """``a, b, c``: the names in order, as many as fit in ``limit`` characters (and at most ``most``), then
    ``... and 40 more``; each name cut as :func:`quoted` cuts a long one."""
    shown_names: list[str] = []
    used = 0
    for name in names[:most]:
        text = name if len(name) <= ECHO_CHARS else f"{name[:ECHO_CHARS]}..."
        if shown_names and used + len(text) + 2 > limit:
            break
        shown_names.append(text)
        used += len(text) + 2
    rest = len(names) - len(shown_names)
    return ", ".join(shown_names) + (f", ... and {rest} more" if rest else "")


def quoted(text: Any, limit: int = ECHO_CHARS) -> str:
    """``'text'`` for a message, a long text cut as :func:`shown` cuts it (a name or key a user typed)."""
    text = str(text) if not isinstance(text, str) else text
    return f"'{text}'" if len(text) <= limit else f"'{text[:limit]}...' ({len(text):,} characters)"


EXIT_USAGE = 2
"""Bad input (a :class:`ConfigError`): nothing was written."""
EXIT_NO_SPACE = 74
"""A checkpoint did not fit on its disk (``EX_IOERR``): the previous checkpoints are intact; free space, then run
the same command (under SLURM the job script puts the job back in the queue, held, for that)."""
EXIT_REQUEUE = 75
"""Stopped with its state saved (``EX_TEMPFAIL``): SIGTERM (pre-emption, a time limit) during training, or an
interrupted study. Running the same command again continues it; SLURM job scripts requeue on it."""


class RunStopped(RuntimeError):
    """A run (training, trial, cell) stopped itself for a reason the user should read; the CLI prints the message
    and exits with ``exit_code`` (1 unless a subclass says otherwise)."""

    exit_code = 1
