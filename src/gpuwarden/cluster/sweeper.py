"""The coordinator's maintenance thread: a sweep every ``sweep_every_s`` seconds.

Every coordinator runs one; only the one holding the store's maintenance lock
(PostgreSQL: a session advisory lock) sweeps, the others try again each time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.cluster.coordinator import sweep
from gpuwarden.config import ClusterSettings
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import ClusterStore

log = logging.getLogger("gpuwarden.cluster")


class Sweeper:
    def __init__(
        self,
        store: ClusterStore,
        registry: Registry | None,
        settings: ClusterSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last: dict[str, Any] = {}
        self.leader = False

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
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

    def once(self) -> dict[str, Any]:
        got = sweep(
            self.store,
            self.clock(),
            self.settings.offline_after_s,
            registry=self.registry,
        )
        if bool(got.get("leader")) != self.leader:
            self.leader = bool(got.get("leader"))
            log.info("maintenance sweeps: %s", "this coordinator" if self.leader else "another")
        self.last = got
        return got

    def _run(self) -> None:
        while not self._stop.wait(self.settings.sweep_every_s):
            try:
                self.once()
            except Exception:  # the sweeper must outlive a failing store call
                log.exception("maintenance sweep failed")
