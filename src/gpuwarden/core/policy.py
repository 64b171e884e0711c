"""Admission and ordering: ``plan(snapshot, now) -> decisions``. Pure.

The broker gathers a :class:`Snapshot` (queued jobs with their effective
footprints, each GPU's capacity, ledger and foreign memory, cpu slots) and
carries out the decisions. The rules (DESIGN.md, "Admission rules"):

- A ``vram`` job starts on one GPU only if its footprint fits that GPU's free
  budget: total, minus the configured reserve, minus memory held by processes
  gpuwarden did not start, minus the ledger. Two GPUs' free memory never adds up.
- It shares a GPU only if it and every holder there opt in to co-residence.
- Order: higher priority first, then the job whose owner used least (fair share),
  then a job whose model is warm, then arrival.
- The first job that cannot start (the first ``max_reservations``) gets a
  reservation: the GPU held back for it in the previous pass (``held_back``),
  else the GPU it fits soonest (:func:`fits_soonest_key`). A later job may start
  on a reserved GPU only where it will not delay the reserved job: either both
  co-reside and fit beside each other, together with every job already started beside it, once
  everything else there has ended; or it is expected to end before the reserved
  job could fit (run-time estimates: its type's measured one, else its own
  ``est_s``; a holder without one may end at any moment, so the head's fit is
  reckoned as if it had gone; a job without an estimate never backfills this way).
- A job whose footprint exceeds every GPU's total (less the reserve) is refused.
- A degraded GPU takes no ``vram`` job; ``cpu`` jobs go on. Nor does a GPU whose
  lock file (``gpu_lock``) a process outside the queue holds or waits for
  (``GpuView.locked``): jobs running there go on, nothing new starts.
- Host RAM (:mod:`gpuwarden.core.ramadmit`), for jobs of either lane: a job
  starts only where MemAvailable, less what running jobs' caps still promise,
  less the largest floor (the node's, its own, the running jobs'), holds its
  cap, and MemAvailable its start minimum; otherwise it waits with that reason
  (no GPU is held back for it). Each start in a pass takes its cap from what is
  left.
- A job on several GPUs (``gpus = N``) starts only when N GPUs of the node each
  fit its footprint at once, never on fewer; its reservation holds back the N
  GPUs it fits soonest. It never starts beside a held-back job (only where it
  ends before that job could fit), and nothing is evicted, released or
  preempted for it: several GPUs are not freed at once for one job.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwarden.core import ramadmit
from gpuwarden.core.bestfit import FreeOrder
from gpuwarden.core.lease import is_lease
from gpuwarden.core.ledger import Holding, HoldState, compatible
from gpuwarden.core.model import Lane, format_bytes, gpu_list
from gpuwarden.core.preempt import Need, Preempt, Victim, choose, describe, preempts
from gpuwarden.core.queueindex import NONE, Leaf, MinTree
from gpuwarden.core.ramadmit import NO_RAM, UNSAMPLED, RamNeed, RamView


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
    #: a runtime type's job: the managed runtime (its name on this node, or the
    #: word its type gave when no runtime here answers to it) and the model
    runtime: str = ""
    model: str = ""
    #: who submitted it (the token's id, "" for local) and that owner's decayed
    #: use in GiB-hours as the pass sees it (:mod:`gpuwarden.core.fairshare`)
    owner: str = ""
    usage: float = 0.0
    #: how many GPUs it holds at once, ``vram_bytes`` on each (all or none)
    gpus: int = 1
    #: what it asks of the host's RAM (:mod:`gpuwarden.core.ramadmit`)
    ram: RamNeed = NO_RAM
    #: the one GPU it may run on (its ``gpu`` constraint, ``lease --gpu``); "": any
    gpu: str = ""


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
    #: what each managed runtime's processes hold here, by its name (not foreign:
    #: counted against the budget the same way, but named)
    runtimes: tuple[tuple[str, int], ...] = ()
    #: why a process outside the queue keeps it (``gpu_lock``: it holds or waits
    #: for the GPU's lock file), or "": taken like a degraded GPU, with this reason
    locked: str = ""

    @property
    def runtime_bytes(self) -> int:
        return sum(b for _, b in self.runtimes)

    @property
    def capacity(self) -> int:
        """What gpuwarden may use here when none of its own holdings remain."""
        return max(
            0, self.total_bytes - self.reserve_bytes - self.foreign_bytes - self.runtime_bytes
        )

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
            "runtimes": [{"name": n, "bytes": b} for n, b in self.runtimes],
            "locked": self.locked,
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
            runtimes=tuple((str(r["name"]), int(r["bytes"])) for r in d.get("runtimes", [])),
            locked=str(d.get("locked", "")),
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
    #: how many waiting jobs may have a GPU held back for them in one pass (the
    #: first that cannot start, then the next, in queue order)
    max_reservations: int = 1
    #: the managed runtimes (their memory is in each GPU's ``runtimes``)
    runtimes: tuple[RuntimeView, ...] = ()
    #: ``(job id, GPU uuid)``: the GPUs held back in the previous pass (``Wait.reserved_gpu``,
    #: ``ClassWait.reserved_gpu``); a job that still gets a reservation keeps its GPU,
    #: so the GPU that drains for it is not traded for another that looks sooner
    held_back: tuple[tuple[str, str], ...] = ()
    #: the running attempts of preemptible types (:mod:`gpuwarden.core.preempt`)
    victims: tuple[Victim, ...] = ()
    #: the host's RAM as the loop sampled it (:mod:`gpuwarden.core.ramadmit`; not
    #: sampled: every job is admitted as far as RAM goes)
    ram: RamView = UNSAMPLED

    def gpus_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gpus]


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    #: its GPU, or a multi-GPU job's GPUs comma-separated (``core.model.gpu_list``)
    gpu_uuid: str | None
    #: started beside the job this GPU is held back for (counts against its room)
    backfill_for: str | None = None
    #: its model is loaded already, in the type's warm server there or in its
    #: managed runtime (a runtime job): no new memory, no load
    warm: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    job_id: str
    reason: str
    #: the GPU held back for this job, if it got the reservation (a multi-GPU
    #: job's GPUs, comma-separated)
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


@dataclass(frozen=True, slots=True)
class RuntimeView:
    """A managed runtime as admission sees it (its memory is in ``GpuView.runtimes``)."""

    name: str
    #: it may be asked to release now (idle past its grace, releasable, reachable)
    may_ask: bool
    #: why not (or why), in a person's words
    why: str = ""
    #: a release was asked and its memory has not shown free yet
    releasing: bool = False
    #: it answers (its API could be read at the last look)
    reachable: bool = True
    #: the models it says it has loaded (its own account)
    models: tuple[str, ...] = ()
    #: the GPUs it loads models on (its ``gpus`` key; empty: any)
    gpus: tuple[str, ...] = ()
    kind: str = ""


@dataclass(frozen=True, slots=True)
class AskRuntime:
    """Ask a managed runtime to release its memory on a GPU, for a waiting job (the
    GPU is held back for that job meanwhile). The broker re-checks that it is idle
    right before it asks one whose release would abort work."""

    name: str
    gpu_uuid: str
    nbytes: int
    job_id: str


def order(jobs: tuple[QueuedJob, ...] | list[QueuedJob]) -> list[QueuedJob]:
    """Higher priority first, then the owner who used least (fair share), then a
    job whose model is warm, then arrival order."""
    return sorted(jobs, key=_rank)


def never_fits(need: int, gpus: tuple[GpuView, ...] | list[GpuView], count: int = 1) -> str | None:
    """Why a footprint can never fit one of these GPUs (``count`` of them at once,
    for a multi-GPU job), or None if it can."""
    if not gpus:
        return None  # a node without GPUs (yet) says so in its wait reason
    best = max(g.total_bytes - g.reserve_bytes for g in gpus)
    if need > best:
        where = "one GPU" if count == 1 else f"each of {count} GPUs"
        return (
            f"needs {format_bytes(need)} on {where}, more than any GPU here offers "
            f"(the largest has {format_bytes(best)} after the reserve); "
            "it can never run on this node"
        )
    if count > 1 and (big := sum(g.total_bytes - g.reserve_bytes >= need for g in gpus)) < count:
        return (
            f"needs {count} GPUs at once with {format_bytes(need)} on each, and this node "
            f"has {len(gpus)} GPU(s), {big} of them that big (after the reserve); "
            "it can never run on this node"
        )
    return None


#: a member of a class: ``(seq, id)``, or ``(seq, id, owner, usage)`` where the
#: class holds jobs of several owners (fair share: they need the same, but their
#: owners' use orders them apart)
Member = tuple[int, str] | tuple[int, str, str, float]


@dataclass(frozen=True, slots=True)
class Lineup:
    """One class of interchangeable queued jobs, as a pass sees it: what each of
    them needs (``job``: the head, with its id and seq) and all their members
    in queue order, the head first (:mod:`gpuwarden.core.queueindex`): arrival
    order, or the owners' use then arrival where members name their owners."""

    key: Hashable
    job: QueuedJob
    members: Iterable[Member]


