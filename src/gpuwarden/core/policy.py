"""Admission and ordering: ``plan(snapshot, now) -> decisions``. Pure.

The broker gathers a :class:`Snapshot` (queued jobs with their effective
footprints, each GPU's capacity, ledger and foreign memory, cpu slots) and
carries out the decisions. The rules (DESIGN.md, "Admission rules"):

- A ``vram`` job starts on one GPU only if its footprint fits that GPU's free
  budget: total, minus the configured reserve, minus memory held by processes
  gpuwarden did not start, minus the ledger. Two GPUs' free memory never adds up.
- It shares a GPU only if it and every holder there opt in to co-residence.
- Order: higher priority first, then a job whose model is warm, then arrival.
- The first job that cannot start gets a reservation on the GPU it fits soonest
  (one reservation per GPU, in order). A later job may start on a reserved GPU
  only where it will not delay the reserved job: either both co-reside and fit
  beside each other, together with every job already started beside it, once
  everything else there has ended; or it is expected to end before the reserved
  job is expected to fit (run-time estimates per type, measured; a job without
  an estimate, or beside a holder without one, never backfills this way).
- A job whose footprint exceeds every GPU's total (less the reserve) is refused.
- A degraded GPU takes no ``vram`` job; ``cpu`` jobs go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.ledger import Holding, HoldState, compatible
from gpuwarden.core.model import Lane, format_bytes


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: str
    type: str
    lane: Lane
    vram_bytes: int  # effective footprint: max(declared or per-job, measured)
    priority: int
    seq: int
    coresident: bool = False
    warm: bool = False  # its model is loaded in a warm server on this node
    #: how long a job of its type is expected to run (None: not known yet)
    expected_s: float | None = None
    #: its type runs in a warm server (launch mode ``serve``)
    serve: bool = False


@dataclass(frozen=True, slots=True)
class WarmView:
    """A warm model server on this node: its model stays loaded between jobs."""

    type: str
    gpu_uuid: str
    holder: str  # its name in the ledger
    busy: bool  # loading, or running a job
    idle_since: float | None = None
    keep_warm: bool = False
    load_s: float = 0.0  # what reloading it would cost
    idle_grace_s: float = 300.0
    priority: int = 0  # of the jobs it serves; a keep_warm server yields only to higher
    stopping: bool = False  # on its way out (evicted, failed, or its job cancelled)

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WarmView:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class GpuView:
    uuid: str
    total_bytes: int
    reserve_bytes: int = 0
    #: memory used by processes gpuwarden did not start (and any unexplained use)
    foreign_bytes: int = 0
    holdings: tuple[Holding, ...] = ()
    #: why VRAM admission is paused on this GPU, or ""
    degraded: str = ""
    name: str = ""

    @property
    def capacity(self) -> int:
        """What gpuwarden may use here when none of its own holdings remain."""
        return max(0, self.total_bytes - self.reserve_bytes - self.foreign_bytes)

    @property
    def held_bytes(self) -> int:
        return sum(h.bytes for h in self.holdings)

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity - self.held_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "reserve_bytes": self.reserve_bytes,
            "foreign_bytes": self.foreign_bytes,
            "holdings": [h.to_json() for h in self.holdings],
            "degraded": self.degraded,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuView:
        return cls(
            uuid=d["uuid"],
            name=d.get("name", ""),
            total_bytes=int(d["total_bytes"]),
            reserve_bytes=int(d.get("reserve_bytes", 0)),
            foreign_bytes=int(d.get("foreign_bytes", 0)),
            holdings=tuple(Holding.from_json(h) for h in d.get("holdings", [])),
            degraded=d.get("degraded", ""),
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    queued: tuple[QueuedJob, ...]
    gpus: tuple[GpuView, ...]
    running_cpu: int = 0
    cpu_slots: int = 4
    accepting: bool = True
    #: why VRAM admission is paused on the whole node (the probe failed), or ""
    vram_paused: str = ""
    warm: tuple[WarmView, ...] = ()

    def gpus_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gpus]


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    gpu_uuid: str | None
    #: started beside the job this GPU is held back for (counts against its room)
    backfill_for: str | None = None
    #: handed to the type's warm server there (no new memory, no load)
    warm: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    job_id: str
    reason: str
    #: the GPU held back for this job, if it got the reservation
    reserved_gpu: str | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """The job can never run on this node: fail it with the reason."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Stop an idle warm server (idle past its grace, or its memory is needed).
    The broker re-checks that it is idle just before it stops it."""

    holder: str
    type: str
    gpu_uuid: str
    reason: str


Decision = Start | Wait | Refuse | Evict


def order(jobs: tuple[QueuedJob, ...] | list[QueuedJob]) -> list[QueuedJob]:
    """Higher priority first, then a job whose model is warm, then arrival order."""
    return sorted(jobs, key=lambda j: (-j.priority, not j.warm, j.seq))


def never_fits(need: int, gpus: tuple[GpuView, ...] | list[GpuView]) -> str | None:
    """Why a footprint can never fit one of these GPUs, or None if it can."""
    if not gpus:
        return None  # a node without GPUs (yet) says so in its wait reason
    best = max(g.total_bytes - g.reserve_bytes for g in gpus)
    if need <= best:
        return None
    return (
        f"needs {format_bytes(need)} on one GPU, more than any GPU here offers "
        f"(the largest has {format_bytes(best)} after the reserve); "
        "it can never run on this node"
    )


@dataclass
class _Gpu:
    """A GPU during one planning pass: its view plus the starts decided so far."""

    view: GpuView
    holdings: list[Holding] = field(default_factory=list)
    reserved_for: QueuedJob | None = None

    @property
    def free(self) -> int:
        return max(0, self.view.capacity - sum(h.bytes for h in self.holdings))


def plan(snapshot: Snapshot, now: float) -> list[Decision]:
    """Decide, for every queued job, whether it starts now (and where), waits (and
    why), or is refused (and why): one decision per queued job, in queue order.
    :class:`Evict` decisions for idle warm servers come first."""
    cpu_free = snapshot.cpu_slots - snapshot.running_cpu
    gpus = [_Gpu(g, list(g.holdings)) for g in snapshot.gpus]
    warm = _Warm(snapshot.warm)
    evictions = warm.expired(now, {j.type for j in snapshot.queued})
    degraded = {g.uuid: g.degraded for g in snapshot.gpus if g.degraded}
    paused = {
        w.type: snapshot.vram_paused or degraded.get(w.gpu_uuid, "")
        for w in snapshot.warm
        if snapshot.vram_paused or w.gpu_uuid in degraded
    }
    decisions: list[Decision] = []
    for job in order(snapshot.queued):
        if not snapshot.accepting:
            decisions.append(Wait(job.id, "the broker is shutting down"))
        elif job.lane is Lane.CPU:
            if cpu_free > 0:
                cpu_free -= 1
                decisions.append(Start(job.id, None))
            else:
                decisions.append(Wait(job.id, f"all {snapshot.cpu_slots} cpu slots are in use"))
        elif job.serve and (served := warm.serve(job, paused.get(job.type, ""))) is not None:
            decisions.append(served)
        else:
            decision = _place(job, snapshot, gpus, now)
            if isinstance(decision, Start) and job.serve:
                warm.loading(job.type, decision.gpu_uuid or "")
            elif isinstance(decision, Wait) and not snapshot.vram_paused:
                decision, more = _evict_for(job, decision, gpus, warm, snapshot)
                evictions += more
            decisions.append(decision)
    return [*evictions, *decisions]


class _Warm:
    """Warm servers during one planning pass."""

    def __init__(self, servers: tuple[WarmView, ...]) -> None:
        self.by_type = {w.type: w for w in servers}
        self.taken: dict[str, str] = {}  # type -> why later jobs of it wait this pass
        self.evicting: set[str] = set()

    def expired(self, now: float, wanted: set[str]) -> list[Decision]:
        """Servers idle past their grace, unless a queued job wants them now."""
        out: list[Decision] = []
        for w in self.by_type.values():
            if w.busy or w.keep_warm or w.idle_since is None or w.type in wanted:
                continue
            idle = now - w.idle_since
            if idle >= w.idle_grace_s:
                self.evicting.add(w.holder)
                out.append(
                    Evict(
                        w.holder,
                        w.type,
                        w.gpu_uuid,
                        f"idle for {idle:.0f} s (its grace is {w.idle_grace_s:g} s)",
                    )
                )
        return out

    def serve(self, job: QueuedJob, paused: str = "") -> Decision | None:
        """Hand the job to its type's warm server, or say why it waits for it.
        None: there is no server for it (one must be loaded). ``paused``: why VRAM
        admission is paused on the server's GPU (no job goes there then)."""
        if job.type in self.taken:
            return Wait(job.id, self.taken[job.type])
        w = self.by_type.get(job.type)
        if w is None:
            return None
        if paused:
            return Wait(job.id, f"its warm server's GPU {w.gpu_uuid} takes no job: {paused}")
        if w.holder in self.evicting or w.stopping:  # it waits for it to go, then loads anew
            return Wait(job.id, f"its warm {w.type} server on {w.gpu_uuid} is being stopped")
        if w.busy:
            return Wait(job.id, f"waits for the warm {w.type} server on {w.gpu_uuid} (busy)")
        self.taken[job.type] = f"waits for the warm {w.type} server on {w.gpu_uuid} (busy)"
        return Start(job.id, w.gpu_uuid, warm=True)

    def loading(self, type_name: str, gpu: str) -> None:
        self.taken[type_name] = f"waits for its model to load on {gpu}"

    def idle_on(self, gpu: str) -> list[WarmView]:
        return [
            w
            for w in self.by_type.values()
            if w.gpu_uuid == gpu
            and not w.busy
            and w.holder not in self.evicting
            and w.type not in self.taken
        ]


