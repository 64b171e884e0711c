"""Who, in the broker's process, waits for a job to end, and the loop saying so.

The HTTP API runs on a thread of the broker's process (``serve --api``); a
request that waits for its job's result (``POST /v1/jobs?wait=S``) watches the
job here instead of reading the store over and over. The broker loop calls
:meth:`JobEnds.ended` once an attempt's end is committed: a watcher is only told
to look again, and reads the outcome from the store itself (a retried job is
queued again, not ended). Nothing here is durable and nothing is promised: a
watcher looks at the store now and then anyway (``api/waiting.py``), so an end
that is never announced here (a job failed by the plan, a queued job cancelled
by a client) is still seen.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: what a watcher is called with nothing: "look at the job again"
Wake = Callable[[], None]


class JobEnds:
    """Job id -> the watchers told when an attempt of it ends. Thread-safe: the
    loop announces, request handlers watch and unwatch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[str, dict[int, Wake]] = {}
        self._ids = itertools.count()

    def watch(self, job_id: str, wake: Wake) -> Callable[[], None]:
        """Call ``wake`` (on the loop's thread: it must only hand over, e.g.
        ``loop.call_soon_threadsafe``) each time an attempt of ``job_id`` ends,
        until the returned function is called."""
        key = next(self._ids)
        with self._lock:
            self._watchers.setdefault(job_id, {})[key] = wake

        def unwatch() -> None:
            with self._lock:
                watchers = self._watchers.get(job_id)
                if watchers is not None:
                    watchers.pop(key, None)
                    if not watchers:
                        del self._watchers[job_id]

        return unwatch

    def ended(self, job_id: str) -> None:
        """An attempt of ``job_id`` ended and its end is committed: wake its
        watchers. A watcher that raises is logged; the others are still woken."""
        with self._lock:
            watchers = list(self._watchers.get(job_id, {}).values())
        for wake in watchers:
            try:
                wake()
            except Exception:
                log.exception("a watcher of job %s failed", job_id)

    def __len__(self) -> int:
        """How many jobs are watched now."""
        with self._lock:
            return len(self._watchers)