class ClassWait:
    """Why the jobs of one class wait this pass. ``job_id`` is its head, which may
    have a GPU held back for it; the reasons are written when first read (a pass
    over a long queue never formats them), from the GPUs as the pass left them."""

    __slots__ = ("_member", "_reason", "_render", "job_id", "key", "reserved_gpu")

    def __init__(
        self,
        key: Hashable,
        job_id: str,
        render: Callable[[], tuple[str, str]],
        reserved_gpu: str | None = None,
    ) -> None:
        self.key = key
        self.job_id = job_id
        self.reserved_gpu = reserved_gpu
        self._render = render
        self._reason: str | None = None
        self._member = ""

    @classmethod
    def fixed(cls, key: Hashable, job_id: str, reason: str) -> ClassWait:
        return cls(key, job_id, lambda: (reason, reason))

    def _rendered(self) -> None:
        if self._reason is None:
            self._reason, self._member = self._render()

    @property
    def reason(self) -> str:
        """The head's reason."""
        self._rendered()
        assert self._reason is not None
        return self._reason

    @property
    def member_reason(self) -> str:
        """The reason of every other job of the class."""
        self._rendered()
        return self._member

    def wait(self, job_id: str) -> Wait:
        if job_id == self.job_id:
            return Wait(job_id, self.reason, self.reserved_gpu)
        return Wait(job_id, self.member_reason)

    def signature(self) -> tuple[Hashable, str, str | None]:
        """What changes the status: which job heads the class and what is held for it."""
        return (self.key, self.job_id, self.reserved_gpu)


@dataclass(frozen=True, slots=True)
class Shelf:
    """One owner's classes of a :class:`SizedLineup`, the same but for their jobs'
    footprints: bucket ``pos`` holds the jobs whose own footprint is
    ``idents[pos]`` (the same ident across owners is one class of the plan),
    admitted with ``sizes[pos]``, ascending; ``tree`` has each bucket's head as
    ``(seq, tie, pos)`` (:class:`gpuwarden.core.queueindex.MinTree`), kept by the
    index between passes and copied by a pass that changes it."""

    owner: str
    usage: float
    sizes: list[int]
    idents: list[Hashable]
    heads: list[str]
    tree: MinTree
    pos_of: dict[Hashable, int]
    #: a bucket's members in queue order, its head first: ``(seq, id)``
    members: Callable[[int], Iterable[tuple[int, str]]]


@dataclass(frozen=True, slots=True)
class SizedLineup:
    """Classes of queued jobs that differ only in their own footprint (command jobs,
    each with its own ``--vram``), as one: ``job`` is what they all need but the
    footprint (its id, seq, owner and size are each member's), ``shelves`` one per
    owner. A pass decides for them exactly as for one :class:`Lineup` per footprint
    (``key_of(ident)`` is that class's key), but once one of them waits with nothing
    done for it (no GPU held back, nothing evicted, released or preempted), every
    bigger one waits too for the rest of the pass, and is not looked at:
    :class:`RangeWait` says why (``size_of`` gives a waiting job's footprint)."""

    key: Hashable
    job: QueuedJob
    shelves: list[Shelf]
    key_of: Callable[[Hashable], Hashable]
    size_of: Callable[[str], int]


class RangeWait(ClassWait):
    """Why the jobs of a :class:`SizedLineup` that the pass did not look at wait:
    each as the first job of a smaller size that waited for nothing (``ranges``:
    ``(size, its blocked decision)``, the sizes falling), with its own footprint,
    from the GPUs as that job was judged."""

    __slots__ = ("proto", "ranges", "size_of")

    def __init__(self, key: Hashable, proto: QueuedJob, size_of: Callable[[str], int]) -> None:
        super().__init__(key, "", lambda: ("", ""))
        self.proto = proto
        self.size_of = size_of
        self.ranges: list[tuple[int, _Blocked]] = []

    def wait(self, job_id: str) -> Wait:
        size = self.size_of(job_id)
        blocked = next(b for at, b in self.ranges if size >= at)
        return Wait(job_id, blocked.render(replace(self.proto, id=job_id, vram_bytes=size)))

    def signature(self) -> tuple[Hashable, str, str | None]:
        return (self.key, ",".join(str(at) for at, _ in self.ranges), None)


@dataclass
class Pass:
    """What one planning pass decided: warm servers to stop, jobs to start, jobs
    to refuse, and why each remaining class waits (in queue order of its head)."""

    evictions: list[Decision] = field(default_factory=list)
    #: managed runtimes to ask to release, each for the job whose GPU it frees
    asks: list[AskRuntime] = field(default_factory=list)
    starts: list[Start] = field(default_factory=list)
    refusals: list[Refuse] = field(default_factory=list)
    waits: list[ClassWait] = field(default_factory=list)
    #: running preemptible jobs to ask to checkpoint, each for the job that waits
    preemptions: list[Preempt] = field(default_factory=list)


def class_key(job: QueuedJob) -> Hashable:
    """What makes two queued jobs interchangeable for a pass (all but id and seq)."""
    return (
        job.type,
        job.lane,
        job.vram_bytes,
        job.priority,
        job.coresident,
        job.warm,
        job.expected_s,
        job.serve,
        job.runtime,
        job.model,
        job.owner,
        job.usage,
        job.gpus,
        job.ram,
        job.gpu,
    )