def _evict_for(
    job: QueuedJob, wait: Wait, gpus: list[_Gpu], warm: _Warm, snapshot: Snapshot
) -> tuple[Decision, list[Decision]]:
    """When idle warm servers stand between a waiting job and a GPU, evict the
    cheapest to reload until it fits. A ``keep_warm`` server yields only to a job
    of higher priority than the jobs it serves, and only if no other GPU can be
    freed of ordinary idle servers instead."""
    for allow_pinned in (False, True):
        best: tuple[float, _Gpu, list[WarmView]] | None = None
        for g in gpus:
            if g.view.degraded or g.view.capacity < job.vram_bytes:
                continue
            idle = sorted(
                (
                    w
                    for w in warm.idle_on(g.view.uuid)
                    if not w.keep_warm or (allow_pinned and job.priority > w.priority)
                ),
                key=lambda w: (w.load_s, w.holder),
            )
            chosen = _fewest_to_evict(job, g, idle)
            if chosen is not None:
                cost = sum(w.load_s for w in chosen)
                if best is None or cost < best[0]:
                    best = (cost, g, chosen)
        if best is not None:
            _, g, chosen = best
            names = ", ".join(f"{w.type}" for w in chosen)
            evictions: list[Decision] = []
            for w in chosen:
                warm.evicting.add(w.holder)
                why = f"its memory is needed by job {job.id} ({format_bytes(job.vram_bytes)})"
                if w.keep_warm:
                    why += (
                        f", of higher priority ({job.priority} > {w.priority}), with no other room"
                    )
                evictions.append(Evict(w.holder, w.type, w.gpu_uuid, why))
            if g.reserved_for is None:
                g.reserved_for = job
            return (
                Wait(
                    job.id,
                    f"{wait.reason}. Evicting idle warm server(s) on {g.view.uuid}: {names}",
                    g.view.uuid,
                ),
                evictions,
            )
    return wait, []


