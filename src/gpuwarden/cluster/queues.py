"""The coordinator's queue roots: bundles in, result bundles out, on a thread.

The coordinator takes bundles in from its queue roots exactly as the single-host
broker does (:class:`gpuwarden.intake.service.QueueIntake`); agents run the jobs.
With several coordinators on one database, only the one holding the store's
maintenance lock reads queue roots, and each root is read by one process of this
host at a time (an exclusive ``flock`` on ``<root>/.gpuwarden-coordinator.lock``):
two coordinators never take the same bundle (the store's bundle uniqueness is the
backstop). A coordinator that takes a root over re-reads what an earlier one
left in its ``processing/``.

A bundle's input files stay staged under the coordinator's ``state_dir/staging/``
until all of its jobs have ended: the agent a job is leased to fetches them
(``GET /v1/node/jobs/{id}/inputs/{name}``), and only a coordinator that holds
the staged folder offers such a job.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.app import bundle_limits
from gpuwarden.config import Config
from gpuwarden.core.model import Event
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.intake.service import QueueIntake
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore

log = logging.getLogger("gpuwarden.cluster")

#: the file in a queue root whose lock says which coordinator reads it
ROOT_LOCK = ".gpuwarden-coordinator.lock"


class QueueWatcher:
    """Ticks a :class:`QueueIntake` over the roots this process holds."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        config: Config,
        roots: list[QueueRoot],
        *,
        clock: Callable[[], float] = time.time,
        interval_s: float | None = None,
    ) -> None:
        self.store = store
        self.roots = list(roots)
        self.clock = clock
        self.interval_s = interval_s if interval_s is not None else config.broker.poll_interval_s
        #: set to pass again at once (a bundle was extracted, or the thread stops)
        self._wake = threading.Event()
        self.intake = QueueIntake(
            store=store,
            registry=registry,
            staging_dir=config.state_dir / "staging",
            limits=bundle_limits(config),
            roots=self.roots,
            emit=self._emit,
            on_error=self._record_error,
            clock=clock,
            remote_outputs=True,
            wake=self._wake.set,
            commands=config.commands.bundles,
        )
        #: root path -> the open lock file of a root this process reads
        self._held: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the thread ---------------------------------------------------------

    def start(self) -> None:
        if not self.roots or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-queues", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(60)
            self._thread = None
        self.intake.close()  # a bundle being extracted is read again by the next reader
        self._release_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.once()
            except Exception as exc:  # the thread must outlive a failing store call
                self._record_error("queue roots", exc)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    # -- one pass -----------------------------------------------------------

    def once(self) -> list[QueueRoot]:
        """Take the roots this process may read, then one intake and one finish
        over them. Returns the roots it read."""
        if isinstance(self.store, ClusterStore) and not self.store.try_maintenance_lock():
            self._release_all()  # another coordinator leads: it reads the roots
            return []
        now = self.clock()
        for root in self.roots:
            key = str(root.path)
            if key not in self._held and self._lock(root):
                # taken over (or at start): what an earlier reader left in processing/
                self.intake.recover(now, [root])
        held = [r for r in self.roots if str(r.path) in self._held]
        if held:
            self.intake.intake(now, held)
            self.intake.finish_bundles(self.clock(), roots=held)
        return held

    def _lock(self, root: QueueRoot) -> bool:
        try:
            fd = os.open(root.path / ROOT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._record_error(f"opening the lock of queue root {root.path}", exc)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[str(root.path)] = fd
        log.info("reading queue root %s", root.path)
        return True

    def _release_all(self) -> None:
        for fd in self._held.values():
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the descriptor drops its flock
        self._held.clear()

    def _emit(self, kind: str, **detail: Any) -> None:
        job = detail.pop("job", None)
        self.store.add_event(Event(ts=self.clock(), kind=kind, job_id=job, detail=detail))

    def _record_error(self, where: str, exc: Exception) -> None:
        log.error("queue roots: %s failed: %s", where, exc, exc_info=exc)
        with contextlib.suppress(Exception):  # the store itself may be what failed
            self._emit("loop_error", where=where, message=str(exc))
