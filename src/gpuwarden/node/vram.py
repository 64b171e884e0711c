"""The node's VRAM book: the ledger, what the probe shows, and what follows.

Owned by the broker loop (never touched by worker threads). Each observation
attributes the probe's per-process readings to gpuwarden's attempts (by the
PIDs of their process trees), so it knows per GPU:

- what each running attempt uses now (its holding grows to that if it exceeds
  its footprint, and its peak is kept for measurement);
- what other processes use ("foreign": counted against the budget, never
  killed), plus memory no process accounts for beyond the GPU's idle baseline;
- whether the memory of an ended attempt is free yet (the reclaim gate). The
  holding stays, as ``reclaiming``, until the probe shows it free; past
  ``reclaim_timeout_s`` the GPU is degraded and takes no VRAM job until the
  memory is back. It clears by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil

from gpuwarden.core.ledger import Holding, HoldState, Ledger, parts_of
from gpuwarden.core.model import format_bytes, gpu_list
from gpuwarden.core.policy import GpuView
from gpuwarden.gpu.base import GpuReading
from gpuwarden.node.settings import VramSettings


@dataclass
class _Tracked:
    """What the book knows of one holder beyond its ledger entry."""

    main_pid: int | None = None
    #: more processes whose trees are its own (a VRAM lease's app: its command,
    #: the PIDs it registered)
    roots: set[int] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)
    peak_bytes: int = 0
    #: nothing else held memory on its GPU from its start on: its peak is its own
    alone: bool = True


@dataclass(frozen=True, slots=True)
class Measurement:
    type: str
    job_id: str | None
    peak_bytes: int
    alone: bool


@dataclass
class _Gpu:
    reading: GpuReading
    baseline: int = 0
    foreign: int = 0
    #: what each managed runtime's process tree holds here (name, bytes), less
    #: what its running jobs hold for it
    runtimes: tuple[tuple[str, int], ...] = ()
    #: what each runtime's process tree holds here, all of it
    runtime_raw: dict[str, int] = field(default_factory=dict)
    degraded: str = ""


@dataclass
class _RuntimeUse:
    """A runtime job's holding: the runtime it uses, and what that runtime held on
    the GPU when the job started (the least since: what it gives up lowers it)."""

    runtime: str
    baseline: int


class VramBook:
    def __init__(self, settings: VramSettings) -> None:
        self.settings = settings
        self.ledger = Ledger()
        self._tracked: dict[str, _Tracked] = {}
        self._gpus: dict[str, _Gpu] = {}
        self._reserve = settings.reserve_bytes
        #: GPUs with a hardware fault: no VRAM admission until an operator clears it
        self.faults: dict[str, str] = {}
        self._xid_seen: dict[str, int] = {}
        self._tolerance = settings.tolerance_bytes
        #: each managed runtime's process tree, as its poller last found it: what
        #: they hold is named by the runtime, not counted as foreign
        self.runtime_pids: dict[str, set[int]] = {}
        #: the holdings of runtime jobs, by holder: the runtime whose memory each
        #: accounts for (its footprint covers the model the runtime loads for it)
        self.runtime_of: dict[str, _RuntimeUse] = {}
        #: a multi-GPU attempt's holdings, one per GPU, by its holder's name (the
        #: first is the holder itself, the others ``HOLDER+i``)
        self._parts: dict[str, tuple[str, ...]] = {}

    # -- holdings -------------------------------------------------------------

    def start(
        self,
        holder: str,
        gpu: str,
        *,
        type_name: str,
        job_id: str | None,
        nbytes: int,
        coresident: bool,
        now: float,
        expected_s: float | None = None,
        backfill_for: str | None = None,
        state: HoldState = HoldState.RUNNING,
        runtime: str | None = None,
    ) -> None:
        """An attempt starts on ``gpu``: hold its footprint. A runtime job's
        (``runtime``: the managed runtime it uses) holds it for the runtime: while
        it runs, that much of the runtime's memory there is this holding's. A
        multi-GPU attempt (``gpu``: its GPUs, comma-separated) holds ``nbytes`` on
        each, one holding per GPU, all ended and measured as one."""
        gpus = gpu_list(gpu)
        names = parts_of(holder, len(gpus))
        if len(names) > 1:
            self._parts[holder] = names
        for name, one in zip(names, gpus, strict=True):
            self._hold_one(
                name,
                one,
                Holding(
                    holder=name,
                    type=type_name,
                    bytes=nbytes,
                    coresident=coresident,
                    job_id=job_id,
                    since=now,
                    expected_end=None if expected_s is None else now + expected_s,
                    backfill_for=backfill_for,
                    state=state,
                ),
            )
        if runtime is not None:
            g = self._gpus.get(gpu)
            self.runtime_of[holder] = _RuntimeUse(
                runtime, g.runtime_raw.get(runtime, 0) if g else 0
            )

    def _hold_one(self, holder: str, gpu: str, holding: Holding) -> None:
        others = self.ledger.holdings(gpu)
        for other in others:
            if other.holder in self._tracked:
                self._tracked[other.holder].alone = False
        self.ledger.hold(gpu, holding)
        self._tracked[holder] = _Tracked(alone=not others)

    def parts(self, holder: str) -> tuple[str, ...]:
        """The names of its holdings: itself, or a multi-GPU attempt's one per GPU."""
        return self._parts.get(holder, (holder,))

    def held_bytes(self, holder: str) -> int:
        """What it holds now, on all its GPUs together."""
        return sum(h.bytes for p in self.parts(holder) if (h := self.ledger.get(p)) is not None)

    def alone(self, holder: str) -> bool:
        """Nothing else held memory on its GPU (any of its GPUs) since it started."""
        tracked = [self._tracked.get(p) for p in self.parts(holder)]
        return all(t is not None and t.alone for t in tracked)

    def peak(self, holder: str) -> int:
        """The most it was seen to use on one GPU (its footprint is per GPU)."""
        return max(
            (t.peak_bytes for p in self.parts(holder) if (t := self._tracked.get(p))), default=0
        )

    def fault(self, gpu: str, reason: str) -> None:
        self.faults[gpu] = reason

    def clear_fault(self, gpu: str) -> bool:
        return self.faults.pop(gpu, None) is not None

    def set_pid(self, holder: str, pid: int) -> None:
        for part in self.parts(holder):
            if (t := self._tracked.get(part)) is not None:
                t.main_pid = pid
                t.pids.add(pid)

    def add_roots(self, holder: str, pids: set[int]) -> None:
        """Processes outside the attempt's tree whose memory (theirs and their
        descendants') is the holding's from the next observation on (a VRAM
        lease's app)."""
        t = self._tracked.get(holder)
        if t is not None:
            t.roots |= pids

    def end(self, holder: str, now: float) -> Measurement | None:
        """The attempt's processes are gone: its holding waits for the probe to show
        its memory free (reclaiming). Returns what was measured while it ran (a
        multi-GPU attempt's peak is the most it used on one of its GPUs)."""
        holding = self.ledger.get(holder)
        if holding is None or holder not in self._tracked:
            return None
        measurement = Measurement(
            holding.type, holding.job_id, self.peak(holder), self.alone(holder)
        )
        self.runtime_of.pop(holder, None)  # the runtime's memory is its own again
        for part in self._parts.pop(holder, (holder,)):
            tracked = self._tracked.get(part)
            if tracked is None:
                continue
            if not tracked.pids:  # no process ever ran: nothing to reclaim
                self.ledger.release(part)
                del self._tracked[part]
            else:
                self.ledger.update(part, state=HoldState.RECLAIMING, since=now)
        return measurement

    # -- observation ------------------------------------------------------------

    def observe(self, readings: list[GpuReading], now: float) -> list[dict[str, Any]]:
        """Take a fresh probe reading into account. Returns events worth logging."""
        events: list[dict[str, Any]] = []
        seen = {r.uuid for r in readings}
        for gone in set(self._gpus) - seen:
            del self._gpus[gone]
        for r in readings:
            self.ledger.add_gpu(r.uuid)
            g = self._gpus.get(r.uuid)
            first = g is None
            if g is None:
                g = self._gpus[r.uuid] = _Gpu(reading=r)
            g.reading = r
            events += self._observe_gpu(g, first, now)
            if first and r.xids:  # reported before this broker started: history, not news
                self._xid_seen[r.uuid] = r.xids[-1][0]
            events += self._new_xids(r)
        return events

    def _new_xids(self, r: GpuReading) -> list[dict[str, Any]]:
        seen = self._xid_seen.get(r.uuid, 0)
        if r.xids and r.xids[-1][0] < seen:  # the source started counting again
            seen = 0
        new = [(seq, code) for seq, code in r.xids if seq > seen]
        if r.xids:
            self._xid_seen[r.uuid] = r.xids[-1][0]
        return [{"event": "gpu_xid", "gpu": r.uuid, "xid": code} for _, code in new]

    def _observe_gpu(self, g: _Gpu, first: bool, now: float) -> list[dict[str, Any]]:
        r = g.reading
        usage = {p.pid: p.used_bytes for p in r.processes}
        unattributed = max(0, r.used_bytes - sum(usage.values()))
        holdings = self.ledger.holdings(r.uuid)
        # the idle GPU's own use (driver, contexts): the least no process accounts
        # for, ever seen; a restart's leftovers only delay it reaching the true value
        g.baseline = unattributed if first else min(g.baseline, unattributed)
        ours: set[int] = set()
        events: list[dict[str, Any]] = []
        for h in holdings:
            t = self._tracked.get(h.holder)
            if t is None:
                continue
            if h.state is not HoldState.RECLAIMING:
                for root in (t.main_pid, *t.roots):
                    if root is not None:
                        t.pids |= _tree(root)
            ours |= t.pids
            used = sum(usage.get(pid, 0) for pid in t.pids)
            if h.state is not HoldState.RECLAIMING:
                t.peak_bytes = max(t.peak_bytes, used)
                if used > h.bytes:  # it uses more than it declared: count what it uses
                    self.ledger.update(h.holder, bytes=used)
        extra = max(0, unattributed - g.baseline)
        named: dict[str, int] = {}
        raw: dict[str, int] = {}
        for name, pids in self.runtime_pids.items():
            held = sum(usage.get(pid, 0) for pid in pids if pid not in ours)
            raw[name] = held
            held -= self._covered(holdings, name, held)
            if held:
                named[name] = held
            ours = ours | pids
        g.runtimes = tuple(sorted(named.items()))
        g.runtime_raw = raw
        g.foreign = sum(u for pid, u in usage.items() if pid not in ours) + extra
        events += self._reclaim(g, usage, extra, now)
        return events

    def _covered(self, holdings: tuple[Holding, ...], runtime: str, held: int) -> int:
        """How much of the ``held`` bytes of ``runtime`` on a GPU its running jobs
        there hold for it: what it took on since each started, up to each one's
        footprint, and in all no more than it took on since the first of them."""
        uses = [
            (h.bytes, use)
            for h in holdings
            if h.state is not HoldState.RECLAIMING
            and (use := self.runtime_of.get(h.holder)) is not None
            and use.runtime == runtime
        ]
        if not uses:
            return 0
        for _, use in uses:
            use.baseline = min(use.baseline, held)
        each = sum(min(nbytes, held - use.baseline) for nbytes, use in uses)
        return min(each, held - min(use.baseline for _, use in uses))

    def runtime_jobs(self) -> dict[str, list[str]]:
        """The jobs that use each managed runtime now (by its name)."""
        out: dict[str, list[str]] = {}
        for holder, use in self.runtime_of.items():
            h = self.ledger.get(holder)
            if h is not None and h.job_id is not None:
                out.setdefault(use.runtime, []).append(h.job_id)
        return out

    def _reclaim(
        self, g: _Gpu, usage: dict[int, int], extra: int, now: float
    ) -> list[dict[str, Any]]:
        """Release reclaiming holdings whose memory the probe shows free; degrade
        the GPU while one is overdue, and clear that once it is released."""
        events: list[dict[str, Any]] = []
        overdue: list[str] = []
        for h in self.ledger.holdings(g.reading.uuid):
            if h.state is not HoldState.RECLAIMING:
                continue
            t = self._tracked[h.holder]
            left = sum(usage.get(pid, 0) for pid in t.pids)
            if 0 < left < h.bytes:  # part is back already: hold only what still shows
                self.ledger.update(h.holder, bytes=left)
            if left <= self._tolerance and extra <= self._tolerance:
                self.ledger.release(h.holder)
                del self._tracked[h.holder]
                events.append(
                    {
                        "event": "memory_reclaimed",
                        "job": h.job_id,
                        "gpu": g.reading.uuid,
                        "after_s": round(now - h.since, 3),
                    }
                )
            elif now - h.since > self.settings.reclaim_timeout_s:
                still = left or extra
                pids = ", ".join(str(p) for p in sorted(t.pids) if usage.get(p)) or "none listed"
                overdue.append(
                    f"{format_bytes(still)} of job {h.job_id} ({h.type}) still shows as used "
                    f"{now - h.since:.0f} s after it ended (PIDs: {pids}); VRAM admission "
                    "here is paused until it is free"
                )
        reason = "; ".join(overdue)
        if reason and not g.degraded:
            events.append({"event": "gpu_degraded", "gpu": g.reading.uuid, "reason": reason})
        elif g.degraded and not reason:
            events.append({"event": "gpu_recovered", "gpu": g.reading.uuid, "was": g.degraded})
        g.degraded = reason
        return events

    # -- what the policy and status see ----------------------------------------------

    def views(self) -> tuple[GpuView, ...]:
        return tuple(
            GpuView(
                uuid=uuid,
                name=g.reading.name,
                total_bytes=g.reading.total_bytes,
                reserve_bytes=self._reserve,
                foreign_bytes=g.foreign,
                runtimes=g.runtimes,
                holdings=self.ledger.holdings(uuid),
                degraded=(
                    f"hardware fault: {self.faults[uuid]}" if uuid in self.faults else g.degraded
                ),
            )
            for uuid, g in self._gpus.items()
        )

    def degraded(self) -> dict[str, str]:
        out = {uuid: g.degraded for uuid, g in self._gpus.items() if g.degraded}
        out.update({uuid: f"hardware fault: {why}" for uuid, why in self.faults.items()})
        return out


def _tree(pid: int) -> set[int]:
    """The PID and its live descendants (processes of one attempt)."""
    try:
        proc = psutil.Process(pid)
        return {pid} | {c.pid for c in proc.children(recursive=True)}
    except psutil.Error:
        return {pid}