def _fewest_to_evict(job: QueuedJob, g: _Gpu, idle: list[WarmView]) -> list[WarmView] | None:
    """The idle servers, cheapest to reload first, whose leaving lets the job fit."""
    if not idle:
        return None
    gone: set[str] = set()
    chosen: list[WarmView] = []
    for w in idle:
        gone.add(w.holder)
        chosen.append(w)
        left = [h for h in g.holdings if h.holder not in gone]
        if _fits(job, g.view.capacity, left):
            return chosen
    return None


def _place(job: QueuedJob, snapshot: Snapshot, gpus: list[_Gpu], now: float) -> Decision:
    if snapshot.vram_paused:
        return Wait(job.id, f"VRAM admission is paused: {snapshot.vram_paused}")
    need = job.vram_bytes
    if not gpus:
        return Wait(job.id, f"needs {format_bytes(need)} on one GPU; this node has no GPU")
    if (why := never_fits(need, snapshot.gpus)) is not None:
        return Refuse(job.id, why)
    fitting = [(g, how) for g in gpus if (how := _can_start(job, g, now)) is not None]
    if fitting:
        best, how = min(fitting, key=lambda gh: (gh[0].free - need, gh[0].view.uuid))
        backfill_for = how or None
        best.holdings.append(
            Holding(
                holder=f"{job.id}/next",
                type=job.type,
                bytes=need,
                coresident=job.coresident,
                job_id=job.id,
                since=now,
                expected_end=None if job.expected_s is None else now + job.expected_s,
                backfill_for=backfill_for,
            )
        )
        return Start(job.id, best.view.uuid, backfill_for)
    reserved = _reserve(job, gpus)
    reason = f"needs {format_bytes(need)} on one GPU; " + "; ".join(_why_not(job, g) for g in gpus)
    if reserved is not None:
        reason += f". {reserved.view.uuid} is held back for it until it fits"
    return Wait(job.id, reason, reserved.view.uuid if reserved else None)