def lineups_of(queued: Iterable[QueuedJob]) -> tuple[list[Lineup], dict[Hashable, list[QueuedJob]]]:
    """Group queued jobs into classes (see :func:`plan_pass`)."""
    groups: dict[Hashable, list[QueuedJob]] = {}
    for job in queued:
        groups.setdefault(class_key(job), []).append(job)
    lineups = []
    for key, jobs in groups.items():
        jobs.sort(key=lambda j: j.seq)
        lineups.append(Lineup(key, jobs[0], [(j.seq, j.id) for j in jobs]))
    return lineups, groups


def sized_key(job: QueuedJob) -> Hashable:
    """The class of :func:`class_key` but for the footprint (a :class:`SizedLineup`)."""
    return replace(job, id="", seq=0, vram_bytes=0)


def sized_lineups_of(
    queued: Iterable[QueuedJob],
) -> tuple[list[SizedLineup], dict[Hashable, list[QueuedJob]]]:
    """Group queued jobs into sized lineups (one per :func:`sized_key`), each of
    the classes of :func:`lineups_of` a bucket, tied as there (first seen first)."""
    lineups, groups = lineups_of(queued)
    size = {j.id: j.vram_bytes for j in queued}
    by_sized: dict[Hashable, list[tuple[int, int, Lineup]]] = {}
    for n, lu in enumerate(lineups):
        by_sized.setdefault(sized_key(lu.job), []).append((lu.job.vram_bytes, n, lu))
    out = []
    for key, buckets in by_sized.items():
        buckets.sort(key=lambda b: (b[0], b[1]))
        members = [list(b[2].members) for b in buckets]
        proto = buckets[0][2].job
        shelf = Shelf(
            owner=proto.owner,
            usage=proto.usage,
            sizes=[b[0] for b in buckets],
            idents=[b[0] for b in buckets],
            heads=[m[0][1] for m in members],
            tree=MinTree(
                [
                    (m[0][0], b[1], pos)
                    for pos, (b, m) in enumerate(zip(buckets, members, strict=True))
                ]
            ),
            pos_of={b[0]: pos for pos, b in enumerate(buckets)},
            members=lambda pos, members=members: members[pos],  # type: ignore[misc]
        )
        keys: dict[Hashable, Hashable] = {b[0]: b[2].key for b in buckets}
        out.append(SizedLineup(key, proto, [shelf], keys.__getitem__, size.__getitem__))
    return out, groups


def plan(snapshot: Snapshot, now: float) -> list[Decision]:
    """Decide, for every queued job, whether it starts now (and where), waits (and
    why), or is refused (and why): one decision per queued job, in queue order.
    :class:`Evict` decisions for idle warm servers come first. (The broker loop
    calls :func:`plan_pass` on the classes it keeps; this is the same pass, with
    every job's decision spelled out.)"""
    lineups, groups = sized_lineups_of(snapshot.queued)
    done = plan_pass(lineups, snapshot, now)
    by_id: dict[str, Decision] = {d.job_id: d for d in done.starts}
    by_id.update((d.job_id, d) for d in done.refusals)
    ranges: dict[Hashable, ClassWait] = {}
    for w in done.waits:
        if isinstance(w, RangeWait):
            ranges[w.key] = w
            continue
        for job in groups[w.key]:
            by_id.setdefault(job.id, w.wait(job.id))
    for job in snapshot.queued:  # those of the bigger sizes no pass looked at
        if job.id not in by_id:
            by_id[job.id] = ranges[sized_key(job)].wait(job.id)
    return [*done.evictions, *(by_id[j.id] for j in order(snapshot.queued))]


def plan_pass(lineups: Iterable[Lineup | SizedLineup], snapshot: Snapshot, now: float) -> Pass:
    """One planning pass over classes of interchangeable jobs (``snapshot.queued``
    is not read). Jobs are taken in queue order across classes (:func:`order`);
    once a class's head cannot start, the rest of its class waits with it, so the
    work is proportional to the classes and the jobs started, not to the queue
    (and, for a :class:`SizedLineup`, to the sizes that waited for something)."""
    lineups = list(lineups)
    done = Pass()
    step = _Step(snapshot, now, {lu.job.type for lu in lineups})
    done.evictions = step.evictions
    done.asks = step.asks
    done.preemptions = step.preemptions
    if not snapshot.accepting:
        for lu in sorted(lineups, key=lambda lu: _rank(lu.job)):
            done.waits.append(_closed(lu))
        return done
    heads: list[_Head] = []
    runs: list[_SizedRun] = []
    for n, lu in enumerate(lineups):
        if isinstance(lu, SizedLineup):
            run = _SizedRun(lu, n, step)
            run.run_no = len(runs)
            runs.append(run)
            _push(heads, run.next())
            continue
        members = iter(lu.members)
        first = next(members, None)
        if first is not None:
            head = _as(lu.job, first)
            heads.append((_rank(head), n, n, head, members))
    heapq.heapify(heads)
    while heads:
        _, _, n, job, where = heapq.heappop(heads)
        if isinstance(where, tuple):
            _push(heads, runs[where[0]].decide(job, where[1], where[2], done))
            continue
        decision = step.decide(job)
        if isinstance(decision, Start):
            done.starts.append(decision)
            if (following := next(where, None)) is not None:
                job = _as(job, following)
                heapq.heappush(heads, (_rank(job), n, n, job, where))
        elif isinstance(decision, Refuse):  # every job of the class needs the same
            done.refusals.append(decision)
            done.refusals.extend(Refuse(m[1], decision.reason) for m in where)
        else:
            done.waits.append(decision.class_wait(lineups[n].key))
    done.waits += [run.range for run in runs if run.range.ranges]
    return done


#: a class's next job in a pass: its rank, tie, lineup, the job, and its members
#: to come (a :class:`Lineup`) or ``(run, shelf, bucket)`` (a :class:`SizedLineup`)
_Head = tuple[Any, int, int, QueuedJob, Any]


def _push(heads: list[_Head], head: _Head | None) -> None:
    if head is not None:
        heapq.heappush(heads, head)


def _closed(lu: Lineup | SizedLineup) -> ClassWait:
    """Why a lineup waits while the broker shuts down."""
    why = "the broker is shutting down"
    if isinstance(lu, Lineup):
        return ClassWait.fixed(lu.key, lu.job.id, why)
    wait = RangeWait(lu.key, lu.job, lu.size_of)
    wait.ranges.append((0, _Blocked(lu.job, lambda _j: why)))
    return wait


