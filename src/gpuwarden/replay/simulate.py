"""Replay a trace of jobs through a planner in virtual time. Pure.

A discrete-event simulator for ``plan(snapshot, now) -> decisions`` (or any
function with that signature: the baselines in ``bench/packing.py`` are plugged
in the same way). No I/O, no clock, no threads: time is a number that jumps from
one event to the next, so thousands of jobs replay in a second.

It keeps a :class:`~gpuwarden.core.ledger.Ledger` the way the broker does:

- an attempt's footprint is held when it starts (holder ``JOB/ATTEMPT``);
- when the probe measures more than the holding (``measure``), the holding grows
  (the peak is reached as the attempt loads), and a job that had its GPU to
  itself from its start to its end raises its type's footprint for the jobs that
  follow (a measurement never lowers it);
- when the attempt ends (done, failed, cancelled or crashed) the holding turns
  ``reclaiming`` (``since`` = the end), and it is released once the device shows
  the memory free, ``reclaim_delay_s`` later. Memory a job leaks is never shown
  free: its holding shrinks to what still shows and stays, and
  ``reclaim_timeout_s`` after the end the GPU is marked degraded and stays so (a
  holding released late clears the mark, as on a real node).

Beside the ledger it models the physical device: every started attempt uses its
``actual_peak_bytes`` (from its start until its memory is freed), foreign
processes use what they allocate, and an attempt whose peak does not fit in what
is physically left crashes at once with a CUDA out-of-memory. Such a crash is
retried (``max_retries``, after ``retry_delay_s``) when other work used the GPU,
and fails the job when it had the GPU to itself (its footprint is wrong), as in
DESIGN.md's failure classification.

The planner is called once per distinct event time (arrival, end, release,
cancellation, retry, foreign allocation, reclaim timeout) while anything is
queued; its ``Start`` decisions are carried out in order, ``Refuse`` fails the
job with the reason, ``Wait`` records the reason and the GPU held back for the
job, which the next snapshot passes on (``Snapshot.held_back``, as the broker
loop does). The run ends when no event is
left: a job still queued then is reported ``waiting`` with its last reason.

Warm servers (launch mode ``serve``, a :class:`TraceJob` with ``serve=True``) are
modelled the way the broker drives them (:mod:`gpuwarden.node.warm`):

- a ``Start`` (not ``warm``) of a serve job starts a server of its type on the
  planned GPU: the type's footprint is held as a ``warm`` holding named
  ``warm:<type>:<epoch>`` (epochs count up from 1), the device shows the type's
  real peak used from that moment, the model loads for ``load_s`` and then the
  job runs for ``duration_s``. Each such start is one model load;
- a ``Start(warm=True)`` hands the job to the type's idle server on that GPU: no
  new memory, no load, the job runs for ``duration_s``. A server serves one job
  at a time, and the planner sees it busy while it loads or runs one;
- a server whose job ended (done, or the job's own failure) is idle from then on;
  the planner is called when its idle grace (``TraceJob.idle_grace_s`` of the job
  that started it, else ``SimOptions.idle_grace_s``) runs out, so an ``Evict``
  for the grace lands on time even when nothing is queued;
- an ``Evict`` stops the idle server at once: its holding turns ``reclaiming``
  and is released ``reclaim_delay_s`` later, like an attempt's. A server whose
  load crashed (out of memory), or whose job was cancelled, stops the same way;
- ``QueuedJob.serve`` and ``QueuedJob.warm`` are set as the broker sets them
  (``warm``: its type has a server, loading, busy or idle), and ``Snapshot.warm``
  has a :class:`~gpuwarden.core.policy.WarmView` per server (``load_s`` is 0 until
  the load is over, as in the broker, where it is the measured load time).

These are planner bugs (:class:`SimError`): an ``Evict`` of a busy, unknown or
already stopped server; a warm ``Start`` with no idle server of the type on that
GPU; a second server of a type that has one; and a new server of a type whose
server was evicted in the same planning pass (the broker keeps a stopping server
in its pool until its process is gone, so ``WarmPool.add`` would raise there).
A served job's run time (for the estimates) excludes the load, as the broker's
``started_at`` of a served result does. Servers never leak memory.

One file because it is one state machine: every event handler of :class:`_Sim`
moves the same ledger, device and server state, and the records it fills are
what :func:`simulate` returns; split, each part would need the others' fields.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum

from gpuwarden.core import profile
from gpuwarden.core.ledger import Holding, HoldState, Ledger
from gpuwarden.core.model import Lane, format_bytes
from gpuwarden.core.policy import (
    Decision,
    Evict,
    GpuView,
    QueuedJob,
    Refuse,
    Snapshot,
    Start,
    Wait,
    WarmView,
)
from gpuwarden.errors import GpuwardenError

#: ``plan`` or anything with its signature.
Planner = Callable[[Snapshot, float], Sequence[Decision]]


class SimError(GpuwardenError):
    """The planner broke the protocol (started a job that is not queued, onto no GPU...)."""


@dataclass(frozen=True, slots=True)
class SimGpu:
    uuid: str
    total_bytes: int
    reserve_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TraceJob:
    id: str
    type: str
    arrival_s: float
    #: how long an attempt runs once started (until it ends, done or failed)
    duration_s: float
    #: the declared footprint (what admission uses); 0 for a cpu job
    vram_bytes: int = 0
    lane: Lane = Lane.VRAM
    #: what the job really uses at its peak; None: exactly its declaration
    actual_peak_bytes: int | None = None
    coresident: bool = False
    priority: int = 0
    #: the job's own failure: it runs its duration, then ends failed (never re-run)
    fails: bool = False
    #: memory the device never shows free after the job's process ended
    leak_bytes: int = 0
    #: when the client cancels it (queued: removed; running: stopped), if ever
    cancel_at_s: float | None = None
    #: its type runs in a warm server (launch mode ``serve``); the fields below are
    #: the type's and are taken from the job that starts a server
    serve: bool = False
    #: how long the server's model takes to load (before its first job runs)
    load_s: float = 0.0
    #: the server is never evicted for idleness, and yields its memory only to a
    #: job of higher priority than the jobs it serves
    keep_warm: bool = False
    #: how long the server may stay idle before it is evicted (None: the options')
    idle_grace_s: float | None = None
    #: how long its submitter expects it to run (planned with until its type has a
    #: measured run time, as the broker does: ``core.profile.expected_s``)
    est_s: float | None = None

    @property
    def peak_bytes(self) -> int:
        return self.vram_bytes if self.actual_peak_bytes is None else self.actual_peak_bytes


@dataclass(frozen=True, slots=True)
class ForeignAlloc:
    """Memory a process gpuwarden did not start holds on a GPU, from ``start_s`` to
    ``end_s`` (None: for ever). It gets what is physically free, at most ``bytes``."""

    gpu: str
    start_s: float
    bytes: int
    end_s: float | None = None


@dataclass(frozen=True, slots=True)
class SimOptions:
    #: the device shows an ended attempt's memory free this long after its end
    reclaim_delay_s: float = 0.0
    #: an ended attempt's memory not shown free this long after its end: degraded
    reclaim_timeout_s: float = 60.0
    #: retries after a CUDA out-of-memory while something else used the GPU
    max_retries: int = 3
    retry_delay_s: float = 0.0
    #: grow holdings to the measured peak, and raise a type's footprint when a job
    #: of that type ran with its GPU to itself (what the broker does)
    measure: bool = True
    foreign: tuple[ForeignAlloc, ...] = ()
    cpu_slots: int = 4
    #: give the planner run-time estimates (the longest of a type's last
    #: ``RUN_TIME_WINDOW`` runs, as the broker does) for backfilling
    estimate_run_times: bool = True
    #: record a :class:`LedgerSample` per GPU after every planning pass
    record_history: bool = False
    #: stop processing events after this virtual time (None: run until none is left)
    until_s: float | None = None
    #: a warm server's idle grace when its type names none (``[warm] idle_grace_s``)
    idle_grace_s: float = 300.0


class Outcome(StrEnum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REFUSED = "refused"
    WAITING = "waiting"  # still queued when the run ended


@dataclass(slots=True)
class JobRecord:
    id: str
    type: str
    lane: Lane
    arrival_s: float
    outcome: Outcome = Outcome.WAITING
    reason: str = ""
    #: start of the first attempt and end of the last one
    start_s: float | None = None
    end_s: float | None = None
    gpu: str | None = None
    attempts: int = 0
    oom_crashes: int = 0
    #: the GPU held back for it at its last wait, if any
    reserved_gpu: str | None = None
    #: its last attempt was handed to an already loaded warm server
    served_warm: bool = False

    @property
    def completion_s(self) -> float | None:
        """Arrival to end, for a job that ran to the end (done or its own failure)."""
        if self.end_s is None or self.outcome not in (Outcome.DONE, Outcome.FAILED):
            return None
        return self.end_s - self.arrival_s


@dataclass(slots=True)
class ServerRecord:
    """One warm server's life."""

    holder: str  # its name in the ledger: ``warm:<type>:<epoch>``
    type: str
    gpu: str
    started_s: float
    #: when its model was loaded (None: the load crashed, or it was stopped first)
    loaded_s: float | None = None
    stopped_s: float | None = None
    #: when its memory was shown free and its holding released
    released_s: float | None = None
    jobs_served: int = 0
    reason: str = ""  # why it stopped


