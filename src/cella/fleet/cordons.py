"""Cordoned nodes: the planner places nothing new on them (a node being drained, or held
out by its operator until `uncordon`). Kept in a small file of the gateway's, so a
gateway that restarts mid-drain still keeps new sandboxes off the node."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class Cordons:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._names: set[str] = set()
        if path.exists():
            self._names = set(json.loads(path.read_text()))

    def __contains__(self, node: object) -> bool:
        return node in self._names

    def names(self) -> set[str]:
        return set(self._names)

    def cordon(self, node: str) -> None:
        with self._lock:
            self._names.add(node)
            self._save()

    def uncordon(self, node: str) -> bool:
        """Whether it was cordoned."""
        with self._lock:
            was = node in self._names
            self._names.discard(node)
            self._save()
            return was

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self._names)))
        os.replace(tmp, self.path)  # written whole: a crash leaves the old list or the new
