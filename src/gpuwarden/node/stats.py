"""What the node counts of itself, for ``/metrics``: a plain accumulator the loop owns.

:class:`NodeStats` is fed by the loop's thread only, through a few hooks where the
loop learns each thing: an attempt's start (:meth:`NodeStats.attempt_started`,
from ``AttemptRunner.begin``) and its recorded end (:meth:`NodeStats.attempt_ended`,
from ``AttemptRunner.follow``), an eviction (:meth:`NodeStats.evicted`, from the
loop's plan), and the events the broker emits (:meth:`NodeStats.on_event`, from
``Broker.emit``: ``memory_reclaimed``, ``gpu_xid``, ``warm_server_loaded``, the
managed runtimes' releases). Its :meth:`NodeStats.snapshot` is published in the
broker's status (``BrokerStatus.stats``), so every process that reads the status
(``serve --api``, a separate API, an agent's report to its coordinator) sees the
same numbers; the API's ``/metrics`` turns them into Prometheus series
(``gpuwarden.api.metrics``). Nothing here knows of Prometheus.

The counts are since the broker started (a restart starts them again at zero, as
Prometheus counters expect). The label sets stay small: job types are the
registry's, GPUs the node's, outcomes :class:`gpuwarden.core.classify.Outcome`'s,
runtimes the configuration's; what an event names beyond those is not counted.

Histograms are Prometheus-style: fixed upper bounds, counts per bucket, a sum and
a count; :meth:`Histogram.cumulative` gives the ``le`` buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LOAD_BUCKETS",
    "RECLAIM_BUCKETS",
    "RUN_BUCKETS",
    "WAIT_BUCKETS",
    "Histogram",
    "NodeStats",
    "StatsSnapshot",
]

#: upper bounds, in seconds, of the queue wait histogram (submitted -> attempt start)
WAIT_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400)
#: of the run time histogram (an attempt's start -> its end)
RUN_BUCKETS: tuple[float, ...] = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 14400, 43200, 86400)
#: of the reclaim histogram (a holder gone -> its memory free on the device)
RECLAIM_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
#: of a warm server's model load
LOAD_BUCKETS: tuple[float, ...] = (0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800)

#: a managed runtime's release, by how it ended (the event that says it)
RELEASE_RESULTS: dict[str, str] = {
    "runtime_released": "released",
    "runtime_release_ineffective": "ineffective",
    "runtime_reloaded_during_handoff": "reloaded",
}

#: the Xid codes kept apart per GPU; a code outside this range counts as -1
_XID_MAX = 1000


@dataclass(slots=True)
class Histogram:
    """Observations in fixed buckets: ``counts[i]`` are those ``<= bounds[i]`` and
    above the bound before; the last count is those above every bound (``+Inf``)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        """Count one observation (a negative one, from a clock step, as 0)."""
        if not math.isfinite(value):
            return
        value = max(0.0, value)
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, observations <= le)`` for each bound, then ``(inf, count)``."""
        out: list[tuple[float, int]] = []
        seen = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            out.append((bound, seen))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"le": list(self.bounds), "counts": list(self.counts), "sum": round(self.sum, 6)}

    @classmethod
    def from_json(cls, d: Any) -> Histogram | None:
        """A published histogram read back; None when it is not one (another
        version, a hand-written document)."""
        if not isinstance(d, dict):
            return None
        try:
            bounds = tuple(float(b) for b in d.get("le") or ())
            counts = [max(0, int(c)) for c in d.get("counts") or ()]
            total = float(d.get("sum", 0.0))
        except (TypeError, ValueError):
            return None
        if len(counts) != len(bounds) + 1 or list(bounds) != sorted(bounds):
            return None
        return cls(bounds, counts, total if math.isfinite(total) else 0.0)


def _histograms(d: Any) -> dict[str, Histogram]:
    out: dict[str, Histogram] = {}
    if isinstance(d, dict):
        for key, value in d.items():
            h = Histogram.from_json(value)
            if h is not None:
                out[str(key)] = h
    return out


def _counts(d: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(d, dict):
        for key, value in d.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[str(key)] = max(0, int(value))
    return out


def _nested(d: Any) -> dict[str, dict[str, int]]:
    if not isinstance(d, dict):
        return {}
    return {str(k): _counts(v) for k, v in d.items() if isinstance(v, dict)}


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """The node's counts as published in its status (``BrokerStatus.stats``)."""

    #: when the counts started (the broker's start)
    since: float = 0.0
    #: type -> outcome -> attempts ended so
    attempts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: type -> queue wait (seconds from submission, or from the retry's requeue, to start)
    wait: dict[str, Histogram] = field(default_factory=dict)
    #: type -> run time (seconds from an attempt's start to its end)
    run: dict[str, Histogram] = field(default_factory=dict)
    #: GPU -> seconds until a gone holder's memory was free on the device
    reclaim: dict[str, Histogram] = field(default_factory=dict)
    #: type -> its warm servers' model loads (count and seconds)
    warm_loads: dict[str, Histogram] = field(default_factory=dict)
    #: type -> warm servers evicted
    evictions: dict[str, int] = field(default_factory=dict)
    #: runtime -> result (``released``, ``ineffective``, ``reloaded``) -> releases
    releases: dict[str, dict[str, int]] = field(default_factory=dict)
    #: runtime -> bytes its releases gave back
    released_bytes: dict[str, int] = field(default_factory=dict)
    #: GPU -> Xid code -> times reported
    xids: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the GPUs with a hardware fault now (VRAM admission paused until cleared)
    faults: tuple[str, ...] = ()
    #: type -> jobs in the node's queue now
    queued: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "attempts": {t: dict(o) for t, o in self.attempts.items()},
            "wait": {t: h.to_json() for t, h in self.wait.items()},
            "run": {t: h.to_json() for t, h in self.run.items()},
            "reclaim": {g: h.to_json() for g, h in self.reclaim.items()},
            "warm_loads": {t: h.to_json() for t, h in self.warm_loads.items()},
            "evictions": dict(self.evictions),
            "releases": {r: dict(o) for r, o in self.releases.items()},
            "released_bytes": dict(self.released_bytes),
            "xids": {g: dict(c) for g, c in self.xids.items()},
            "faults": list(self.faults),
            "queued": dict(self.queued),
        }

    @classmethod
    def from_json(cls, d: Any) -> StatsSnapshot:
        """Read a published document back; what is missing or malformed is empty."""
        if not isinstance(d, dict):
            return cls()
        since = d.get("since")
        faults = d.get("faults")
        return cls(
            since=float(since) if isinstance(since, int | float) else 0.0,
            attempts=_nested(d.get("attempts")),
            wait=_histograms(d.get("wait")),
            run=_histograms(d.get("run")),
            reclaim=_histograms(d.get("reclaim")),
            warm_loads=_histograms(d.get("warm_loads")),
            evictions=_counts(d.get("evictions")),
            releases=_nested(d.get("releases")),
            released_bytes=_counts(d.get("released_bytes")),
            xids=_nested(d.get("xids")),
            faults=tuple(str(g) for g in faults) if isinstance(faults, list) else (),
            queued=_counts(d.get("queued")),
        )


