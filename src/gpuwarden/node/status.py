"""The node's status: what its broker publishes of itself, typed.

The broker loop writes a :class:`BrokerStatus` (``Broker.status``); the store
keeps it as JSON, the payload of a :class:`gpuwarden.store.base.NodeStatus` row
(:meth:`BrokerStatus.to_json`); ``explain``, the API and ``status --json`` read
that document back (:meth:`BrokerStatus.from_json`). The document's keys and
their order are a contract: clients and tests read them.

A stored document may come from another version of gpuwarden, or be partial
(written by hand in a test): every reader here takes a missing key as empty.

:class:`GpuReport` is what an agent tells its coordinator about each GPU: the room
a new job could take there (``Broker.room``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.policy import GpuView, WarmView
from gpuwarden.core.ramadmit import UNSAMPLED, RamView
from gpuwarden.gpu.base import GpuSensors
from gpuwarden.node.stats import StatsSnapshot


@dataclass(frozen=True, slots=True)
class ProcessUse:
    """One process's memory on a GPU, as the probe read it."""

    pid: int
    used_bytes: int

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "used_bytes": self.used_bytes}


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One GPU: the probe's reading, and the VRAM book's view of it (reserve,
    foreign memory, holdings, degraded), when the book has one."""

    uuid: str
    name: str
    total_bytes: int
    used_bytes: int = 0
    processes: tuple[ProcessUse, ...] = ()
    view: GpuView | None = None
    #: utilisation, temperature, power (None: the probe does not read them)
    sensors: GpuSensors | None = None

    @property
    def free_bytes(self) -> int:
        """What admission may still give out here (0 without a view)."""
        return self.view.free_bytes if self.view is not None else 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "uuid": self.uuid,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "processes": [p.to_json() for p in self.processes],
        }
        if self.view is not None:
            out.update(self.view.to_json())
        out["free_bytes"] = self.free_bytes
        out["sensors"] = self.sensors.to_json() if self.sensors is not None else None
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuStatus:
        return cls(
            uuid=str(d["uuid"]),
            name=str(d.get("name", "")),
            total_bytes=int(d.get("total_bytes", 0)),
            used_bytes=int(d.get("used_bytes", 0)),
            processes=tuple(
                ProcessUse(int(p["pid"]), int(p["used_bytes"])) for p in d.get("processes", [])
            ),
            view=GpuView.from_json(d) if "holdings" in d else None,
            sensors=GpuSensors.from_json(d.get("sensors")),
        )


@dataclass(frozen=True, slots=True)
class FootprintStatus:
    """A vram-lane type's footprint: declared, measured (0 if never) and what
    admission uses."""

    declared_bytes: int
    measured_bytes: int
    effective_bytes: int

    def to_json(self) -> dict[str, int]:
        return {
            "declared_bytes": self.declared_bytes,
            "measured_bytes": self.measured_bytes,
            "effective_bytes": self.effective_bytes,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FootprintStatus:
        return cls(
            int(d.get("declared_bytes", 0)),
            int(d.get("measured_bytes", 0)),
            int(d.get("effective_bytes", 0)),
        )


@dataclass(frozen=True, slots=True)
class RunningStatus:
    """An attempt the broker runs now."""

    job: str
    type: str
    attempt: int
    gpu: str | None = None
    started_at: float | None = None
    #: asked to checkpoint and yield to this job (preemption), or None
    preempting_for: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "job": self.job,
            "type": self.type,
            "attempt": self.attempt,
            "gpu": self.gpu,
            "started_at": self.started_at,
        }
        if self.preempting_for is not None:
            out["preempting_for"] = self.preempting_for
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunningStatus:
        return cls(
            job="" if d.get("job") is None else str(d["job"]),  # None: hidden from a submitter
            type=str(d.get("type", "")),
            attempt=int(d.get("attempt", 0)),
            gpu=d.get("gpu"),
            started_at=d.get("started_at"),
            preempting_for=d.get("preempting_for"),
        )


@dataclass(frozen=True, slots=True)
class WarmStatus:
    """A warm server, as ``gpuwarden status`` shows it."""

    type: str
    gpu: str
    epoch: int
    state: str
    footprint_bytes: int
    jobs_served: int
    load_s: float | None
    #: seconds idle (only while it is idle)
    idle_s: float | None
    pid: int | None
    keep_warm: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "gpu": self.gpu,
            "epoch": self.epoch,
            "state": self.state,
            "footprint_bytes": self.footprint_bytes,
            "jobs_served": self.jobs_served,
            "load_s": self.load_s,
            "idle_s": self.idle_s,
            "pid": self.pid,
            "keep_warm": self.keep_warm,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WarmStatus:
        return cls(
            type=str(d.get("type", "")),
            gpu=str(d.get("gpu", "")),
            epoch=int(d.get("epoch", 0)),
            state=str(d.get("state", "")),
            footprint_bytes=int(d.get("footprint_bytes", 0)),
            jobs_served=int(d.get("jobs_served", 0)),
            load_s=d.get("load_s"),
            idle_s=d.get("idle_s"),
            pid=d.get("pid"),
            keep_warm=bool(d.get("keep_warm", False)),
        )


@dataclass(frozen=True, slots=True)
class LoopError:
    """The last step of the loop that failed."""

    ts: float
    where: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"ts": self.ts, "where": self.where, "message": self.message}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoopError:
        return cls(float(d.get("ts", 0.0)), str(d.get("where", "")), str(d.get("message", "")))


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    """What ``gpuwarden status`` shows of one node."""

    #: the broker has shut down (its last status)
    stopped: bool = False
    accepting: bool = True
    #: the probe's kind (``nvml``, ``nvidia-smi``, ``sim``, ``none``)
    probe: str = ""
    #: why the probe's last read failed (VRAM admission is paused), or ""
    probe_error: str = ""
    gpus: tuple[GpuStatus, ...] = ()
    #: per GPU, why VRAM admission is paused there
    degraded: dict[str, str] = field(default_factory=dict)
    #: per GPU with a latched hardware fault: ``xid``, ``latched_at``, ``reason``
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per vram-lane type
    footprints: dict[str, FootprintStatus] = field(default_factory=dict)
    #: per queue root, how many bundles each of its subfolders holds
    queues: dict[str, dict[str, int]] = field(default_factory=dict)
    running: tuple[RunningStatus, ...] = ()
    warm: tuple[WarmStatus, ...] = ()
    #: the warm servers as the admission policy sees them (``explain``, ``preview``)
    warm_views: tuple[WarmView, ...] = ()
    #: per queued job, why it waits
    waiting: dict[str, str] = field(default_factory=dict)
    last_error: LoopError | None = None
    #: how many queued jobs the loop's queue index holds (``waiting`` names the first)
    queued_indexed: int = 0
    #: the managed runtimes as the loop last saw them (``ManagedRuntimes.statuses``)
    runtimes: tuple[dict[str, Any], ...] = ()
    #: what the node counted since its broker started (``/metrics``: :mod:`gpuwarden.node.stats`)
    stats: StatsSnapshot = field(default_factory=StatsSnapshot)
    #: the host's RAM as admission sees it (``core.ramadmit.RamView``; SPEC section 11)
    ram: RamView = UNSAMPLED
    #: the running service jobs: name, job, state, since, last_ok, error, port, gpu,
    #: owner, share, upstream (the forwarder; never its credential)
    services: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "stopped": self.stopped,
            "accepting": self.accepting,
            "probe": self.probe,
            "probe_error": self.probe_error,
            "gpus": [g.to_json() for g in self.gpus],
            "degraded": dict(self.degraded),
            "footprints": {t: f.to_json() for t, f in self.footprints.items()},
            "queues": {root: dict(depth) for root, depth in self.queues.items()},
            "running": [r.to_json() for r in self.running],
            "warm": [w.to_json() for w in self.warm],
            "warm_views": [v.to_json() for v in self.warm_views],
            "waiting": dict(self.waiting),
            "last_error": self.last_error.to_json() if self.last_error is not None else None,
            "queued_indexed": self.queued_indexed,
            "runtimes": [dict(r) for r in self.runtimes],
            "stats": self.stats.to_json(),
            "faults": {g: dict(f) for g, f in self.faults.items()},
            "ram": self.ram.to_json(),
            "services": [dict(x) for x in self.services],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BrokerStatus:
        """Read a stored document back (a missing key is taken as empty)."""
        last_error = d.get("last_error")
        return cls(
            stopped=bool(d.get("stopped", False)),
            accepting=bool(d.get("accepting", True)),
            probe=str(d.get("probe", "")),
            probe_error=str(d.get("probe_error") or ""),
            gpus=tuple(GpuStatus.from_json(g) for g in d.get("gpus", [])),
            degraded={str(k): str(v) for k, v in (d.get("degraded") or {}).items()},
            faults={
                str(k): dict(v) for k, v in (d.get("faults") or {}).items() if isinstance(v, dict)
            },
            footprints={
                str(t): FootprintStatus.from_json(f) for t, f in (d.get("footprints") or {}).items()
            },
            queues={str(r): dict(q) for r, q in (d.get("queues") or {}).items()},
            running=tuple(RunningStatus.from_json(r) for r in d.get("running", [])),
            warm=tuple(WarmStatus.from_json(w) for w in d.get("warm", [])),
            warm_views=tuple(WarmView.from_json(w) for w in d.get("warm_views", [])),
            waiting={str(k): str(v) for k, v in (d.get("waiting") or {}).items()},
            last_error=LoopError.from_json(last_error) if isinstance(last_error, dict) else None,
            queued_indexed=int(d.get("queued_indexed") or 0),
            runtimes=tuple(dict(r) for r in d.get("runtimes") or () if isinstance(r, dict)),
            stats=StatsSnapshot.from_json(d.get("stats")),
            ram=RamView.from_json(d.get("ram")),
            services=tuple(dict(x) for x in d.get("services") or () if isinstance(x, dict)),
        )

    def gpu_views(self) -> tuple[GpuView, ...]:
        """The GPUs as the admission policy sees them (those the book had a view of)."""
        return tuple(g.view for g in self.gpus if g.view is not None)


@dataclass(frozen=True, slots=True)
class GpuReport:
    """One GPU as placement needs it (an agent's report to its coordinator)."""

    uuid: str
    name: str
    total_bytes: int
    #: what a new job could take here now (its ledger's room, plus what idle warm
    #: servers would give back; less what jobs leased here but not started take)
    free_bytes: int
    #: its total less the reserve: the most any one job could ever take
    usable_bytes: int
    #: what the probe shows used
    used_bytes: int
    #: what the ledger holds
    ledger_bytes: int
    foreign_bytes: int
    reserve_bytes: int
    degraded: str
    sensors: GpuSensors | None = None
    #: what jobs queued here and not started yet will take (counted out of ``free_bytes``)
    waiting_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "usable_bytes": self.usable_bytes,
            "used_bytes": self.used_bytes,
            "ledger_bytes": self.ledger_bytes,
            "foreign_bytes": self.foreign_bytes,
            "reserve_bytes": self.reserve_bytes,
            "degraded": self.degraded,
            "sensors": self.sensors.to_json() if self.sensors is not None else None,
            "waiting_bytes": self.waiting_bytes,
        }


