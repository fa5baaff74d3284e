"""The resumable store of zero-shot scores: one JSON file per (view, task), keyed by what produced it.

A score is reused only when its key (the view's weights digest, task, limit, data folder) matches, so an
interrupted run continues with the next task and a changed operator or limit is scored afresh.
Unreadable files are scored again. Only the process that writes results (rank 0) writes here.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from ..core.io import atomic_write_json, json_digest


def score_key(view_digest: str | None, task: str, limit: int | None, data_dir: str | None) -> str:
    return json_digest([view_digest, task, limit, data_dir])


class ScoreStore:
    """Saved zero-shot scores under `root/<view>/<task>.json`; `root=None` keeps nothing."""

    def __init__(self, root: Path | None, *, write: bool = True) -> None:
        self.root = root
        self.write = write

    def path(self, view: str, task: str) -> Path | None:
        return None if self.root is None else self.root / view / f"{task}.json"

    def get(self, view: str, task: str, key: str) -> dict[str, Any] | None:
        """The saved record when present, readable and made with `key`; None otherwise."""
        path = self.path(view, task)
        if path is None or not path.is_file():
            return None
        with contextlib.suppress(OSError, ValueError, KeyError, AttributeError, TypeError):
            saved = json.loads(path.read_text())
            if saved.get("key") != key:
                return None
            if all(isinstance(r, dict) and "acc" in r for r in saved["scores"].values()):
                return saved
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"{path} is not a saved zero-shot score; scoring again")
        return None

    def put(self, view: str, task: str, key: str, record: dict[str, Any]) -> None:
        path = self.path(view, task)
        if path is not None and self.write:
            atomic_write_json(path, {"key": key, "view": view, "task": task, **record})