@dataclass(frozen=True, slots=True)
class LedgerSample:
    """One GPU right after a planning pass at ``t``."""

    t: float
    gpu: str
    holdings: tuple[Holding, ...]
    held_bytes: int
    #: what the planner saw held plus the footprints it started in this pass (the
    #: holdings before the probe measured the new attempts): its admission budget
    admitted_bytes: int
    #: total - reserve - foreign at ``t``
    capacity: int
    #: memory the device shows used (attempts, memory not yet freed, leaks, foreign)
    physical_bytes: int
    #: attempts started on this GPU in this pass
    started: int
    degraded: str


@dataclass(slots=True)
class SimResult:
    jobs: dict[str, JobRecord]
    makespan_s: float
    oom_crashes: int
    model_loads: int
    plan_calls: int
    events: int
    #: GPU -> why it was degraded when the run ended
    degraded: dict[str, str]
    #: holdings still in the ledger at the end (memory never shown free), besides
    #: those of warm servers still running
    leaked: tuple[Holding, ...]
    history: list[LedgerSample]
    ledger: Ledger
    #: type -> footprint learned by measurement (only types that were raised)
    footprints: dict[str, int]
    #: every warm server started, in start order
    servers: list[ServerRecord] = field(default_factory=list)

    @property
    def completions(self) -> list[float]:
        """Arrival-to-end times of the jobs that ended ``done``, in job order."""
        return [
            r.end_s - r.arrival_s
            for r in self.jobs.values()
            if r.outcome is Outcome.DONE and r.end_s is not None
        ]

    def outcomes(self) -> Counter[Outcome]:
        return Counter(r.outcome for r in self.jobs.values())