class _SizedRun:
    """A :class:`SizedLineup` during one pass: which of its sizes are still open
    (below ``below``, or never admitted here: they are refused when reached, and
    those whose class waits for something), and each bucket's head."""

    def __init__(self, lu: SizedLineup, n: int, step: _Step) -> None:
        self.lu, self.n, self.step = lu, n, step
        self.run_no = 0
        self.trees = [s.tree for s in lu.shelves]
        self.copied = [False] * len(self.trees)
        #: each shelf's first open bucket (None: to be found again, its tree or the
        #: open sizes changed)
        self.firsts: list[Leaf | None] = [None] * len(self.trees)
        #: the shelves by their owner's use: the first with an open bucket comes first
        self.by_use = sorted(range(len(lu.shelves)), key=lambda i: lu.shelves[i].usage)
        self.left: dict[tuple[int, int], Iterator[tuple[int, str]]] = {}
        self.head: dict[tuple[int, int], tuple[int, str]] = {}
        self.below = float("inf")
        self.big = float("inf") if step.best is None else step.best  # bigger: refused
        #: a bigger job waits too only where nothing was done for a smaller one, and
        #: no victim is already preempting for one of them
        self.prune = lu.job.gpus == 1 and not step.pending
        self.range = RangeWait(lu.key, lu.job, lu.size_of)

    def next(self) -> _Head | None:
        """The open bucket whose head comes first (queue order), as a pass head."""
        best: tuple[float, Leaf, int] | None = None
        for i in self.by_use:
            s = self.lu.shelves[i]
            if best is not None and s.usage > best[0]:
                break  # (the owners who used more come after)
            leaf = self.firsts[i]
            if leaf is None:
                leaf = self.firsts[i] = self._first(i)
            if leaf is not NONE and leaf[2] >= 0 and (best is None or (s.usage, leaf) < best[:2]):
                best = (s.usage, leaf, i)
        if best is None:
            return None
        _, (seq, tie, pos), i = best
        s = self.lu.shelves[i]
        head = self.head.get((i, pos))
        job_id = s.heads[pos] if head is None else head[1]
        job = _member(
            self.lu.job, job_id, seq, vram_bytes=s.sizes[pos], owner=s.owner, usage=s.usage
        )
        return (_rank(job), tie, self.n, job, (self.run_no, i, pos))

    def _first(self, i: int) -> Leaf:
        """Shelf ``i``'s open bucket whose head comes first."""
        s, tree = self.lu.shelves[i], self.trees[i]
        count = len(s.sizes)
        if self.below > self.big:
            return tree.min_in(0, count)
        hi = bisect_left(s.sizes, self.below)
        lo = bisect_right(s.sizes, self.big)
        return min(tree.min_in(0, hi), tree.min_in(lo, count))

    def decide(self, job: QueuedJob, i: int, pos: int, done: Pass) -> _Head | None:
        """Decide for the head of bucket ``pos`` of shelf ``i``; the next head."""
        step = self.step
        marks = (len(step.evictions), len(step.asks), len(step.preemptions))
        decision = step.decide(job)
        ident = self.lu.shelves[i].idents[pos]
        if isinstance(decision, Start):
            done.starts.append(decision)
            self._advance(i, pos)
        elif isinstance(decision, Refuse):
            done.refusals.append(decision)
            done.refusals.extend(Refuse(j, decision.reason) for j in self._rest(ident, job.id))
            self._close(ident)
        else:
            done.waits.append(decision.class_wait(self.lu.key_of(ident)))
            self._close(ident)
            pure = decision.reserved is None and marks == (
                len(step.evictions),
                len(step.asks),
                len(step.preemptions),
            )
            if pure and self.prune and job.vram_bytes <= self.big:
                self.below = job.vram_bytes
                self.firsts = [None] * len(self.trees)
                self.range.ranges.append((job.vram_bytes, decision))
        return self.next()

    def _tree(self, i: int) -> MinTree:
        """Shelf ``i``'s tree, to change (the pass's own copy)."""
        self.firsts[i] = None
        if not self.copied[i]:
            self.trees[i], self.copied[i] = self.trees[i].copy(), True
        return self.trees[i]

    def _advance(self, i: int, pos: int) -> None:
        """The head of a bucket started: its next member heads it."""
        rest = self.left.get((i, pos))
        if rest is None:
            rest = self.left[(i, pos)] = iter(self.lu.shelves[i].members(pos))
            next(rest, None)  # the head
        following = next(rest, None)
        if following is None:
            self._tree(i).set(pos, NONE)
            return
        self.head[(i, pos)] = following
        self._tree(i).set(pos, (following[0], self._tree(i).t[self.trees[i].size + pos][1], pos))

    def _close(self, ident: Hashable) -> None:
        """Take the class ``ident`` (its buckets on every shelf) out of the pass."""
        for i, s in enumerate(self.lu.shelves):
            pos = s.pos_of.get(ident)
            if pos is not None:
                self._tree(i).set(pos, NONE)

    def _rest(self, ident: Hashable, decided: str) -> list[str]:
        """The jobs of the class ``ident`` not decided yet, but ``decided``."""
        out = []
        for i, s in enumerate(self.lu.shelves):
            pos = s.pos_of.get(ident)
            if pos is None or self.trees[i].t[self.trees[i].size + pos] is NONE:
                continue
            rest: Iterable[tuple[int, str]] | None = self.left.get((i, pos))
            if rest is None:
                rest = s.members(pos)
            elif (head := self.head.get((i, pos))) is not None:
                rest = itertools.chain([head], rest)
            out += [m[1] for m in rest if m[1] != decided]
        return out


#: a job's place in the queue: priority, its owner's use, warm, arrival
Rank = tuple[int, float, bool, int]


def _rank(job: QueuedJob, seq: int | None = None) -> Rank:
    return (-job.priority, job.usage, not job.warm, job.seq if seq is None else seq)


def _as(proto: QueuedJob, member: Member) -> QueuedJob:
    seq, job_id = member[0], member[1]
    if job_id == proto.id:
        return proto
    owner, usage = (member[2], member[3]) if len(member) == 4 else (proto.owner, proto.usage)
    return _member(proto, job_id, seq, vram_bytes=proto.vram_bytes, owner=owner, usage=usage)


def _member(
    proto: QueuedJob, job_id: str, seq: int, *, vram_bytes: int, owner: str, usage: float
) -> QueuedJob:
    """A job of ``proto``'s class but for these (``dataclasses.replace`` without
    its cost: a pass makes one per judgement)."""
    return QueuedJob(
        job_id,
        proto.type,
        proto.lane,
        vram_bytes,
        proto.priority,
        seq,
        proto.coresident,
        proto.warm,
        proto.expected_s,
        proto.serve,
        proto.runtime,
        proto.model,
        owner,
        usage,
        proto.gpus,
        proto.ram,
        proto.gpu,
    )


