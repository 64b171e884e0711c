"""Warm model servers in ``core.simulate``, driven by ``core.policy.plan``: a burst
loads once, idle grace and on-demand eviction in virtual time, ``keep_warm``, no
eviction of a busy server, and a property over random serve traces (budget, each
warm holding released exactly once after its eviction, every job ends)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.core.ledger import Holding, HoldState, Ledger
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    Decision,
    Evict,
    GpuView,
    QueuedJob,
    Snapshot,
    Start,
    Wait,
    WarmView,
    plan,
)
from gpuwarden.replay.simulate import (
    ForeignAlloc,
    Outcome,
    SimError,
    SimGpu,
    SimOptions,
    SimResult,
    TraceJob,
    simulate,
)


def gib(x: float) -> int:
    return int(x * GIB)


class CheckedLedger(Ledger):
    """A ledger that records every hold and release (release twice still raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()

    def hold(self, gpu: str, holding: Holding) -> None:
        super().hold(gpu, holding)
        self.holds[holding.holder] += 1

    def release(self, holder: str) -> Holding:
        h = super().release(holder)
        self.releases[holder] += 1
        return h


class Spy:
    """``plan``, keeping every snapshot and the decisions taken on it."""

    def __init__(self) -> None:
        self.passes: list[tuple[float, Snapshot, list[Decision]]] = []

    def __call__(self, snapshot: Snapshot, now: float) -> Sequence[Decision]:
        decisions = plan(snapshot, now)
        self.passes.append((now, snapshot, decisions))
        return decisions

    def evictions(self) -> list[tuple[float, Evict]]:
        return [(t, d) for t, _, ds in self.passes for d in ds if isinstance(d, Evict)]


def served(
    job_id: str,
    arrival: float,
    duration: float = 1.0,
    *,
    type: str = "m",
    gib_: float = 6,
    load_s: float = 10.0,
    priority: int = 0,
    keep_warm: bool = False,
    idle_grace_s: float | None = None,
    coresident: bool = False,
) -> TraceJob:
    return TraceJob(
        job_id,
        type,
        arrival,
        duration,
        gib(gib_),
        priority=priority,
        coresident=coresident,
        serve=True,
        load_s=load_s,
        keep_warm=keep_warm,
        idle_grace_s=idle_grace_s,
    )


ONE = [SimGpu("G", gib(24))]


def test_a_burst_of_one_type_loads_once_and_runs_back_to_back() -> None:
    spy = Spy()
    ledger = CheckedLedger()
    trace = [served(f"a{i}", 0.0) for i in range(5)]
    r = simulate(ONE, trace, spy, SimOptions(idle_grace_s=30, reclaim_delay_s=1), ledger=ledger)
    assert r.model_loads == 1
    [server] = r.servers
    assert server.holder == "warm:m:1" and server.gpu == "G"
    assert (server.loaded_s, server.jobs_served) == (10.0, 5)
    # the first job waits for the load; each later one runs on the idle server at once
    assert [(r.jobs[f"a{i}"].start_s, r.jobs[f"a{i}"].end_s) for i in range(5)] == [
        (0.0, 11.0),
        (11.0, 12.0),
        (12.0, 13.0),
        (13.0, 14.0),
        (14.0, 15.0),
    ]
    assert [r.jobs[f"a{i}"].served_warm for i in range(5)] == [False, True, True, True, True]
    assert r.outcomes() == Counter({Outcome.DONE: 5})
    # one warm holding, held once and released once (after the idle grace)
    assert ledger.holds == Counter({"warm:m:1": 1})
    assert ledger.releases == Counter({"warm:m:1": 1})
    # what the planner saw: serve jobs, warm once their type has a server
    first_now, first, _ = spy.passes[0]
    assert first_now == 0.0 and not first.warm
    assert all(q.serve and not q.warm for q in first.queued)
    _, later, decisions = next(p for p in spy.passes if p[0] == 11.0)
    [view] = later.warm
    assert view == WarmView(
        type="m",
        gpu_uuid="G",
        holder="warm:m:1",
        busy=False,
        idle_since=11.0,
        keep_warm=False,
        load_s=10.0,
        idle_grace_s=30.0,
        priority=0,
    )
    assert all(q.warm for q in later.queued)
    assert Start("a1", "G", warm=True) in decisions
    [holding] = later.gpus[0].holdings
    assert holding.state is HoldState.WARM and holding.bytes == gib(6) and holding.job_id is None


def test_while_it_loads_the_server_is_busy_and_holds_its_memory() -> None:
    spy = Spy()
    simulate(ONE, [served("a", 0.0), served("b", 5.0)], spy, SimOptions(idle_grace_s=30))
    _, snap, decisions = next(p for p in spy.passes if p[0] == 5.0)
    [view] = snap.warm
    assert view.busy and view.idle_since is None and view.load_s == 0.0  # not loaded yet
    assert snap.gpus[0].held_bytes == gib(6)
    [wait] = decisions
    assert isinstance(wait, Wait) and "busy" in wait.reason


def test_idle_grace_eviction_in_virtual_time() -> None:
    spy = Spy()
    ledger = CheckedLedger()
    trace = [
        served("a", 0.0),  # loads 0-10, runs 10-11, idle from 11
        served("b", 20.0),  # within the grace: served warm, the grace starts again at 21
        served("c", 100.0),  # long after the eviction at 51: a second load
    ]
    opts = SimOptions(idle_grace_s=30, reclaim_delay_s=2.0)
    r = simulate(ONE, trace, spy, opts, ledger=ledger)
    assert r.model_loads == 2
    first, second = r.servers
    assert (first.holder, first.jobs_served) == ("warm:m:1", 2)
    assert (first.stopped_s, first.released_s) == (51.0, 53.0)  # 21 + 30 s, then reclaim
    assert first.reason.startswith("evicted: idle for 30 s")
    assert (second.holder, second.started_s, second.stopped_s) == ("warm:m:2", 100.0, 141.0)
    assert r.jobs["b"].served_warm and (r.jobs["b"].start_s, r.jobs["b"].end_s) == (20.0, 21.0)
    assert r.jobs["c"].end_s == 111.0
    # the planner was called at the grace's end although nothing was queued
    [(t1, e1), (t2, e2)] = spy.evictions()
    assert (t1, e1.holder, t2, e2.holder) == (51.0, "warm:m:1", 141.0, "warm:m:2")
    assert not next(s for t, s, _ in spy.passes if t == 51.0).queued
    assert ledger.releases == Counter({"warm:m:1": 1, "warm:m:2": 1})
    assert len(r.ledger) == 0 and r.leaked == ()


def test_a_per_type_grace_overrides_the_default() -> None:
    r = simulate(ONE, [served("a", 0.0, idle_grace_s=5)], plan, SimOptions(idle_grace_s=300))
    assert r.servers[0].stopped_s == 16.0


def test_on_demand_eviction_when_a_waiting_job_needs_the_room() -> None:
    spy = Spy()
    trace = [
        served("a", 0.0),  # a 6 GiB server, idle from 11 with a 300 s grace
        TraceJob("big", "llm", 20.0, 5.0, gib(20)),  # needs the GPU to itself
    ]
    r = simulate(ONE, trace, spy, SimOptions(reclaim_delay_s=1.0))
    [(t, evict)] = spy.evictions()
    assert t == 20.0 and evict.holder == "warm:m:1"
    assert "needed by job big" in evict.reason
    assert r.servers[0].stopped_s == 20.0 and r.servers[0].released_s == 21.0
    assert r.jobs["big"].start_s == 21.0  # as soon as the memory shows free
    assert r.jobs["big"].outcome is Outcome.DONE
    assert r.model_loads == 2  # the server's load and the big job's


def test_keep_warm_is_never_evicted_for_idleness_and_yields_only_to_higher_priority() -> None:
    same = [
        served("p", 0.0, keep_warm=True),
        TraceJob("big", "llm", 20.0, 5.0, gib(20)),  # priority 0, as the server's jobs
    ]
    r = simulate(ONE, same, plan, SimOptions(idle_grace_s=30, reclaim_delay_s=1.0))
    assert r.jobs["big"].outcome is Outcome.WAITING  # it waits for the pinned server
    [server] = r.servers
    assert server.stopped_s is None  # never stopped, though idle far past its grace
    assert r.leaked == ()  # a live server's holding is not a leak
    [held] = r.ledger.holdings("G")
    assert held.state is HoldState.WARM

    urgent = [*same[:1], TraceJob("big", "llm", 20.0, 5.0, gib(20), priority=5)]
    spy = Spy()
    r = simulate(ONE, urgent, spy, SimOptions(idle_grace_s=30, reclaim_delay_s=1.0))
    [(t, evict)] = spy.evictions()
    assert t == 20.0 and "higher priority (5 > 0)" in evict.reason
    assert r.jobs["big"].outcome is Outcome.DONE and r.jobs["big"].start_s == 21.0


def test_a_busy_server_is_never_evicted() -> None:
    spy = Spy()
    trace = [
        served("slow", 0.0, 50.0),  # loads 0-10, runs 10-60
        TraceJob("big", "llm", 5.0, 5.0, gib(20)),
    ]
    r = simulate(ONE, trace, spy, SimOptions(reclaim_delay_s=1.0))
    [(t, evict)] = spy.evictions()
    assert (t, evict.holder) == (60.0, "warm:m:1")  # only once its job ended
    assert r.jobs["slow"].outcome is Outcome.DONE and r.jobs["slow"].end_s == 60.0
    assert r.jobs["big"].start_s == 61.0
    for _, snap, decisions in spy.passes:
        busy = {w.holder for w in snap.warm if w.busy}
        assert not any(isinstance(d, Evict) and d.holder in busy for d in decisions)


def test_a_planner_that_breaks_the_warm_protocol_is_caught() -> None:
    trace = [served("a", 0.0, 50.0), served("b", 1.0)]

    def evict_busy(s: Snapshot, now: float) -> list[Decision]:
        if now == 0.0:
            return [Start("a", "G")]
        return [Evict(w.holder, w.type, w.gpu_uuid, "bug") for w in s.warm]

    with pytest.raises(SimError, match="busy"):
        simulate(ONE, trace, evict_busy)

    def evict_unknown(s: Snapshot, now: float) -> list[Decision]:
        return [Evict("warm:m:9", "m", "G", "bug"), *(Wait(q.id, "x") for q in s.queued)]

    with pytest.raises(SimError, match="unknown"):
        simulate(ONE, trace, evict_unknown)

    def warm_without_server(s: Snapshot, now: float) -> list[Decision]:
        return [Start(q.id, "G", warm=True) for q in s.queued]

    with pytest.raises(SimError, match="no server"):
        simulate(ONE, trace, warm_without_server)

    def two_servers(s: Snapshot, now: float) -> list[Decision]:
        return [Start(q.id, "G") for q in s.queued]

    with pytest.raises(SimError, match="second m server"):
        simulate(ONE, [served("a", 0.0, coresident=True), served("b", 1.0)], two_servers)


def test_a_server_whose_load_crashes_stops_and_its_job_is_retried() -> None:
    # foreign memory leaves 14 GiB; the server really needs 16 GiB though it declares 6
    crashy = TraceJob("a", "m", 1.0, 1.0, gib(6), actual_peak_bytes=gib(16), serve=True)
    opts = SimOptions(
        foreign=(ForeignAlloc("G", 0.0, gib(10), end_s=2.0),),
        retry_delay_s=1.5,
        reclaim_delay_s=0.5,
        idle_grace_s=10,
    )
    ledger = CheckedLedger()
    r = simulate(ONE, [crashy], plan, opts, ledger=ledger)
    assert (r.oom_crashes, r.model_loads) == (1, 2)
    first, second = r.servers
    assert (first.stopped_s, first.reason, first.loaded_s) == (1.0, "it crashed", None)
    assert first.released_s == 1.5
    assert (second.holder, second.started_s, second.jobs_served) == ("warm:m:2", 2.5, 1)
    assert r.jobs["a"].outcome is Outcome.DONE and r.jobs["a"].attempts == 2
    assert ledger.releases == Counter({"warm:m:1": 1, "warm:m:2": 1})


def test_cancelling_a_served_job_stops_its_server() -> None:
    trace = [TraceJob("a", "m", 0.0, 5.0, gib(6), serve=True, load_s=10, cancel_at_s=3.0)]
    r = simulate(ONE, trace, plan, SimOptions(reclaim_delay_s=1.0))
    [server] = r.servers
    assert (server.stopped_s, server.released_s) == (3.0, 4.0)
    assert server.reason == "its job was cancelled" and server.loaded_s is None
    assert r.jobs["a"].outcome is Outcome.CANCELLED


def test_a_served_jobs_own_failure_leaves_its_server_idle() -> None:
    trace = [
        TraceJob("bad", "m", 0.0, 1.0, gib(6), serve=True, load_s=2, fails=True),
        served("ok", 0.5),
    ]
    r = simulate(ONE, trace, plan, SimOptions(idle_grace_s=10))
    assert r.jobs["bad"].outcome is Outcome.FAILED
    assert r.jobs["ok"].served_warm and r.model_loads == 1
    assert r.servers[0].jobs_served == 2


def test_run_time_estimates_of_served_jobs_leave_the_load_out() -> None:
    spy = Spy()
    simulate(ONE, [served("a", 0.0, 3.0), served("b", 14.0)], spy)  # a: load 0-10, run 10-13
    _, snap, _ = next(p for p in spy.passes if p[0] == 14.0)
    assert [q.expected_s for q in snap.queued] == [3.0]


# --- issues found in the policy (policy.py is another engineer's; see the report) ---


def idle_server_snapshot(*queued: QueuedJob, gpus: tuple[GpuView, ...] = ()) -> Snapshot:
    warm = Holding("warm:m:1", "m", gib(6), coresident=True, state=HoldState.WARM)
    view = WarmView("m", "G0", "warm:m:1", busy=False, idle_since=0.0, idle_grace_s=30.0)
    return Snapshot(
        queued=queued,
        gpus=gpus or (GpuView("G0", gib(24), holdings=(warm,)),),
        warm=(view,),
    )


def test_policy_no_grace_eviction_of_a_server_whose_job_is_queued() -> None:
    job = QueuedJob("j", "m", Lane.VRAM, gib(6), 0, 0, coresident=True, warm=True, serve=True)
    decisions = plan(idle_server_snapshot(job), 30.0)
    assert decisions == [Start("j", "G0", warm=True)]


def test_policy_no_new_server_in_the_pass_that_evicts_the_old_one() -> None:
    trace = [
        served("m1", 0.0, 20.0, coresident=True),  # G0 (best fit): loads 0-10, runs 10-30
        TraceJob("flat", "flat", 1.0, 1000.0, gib(19), coresident=True),  # G1, for good
        TraceJob("big", "llm", 15.0, 5.0, gib(20), priority=5),  # waits; G0 held back
        served("m2", 16.0, coresident=True),  # waits for the busy m server
    ]
    # at 30 the m server goes idle; in one pass the policy evicts it for big and starts
    # m2 cold on G1 (6 GiB beside flat's 19 on 32 GiB): SimError, a broker crash
    gpus = [SimGpu("G0", gib(24)), SimGpu("G1", gib(32))]
    r = simulate(gpus, trace, plan, SimOptions(reclaim_delay_s=1.0))
    assert r.outcomes()[Outcome.DONE] == 4


# --- property ----------------------------------------------------------------------

#: name, GiB, serve, coresident, load seconds
TYPES = (
    ("a", 6, True, False, 5.0),
    ("b", 10, True, False, 8.0),
    ("c", 14, True, False, 12.0),
    ("e", 3, True, True, 2.0),
    ("f", 5, True, True, 4.0),
    ("x", 8, False, False, 0.0),
    ("y", 4, False, True, 0.0),
)


@st.composite
def serve_traces(draw: st.DrawFn) -> tuple[list[SimGpu], list[TraceJob], SimOptions]:
    """One GPU, serve and plain types, keep_warm and per-type graces, failures and
    cancels. Every time in a trace is a multiple of 0.5 s plus its job's own
    ``i / 1024`` s (exact in binary), so no job arrives at the very instant another
    chain of events ends a grace: that coincidence, and two GPUs, run into the
    policy issue the xfail tests above show (a SimError), not into what this checks."""
    gpus = [SimGpu("G", gib(draw(st.sampled_from([16, 24]))))]
    keep = {name: draw(st.integers(0, 5)) == 0 for name, *_ in TYPES}
    grace = {name: draw(st.sampled_from([None, 3.0, 20.0])) for name, *_ in TYPES}
    trace = []
    for i in range(draw(st.integers(1, 25))):
        if draw(st.integers(0, 9)) == 0:
            arrival = draw(st.integers(0, 60)) / 2 + i / 1024
            trace.append(TraceJob(f"j{i}", "cpu", arrival, 2.0, 0, Lane.CPU))
            continue
        name, size, serve, coresident, load_s = draw(st.sampled_from(TYPES))
        arrival = draw(st.integers(0, 120)) / 2 + i / 1024
        trace.append(
            TraceJob(
                f"j{i}",
                name,
                arrival,
                float(draw(st.integers(1, 10))),
                gib(size),
                coresident=coresident,
                priority=draw(st.sampled_from([0, 0, 0, 5])),
                fails=draw(st.integers(0, 9)) == 0,
                cancel_at_s=arrival + draw(st.integers(0, 30))
                if draw(st.integers(0, 9)) == 0
                else None,
                serve=serve,
                load_s=load_s,
                keep_warm=keep[name] and serve,
                idle_grace_s=grace[name],
            )
        )
    opts = SimOptions(
        reclaim_delay_s=draw(st.sampled_from([0.0, 0.5, 2.0])),
        idle_grace_s=draw(st.sampled_from([5.0, 60.0])),
        cpu_slots=2,
        record_history=True,
    )
    return gpus, trace, opts


def check_serve_run(gpus: list[SimGpu], trace: list[TraceJob], r: SimResult) -> None:
    ledger = r.ledger
    assert isinstance(ledger, CheckedLedger)
    # (a) the ledger never holds more than the GPU's capacity (footprints are honest)
    for s in r.history:
        assert s.held_bytes <= s.capacity, s
        assert s.physical_bytes <= s.capacity, s
    assert r.oom_crashes == 0
    # (b) each warm holding is held once, and released exactly once after its server
    # stopped; only keep_warm servers may still run at the end
    keep = {t.type for t in trace if t.keep_warm}
    per_type: Counter[str] = Counter()
    for server in r.servers:
        assert ledger.holds[server.holder] == 1
        if server.stopped_s is None:
            assert server.type in keep, server
            assert ledger.releases[server.holder] == 0
            per_type[server.type] += 1
        else:
            assert ledger.releases[server.holder] == 1, server
            assert server.released_s is not None and server.released_s >= server.stopped_s
    assert all(n == 1 for n in per_type.values())  # one server per type at most
    assert r.leaked == ()
    assert all(h.state is HoldState.WARM for h in ledger.holdings("G"))
    # (c) every job ends; one may wait for ever only for a keep_warm server that is
    # never made to yield (a job of no higher priority than the jobs it serves)
    pinned = [s for s in r.servers if s.stopped_s is None]
    for t in trace:
        rec = r.jobs[t.id]
        assert rec.outcome is not Outcome.REFUSED
        if rec.outcome is Outcome.WAITING:
            assert pinned, f"{t.id} waits for ever with no pinned server: {rec.reason}"
            assert t.lane is Lane.VRAM and t.type not in {s.type for s in pinned}, rec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=serve_traces())
def test_property_serve_traces_keep_the_budget_release_once_and_end(
    scenario: tuple[list[SimGpu], list[TraceJob], SimOptions],
) -> None:
    gpus, trace, opts = scenario
    ledger = CheckedLedger()
    r = simulate(gpus, trace, plan, opts, ledger=ledger)  # a planner bug raises SimError
    check_serve_run(gpus, trace, r)
    loads = sum(1 for t in trace if t.lane is Lane.VRAM and not t.serve) + len(r.servers)
    retries = sum(r.jobs[t.id].attempts - 1 for t in trace if not t.serve)
    assert r.model_loads == loads + retries
