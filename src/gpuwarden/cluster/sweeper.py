"""The coordinator's maintenance thread: a sweep every ``sweep_every_s`` seconds.

Every coordinator runs one; only the one holding the store's maintenance lock
(PostgreSQL: a session advisory lock) sweeps, the others try again each time.
Each also removes, every :data:`~gpuwarden.cluster.logcopy.PRUNE_EVERY_S`, the
copies of ended attempts' streams it keeps in its own state directory
(:func:`gpuwarden.cluster.logcopy.prune`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.cluster import logcopy
from gpuwarden.cluster.coordinator import sweep
from gpuwarden.cluster.nodeview import Timing
from gpuwarden.config import ClusterSettings
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import ClusterStore

log = logging.getLogger("gpuwarden.cluster")


@dataclass(frozen=True, slots=True)
class LogCopies:
    """Where this coordinator keeps its copies of streams, and for how long."""

    root: Path
    keep_s: float


class Sweeper:
    def __init__(
        self,
        store: ClusterStore,
        registry: Registry | None,
        settings: ClusterSettings,
        *,
        clock: Callable[[], float] = time.time,
        logs: LogCopies | None = None,
    ) -> None:
        self.store = store
        self.logs = logs
        self._pruned_at = -1e18
        self.registry = registry
        self.settings = settings
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last: dict[str, Any] = {}
        self.leader = False
        #: when this coordinator started: every lease then got a full period
        self.started_at: float | None = None
        self.timing = Timing(
            lease_s=settings.lease_s,
            offline_after_s=settings.offline_after_s,
            affinity_wait_s=settings.affinity_wait_s,
            fence_grace_s=settings.fence_grace_s,
        )

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self.give_full_period()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        try:
            self.store.release_maintenance_lock()
        except Exception:  # the store may be closed already
            log.debug("releasing the maintenance lock failed", exc_info=True)

    def give_full_period(self) -> None:
        """A coordinator that starts gives every lease a full period (and the grace)
        from now: no lease is swept for the time no coordinator ran or could be
        reached. Tried again by each sweep until the store takes it."""
        now = self.clock()
        try:
            n = self.store.extend_leases(self.timing.held_until(now))
        except Exception:  # the store may be unreachable now: the next sweep tries
            log.warning("could not give the leases a full period yet", exc_info=True)
            return
        self.started_at = now
        if n:
            log.info("gave %d lease(s) a full period from the coordinator's start", n)

    def once(self) -> dict[str, Any]:
        if self.started_at is None:
            self.give_full_period()
            if self.started_at is None:
                return {"leader": False}
        got = sweep(
            self.store,
            self.clock(),
            self.settings.offline_after_s,
            registry=self.registry,
            timing=self.timing,
            started_at=self.started_at,
        )
        if bool(got.get("leader")) != self.leader:
            self.leader = bool(got.get("leader"))
            log.info("maintenance sweeps: %s", "this coordinator" if self.leader else "another")
        self.last = got
        return got

    def prune_logs(self) -> int:
        """Remove the copies of ended attempts' streams not written for their
        keep time; how many attempts' copies went."""
        if self.logs is None:
            return 0
        now = self.clock()
        self._pruned_at = now
        gone = logcopy.prune(self.logs.root, now=now, keep_s=self.logs.keep_s, ended=self._ended)
        if gone:
            log.info("removed the stream copies of %d ended attempts", gone)
        return gone

    def _ended(self, job_id: str, number: int) -> bool:
        for attempt in self.store.attempts(job_id):
            if attempt.number == number:
                return attempt.ended_at is not None
        return True  # no such attempt (the job is gone): nothing to serve it to

    def _run(self) -> None:
        while not self._stop.wait(self.settings.sweep_every_s):
            self.tick()

    def tick(self) -> None:
        """One sweep, and the prune of stream copies when it is due. A failure is
        logged, never raised: the thread outlives it."""
        try:
            self.once()
            if self.clock() - self._pruned_at >= logcopy.PRUNE_EVERY_S:
                self.prune_logs()
        except Exception as exc:  # the sweeper must outlive a failing store call
            if self.store.unavailable(exc):
                self.store_lost(exc)
            else:
                log.exception("maintenance sweep failed")

    def store_lost(self, exc: BaseException) -> None:
        """The store could not be reached: once it can, every lease gets a full
        period again (:meth:`give_full_period`), as after a start. An agent's
        renewals and end reports were refused with 503s meanwhile, so no lease is
        swept for the coordinator's own outage: a job that ended during it is not
        taken back and run again."""
        if self.started_at is not None:
            log.warning("maintenance sweep: the store is unreachable (%s)", exc)
        self.started_at = None