class _Clock:
    """A pass's count of the changes to its GPUs (a start's holding, a GPU held
    back): a wait's reason is written later, from the GPUs as they were at its
    stamp (:meth:`_Gpu.seen`), with no copy of every GPU per waiting job."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def tick(self) -> int:
        self.n += 1
        return self.n


@dataclass(eq=False)
class _Gpu:
    """A GPU during one planning pass: its view plus the starts decided so far.
    Holdings are only added to and ``reserved_for`` is set at most once, each
    change stamped by the pass's clock; ``order`` (the pass's best-fit rows, if
    any) is told of each change at position ``pos``."""

    view: GpuView
    holdings: list[Holding] = field(default_factory=list)
    reserved_for: QueuedJob | None = None
    capacity: int = 0
    held: int = 0
    shared_only: bool = True  # every holder co-resides
    clock: _Clock = field(default_factory=_Clock)
    order: FreeOrder | None = None
    pos: int = 0
    #: the clock's stamps of the holdings added in this pass, and of ``reserved_for``
    added: list[int] = field(default_factory=list)
    reserved_at: int = 0
    base: int = 0  # holdings when the pass began
    #: :func:`head_fits_at` for ``reserved_for``, and how many holdings it saw
    fits_at: tuple[int, float | None] = (-1, None)

    def __post_init__(self) -> None:
        self.capacity = self.view.capacity
        self.held = sum(h.bytes for h in self.holdings)
        self.shared_only = all(h.coresident for h in self.holdings)
        self.base = len(self.holdings)
        self._reorder()

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.held)

    def add(self, holding: Holding) -> None:
        self.holdings.append(holding)
        self.held += holding.bytes
        self.shared_only = self.shared_only and holding.coresident
        self.added.append(self.clock.tick())
        self._reorder()

    def hold_for(self, job: QueuedJob) -> None:
        """Hold the GPU back for ``job``, unless it is held back for a job already."""
        if self.reserved_for is None:
            self.reserved_for = job
            self.reserved_at = self.clock.tick()
            if self.order is not None:
                self.order.hold(self.pos)

    def seen(self, at: int) -> tuple[int, QueuedJob | None]:
        """How many holdings it had at the clock's stamp ``at``, and whom it was
        held back for then."""
        head = self.reserved_for if self.reserved_at <= at else None  # (None: never held)
        return self.base + bisect_right(self.added, at), head

    def head_fits_at(self, now: float) -> float | None:
        """:func:`head_fits_at` of the job the GPU is held back for, here, as it is
        now (worked out again only once a holding was added)."""
        assert self.reserved_for is not None
        if self.fits_at[0] != len(self.holdings):
            at = head_fits_at(self.reserved_for, self.capacity, self.holdings, now)
            self.fits_at = (len(self.holdings), at)
        return self.fits_at[1]

    def fits(self, job: QueuedJob) -> bool:
        return (not self.holdings or (job.coresident and self.shared_only)) and (
            job.vram_bytes + self.held <= self.capacity
        )

    def _reorder(self) -> None:
        if self.order is None or self.reserved_for is not None or self.view.degraded:
            return
        if self.shared_only:
            self.order.put(
                self.pos, self.capacity - self.held, self.view.uuid, empty=not self.holdings
            )
        else:
            self.order.drop(self.pos)


class _Blocked:
    """A job that cannot start now, its reason still to be written."""

    def __init__(
        self,
        job: QueuedJob,
        render: Callable[[QueuedJob], str],
        reserved: str | None = None,
    ):
        self.job = job
        #: the reason, for this job or (a pruned class) another of its class but size
        self.render = render
        self.reserved = reserved
        self.extra: list[str] = []  # sentences about the head only

    def class_wait(self, key: Hashable) -> ClassWait:
        def both() -> tuple[str, str]:
            base = self.render(self.job)
            return ". ".join([base, *self.extra]), base

        return ClassWait(key, self.job.id, both, self.reserved)


class _Step:
    """The state of one planning pass: GPUs, warm servers, cpu slots."""

    def __init__(self, snapshot: Snapshot, now: float, wanted: set[str]) -> None:
        self.snapshot = snapshot
        self.now = now
        self.cpu_free = snapshot.cpu_slots - snapshot.running_cpu
        self.clock = _Clock()
        self.order = FreeOrder()
        self.gpus = [
            _Gpu(_paused_view(g), list(g.holdings), clock=self.clock, order=self.order, pos=n)
            for n, g in enumerate(snapshot.gpus)
        ]
        self.best = max((g.total_bytes - g.reserve_bytes for g in snapshot.gpus), default=None)
        self.reservations_left = snapshot.max_reservations
        self._most_free: tuple[int, int] | None = None
        self.held_back = dict(snapshot.held_back)
        self.warm = _Warm(snapshot.warm)
        #: the GPUs a warm server is on, in order: the only ones an eviction frees
        self.warm_uuids = {w.gpu_uuid for w in snapshot.warm}
        self.warm_gpus = [g for g in self.gpus if g.view.uuid in self.warm_uuids]
        self.evictions = self.warm.expired(now, wanted)
        #: (size, priority) of the jobs no eviction made room for on every GPU, by
        #: whether they co-reside (:meth:`evict_for`)
        self.no_eviction: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.runtimes = {r.name: r for r in snapshot.runtimes}
        self.asks: list[AskRuntime] = []
        self.preemptions: list[Preempt] = []
        #: victims asked (this pass or before) stay out of other jobs' choices
        self.victims = [v for v in snapshot.victims if v.preempting_for is None]
        self.pending = [v for v in snapshot.victims if v.preempting_for is not None]
        self.ram = snapshot.ram
        degraded = {g.uuid: g.degraded or g.locked for g in snapshot.gpus if g.degraded or g.locked}
        self.paused = {
            w.type: snapshot.vram_paused or degraded.get(w.gpu_uuid, "")
            for w in snapshot.warm
            if snapshot.vram_paused or w.gpu_uuid in degraded
        }

    def evict_for(self, job: QueuedJob, blocked: _Blocked, room: list[_Gpu]) -> list[Decision]:
        """:func:`_evict_for` on the GPUs of ``room`` a warm server is on, unless an
        earlier job of this pass, on every GPU, was no bigger, of no lower priority and
        as co-resident, and no eviction made room for it: then none can for this
        one. (Within a pass a GPU only gains holders, and idle servers are only
        taken away, so what failed once fails for any job harder to place.)"""
        failed = self.no_eviction[job.coresident] if room is self.gpus else None
        if failed is not None and any(v <= job.vram_bytes and p >= job.priority for v, p in failed):
            return []
        evicted = _evict_for(job, blocked, self.with_warm(room), self.warm)
        if failed is not None and not evicted:
            failed.append((job.vram_bytes, job.priority))
        return evicted

    def with_warm(self, gpus: list[_Gpu]) -> list[_Gpu]:
        """Those of ``gpus`` that a warm server is on, in their order."""
        if gpus is self.gpus:
            return self.warm_gpus
        return [g for g in gpus if g.view.uuid in self.warm_uuids]

    def most_free(self, coresident: bool) -> int:
        """The most memory free now on any GPU a job may share (``coresident``: one
        whose holders all share theirs), or on an empty one: no job that needs more
        fits any GPU."""
        if self._most_free is None:
            self._most_free = (
                max((g.capacity - g.held for g in self.gpus if g.shared_only), default=-1),
                max((g.capacity for g in self.gpus if not g.holdings), default=-1),
            )
        shared, empty = self._most_free
        return max(shared, empty) if coresident else empty

    def decide(self, job: QueuedJob) -> Start | Refuse | _Blocked:
        """A job's decision: host RAM first (any lane), then its lane's rules. A
        start takes its cap from the RAM left for the rest of the pass."""
        short = ramadmit.admit(self.ram, job.ram)
        if short is not None:
            return _Blocked(job, lambda _j: short)
        decision = self.decide_lane(job)
        if isinstance(decision, Start):
            self.ram = self.ram.after_start(job.ram)
        return decision

    def decide_lane(self, job: QueuedJob) -> Start | Refuse | _Blocked:
        if job.lane is Lane.CPU:
            if self.cpu_free > 0:
                self.cpu_free -= 1
                return Start(job.id, None)
            slots = self.snapshot.cpu_slots
            return _Blocked(job, lambda _j: f"all {slots} cpu slots are in use")
        if job.serve and (served := self.warm.serve(job, self.paused.get(job.type, ""))):
            if isinstance(served, Start):
                return served
            reason = served.reason
            return _Blocked(job, lambda _j: reason)
        among = None
        if job.runtime:
            runtime_decision = self.runtime_job(job)
            if not isinstance(runtime_decision, list):
                return runtime_decision
            among = runtime_decision
        if job.gpu:
            pinned = self.pinned(job, among)
            if not isinstance(pinned, list):
                return pinned
            among = pinned
        decision = self.place(job, among)
        if isinstance(decision, Start) and job.serve:
            self.warm.loading(job.type, decision.gpu_uuid or "")
        elif isinstance(decision, _Blocked) and not self.snapshot.vram_paused and job.gpus == 1:
            # (a multi-GPU job waits for GPUs to come free on their own: no eviction,
            # release or preemption frees several GPUs at once for it)
            room = self.gpus if among is None or not job.gpu else among  # a pin: only there
            evicted = self.evict_for(job, decision, room)
            self.evictions += evicted
            asked: list[AskRuntime] = []
            if not evicted and self.snapshot.runtimes:
                gpus = self.gpus if among is None else among
                asked = _ask_runtimes_for(job, decision, gpus, self.runtimes)
                self.asks += asked
            if not evicted and not asked and self.snapshot.victims and among is None:
                self.preempt_for(job, decision)
        return decision

    def preempt_for(self, job: QueuedJob, blocked: _Blocked) -> None:
        """When running preemptible jobs of lower priority stand between a waiting
        job and a GPU, ask the fewest and cheapest to checkpoint (or wait for those
        already asked for it), and hold that GPU back for it."""
        mine = [v for v in self.pending if v.preempting_for == job.id]
        gpus = {
            g.view.uuid: g
            for g in self.gpus
            if not g.view.degraded
            and g.capacity >= job.vram_bytes
            and (g.reserved_for is None or g.reserved_for.id == job.id)
        }
        need = Need(job.id, job.vram_bytes, job.coresident, job.priority)
        views = [(u, g.capacity, g.holdings) for u, g in gpus.items()]
        choice = choose(need, views, [*self.victims, *mine], self.now)
        if choice is None:
            return
        g = gpus[choice.gpu_uuid]
        g.hold_for(job)
        blocked.reserved = g.view.uuid
        blocked.extra.append(describe(choice, job.id))
        # (by job: a multi-GPU victim is listed once per GPU it holds)
        chosen = {v.job_id for v in choice.victims}
        self.victims = [v for v in self.victims if v.job_id not in chosen]
        self.preemptions += preempts(choice, job.id)

    def runtime_job(self, job: QueuedJob) -> Start | Refuse | _Blocked | list[_Gpu]:
        """A runtime type's job: refused where this node has no such runtime, held
        while it does not answer, started at once (no new memory) where the runtime
        has its model loaded; else the GPUs it may be placed on (the runtime's)."""
        rt = self.runtimes.get(job.runtime)
        if rt is None:
            return Refuse(
                job.id,
                f"its type uses the managed runtime {job.runtime!r}, and this node has no "
                "runtime of that name, nor exactly one of that kind (add a [[runtimes]] "
                "entry to its configuration)",
            )
        if not rt.reachable or self.snapshot.vram_paused:
            why = self.snapshot.vram_paused or rt.why
            return _Blocked(job, lambda _j: f"waits for the runtime {rt.name}: {why}")
        mine = [g for g in self.gpus if not rt.gpus or g.view.uuid in rt.gpus]
        if job.model in rt.models:
            held = [
                (b, g.view.uuid, g)
                for g in mine
                if not g.view.degraded
                for n, b in g.view.runtimes
                if n == rt.name and b > 0
            ]
            if held:
                g = max(held, key=lambda t: (t[0], t[1]))[2]
                return Start(job.id, g.view.uuid, warm=True)
        if not mine:
            where = ", ".join(rt.gpus)
            return _Blocked(job, lambda _j: f"the runtime {rt.name}'s GPUs ({where}) are not here")
        return mine

    def pinned(self, job: QueuedJob, among: list[_Gpu] | None) -> _Blocked | list[_Gpu]:
        """A job pinned to one GPU (its ``gpu`` constraint) is placed only there; it
        waits, saying so, where this node has no such GPU."""
        pin = job.gpu
        mine = [g for g in (self.gpus if among is None else among) if g.view.uuid == pin]
        if not mine:
            have = ", ".join(g.view.uuid for g in self.gpus) or "none"
            return _Blocked(
                job, lambda _j: f"it is pinned to GPU {pin} (--gpu), which this node has not "
                f"(its GPUs: {have})"
            )  # fmt: skip
        return mine

    def place(self, job: QueuedJob, among: list[_Gpu] | None = None) -> Start | Refuse | _Blocked:
        """Start the job on the GPU of ``among`` (all of them: None) where it fits
        tightest, or say why it waits (holding a GPU back for it where one may be)."""
        snapshot, now = self.snapshot, self.now
        gpus = self.gpus if among is None else among
        if snapshot.vram_paused:
            paused = snapshot.vram_paused
            return _Blocked(job, lambda _j: f"VRAM admission is paused: {paused}")
        need = job.vram_bytes
        if not gpus:
            return _Blocked(
                job, lambda j: f"needs {format_bytes(need)} on one GPU; this node has no GPU"
            )
        if self.best is not None and need > self.best:
            return Refuse(job.id, never_fits(need, snapshot.gpus) or "")
        if job.gpus > 1:
            return self.place_many(job, gpus)
        tightest = self.tightest(job, among)
        if tightest is not None:
            best, how = tightest
            backfill_for = how or None
            best.add(_started(job, f"{job.id}/next", now, backfill_for))
            self._most_free = None
            return Start(job.id, best.view.uuid, backfill_for)
        at = self.clock.n  # the GPUs as the job was judged: their state at this stamp
        reserved = None
        if self.reservations_left > 0:
            reserved = _reserve(job, gpus, self.held_back.get(job.id))
            if reserved is not None:
                self.reservations_left -= 1

        def render(j: QueuedJob) -> str:  # j: this job, or one of its size (a pruned class)
            pin = f"it is pinned to GPU {j.gpu} (--gpu) and " if j.gpu else ""
            return f"{pin}needs {format_bytes(j.vram_bytes)} on one GPU; " + "; ".join(
                _why_not(j, g, g.seen(at)) for g in gpus
            )

        blocked = _Blocked(job, render, reserved.view.uuid if reserved else None)
        if reserved is not None:
            blocked.extra.append(f"{reserved.view.uuid} is held back for it until it fits")
        return blocked

    def tightest(self, job: QueuedJob, among: list[_Gpu] | None) -> tuple[_Gpu, str] | None:
        """The GPU of ``among`` (all of them: None) where the job may start now and
        fits tightest (the least memory left free, ties by UUID), and how it starts
        there (:func:`_can_start`); None where it fits none. Over all the GPUs,
        those nothing is held back for are one bisect of the best-fit rows
        (:class:`gpuwarden.core.bestfit.FreeOrder`); only those held back are
        judged one by one."""
        need, now = job.vram_bytes, self.now
        if among is None and need >= 0:
            gpus = self.gpus
            fitting = [
                (gpus[p], how)
                for p in self.order.held
                if (how := _can_start(job, gpus[p], now)) is not None
            ]
            pos = self.order.tightest(need, job.coresident)
            if pos is not None:
                fitting.append((gpus[pos], ""))
        elif need <= self.most_free(job.coresident):  # (else it fits no GPU here)
            gpus = self.gpus if among is None else among
            fitting = [(g, how) for g in gpus if (how := _can_start(job, g, now)) is not None]
        else:
            return None
        if not fitting:
            return None
        return min(fitting, key=lambda gh: (gh[0].free - need, gh[0].view.uuid, gh[0].pos))

    def place_many(self, job: QueuedJob, gpus: list[_Gpu]) -> Start | Refuse | _Blocked:
        """A job on ``job.gpus`` GPUs: all at once or not at all, on those where it
        fits tightest, never beside a job one of them is held back for (only where
        it would end before that job could fit); else it waits, with the GPUs it
        fits soonest held back for it, all of them, where a reservation is left."""
        n, need, now = job.gpus, job.vram_bytes, self.now
        if (why := never_fits(need, self.snapshot.gpus, n)) is not None:
            return Refuse(job.id, why)
        fitting = [g for g in gpus if _can_start(job, g, now) == ""]
        if len(fitting) >= n:
            chosen = sorted(fitting, key=lambda g: (g.free - need, g.view.uuid))[:n]
            for i, g in enumerate(chosen):
                g.add(_started(job, f"{job.id}/next@{i}", now))
            self._most_free = None
            return Start(job.id, ",".join(g.view.uuid for g in chosen))
        at = self.clock.n  # the GPUs as the job was judged: their state at this stamp
        reserved: list[_Gpu] = []
        if self.reservations_left > 0:
            reserved = _reserve_many(job, gpus, self.held_back.get(job.id))
            if reserved:
                self.reservations_left -= 1
        could = {g.view.uuid for g in fitting}

        def render(_j: QueuedJob) -> str:
            each = [
                f"{g.view.uuid} could take it"
                if g.view.uuid in could
                else _why_not(job, g, g.seen(at))
                for g in gpus
            ]
            return (
                f"needs {format_bytes(need)} on each of {n} GPUs at once, and {len(could)} "
                "can take it now; " + "; ".join(each)
            )

        held = ",".join(g.view.uuid for g in reserved)
        blocked = _Blocked(job, render, held or None)
        if reserved:
            names = ", ".join(g.view.uuid for g in reserved)
            blocked.extra.append(f"{names} are held back for it until it fits on all {n}")
        return blocked


def _started(job: QueuedJob, holder: str, now: float, backfill_for: str | None = None) -> Holding:
    """The holding a start decided in this pass counts as, for the rest of it."""
    return Holding(
        holder=holder,
        type=job.type,
        bytes=job.vram_bytes,
        coresident=job.coresident,
        job_id=job.id,
        since=now,
        expected_end=None if job.expected_s is None else now + job.expected_s,
        backfill_for=backfill_for,
    )


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

    def idle_by_gpu(self) -> dict[str, list[WarmView]]:
        """The idle servers that may still be evicted this pass, by GPU."""
        out: dict[str, list[WarmView]] = {}
        for w in self.by_type.values():
            if not w.busy and w.holder not in self.evicting and w.type not in self.taken:
                out.setdefault(w.gpu_uuid, []).append(w)
        return out


def _evict_for(job: QueuedJob, blocked: _Blocked, gpus: list[_Gpu], warm: _Warm) -> list[Decision]:
    """When idle warm servers stand between a waiting job and a GPU, evict the
    cheapest to reload until it fits. A ``keep_warm`` server yields only to a job
    of higher priority than the jobs it serves, and only if no other GPU can be
    freed of ordinary idle servers instead. Returns the evictions (and says so in
    ``blocked``); none when no idle server could make room."""
    idle_by_gpu = warm.idle_by_gpu()
    if not idle_by_gpu:
        return []
    for allow_pinned in (False, True):
        best: tuple[float, _Gpu, list[WarmView]] | None = None
        for g in gpus:
            servers = idle_by_gpu.get(g.view.uuid)
            if not servers or g.view.degraded or g.capacity < job.vram_bytes:
                continue
            idle = sorted(
                (
                    w
                    for w in servers
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
            g.hold_for(job)
            blocked.extra.append(f"Evicting idle warm server(s) on {g.view.uuid}: {names}")
            blocked.reserved = g.view.uuid
            return evictions
    return []


def _ask_runtimes_for(
    job: QueuedJob, blocked: _Blocked, gpus: list[_Gpu], runtimes: dict[str, RuntimeView]
) -> list[AskRuntime]:
    """When managed runtimes hold the room a waiting job needs on a GPU, ask those
    that may be asked to release it there (the GPU that needs the least back), and
    hold that GPU back for the job. One whose release is pending keeps the GPU
    held. Those in their grace or busy are named in the reason, not asked."""
    best: tuple[int, _Gpu, list[tuple[str, int]]] | None = None
    waiting_on: list[str] = []
    for g in gpus:
        if g.view.degraded or not g.view.runtimes:
            continue
        askable = [
            (n, b)
            for n, b in g.view.runtimes
            if (r := runtimes.get(n)) is not None and (r.may_ask or r.releasing)
        ]
        for n, b in g.view.runtimes:
            r = runtimes.get(n)
            if r is not None and not (r.may_ask or r.releasing):
                waiting_on.append(
                    f"The runtime {n} holds {format_bytes(b)} on {g.view.uuid}, not asked: {r.why}"
                )
        back = sum(b for _, b in askable)
        if not askable or not _fits(job, g.capacity + back, g.holdings):
            continue
        if best is None or back < best[0]:
            best = (back, g, askable)
    if best is None:
        blocked.extra += waiting_on
        return []
    back, g, askable = best
    g.hold_for(job)
    blocked.reserved = g.view.uuid
    names = ", ".join(n for n, _ in askable)
    pending = all(runtimes[n].releasing for n, _ in askable)
    verb = "Waiting for" if pending else "Asking"
    blocked.extra.append(
        f"{verb} the runtime(s) {names} to release {format_bytes(back)} on {g.view.uuid}; "
        f"{g.view.uuid} is held back for it meanwhile"
    )
    return [AskRuntime(n, g.view.uuid, b, job.id) for n, b in askable if not runtimes[n].releasing]


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


def _fits(job: QueuedJob, capacity: int, holdings: list[Holding]) -> bool:
    return compatible(job.coresident, holdings) and (
        job.vram_bytes + sum(h.bytes for h in holdings) <= capacity
    )


def _can_start(job: QueuedJob, g: _Gpu, now: float) -> str | None:
    """None if the job cannot start on this GPU now; else ``""``, or the id of the
    held-back job it starts beside (a co-resident backfill)."""
    if g.view.degraded or not g.fits(job):
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
        and job.vram_bytes + head.vram_bytes + beside <= g.capacity
    )


def _ends_before_head_fits(job: QueuedJob, head: QueuedJob, g: _Gpu, now: float) -> bool:
    if job.expected_s is None:
        return False
    fits_at = g.head_fits_at(now)
    return fits_at is not None and now + job.expected_s <= fits_at


def head_fits_at(
    head: QueuedJob, capacity: int, holdings: list[Holding], now: float
) -> float | None:
    """The earliest ``head`` could fit, as the holders end in their expected order:
    a holder with no estimate, or past it, may end at any moment, so it counts as
    gone already (taking it as staying would promise a later time than the head
    may really fit at, and let a backfill run into it). None if it never fits."""
    left = sorted(
        (h for h in holdings if h.expected_end is not None and h.expected_end > now),
        key=lambda h: h.expected_end or now,
    )
    at = now
    while not _fits(head, capacity, left):
        if not left:
            return None
        ending = left.pop(0).expected_end
        at = max(at, ending or now)
    return at


def _reserve(job: QueuedJob, gpus: list[_Gpu], previous: str | None = None) -> _Gpu | None:
    """Hold back, for a job that cannot start (the head of the queue, or one of the
    first ``max_reservations``), a GPU among those not degraded, not held back yet
    and big enough: ``previous``, the one held back for it in the previous pass, if
    it still is one of them (it drains for the job: nothing that could delay the
    job started there since); else the one it fits soonest (:func:`fits_soonest_key`),
    ties to the GPU with the least of gpuwarden's memory on it, then by UUID."""
    candidates = [
        g
        for g in gpus
        if g.reserved_for is None and not g.view.degraded and g.capacity >= job.vram_bytes
    ]
    if not candidates:
        return None
    kept = [g for g in candidates if g.view.uuid == previous]
    chosen = (
        kept[0]
        if kept
        else min(
            candidates,
            key=lambda g: (*fits_soonest_key(job, g.capacity, g.holdings), g.held, g.view.uuid),
        )
    )
    chosen.hold_for(job)
    return chosen


def _reserve_many(job: QueuedJob, gpus: list[_Gpu], previous: str | None) -> list[_Gpu]:
    """Hold back ``job.gpus`` GPUs for a multi-GPU job that cannot start (as
    :func:`_reserve` does one): those held back for it in the previous pass first,
    then those it fits soonest. None when fewer than that many may be held."""
    candidates = [
        g
        for g in gpus
        if g.reserved_for is None and not g.view.degraded and g.capacity >= job.vram_bytes
    ]
    if len(candidates) < job.gpus:
        return []
    kept = set(gpu_list(previous))
    chosen = sorted(
        candidates,
        key=lambda g: (
            g.view.uuid not in kept,
            *fits_soonest_key(job, g.capacity, g.holdings),
            g.held,
            g.view.uuid,
        ),
    )[: job.gpus]
    for g in chosen:
        g.hold_for(job)
    return sorted(chosen, key=lambda g: g.view.uuid)


def fits_soonest_key(job: QueuedJob, capacity: int, holdings: list[Holding]) -> tuple[int, float]:
    """How soon ``job`` is likely to fit beside these holdings, as a sort key (the
    smaller, the sooner), from what is known of every holder: when it started. The
    holders leave in the order they are likely to end: memory being reclaimed
    first, then running jobs from the youngest to the oldest (run times are
    heavy-tailed: a job that has run long is likely to run long yet; a type's
    run-time estimate, the longest of its last runs, says little about one job),
    until the job fits; holdings started beside it never leave (they fit with it).
    The key is how many running holders must end first (each one a wait of its
    own), then minus the start of the oldest of them (the younger, the sooner)."""
    stay = [h for h in holdings if h.backfill_for == job.id]
    left = sorted(
        (h for h in holdings if h.backfill_for != job.id),
        key=lambda h: (h.state is not HoldState.RECLAIMING, -h.since),
    )
    must = 0
    oldest = float("inf")
    while left and not _fits(job, capacity, stay + left):
        ending = left.pop(0)
        if ending.state is not HoldState.RECLAIMING:
            must += 1
            oldest = min(oldest, ending.since)
    return must, -oldest


def _why_not(job: QueuedJob, g: _Gpu, seen: tuple[int, QueuedJob | None]) -> str:
    """Why the job could not start on ``g`` when the pass judged it: ``seen`` is
    how many holdings ``g`` had then, and whom it was held back for."""
    uuid = g.view.uuid
    holdings = g.holdings[: seen[0]]
    if g.view.locked:
        return f"{uuid}: {g.view.locked}"
    if g.view.degraded:
        return f"{uuid} is degraded ({g.view.degraded})"
    if not compatible(job.coresident, holdings):
        who = ", ".join(_holder(h) for h in holdings)
        if job.coresident:
            return f"{uuid} is held by {who}, which does not share its GPU"
        return f"{uuid} is not empty ({who}) and {job.type} needs a GPU to itself"
    free = max(0, g.capacity - sum(h.bytes for h in holdings))
    if free < job.vram_bytes:
        parts = [f"{format_bytes(h.bytes)} held by {_holder(h)}" for h in holdings]
        parts += [f"{format_bytes(b)} by the runtime {n}" for n, b in g.view.runtimes]
        if g.view.foreign_bytes:
            parts.append(f"{format_bytes(g.view.foreign_bytes)} by other processes")
        if g.view.reserve_bytes:
            parts.append(f"{format_bytes(g.view.reserve_bytes)} kept in reserve")
        return f"{uuid} has {format_bytes(free)} free" + (": " + ", ".join(parts) if parts else "")
    head = seen[1]
    if head is not None:
        return f"{uuid} is held back for job {head.id}, which waits for it and must not be delayed"
    return f"{uuid} cannot take it"  # pragma: no cover - every refusal above has a reason


def _paused_view(g: GpuView) -> GpuView:
    """A GPU an outside process keeps (``locked``) is planned as a degraded one:
    no new ``vram`` job, no eviction, release or preemption for one there."""
    return replace(g, degraded=g.locked) if g.locked and not g.degraded else g


def _holder(h: Holding) -> str:
    if is_lease(h.type) and h.state is HoldState.RUNNING:
        return f"lease {h.job_id} of {format_bytes(h.bytes)}"
    who = f"{h.type} ({h.job_id})" if h.job_id else h.type
    if h.state is HoldState.RECLAIMING:
        return f"{who}, ended, its memory not yet shown free"
    if h.state is HoldState.WARM:
        return f"{who}, warm server"
    return f"{who}, {h.state.value}"