def gpu_reports(
    views: Sequence[GpuView],
    *,
    used: Mapping[str, int],
    evictable: set[str],
    waiting: int,
    sensors: Mapping[str, GpuSensors] | None = None,
) -> list[GpuReport]:
    """Per GPU, the room a new job could take: what its ledger lets a new job take,
    plus what the ``evictable`` holders (idle warm servers) would give back, never
    more than the GPU offers and nothing while it is degraded; less ``waiting``
    bytes (jobs queued and not started yet), taken from the GPUs with the most
    room first. ``used``: per GPU, what the probe shows used."""
    free: dict[str, int] = {}
    for v in views:
        usable = max(0, v.total_bytes - v.reserve_bytes)
        back = sum(h.bytes for h in v.holdings if h.holder in evictable)
        free[v.uuid] = 0 if v.degraded or v.locked else min(usable, v.free_bytes + back)
    taken: dict[str, int] = {}
    for uuid in sorted(free, key=lambda u: -free[u]):
        take = min(waiting, free[uuid])
        free[uuid] -= take
        taken[uuid] = take
        waiting -= take
    return [
        GpuReport(
            uuid=v.uuid,
            name=v.name,
            total_bytes=v.total_bytes,
            free_bytes=free[v.uuid],
            usable_bytes=max(0, v.total_bytes - v.reserve_bytes),
            used_bytes=used.get(v.uuid, 0),
            ledger_bytes=v.held_bytes,
            foreign_bytes=v.foreign_bytes,
            reserve_bytes=v.reserve_bytes,
            degraded=v.degraded,
            sensors=(sensors or {}).get(v.uuid),
            waiting_bytes=taken.get(v.uuid, 0),
        )
        for v in views
    ]