class _Ev(IntEnum):
    """Event kinds; at one instant they are handled in this order."""

    FOREIGN_END = 0
    RELEASE = 1
    END = 2
    RECLAIM_TIMEOUT = 3
    FOREIGN_START = 4
    ARRIVE = 5
    CANCEL = 6
    GRACE = 7  # a warm server's idle grace runs out: plan (its eviction is due)


class _St(IntEnum):
    PENDING = 0  # not arrived yet, or waiting to be retried
    QUEUED = 1
    RUNNING = 2
    OVER = 3


@dataclass(slots=True)
class _Job:
    trace: TraceJob
    seq: int
    record: JobRecord
    state: _St = _St.PENDING
    holder: str = ""  # the current (or last) attempt


#: how many of a type's latest runs its run-time estimate looks at
RUN_TIME_WINDOW = 20


@dataclass(slots=True)
class _Server:
    record: ServerRecord
    declared: int  # the type's declared footprint
    peak: int  # what its model really uses on the device
    load_s: float
    keep_warm: bool
    idle_grace_s: float
    priority: int
    physical: int = 0
    device_alone: bool = False
    alone: bool = False
    #: the attempt it loads for or runs (None: idle)
    job: str | None = None
    idle_since: float | None = None
    stopped: bool = False

    @property
    def holder(self) -> str:
        return self.record.holder

    @property
    def gpu(self) -> str:
        return self.record.gpu

    @property
    def leak_bytes(self) -> int:
        return 0

    def view(self, now: float) -> WarmView:
        loaded = self.record.loaded_s
        return WarmView(
            type=self.record.type,
            gpu_uuid=self.gpu,
            holder=self.holder,
            busy=self.job is not None,
            idle_since=self.idle_since if self.job is None else None,
            keep_warm=self.keep_warm,
            load_s=self.load_s if loaded is not None and loaded <= now else 0.0,
            idle_grace_s=self.idle_grace_s,
            priority=self.priority,
        )


@dataclass(slots=True)
class _Attempt:
    holder: str
    job: _Job
    gpu: str | None
    physical: int = 0  # bytes the device shows used for it
    #: nothing else used the device's memory when it loaded (an OOM is its own)
    device_alone: bool = False
    #: no other holding on its GPU from its start on (its peak is its own)
    alone: bool = False
    ended: bool = False
    started: float = 0.0
    #: when the job itself began to run (after its server's load, if any)
    run_from: float = 0.0
    #: the warm server it runs on (then it holds no memory of its own)
    server: _Server | None = None

    @property
    def leak_bytes(self) -> int:
        return self.job.trace.leak_bytes


