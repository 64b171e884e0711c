"""The node's queue as its loop keeps it between ticks.

The loop does not read every queued job from the store on every tick (a queue
of 100,000 jobs would cost more than the rest of the tick together). It keeps a
:class:`gpuwarden.core.queueindex.QueueIndex` of the queued jobs, keyed by class
``(type, priority, per-job footprint, declared run time)``, loaded once at start and then followed
through the store's events: every change of a job's state is an event written
in the same transaction, so the events after the cursor name exactly the jobs
that entered or left ``queued`` (a submission from the CLI, the API or an agent's
sync, a retry, a cancel), or were released when their dependencies came to hold
(``dependencies_held``: a job held for them is queued but never indexed, so the
plan never looks at it). Those jobs are read again, and only they.

Where event ids could become visible out of order (PostgreSQL sequences commit
in any order), a cheap count of the store's queued jobs is compared with the
index every few seconds and a difference reloads it, with a line in the log.
A job is read in full only when it starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from gpuwarden.core.profile import est_class
from gpuwarden.core.queueindex import QueueIndex
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.base import QueueEntry, Store

log = logging.getLogger("gpuwarden.node.loop")

#: events read per store call while catching up, and at most per tick
_EVENT_BATCH = 5000
_EVENTS_PER_TICK = 50_000
#: how often the index's size is checked against the store's count
_CHECK_EVERY_S = 5.0
#: ids per ``queue_entries`` call
_ID_BATCH = 900

#: a class of the index: job type, priority, the job's own footprint (or None), and
#: the run time it declared as the planner rounds it (``core.profile.est_class``;
#: None for a job that declares none, as most do: their classes are not split)
ClassKey = tuple[str, int, int | None, float | None]


class QueueBook:
    """The queued jobs of this node, by class, kept in step with the store."""

    def __init__(self, store: Store, registry: Registry, clock: Callable[[], float]) -> None:
        self.store = store
        self.registry = registry
        self.clock = clock
        self.index: QueueIndex[ClassKey] = QueueIndex()
        self._cursor = 0
        self._checked_at = float("-inf")
        self._loaded = False

    def __len__(self) -> int:
        return len(self.index)

    def refresh(self, now: float) -> bool:
        """Take in what changed since the last call. True if the queue changed."""
        if not self._loaded:
            self.reload(now)
            return True
        changed = self._follow(now)
        if now - self._checked_at >= _CHECK_EVERY_S:
            self._checked_at = now
            queued = self.store.queued_count()
            if queued != len(self.index):
                log.info(
                    "the queue index holds %d jobs, the store %d queued: reloading it",
                    len(self.index),
                    queued,
                )
                self.reload(now)
                changed = True
        return changed

    def reload(self, now: float) -> None:
        """Read every queued job again (at start, and when the count disagrees)."""
        cursor = self.store.last_event_id()  # first: what happens meanwhile is replayed
        self.index.clear()
        self._take(self.store.queue_entries(), now)
        self._cursor = max(self._cursor, cursor)
        self._checked_at = now
        self._loaded = True

    def _follow(self, now: float) -> bool:
        touched: set[str] = set()
        read = 0
        while read < _EVENTS_PER_TICK:
            batch = self.store.events(after_id=self._cursor, limit=_EVENT_BATCH)
            if not batch:
                break
            read += len(batch)
            self._cursor = batch[-1].id or self._cursor
            touched.update(
                e.job_id
                for e in batch
                if e.job_id is not None
                and ("queued" in (e.to_state, e.from_state) or e.kind == "dependencies_held")
            )
            if len(batch) < _EVENT_BATCH:
                break
        if not touched:
            return False
        for job_id in touched:
            self.index.remove(job_id)
        ids = sorted(touched)
        for i in range(0, len(ids), _ID_BATCH):
            self._take(self.store.queue_entries(ids[i : i + _ID_BATCH]), now)
        return True

    def _take(self, entries: Iterable[QueueEntry], now: float) -> None:
        """Index queued jobs; end at once those that must never run."""
        for e in entries:
            if e.cancel_requested:  # asked while it ran; it must never run again
                self.store.transition(
                    e.id, JobState.CANCELLED, now=now, reason="cancelled before it ran again"
                )
            elif e.type not in self.registry.types:
                self.store.transition(
                    e.id,
                    JobState.FAILED,
                    now=now,
                    reason=f"job type {e.type} is not known to this broker (module removed?)",
                )
            else:
                key = (e.type, e.priority, e.vram_bytes, est_class(e.est_s))
                self.index.add(e.id, e.seq, key)

    def classes(self) -> list[ClassKey]:
        return self.index.classes()

    def by_type(self) -> dict[str, int]:
        """How many jobs of each type are queued (the metrics' queue depth)."""
        out: dict[str, int] = {}
        for key in self.index.classes():
            out[key[0]] = out.get(key[0], 0) + self.index.size(key)
        return out

    def first(self, order: Iterable[ClassKey], limit: int) -> list[tuple[ClassKey, str]]:
        """Up to ``limit`` queued jobs, class by class in ``order``: ``(class, id)``."""
        out: list[tuple[ClassKey, str]] = []
        for key in order:
            for _, job_id in self.index.members(key):
                if len(out) >= limit:
                    return out
                out.append((key, job_id))
        return out
