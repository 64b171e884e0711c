"""A running attempt's streams, sent to the coordinator as they grow.

After each sync, for each job held here whose attempt runs (and whose reports the
coordinator has all had, so its attempt is the one running here), the new bytes
of ``stdout.log``, ``stderr.log`` and ``build.log`` in the attempt's folder go up,
at most :data:`~gpuwarden.cluster.logcopy.MAX_CHUNK` a request, each with its
offset: every :data:`EVERY_S` seconds a stream sends one chunk, and more while
it has full chunks to send, up to :data:`BURST_CHUNKS` of them, while the sync's
:data:`BURST_S` seconds for extra chunks last (one budget for all streams of all
jobs: the sync runs on the node's loop). So a stream that writes fast is sent at
up to 512 KiB a second, one that writes a line now and then in one small request
(SPEC.md,
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

#: the least time between two bursts of one stream
EVERY_S = 1.0
#: the most chunks of one stream in one burst (8 x 64 KiB: 512 KiB a second)
BURST_CHUNKS = 8
#: the time one sync may spend on chunks past each stream's first, all streams
#: together (the node's loop waits meanwhile)
BURST_S = 0.1
#: the most chunks of a stream sent at an attempt's end, before its finish
FINAL_CHUNKS = 16


@dataclass
class _Sent:
    """What went up of one stream of one local attempt."""

    offset: int = 0
    at: float = -1e9
    #: the file was refused (a link, a FIFO): never read
    refused: bool = False
    #: the attempt ended and its last bytes went up
    done: bool = False


@dataclass
class LogShipper:
    """Sends the running attempts' new bytes; keeps where each stream stands."""

    coordinator: Coordinator
    jobs_dir: Path
    monotonic: Callable[[], float]
    sent: dict[tuple[str, int, str], _Sent] = field(default_factory=dict)
    #: until when this sync may send chunks past each stream's first (monotonic)
    burst_until: float = -1e18

    def begin(self) -> None:
        """A sync's shipping starts: its :data:`BURST_S` for extra chunks."""
        self.burst_until = self.monotonic() + BURST_S

    def ship(
        self, job_id: str, lease_id: str, local_id: str, attempt: int, *, final: bool = False
    ) -> None:
        """Send what is new of each stream of attempt ``attempt`` (local number) of
        the local job ``local_id``, leased as ``job_id``. ``final``: the attempt
        ended and its finish goes next: up to :data:`FINAL_CHUNKS` chunks a stream,
        at once, once."""
        for stream in STREAMS:
            state = self.sent.setdefault((local_id, attempt, stream), _Sent())
            if state.refused or state.done:
                continue
            if final:
                state.done = True
                for _ in range(FINAL_CHUNKS):
                    if not self._send_one(job_id, lease_id, local_id, (attempt, stream), state):
                        break
            elif self.monotonic() - state.at >= EVERY_S:
                self._burst(job_id, lease_id, local_id, (attempt, stream), state)

    def _burst(
        self, job_id: str, lease_id: str, local_id: str, which: tuple[int, str], state: _Sent
    ) -> None:
        """Chunks of one stream while each is full (more is waiting), up to
        :data:`BURST_CHUNKS`; past the first, only within the sync's budget."""
        for _ in range(BURST_CHUNKS):
            before = state.offset
            if not self._send_one(job_id, lease_id, local_id, which, state):
                return
            if state.offset - before < MAX_CHUNK or self.monotonic() >= self.burst_until:
                return

    def _send_one(
        self, job_id: str, lease_id: str, local_id: str, which: tuple[int, str], state: _Sent
    ) -> bool:
        """One chunk of a stream; whether one went up."""
        attempt, stream = which
        data = self._read(local_id, attempt, stream, state)
        if not data:
            return False
        state.at = self.monotonic()
        try:
            state.offset = self.coordinator.send_log(job_id, lease_id, stream, state.offset, data)
        except (CoordinatorError, Refused) as exc:
            log.debug("job %s: %s not sent now: %s", job_id, stream, exc)
            return False
        return True

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
