"""The JSON-lines event log of ``gpuwarden serve``: one event per line, appended.

The file is opened in append mode (``O_APPEND``), so ``copytruncate`` rotation
works: after the copy truncates it, the next line lands at the new end.

Each line of a store event carries the event's ``id``. With a cursor file (``serve
--log``: ``<state_dir>/eventlog.cursor``) the log survives a broker that is killed:

- each batch of lines is one ``write``, and only after it returns is the cursor
  replaced (a new file renamed over the old one) with the last id written, the
  log's path and its size after the write;
- the next start (:meth:`EventLog.resume`) goes on after the cursor's id, or,
  when the log named there holds complete lines past the recorded size (the
  broker died between a write and its cursor), after the last id among them; a
  line a kill cut short is cut off and written again whole. So no event is lost
  or written twice, into the same file or a new one.

The one case it cannot tell apart: a ``copytruncate`` that empties the file in the
microseconds between a write and its cursor, followed by a kill in the same
window. The rotated copy then has the batch and it is written again; its lines
carry their ids, so a reader can drop the repeats.

The cursor is as durable as the log lines themselves: neither is fsynced, so both
survive the broker's death (the kernel has them), not the host's power loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from gpuwarden.core.model import Event

__all__ = ["CURSOR_FILE", "EventLog", "NullLog"]

log = logging.getLogger("gpuwarden.eventlog")

#: the event log's cursor, in the state directory
CURSOR_FILE = "eventlog.cursor"
#: at most this much of a log's end is read back at a start
_TAIL_LIMIT = 64 * 1024 * 1024


class EventLog:
    """Writes events as JSON lines to a file (``path``) or a stream.

    ``cursor``, with ``path``: the cursor file that carries the log across
    restarts (module docstring). Without it the log starts at whatever
    :meth:`resume` is given.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        stream: IO[str] | None = None,
        cursor: Path | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._owned = path is not None
        self.path = path.absolute() if path is not None else None
        self.cursor = cursor if path is not None else None
        self._fd: int | None = None
        self._out: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        else:
            self._out = stream if stream is not None else sys.stdout

    # -- writing ---------------------------------------------------------------

    def write(self, record: Event | dict[str, Any]) -> None:
        """Write one line (an event, or a record that is no store event)."""
        if isinstance(record, Event):
            self.write_events([record])
            return
        self._emit(json.dumps(record, sort_keys=False, default=str) + "\n")

    def write_events(self, events: Sequence[Event]) -> None:
        """Write store events, in order, as one write; then move the cursor past them."""
        if not events:
            return
        text = "".join(_line(e) for e in events)
        with self._lock:
            self._emit_locked(text)
            last = next((e.id for e in reversed(events) if e.id is not None), None)
            if last is not None and self.cursor is not None and self._fd is not None:
                self._save(last, os.fstat(self._fd).st_size)

    def _emit(self, text: str) -> None:
        with self._lock:
            self._emit_locked(text)

    def _emit_locked(self, text: str) -> None:
        if self._fd is not None:
            view = memoryview(text.encode("utf-8"))
            while view:
                view = view[os.write(self._fd, view) :]
        elif self._out is not None:
            self._out.write(text)
            self._out.flush()

    def _save(self, last_id: int, size: int) -> None:
        assert self.cursor is not None
        tmp = self.cursor.with_name(f".{self.cursor.name}.tmp")
        data = json.dumps({"id": last_id, "log": str(self.path), "size": size}) + "\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)
        tmp.replace(self.cursor)

    # -- starting again ----------------------------------------------------------

    def resume(self, default: int) -> int:
        """The id of the last store event this log already has: events after it are
        the ones to write. ``default`` (the store's last id: "from now on") when
        there is no cursor; a missing cursor file is created there."""
        if self.cursor is None or self.path is None:
            return default
        try:
            saved = json.loads(self.cursor.read_text(encoding="utf-8"))
            last = int(saved["id"])
            logged = Path(str(saved.get("log") or self.path))
            size = int(saved.get("size") or 0)
        except FileNotFoundError:
            with self._lock:
                self._save(default, self._size())
            return default
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "event log cursor %s cannot be read (%s): the log goes on from the store's "
                "latest event",
                self.cursor,
                exc,
            )
            return default
        found = self._tail_ids(logged, size, last)
        if found > last:
            log.info("event log %s: lines up to event %d came after its cursor", logged, found)
        if found > default:
            # the store has fewer events than the log has written: it lost its last
            # commits (restored from a copy). The ids after its last one are new
            # events now; the log goes on with them.
            log.warning(
                "event log %s has events up to %d but the store's last is %d (the store "
                "lost commits?): the log goes on from the store's last event",
                logged,
                found,
                default,
            )
            return default
        return found

    def _size(self) -> int:
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def _tail_ids(self, logged: Path, size: int, last: int) -> int:
        """The last event id in the complete lines ``logged`` got after ``size`` (or,
        when it is shorter now, a rotation emptied it: in all of it); a cut-short
        last line is cut off (only in this log's own file)."""
        try:
            fd = os.open(logged, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return last  # gone (rotated away), or not a file: nothing to add
        try:
            now = os.fstat(fd).st_size
            start = size if now >= size else 0
            start = max(start, now - _TAIL_LIMIT)
            data = os.pread(fd, now - start, start)
        finally:
            os.close(fd)
        complete, newline, partial = data.rpartition(b"\n")
        if partial and self._fd is not None and logged == self.path:
            # a line the kill cut short: cut it off, it is written again whole
            with contextlib.suppress(OSError):
                os.truncate(logged, start + len(complete) + len(newline))
        found = last
        for raw in complete.split(b"\n"):
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            got = line.get("id") if isinstance(line, dict) else None
            if isinstance(got, int) and not isinstance(got, bool) and got > found:
                found = got
        return found

    def close(self) -> None:
        if self._owned and self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _line(event: Event) -> str:
    data = event.to_json()
    if event.id is not None:
        data["id"] = event.id
    return json.dumps(data, sort_keys=False, default=str) + "\n"


class NullLog(EventLog):
    """Discards events (``run-once`` without ``--verbose``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owned = False
        self.path = None
        self.cursor = None
        self._fd = None
        self._out = None

    def write(self, record: Event | dict[str, Any]) -> None:
        return None

    def write_events(self, events: Sequence[Event]) -> None:
        return None
