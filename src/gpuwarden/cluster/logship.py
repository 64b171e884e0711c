"""A running attempt's streams, sent to the coordinator as they grow.

After each sync, for each job held here whose attempt runs (and whose reports the
coordinator has all had, so its attempt is the one running here), the new bytes
of ``stdout.log``, ``stderr.log`` and ``build.log`` in the attempt's folder go up,
at most :data:`~gpuwarden.cluster.logcopy.MAX_CHUNK` a request, at most one
request per stream every :data:`EVERY_S` seconds, each with its offset (SPEC.md,
section 16, "Streams while a job runs"). The files are the job's: opened through
:func:`gpuwarden.safefs.open_file` (no link, no FIFO, a regular file only).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden import safefs
from gpuwarden.cluster.coordinator_client import Coordinator, CoordinatorError, Refused
from gpuwarden.cluster.logcopy import MAX_CHUNK, STREAMS

log = logging.getLogger("gpuwarden.agent")

#: the least time between two requests of one stream
EVERY_S = 1.0


@dataclass
class _Sent:
    """What went up of one stream of one local attempt."""

    offset: int = 0
    at: float = -1e9
    #: the file was refused (a link, a FIFO): never read
    refused: bool = False


@dataclass
class LogShipper:
    """Sends the running attempts' new bytes; keeps where each stream stands."""

    coordinator: Coordinator
    jobs_dir: Path
    monotonic: Callable[[], float]
    sent: dict[tuple[str, int, str], _Sent] = field(default_factory=dict)

    def ship(self, job_id: str, lease_id: str, local_id: str, attempt: int) -> None:
        """Send what is new of each stream of attempt ``attempt`` (local number) of
        the local job ``local_id``, leased as ``job_id``."""
        for stream in STREAMS:
            key = (local_id, attempt, stream)
            state = self.sent.setdefault(key, _Sent())
            now = self.monotonic()
            if state.refused or now - state.at < EVERY_S:
                continue
            data = self._read(local_id, attempt, stream, state)
            if not data:
                continue
            state.at = now
            try:
                state.offset = self.coordinator.send_log(
                    job_id, lease_id, stream, state.offset, data
                )
            except (CoordinatorError, Refused) as exc:
                log.debug("job %s: %s not sent now: %s", job_id, stream, exc)

    def _read(self, local_id: str, attempt: int, stream: str, state: _Sent) -> bytes:
        rel = f"{local_id}/attempt-{attempt}/{stream}.log"
        try:
            fd = safefs.open_file(rel, under=self.jobs_dir)
        except FileNotFoundError:
            return b""
        except safefs.UnsafePathError as exc:
            log.warning("job %s: %s is not sent: it %s", local_id, rel, exc.why)
            state.refused = True
            return b""
        try:
            return os.pread(fd, MAX_CHUNK, state.offset)
        finally:
            os.close(fd)

    def forget(self, keep: set[str]) -> None:
        """Drop what is kept of local jobs not in ``keep``."""
        for key in [k for k in self.sent if k[0] not in keep]:
            del self.sent[key]
