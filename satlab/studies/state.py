"""``<out_dir>/state.json``: the study's parent run (what ``satlab report`` looks for) and each trial's status, run
id, log and timing on this host. The study and MLflow stay the record of what finished, so a deleted state file
loses nothing but timings and failure reasons."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


class StudyState:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.data.setdefault("cells", {})

    @property
    def parent_run_id(self) -> str | None:
        return self.data.get("parent_run_id")

    @property
    def tracking_uri(self) -> str | None:
        return self.data.get("tracking_uri")

    @property
    def cells(self) -> dict[str, dict[str, Any]]:
        return self.data["cells"]

    def set_parent(self, name: str, run_id: str, tracking_uri: str, experiment: str) -> None:
        with self._lock:
            self.data.update(name=name, parent_run_id=run_id, tracking_uri=tracking_uri, experiment=experiment)
            self._save()

    def update(self, key: str, **fields: Any) -> None:
        with self._lock:
            self.cells.setdefault(key, {}).update(fields, updated=time.strftime("%Y-%m-%d %H:%M:%S"))
            self._save()

    def forget(self, key: str) -> None:
        with self._lock:
            self.cells.pop(key, None)
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)
