"""What machine this is, in words: the CPU's name and caches (a run's provenance tag, the bench's host line)."""

from __future__ import annotations

import platform
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (with its model number: one name covers several generations)."""
    try:
        lines = _CPUINFO.read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for key, _, value in (line.partition(":") for line in lines if ":" in line):
        fields.setdefault(key.strip(), value.strip())  # the first core's
    name = " ".join(fields.get("model name", platform.processor() or platform.machine()).split())
    numbers = ", ".join(f"{label} {fields[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
                        if key in fields)
    return f"{name} ({numbers})" if numbers else name


def cpu_caches() -> dict[str, str]:
    """Data and unified cache sizes of core 0 by level, e.g. {"L2": "2048K", "L3": "266240K"} (empty off Linux)."""
    caches = {}
    for index in sorted(_CACHES.glob("index*")):
        try:
            if (index / "type").read_text().strip() != "Instruction":
                caches[f"L{(index / 'level').read_text().strip()}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return caches
