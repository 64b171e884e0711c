"""The dashboard's memory timeline: per GPU, the ledger against the device's own
reading over the last hour, kept in this API process.

A :class:`History` is a ring buffer per GPU (:data:`KEEP_S` at one sample per
:data:`EVERY_S`), filled from what each node's broker last published (the store's
node statuses: no probe is read here). :class:`Sampler` fills it on a thread of
its own while the app runs (its lifespan); a read also takes a sample when one is
due, so an API that has no running sampler (a test client) has data too. The
buffer starts empty with each process: :meth:`History.since` says how far back
it reaches, and the page says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore, NodeState

log = logging.getLogger(__name__)

#: seconds between samples
EVERY_S = 10.0
#: how far back the timeline reaches
KEEP_S = 3600.0
#: a node's status older than this is not sampled (its broker is not running)
STALE_S = 60.0
#: at most this many GPUs are followed (a cluster's worth)
MAX_GPUS = 1024


@dataclass(frozen=True, slots=True)
class Sample:
    """One GPU at one moment."""

    ts: float
    used_bytes: int
    ledger_bytes: int
    foreign_bytes: int
    runtime_bytes: int

    def to_json(self) -> list[float | int]:
        return [
            round(self.ts, 3),
            self.used_bytes,
            self.ledger_bytes,
            self.foreign_bytes,
            self.runtime_bytes,
        ]


#: the order of a sample's fields in :meth:`Sample.to_json`
FIELDS = ("ts", "used_bytes", "ledger_bytes", "foreign_bytes", "runtime_bytes")


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def gpu_sample(gpu: dict[str, Any], ts: float) -> Sample:
    """A sample of one GPU of a published status document (or of an agent's
    report, which gives the ledger's total as ``ledger_bytes``)."""
    holdings = gpu.get("holdings") or []
    runtimes = gpu.get("runtimes") or []
    ledger = sum(_int(h.get("bytes")) for h in holdings if isinstance(h, dict))
    return Sample(
        ts=ts,
        used_bytes=_int(gpu.get("used_bytes")),
        ledger_bytes=ledger if "holdings" in gpu else _int(gpu.get("ledger_bytes")),
        foreign_bytes=_int(gpu.get("foreign_bytes")),
        runtime_bytes=sum(_int(r.get("bytes")) for r in runtimes if isinstance(r, dict)),
    )


class History:
    """Per GPU uuid, the samples of the last :data:`KEEP_S` seconds. Thread-safe."""

    def __init__(
        self,
        store: Store,
        *,
        every_s: float = EVERY_S,
        keep_s: float = KEEP_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.every_s = every_s
        self.keep_s = keep_s
        self.clock = clock
        self._size = max(2, int(keep_s / every_s) + 1)
        self._gpus: dict[str, deque[Sample]] = {}
        self._names: dict[str, tuple[str, str, int]] = {}  # uuid -> (node, name, total)
        self._started = clock()
        self._last = 0.0
        self._lock = threading.Lock()

    def sample(self) -> None:
        """Take one sample of every GPU of every live node: the brokers' published
        statuses, and on a coordinator the agents' last reports."""
        now = self.clock()
        live: list[tuple[str, list[Any]]] = [
            (s.node, s.payload.get("gpus") or [])
            for s in self.store.node_statuses()
            if now - s.updated_at <= STALE_S and not s.payload.get("stopped")
        ]
        if isinstance(self.store, ClusterStore):
            known = {node for node, _ in live}
            live += [
                (r.name, r.report.get("gpus") or [])
                for r in self.store.list_nodes()
                if r.name not in known
                and r.last_seen is not None
                and now - r.last_seen <= STALE_S
                and r.state is not NodeState.REVOKED
            ]
        with self._lock:
            self._last = now
            for node, gpus in live:
                for gpu in gpus:
                    if isinstance(gpu, dict) and isinstance(gpu.get("uuid"), str):
                        self._add(node, gpu, now)

    def _add(self, node: str, gpu: dict[str, Any], now: float) -> None:
        uuid = str(gpu["uuid"])[:128]
        ring = self._gpus.get(uuid)
        if ring is None:
            if len(self._gpus) >= MAX_GPUS:
                return
            ring = self._gpus[uuid] = deque(maxlen=self._size)
        ring.append(gpu_sample(gpu, now))
        self._names[uuid] = (node, str(gpu.get("name", ""))[:200], _int(gpu.get("total_bytes")))

    def sample_if_due(self) -> None:
        if self.clock() - self._last >= self.every_s:
            self.sample()

    def since(self) -> float | None:
        """The time of the oldest sample kept (None: none yet)."""
        with self._lock:
            first = [ring[0].ts for ring in self._gpus.values() if ring]
        return min(first) if first else None

    def to_json(self) -> dict[str, Any]:
        """The timeline: ``gpus`` each with its samples as rows of :data:`FIELDS`."""
        now = self.clock()
        with self._lock:
            gpus = [
                {
                    "uuid": uuid,
                    "node": self._names[uuid][0],
                    "name": self._names[uuid][1],
                    "total_bytes": self._names[uuid][2],
                    "samples": [s.to_json() for s in ring if now - s.ts <= self.keep_s],
                }
                for uuid, ring in sorted(self._gpus.items())
            ]
        return {
            "now": now,
            "every_s": self.every_s,
            "keep_s": self.keep_s,
            "since": self.since(),
            "process_started_at": self._started,
            "fields": list(FIELDS),
            "gpus": gpus,
        }


class Sampler:
    """Samples a :class:`History` every ``every_s`` on a daemon thread."""

    def __init__(self, history: History) -> None:
        self.history = history
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-history", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.history.sample()
            except Exception:  # the store is away for a moment: the next sample tries again
                log.warning("could not sample the GPUs for the dashboard", exc_info=True)
            self._stop.wait(self.history.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
