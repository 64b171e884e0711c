"""The JSON-lines event log of ``gpuwarden serve``: one event per line, appended.

The file is opened in append mode (``O_APPEND``), so ``copytruncate`` rotation
works: after the copy truncates it, the next line lands at the new end.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import IO, Any

from gpuwarden.core.model import Event


class EventLog:
    def __init__(self, path: Path | None = None, *, stream: IO[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._owned = path is not None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out: IO[str] = path.open("a", encoding="utf-8")
        else:
            self._out = stream if stream is not None else sys.stdout

    def write(self, record: Event | dict[str, Any]) -> None:
        data = record.to_json() if isinstance(record, Event) else record
        line = json.dumps(data, sort_keys=False, default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def close(self) -> None:
        if self._owned:
            self._out.close()


class NullLog(EventLog):
    """Discards events (``run-once`` without ``--verbose``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owned = False

    def write(self, record: Event | dict[str, Any]) -> None:
        return None
