"""The one reader of a comma-separated list of numbers on the command line (``--depths 6,12,24``, ``--seeds 0,1,2``,
``--drifts 0.5,1``), so every command accepts the same spellings and words its refusal the same way."""

from __future__ import annotations

from satlab.config.errors import shown


def number_list(option: str, text: str, problems: list[str], *, example: str, kind: type = int, low: float = 1,
                high: float | None = None, multiple: int = 1, at_least: int = 1, distinct: bool = False,
                why: str = "") -> list:
    """``text`` as ``kind`` values in the order given, each within [low, high] and a multiple of ``multiple``, at
    least ``at_least`` of them distinct, none repeated when ``distinct``. Anything else appends one problem that
    says what is valid (``why`` adds the reason) and returns []; blanks between commas are ignored."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    valid = (len(set(values)) >= at_least
             and all(low <= v and (high is None or v <= high) and (multiple == 1 or v % multiple == 0) for v in values)
             and not (distinct and len(set(values)) < len(values)))
    if valid:
        return values
    count = f"at least {at_least} distinct " if at_least > 1 else ""
    span = f">= {low:g}" if high is None else f"from {low:g} to {high:g}"
    rule = (f"{count}comma-separated {'integers' if kind is int else 'numbers'} {span}"
            + (f", multiples of {multiple}" if multiple > 1 else "") + (", none repeated" if distinct else ""))
    problems.append(f"{option} takes {rule}{f' ({why})' if why else ''}, e.g. {example}; got {shown(text)}")
    return []