@dataclass(slots=True)
class _Sim:
    gpus: tuple[SimGpu, ...]
    opts: SimOptions
    planner: Planner
    ledger: Ledger
    by_uuid: dict[str, SimGpu] = field(default_factory=dict)
    jobs: dict[str, _Job] = field(default_factory=dict)
    queued: dict[str, QueuedJob] = field(default_factory=dict)
    attempts: dict[str, _Attempt] = field(default_factory=dict)
    heap: list[tuple[float, int, int, str]] = field(default_factory=list)
    counter: int = 0
    physical: dict[str, int] = field(default_factory=dict)
    foreign: dict[str, int] = field(default_factory=dict)
    foreign_got: dict[int, int] = field(default_factory=dict)
    degraded: dict[str, dict[str, str]] = field(default_factory=dict)
    footprints: dict[str, int] = field(default_factory=dict)
    run_times: dict[str, list[float]] = field(default_factory=dict)
    running_cpu: int = 0
    oom_crashes: int = 0
    model_loads: int = 0
    plan_calls: int = 0
    events: int = 0
    history: list[LedgerSample] = field(default_factory=list)
    #: every warm server by holder, and the live one of each type
    servers: dict[str, _Server] = field(default_factory=dict)
    warm: dict[str, _Server] = field(default_factory=dict)
    epoch: int = 0
    #: a warm server's grace ran out: plan even if nothing is queued
    wake: bool = False

    # --- events -------------------------------------------------------------------

    def push(self, t: float, kind: _Ev, payload: str) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, int(kind), self.counter, payload))

    def run(self) -> None:
        heap = self.heap
        until = self.opts.until_s
        while heap:
            now = heap[0][0]
            if until is not None and now > until:
                break
            while heap and heap[0][0] == now:
                _, kind, _, payload = heapq.heappop(heap)
                self.events += 1
                self.handle(_Ev(kind), payload, now)
            if self.queued or self.wake:
                self.wake = False
                self.plan(now)

    def handle(self, kind: _Ev, payload: str, now: float) -> None:
        if kind is _Ev.ARRIVE:
            job = self.jobs[payload]
            if job.state is _St.PENDING:
                job.state = _St.QUEUED
                self.queued[payload] = self.queued_job(job)
        elif kind is _Ev.END:
            attempt = self.attempts[payload]
            if not attempt.ended:
                failed = attempt.job.trace.fails
                if not failed:
                    times = self.run_times.setdefault(attempt.job.trace.type, [])
                    times.append(now - attempt.run_from)
                    del times[:-RUN_TIME_WINDOW]
                self.end_attempt(
                    attempt,
                    now,
                    Outcome.FAILED if failed else Outcome.DONE,
                    "the job failed (its own error; not retried)" if failed else "",
                    server_lives=True,
                )
        elif kind is _Ev.RELEASE:
            self.free_memory(self.user(payload), now)
        elif kind is _Ev.GRACE:
            server = self.servers[payload]
            if not server.stopped and server.job is None:
                self.wake = True
        elif kind is _Ev.RECLAIM_TIMEOUT:
            gpu = self.user(payload).gpu
            if gpu is not None and self.ledger.get(payload) is not None:
                self.degraded.setdefault(gpu, {})[payload] = (
                    f"the reclaim gate timed out: {payload}'s memory was never shown free"
                )
        elif kind is _Ev.CANCEL:
            self.cancel(self.jobs[payload], now)
        elif kind is _Ev.FOREIGN_START:
            i = int(payload)
            alloc = self.opts.foreign[i]
            total = self.gpu(alloc.gpu).total_bytes
            got = max(0, min(alloc.bytes, total - self.physical[alloc.gpu]))
            self.foreign_got[i] = got
            self.physical[alloc.gpu] += got
            self.foreign[alloc.gpu] += got
        elif kind is _Ev.FOREIGN_END:
            i = int(payload)
            alloc = self.opts.foreign[i]
            got = self.foreign_got.pop(i, 0)
            self.physical[alloc.gpu] -= got
            self.foreign[alloc.gpu] -= got

    def user(self, holder: str) -> _Attempt | _Server:
        """Whoever holds (or held) ledger memory under this name."""
        attempt = self.attempts.get(holder)
        return attempt if attempt is not None else self.servers[holder]

    def gpu(self, uuid: str) -> SimGpu:
        g = self.by_uuid.get(uuid)
        if g is None:
            raise SimError(f"no GPU {uuid!r} in this simulation")
        return g

    # --- jobs ---------------------------------------------------------------------

    def footprint(self, t: TraceJob) -> int:
        return max(t.vram_bytes, self.footprints.get(t.type, 0))

    def estimate(self, t: TraceJob, *, holding: bool = False) -> float | None:
        """The job's expected run time: its type's measured estimate, else its est_s
        (rounded up as the queue's classes round it; as declared for a holding)."""
        if not self.opts.estimate_run_times:
            return None
        measured = profile.estimate(self.run_times.get(t.type, ()))
        return profile.expected_s(measured, t.est_s if holding else profile.est_class(t.est_s))

    def queued_job(self, job: _Job) -> QueuedJob:
        t = job.trace
        return QueuedJob(
            id=t.id,
            type=t.type,
            lane=t.lane,
            vram_bytes=self.footprint(t) if t.lane is Lane.VRAM else 0,
            priority=t.priority,
            seq=job.seq,
            coresident=t.coresident,
            expected_s=self.estimate(t),
            serve=t.serve,
        )

    def cancel(self, job: _Job, now: float) -> None:
        rec = job.record
        if job.state in (_St.PENDING, _St.QUEUED):
            self.queued.pop(job.trace.id, None)
            job.state = _St.OVER
            rec.outcome = Outcome.CANCELLED
            rec.reason = "cancelled before it started" if rec.attempts == 0 else "cancelled"
        elif job.state is _St.RUNNING:
            self.end_attempt(self.attempts[job.holder], now, Outcome.CANCELLED, "cancelled")

    def start(
        self,
        job: _Job,
        gpu: str | None,
        now: float,
        backfill_for: str | None = None,
        warm: bool = False,
    ) -> _Attempt | None:
        """Start an attempt; returns it when it crashed at once (out of memory)."""
        t = job.trace
        rec = job.record
        del self.queued[t.id]
        rec.attempts += 1
        if rec.start_s is None:
            rec.start_s = now
        rec.gpu = gpu
        rec.reserved_gpu = None
        job.state = _St.RUNNING
        job.holder = holder = f"{t.id}/{rec.attempts}"
        attempt = _Attempt(holder, job, gpu, started=now, run_from=now)
        self.attempts[holder] = attempt
        rec.served_warm = warm
        if gpu is None:
            self.running_cpu += 1
            self.push(now + t.duration_s, _Ev.END, holder)
            return None
        if t.serve:
            return self.start_served(attempt, gpu, now, warm)
        need = self.footprint(t)
        others = self.ledger.holdings(gpu)
        for h in others:
            self.user(h.holder).alone = False
        attempt.alone = not others
        self.ledger.hold(
            gpu,
            Holding(
                holder=holder,
                type=t.type,
                bytes=need,
                coresident=t.coresident,
                job_id=t.id,
                since=now,
                expected_end=None if (e := self.estimate(t, holding=True)) is None else now + e,
                backfill_for=backfill_for,
            ),
        )
        self.model_loads += 1
        peak = t.peak_bytes
        used = self.physical[gpu]
        free = self.gpu(gpu).total_bytes - used
        attempt.device_alone = used == 0
        if peak > free:
            attempt.physical = max(0, free)
            self.physical[gpu] += attempt.physical
            return attempt
        attempt.physical = peak
        self.physical[gpu] += peak
        if self.opts.measure and peak > need:
            self.ledger.update(holder, bytes=peak)
        self.push(now + t.duration_s, _Ev.END, holder)
        return None

    def start_served(self, attempt: _Attempt, gpu: str, now: float, warm: bool) -> _Attempt | None:
        """Hand the attempt to its type's idle server, or start a server for it."""
        t = attempt.job.trace
        if warm:
            server = self.warm[t.type]  # checked by plan()
            server.job = attempt.holder
            server.idle_since = None
            server.priority = t.priority
            attempt.server = server
            self.push(now + t.duration_s, _Ev.END, attempt.holder)
            return None
        need = self.footprint(t)
        self.epoch += 1
        record = ServerRecord(f"warm:{t.type}:{self.epoch}", t.type, gpu, now)
        server = _Server(
            record=record,
            declared=t.vram_bytes,
            peak=t.peak_bytes,
            load_s=t.load_s,
            keep_warm=t.keep_warm,
            idle_grace_s=self.opts.idle_grace_s if t.idle_grace_s is None else t.idle_grace_s,
            priority=t.priority,
            job=attempt.holder,
        )
        self.servers[record.holder] = server
        self.warm[t.type] = server
        attempt.server = server
        others = self.ledger.holdings(gpu)
        for h in others:
            self.user(h.holder).alone = False
        server.alone = not others
        self.ledger.hold(
            gpu,
            Holding(
                holder=record.holder,
                type=t.type,
                bytes=need,
                coresident=t.coresident,
                state=HoldState.WARM,
                since=now,
            ),
        )
        self.model_loads += 1
        used = self.physical[gpu]
        free = self.gpu(gpu).total_bytes - used
        server.device_alone = attempt.device_alone = used == 0
        if server.peak > free:
            server.physical = max(0, free)
            self.physical[gpu] += server.physical
            return attempt
        server.physical = server.peak
        self.physical[gpu] += server.peak
        if self.opts.measure and server.peak > need:
            self.ledger.update(record.holder, bytes=server.peak)
        record.loaded_s = attempt.run_from = now + t.load_s
        self.push(now + t.load_s + t.duration_s, _Ev.END, attempt.holder)
        return None

    def stop_server(self, server: _Server, now: float, reason: str) -> None:
        """The server's process is gone: its holding waits for the reclaim gate."""
        server.stopped = True
        server.job = None
        record = server.record
        record.stopped_s = now
        record.reason = reason
        if record.loaded_s is not None and record.loaded_s > now:
            record.loaded_s = None  # stopped while it loaded
        if self.warm.get(record.type) is server:
            del self.warm[record.type]
        self.ledger.update(record.holder, state=HoldState.RECLAIMING, since=now)
        opts = self.opts
        if opts.measure and server.alone and server.physical == server.peak > server.declared:
            self.learn(record.type, server.peak)
        self.push(now + opts.reclaim_delay_s, _Ev.RELEASE, record.holder)
        if opts.reclaim_delay_s >= opts.reclaim_timeout_s:
            self.push(now + opts.reclaim_timeout_s, _Ev.RECLAIM_TIMEOUT, record.holder)

    def idle(self, server: _Server, now: float) -> None:
        server.job = None
        server.idle_since = now
        server.record.jobs_served += 1
        if server.keep_warm:
            return
        due = now + server.idle_grace_s
        while due - now < server.idle_grace_s:  # the planner's test, float for float
            due = math.nextafter(due, math.inf)
        self.push(due, _Ev.GRACE, server.holder)

    def learn(self, type_: str, peak: int) -> None:
        if peak <= self.footprints.get(type_, 0):
            return
        self.footprints[type_] = peak
        for job_id, q in self.queued.items():
            if q.type == type_ and q.lane is Lane.VRAM:
                self.queued[job_id] = self.queued_job(self.jobs[job_id])

    def crash(self, attempt: _Attempt, now: float) -> None:
        """The attempt hit a CUDA out-of-memory as it loaded."""
        job = attempt.job
        t = job.trace
        rec = job.record
        gpu = attempt.gpu or ""
        self.oom_crashes += 1
        rec.oom_crashes += 1
        peak = format_bytes(t.peak_bytes)
        if attempt.device_alone:
            if self.opts.measure:
                self.learn(t.type, t.peak_bytes)
            why = (
                f"CUDA out of memory on {gpu} with the GPU to itself: it needs {peak}, "
                f"more than its footprint of {format_bytes(self.footprint(t))}; not retried"
            )
            self.end_attempt(attempt, now, Outcome.FAILED, why)
        elif rec.attempts <= self.opts.max_retries:
            self.end_attempt(attempt, now, None, "")
            job.state = _St.PENDING
            self.push(now + self.opts.retry_delay_s, _Ev.ARRIVE, t.id)
        else:
            why = (
                f"CUDA out of memory on {gpu} while other work used it "
                f"(needs {peak}); gave up after {rec.attempts} attempts"
            )
            self.end_attempt(attempt, now, Outcome.FAILED, why)

    def end_attempt(
        self,
        attempt: _Attempt,
        now: float,
        outcome: Outcome | None,
        reason: str,
        *,
        server_lives: bool = False,
    ) -> None:
        """End an attempt: ``outcome`` None means the job will be retried. A warm
        server it ran on goes idle if ``server_lives`` (the job ran to its end, done
        or its own failure), else it is stopped (crashed, or cancelled)."""
        attempt.ended = True
        job = attempt.job
        rec = job.record
        rec.end_s = now
        if outcome is not None:
            job.state = _St.OVER
            rec.outcome = outcome
            rec.reason = reason
        if attempt.gpu is None:
            self.running_cpu -= 1
            return
        server = attempt.server
        if server is not None:
            if server_lives:
                self.idle(server, now)
            else:
                why = "its job was cancelled" if outcome is Outcome.CANCELLED else "it crashed"
                self.stop_server(server, now, why)
            return
        self.ledger.update(attempt.holder, state=HoldState.RECLAIMING, since=now)
        opts = self.opts
        peak = job.trace.peak_bytes
        if opts.measure and attempt.alone and attempt.physical == peak > job.trace.vram_bytes:
            self.learn(job.trace.type, peak)
        self.push(now + opts.reclaim_delay_s, _Ev.RELEASE, attempt.holder)
        if job.trace.leak_bytes > 0 or opts.reclaim_delay_s >= opts.reclaim_timeout_s:
            self.push(now + opts.reclaim_timeout_s, _Ev.RECLAIM_TIMEOUT, attempt.holder)

    def free_memory(self, attempt: _Attempt | _Server, now: float) -> None:
        """The process is gone: the device frees all but the leaked bytes."""
        gpu = attempt.gpu or ""
        leaked = min(attempt.leak_bytes, attempt.physical)
        self.physical[gpu] -= attempt.physical - leaked
        attempt.physical = leaked
        if leaked:  # never shown free: the holding shrinks to it, the gate times out
            h = self.ledger.get(attempt.holder)
            if h is not None and leaked < h.bytes:
                self.ledger.update(attempt.holder, bytes=leaked)
            return
        self.ledger.release(attempt.holder)
        if isinstance(attempt, _Server):
            attempt.record.released_s = now
        marks = self.degraded.get(gpu)
        if marks is not None:
            marks.pop(attempt.holder, None)
            if not marks:
                del self.degraded[gpu]

    # --- planning -----------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        ledger = self.ledger
        views = tuple(
            GpuView(
                uuid=g.uuid,
                total_bytes=g.total_bytes,
                reserve_bytes=g.reserve_bytes,
                foreign_bytes=self.foreign[g.uuid],
                holdings=ledger.holdings(g.uuid),
                degraded=self.degraded_reason(g.uuid),
            )
            for g in self.gpus
        )
        warm = self.warm
        # warm and the run-time estimate are read fresh each pass, as the broker does
        queued = tuple(
            replace(
                q,
                warm=q.serve and q.type in warm,
                expected_s=self.estimate(self.jobs[q.id].trace),
            )
            for q in self.queued.values()
        )
        # the GPUs held back in the previous pass, as the broker loop keeps them
        held_back = tuple(
            (job_id, gpu)
            for job_id in self.queued
            if (gpu := self.jobs[job_id].record.reserved_gpu) is not None
        )
        return Snapshot(
            queued=queued,
            gpus=views,
            running_cpu=self.running_cpu,
            cpu_slots=self.opts.cpu_slots,
            warm=tuple(s.view(now) for s in warm.values()),
            held_back=held_back,
        )

    def degraded_reason(self, gpu: str) -> str:
        marks = self.degraded.get(gpu)
        return next(iter(marks.values())) if marks else ""

    def plan(self, now: float) -> None:
        self.plan_calls += 1
        decisions = self.planner(self.snapshot(now), now)
        started: Counter[str] = Counter()
        admitted: Counter[str] = Counter()
        if self.opts.record_history:
            for g in self.gpus:
                admitted[g.uuid] = self.ledger.held_bytes(g.uuid)
        crashed: list[_Attempt] = []
        evicted: dict[str, str] = {}  # type -> holder, evicted in this pass
        for d in decisions:
            if isinstance(d, Evict):
                self.evict(d, now)
                evicted[d.type] = d.holder
                continue
            job = self.jobs.get(d.job_id)
            if job is None or job.state is not _St.QUEUED:
                raise SimError(f"the planner decided about {d.job_id!r}, which is not queued")
            if isinstance(d, Start):
                lane = job.trace.lane
                if (d.gpu_uuid is None) != (lane is Lane.CPU):
                    raise SimError(f"{d.job_id} is a {lane} job: started on {d.gpu_uuid!r}")
                if d.gpu_uuid is not None and d.gpu_uuid not in self.physical:
                    raise SimError(f"{d.job_id} started on unknown GPU {d.gpu_uuid!r}")
                if d.gpu_uuid is not None and job.trace.serve:
                    self.check_served(d, job.trace, evicted)
                elif d.warm:
                    raise SimError(f"{d.job_id} was started warm, but its type has no servers")
                if d.gpu_uuid is not None:
                    started[d.gpu_uuid] += 1
                    if not d.warm:
                        admitted[d.gpu_uuid] += self.footprint(job.trace)
                attempt = self.start(job, d.gpu_uuid, now, d.backfill_for, d.warm)
                if attempt is not None:
                    crashed.append(attempt)
            elif isinstance(d, Refuse):
                del self.queued[d.job_id]
                job.state = _St.OVER
                job.record.outcome = Outcome.REFUSED
                job.record.reason = d.reason
            elif isinstance(d, Wait):
                job.record.reason = d.reason
                job.record.reserved_gpu = d.reserved_gpu
        # a crash frees nothing until its memory is reclaimed, so the order of the
        # crashes within one pass does not matter
        for attempt in crashed:
            self.crash(attempt, now)
        if self.opts.record_history:
            self.sample(now, started, admitted)

    def evict(self, d: Evict, now: float) -> None:
        server = self.servers.get(d.holder)
        if server is None or server.stopped:
            state = "unknown" if server is None else "already stopped"
            raise SimError(f"evicted warm server {d.holder!r}, which is {state}")
        if server.job is not None:
            raise SimError(f"evicted warm server {d.holder}, which is busy with {server.job}")
        if (d.type, d.gpu_uuid) != (server.record.type, server.gpu):
            raise SimError(
                f"evicted {d.holder} as a {d.type} server on {d.gpu_uuid}; it is a "
                f"{server.record.type} server on {server.gpu}"
            )
        self.stop_server(server, now, f"evicted: {d.reason}")

    def check_served(self, d: Start, t: TraceJob, evicted: dict[str, str]) -> None:
        server = self.warm.get(t.type)
        if d.warm:
            if server is None or server.job is not None or server.gpu != d.gpu_uuid:
                had = "no server" if server is None else f"{server.holder} on {server.gpu}"
                busy = " (busy)" if server is not None and server.job is not None else ""
                raise SimError(
                    f"{d.job_id} was started warm on {d.gpu_uuid}, but {t.type} has {had}{busy}"
                )
        elif server is not None:
            raise SimError(f"{d.job_id} starts a second {t.type} server while {server.holder} runs")
        elif t.type in evicted:
            raise SimError(
                f"{d.job_id} starts a new {t.type} server in the pass that evicted "
                f"{evicted[t.type]}: the broker keeps a stopping server in its pool until "
                "its process is gone (WarmPool.add would raise)"
            )

    def sample(self, now: float, started: Counter[str], admitted: Counter[str]) -> None:
        for g in self.gpus:
            holdings = self.ledger.holdings(g.uuid)
            self.history.append(
                LedgerSample(
                    t=now,
                    gpu=g.uuid,
                    holdings=holdings,
                    held_bytes=sum(h.bytes for h in holdings),
                    admitted_bytes=admitted[g.uuid],
                    capacity=max(0, g.total_bytes - g.reserve_bytes - self.foreign[g.uuid]),
                    physical_bytes=self.physical[g.uuid],
                    started=started[g.uuid],
                    degraded=self.degraded_reason(g.uuid),
                )
            )


