"""The one check of a device a command is asked to run on, so every command refuses the same names the same way."""

from __future__ import annotations

from satlab.config.errors import shown


def device_problem(text: str, option: str, words: tuple[str, ...] = ("auto", "cpu")) -> str | None:
    """What is wrong with ``text`` as a device (None when nothing): one of ``words``, cuda, or cuda:N of a GPU that
    torch sees. ``option`` is how the command spells the setting (``--device``, ``device``)."""
    if text in words:
        return None
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        return f"{option} takes {', '.join(words)}, cuda or cuda:N, got {shown(text)}"
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return f"{option} {text}: torch {torch.__version__} sees no CUDA GPU here; use {' or '.join(words)}"
    if index and int(index) >= count:
        return f"{option} {text}: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
    return None