def _fits(job: QueuedJob, capacity: int, holdings: list[Holding]) -> bool:
    return compatible(job.coresident, holdings) and (
        job.vram_bytes + sum(h.bytes for h in holdings) <= capacity
    )


def _can_start(job: QueuedJob, g: _Gpu, now: float) -> str | None:
    """None if the job cannot start on this GPU now; else ``""``, or the id of the
    held-back job it starts beside (a co-resident backfill)."""
    if g.view.degraded or not _fits(job, g.view.capacity, g.holdings):
        return None
    head = g.reserved_for
    if head is None:
        return ""
    if _fits_beside(job, head, g):
        return head.id
    if _ends_before_head_fits(job, head, g, now):
        return ""
    return None


def _fits_beside(job: QueuedJob, head: QueuedJob, g: _Gpu) -> bool:
    """Both co-reside and, with every job already started beside the head, both fit
    once everything else there has ended: the head is not delayed."""
    beside = sum(h.bytes for h in g.holdings if h.backfill_for == head.id)
    return (
        job.coresident
        and head.coresident
        and job.vram_bytes + head.vram_bytes + beside <= g.view.capacity
    )


def _ends_before_head_fits(job: QueuedJob, head: QueuedJob, g: _Gpu, now: float) -> bool:
    if job.expected_s is None:
        return False
    fits_at = head_fits_at(head, g.view.capacity, g.holdings, now)
    return fits_at is not None and now + job.expected_s <= fits_at


def head_fits_at(
    head: QueuedJob, capacity: int, holdings: list[Holding], now: float
) -> float | None:
    """When ``head`` is expected to fit, as the holders end in their expected order;
    None when that depends on a holder with no estimate (or past its estimate)."""
    left = sorted(holdings, key=lambda h: h.expected_end if h.expected_end else float("inf"))
    at = now
    while not _fits(head, capacity, left):
        ending = left.pop(0)
        if ending.expected_end is None or ending.expected_end <= now:
            return None  # unknown, or running late: no promise can be made
        at = max(at, ending.expected_end)
    return at


def _reserve(job: QueuedJob, gpus: list[_Gpu]) -> _Gpu | None:
    """Hold back, for the first job that cannot start, the GPU it fits soonest:
    the one with the least of gpuwarden's memory on it among those big enough."""
    candidates = [
        g
        for g in gpus
        if g.reserved_for is None and not g.view.degraded and g.view.capacity >= job.vram_bytes
    ]
    if not candidates:
        return None
    chosen = min(candidates, key=lambda g: (sum(h.bytes for h in g.holdings), g.view.uuid))
    chosen.reserved_for = job
    return chosen


def _why_not(job: QueuedJob, g: _Gpu) -> str:
    uuid = g.view.uuid
    if g.view.degraded:
        return f"{uuid} is degraded ({g.view.degraded})"
    if not compatible(job.coresident, g.holdings):
        who = ", ".join(_holder(h) for h in g.holdings)
        if job.coresident:
            return f"{uuid} is held by {who}, which does not share its GPU"
        return f"{uuid} is not empty ({who}) and {job.type} needs a GPU to itself"
    if g.free < job.vram_bytes:
        parts = [f"{format_bytes(h.bytes)} held by {_holder(h)}" for h in g.holdings]
        if g.view.foreign_bytes:
            parts.append(f"{format_bytes(g.view.foreign_bytes)} by other processes")
        if g.view.reserve_bytes:
            parts.append(f"{format_bytes(g.view.reserve_bytes)} kept in reserve")
        return f"{uuid} has {format_bytes(g.free)} free" + (
            ": " + ", ".join(parts) if parts else ""
        )
    head = g.reserved_for
    if head is not None:
        return f"{uuid} is held back for job {head.id}, which waits for it and must not be delayed"
    return f"{uuid} cannot take it"  # pragma: no cover - every refusal above has a reason


def _holder(h: Holding) -> str:
    who = f"{h.type} ({h.job_id})" if h.job_id else h.type
    if h.state is HoldState.RECLAIMING:
        return f"{who}, ended, its memory not yet shown free"
    if h.state is HoldState.WARM:
        return f"{who}, warm server"
    return f"{who}, {h.state.value}"