def simulate(
    gpus: Iterable[SimGpu],
    trace: Iterable[TraceJob],
    planner: Planner,
    options: SimOptions | None = None,
    *,
    ledger: Ledger | None = None,
) -> SimResult:
    """Replay ``trace`` on ``gpus`` through ``planner`` in virtual time.

    ``ledger`` lets a test pass a (sub)class that checks every hold and release;
    by default a fresh :class:`Ledger` is used. A job's ``seq`` (its place in
    arrival order) follows ``arrival_s``, ties broken by the trace's order; a job
    retried after an out-of-memory crash keeps its ``seq``.
    """
    opts = options or SimOptions()
    gpu_list = tuple(gpus)
    uuids = [g.uuid for g in gpu_list]
    if len(set(uuids)) != len(uuids):
        raise SimError("two GPUs share a uuid")
    led = ledger if ledger is not None else Ledger()
    for u in uuids:
        led.add_gpu(u)
    sim = _Sim(gpu_list, opts, planner, led, {g.uuid: g for g in gpu_list})
    for u in uuids:
        sim.physical[u] = 0
        sim.foreign[u] = 0
    jobs = list(trace)
    by_arrival = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    seqs = {i: seq for seq, i in enumerate(by_arrival)}
    for i, t in enumerate(jobs):
        seq = seqs[i]
        if t.id in sim.jobs:
            raise SimError(f"two trace jobs are named {t.id!r}")
        rec = JobRecord(t.id, t.type, t.lane, t.arrival_s, reason="never planned")
        sim.jobs[t.id] = _Job(t, seq, rec)
        sim.push(t.arrival_s, _Ev.ARRIVE, t.id)
        if t.cancel_at_s is not None:
            sim.push(max(t.cancel_at_s, t.arrival_s), _Ev.CANCEL, t.id)
    for i, alloc in enumerate(opts.foreign):
        if alloc.gpu not in sim.physical:
            raise SimError(f"foreign allocation on unknown GPU {alloc.gpu!r}")
        sim.push(alloc.start_s, _Ev.FOREIGN_START, str(i))
        if alloc.end_s is not None:
            sim.push(max(alloc.end_s, alloc.start_s), _Ev.FOREIGN_END, str(i))
    sim.run()
    ends = [j.record.end_s for j in sim.jobs.values() if j.record.end_s is not None]
    degraded = {g: sim.degraded_reason(g) for g in uuids if sim.degraded.get(g)}
    leaked = tuple(h for u in uuids for h in led.holdings(u) if h.state is not HoldState.WARM)
    return SimResult(
        jobs={k: j.record for k, j in sim.jobs.items()},
        makespan_s=max(ends, default=0.0),
        oom_crashes=sim.oom_crashes,
        model_loads=sim.model_loads,
        plan_calls=sim.plan_calls,
        events=sim.events,
        degraded=degraded,
        leaked=leaked,
        history=sim.history,
        ledger=led,
        footprints=dict(sim.footprints),
        servers=[s.record for s in sim.servers.values()],
    )
