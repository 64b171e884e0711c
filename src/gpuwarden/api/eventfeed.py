"""The store's event log read forward from a cursor, filtered: what ``GET
/v1/events`` streams and what ``gpuwarden events`` prints (on the host, from the
store; with ``--url``, the same objects from the API).

No web stack here (the CLI imports this module): the route is
:mod:`gpuwarden.api.routers.events`.

An event passes the filter (:class:`EventFilter`) when it is of the job asked
for (``job``), when its job is of the type asked for (``type``; an event that
names no job passes when its own ``type`` key is that type: warm servers,
footprints), and, for a submitter (``owner``: its token id), only when it is an
event of one of that token's own jobs. A submitter never sees an event that
names no job (GPU faults, warm servers, the broker's own), and the detail of its
own jobs' events is shown with every other job's id hidden
(:class:`gpuwarden.api.redact.Redactor`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gpuwarden.api.redact import Redactor
from gpuwarden.core.model import Event
from gpuwarden.errors import UserError
from gpuwarden.store.base import Store

__all__ = [
    "BATCH",
    "MAX_ID",
    "EventFeed",
    "EventFilter",
    "as_json",
    "parse_cursor",
    "sse_block",
]

#: the most events one read of the store takes
BATCH = 200
#: the largest event id a client may name (SQL's 64-bit integers)
MAX_ID = 2**63 - 1
#: how many jobs' owner and type a feed remembers (then it forgets them all)
_JOBS_KEPT = 4096
#: a job type as a filter: ``module.type``
TYPE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\.[A-Za-z0-9_-]{1,64}$")
_DIGITS = re.compile(r"^[0-9]{1,19}$")
_KIND = re.compile(r"[^A-Za-z0-9_.-]")


class BadCursor(UserError):
    """A ``Last-Event-ID`` or ``after`` that is not an event id."""


def parse_cursor(text: str, where: str) -> int:
    """An event id a client sent (``where``: ``the Last-Event-ID header``, ``after``):
    0 to :data:`MAX_ID`, in ASCII digits; :class:`BadCursor` saying so otherwise."""
    value = text.strip()
    if not _DIGITS.fullmatch(value) or int(value) > MAX_ID:
        shown = value[:40].encode("ascii", "backslashreplace").decode("ascii")
        raise BadCursor(
            f"{where} must be an event id (an integer from 0 to {MAX_ID}: the id of the last "
            f"event received, 0 for the whole history), not {shown!r}"
        )
    return int(value)


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which events a reader gets: of one job, of one type, of one token's jobs."""

    job: str | None = None
    type: str | None = None
    #: a submitter's token id: only events of the jobs that token submitted
    owner: str | None = None


def as_json(event: Event, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    """An event as the stream and ``events --json`` show it."""
    return {
        "id": event.id,
        "ts": event.ts,
        "kind": event.kind,
        "job": event.job_id,
        "from": event.from_state,
        "to": event.to_state,
        "detail": event.detail if detail is None else detail,
    }


def sse_block(shown: dict[str, Any]) -> str:
    """One server-sent event: ``id``, ``event`` (the kind) and one line of JSON."""
    kind = _KIND.sub("_", str(shown["kind"])) or "event"
    data = json.dumps(shown, ensure_ascii=True, separators=(",", ":"), default=str)
    return f"id: {shown['id']}\nevent: {kind}\ndata: {data}\n\n"


class EventFeed:
    """The events after :attr:`cursor` that pass ``flt``, read in batches.

    :meth:`read` (on a worker thread: it reads the store) returns the next
    events that pass, as shown (:func:`as_json`), and moves :attr:`cursor` to the
    last event it looked at, shown or not. A job's owner and type never change, so
    they are looked up once per job (up to :data:`_JOBS_KEPT` jobs)."""

    def __init__(self, store: Store, flt: EventFilter, *, cursor: int, batch: int = BATCH) -> None:
        self.store = store
        self.flt = flt
        self.cursor = cursor
        self.batch = batch
        self._jobs: dict[str, tuple[str | None, str] | None] = {}
        #: whether the last read took a whole batch (more may be there now)
        self.full = False

    def read(self, upto: int = 0) -> list[dict[str, Any]]:
        """``upto``: the newest event id, read before this call. Ids are handed out
        in commit order, so every event up to it is there to be read; when a read
        of one job's events takes less than a batch, the cursor moves on to it (a
        stream of one job does not read the job's events again for every other)."""
        found = self.store.events(job_id=self.flt.job, after_id=self.cursor, limit=self.batch)
        self.full = len(found) >= self.batch
        if self.flt.job is not None and not self.full:
            self.cursor = max(self.cursor, upto)
        redactor = Redactor(self.store, self.flt.owner) if self.flt.owner else None
        shown: list[dict[str, Any]] = []
        for event in found:
            if event.id is not None:
                self.cursor = max(self.cursor, event.id)
            if not self._passes(event):
                continue
            detail = redactor.value(event.detail) if redactor is not None else None
            shown.append(as_json(event, detail))
        return shown

    def _passes(self, event: Event) -> bool:
        owner, wanted = self.flt.owner, self.flt.type
        if event.job_id is None:
            return owner is None and (wanted is None or event.detail.get("type") == wanted)
        if owner is not None and not event.job_id.startswith(f"{owner}-"):
            return False  # a submitter's job ids all begin with its token id
        if owner is None and wanted is None:
            return True
        job = self._job(event.job_id)
        if job is None:  # not a job's id (``warm:<epoch>``): its own ``type`` counts
            return owner is None and event.detail.get("type") == wanted
        return (owner is None or job[0] == owner) and (wanted is None or job[1] == wanted)

    def _job(self, job_id: str) -> tuple[str | None, str] | None:
        if job_id not in self._jobs:
            if len(self._jobs) >= _JOBS_KEPT:
                self._jobs.clear()
            job = self.store.get_job(job_id)
            self._jobs[job_id] = None if job is None else (job.owner, job.type)
        return self._jobs[job_id]