def _copy(hs: Mapping[str, Histogram]) -> dict[str, Histogram]:
    return {k: Histogram(h.bounds, list(h.counts), h.sum) for k, h in hs.items()}


class NodeStats:
    """The accumulator. Only the loop's thread calls it."""

    def __init__(self, since: float = 0.0) -> None:
        self.since = since
        self.attempts: dict[str, dict[str, int]] = {}
        self.wait: dict[str, Histogram] = {}
        self.run: dict[str, Histogram] = {}
        self.reclaim: dict[str, Histogram] = {}
        self.warm_loads: dict[str, Histogram] = {}
        self.evictions: dict[str, int] = {}
        self.releases: dict[str, dict[str, int]] = {}
        self.released_bytes: dict[str, int] = {}
        self.xids: dict[str, dict[str, int]] = {}

    # -- the hooks ------------------------------------------------------------------

    def attempt_started(self, type_name: str, waited_s: float) -> None:
        """An attempt began after ``waited_s`` in the queue."""
        self.wait.setdefault(type_name, Histogram(WAIT_BUCKETS)).observe(waited_s)

    def attempt_ended(self, type_name: str, outcome: str, run_s: float) -> None:
        """An attempt's end was recorded with ``outcome`` after ``run_s`` running."""
        by = self.attempts.setdefault(type_name, {})
        by[outcome] = by.get(outcome, 0) + 1
        self.run.setdefault(type_name, Histogram(RUN_BUCKETS)).observe(run_s)

    def evicted(self, type_name: str) -> None:
        """A warm server of ``type_name`` was evicted (idle past its grace, or its
        memory was wanted)."""
        self.evictions[type_name] = self.evictions.get(type_name, 0) + 1

    def on_event(self, kind: str, detail: Mapping[str, Any]) -> None:
        """Count what an event the broker emits says (the others are ignored)."""
        if kind == "memory_reclaimed":
            gpu, after = detail.get("gpu"), _number(detail.get("after_s"))
            if isinstance(gpu, str) and after is not None:
                self.reclaim.setdefault(gpu, Histogram(RECLAIM_BUCKETS)).observe(after)
        elif kind == "gpu_xid":
            gpu, code = detail.get("gpu"), detail.get("xid")
            if isinstance(gpu, str) and isinstance(code, int) and not isinstance(code, bool):
                key = str(code) if 0 <= code < _XID_MAX else "-1"
                by = self.xids.setdefault(gpu, {})
                by[key] = by.get(key, 0) + 1
        elif kind == "warm_server_loaded":
            type_name, load = detail.get("type"), _number(detail.get("load_s"))
            if isinstance(type_name, str) and load is not None:
                self.warm_loads.setdefault(type_name, Histogram(LOAD_BUCKETS)).observe(load)
        elif kind in RELEASE_RESULTS:
            runtime = detail.get("runtime")
            if isinstance(runtime, str):
                by = self.releases.setdefault(runtime, {})
                result = RELEASE_RESULTS[kind]
                by[result] = by.get(result, 0) + 1
                back = _number(detail.get("bytes")) if result == "released" else None
                if back is not None:
                    self.released_bytes[runtime] = self.released_bytes.get(runtime, 0) + int(back)

    # -- what is published ----------------------------------------------------------

    def snapshot(
        self, *, queued: Mapping[str, int] | None = None, faults: Iterable[str] = ()
    ) -> StatsSnapshot:
        """The counts now, with the node's present state beside them: ``queued``
        (type -> jobs in its queue) and ``faults`` (the GPUs with a hardware fault)."""
        return StatsSnapshot(
            since=self.since,
            attempts={t: dict(o) for t, o in self.attempts.items()},
            wait=_copy(self.wait),
            run=_copy(self.run),
            reclaim=_copy(self.reclaim),
            warm_loads=_copy(self.warm_loads),
            evictions=dict(self.evictions),
            releases={r: dict(o) for r, o in self.releases.items()},
            released_bytes=dict(self.released_bytes),
            xids={g: dict(c) for g, c in self.xids.items()},
            faults=tuple(sorted(faults)),
            queued=dict(sorted((queued or {}).items())),
        )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
