"""A type's measured profile and the run-time estimate backfilling plans with
(``core/profile.py``, ``node/measured.py: RunTimes``), and what it does to the plan:
a job's declared ``est_s`` is used while its type has no measured run time, the
measurement wins once known, and a backfill never delays the held-back job when
the estimates are right (replayed through ``replay/simulate.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.core import profile
from gpuwarden.core.ledger import Holding
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    Decision,
    GpuView,
    QueuedJob,
    Snapshot,
    Start,
    Wait,
    order,
    plan,
)
from gpuwarden.node.measured import RunTimes
from gpuwarden.replay.simulate import SimGpu, SimOptions, SimResult, TraceJob, simulate


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "10", None, 400 * 86400])
def test_an_est_s_must_be_a_positive_finite_number_of_at_most_a_year(bad: object) -> None:
    with pytest.raises(ValueError, match="est_s must be"):
        profile.check_est_s(bad)


def test_a_valid_est_s_is_taken_as_a_float() -> None:
    assert profile.check_est_s(90) == 90.0 and profile.check_est_s(0.5) == 0.5


@given(st.floats(min_value=1e-3, max_value=profile.MAX_EST_S))
def test_est_class_rounds_up_by_at_most_19_percent(est: float) -> None:
    got = profile.est_class(est)
    assert got is not None
    assert got >= est
    assert got <= max(1.0, est * 2 ** (1 / 4) * (1 + 1e-9))
    assert profile.est_class(got) == got  # a step is its own class


def test_est_class_puts_nearly_equal_estimates_in_one_class_and_few_classes_in_all() -> None:
    assert profile.est_class(None) is None
    assert profile.est_class(0.2) == 1.0
    assert profile.est_class(60.0) == profile.est_class(62.0) == 64.0
    assert profile.est_class(64.0) == 64.0
    # one class per second up to a day would be 86,400; rounded, they are a few dozen
    assert len({profile.est_class(float(s)) for s in range(1, 86_401)}) < 70


def test_wall_times_are_median_p90_and_longest_of_the_latest_runs() -> None:
    assert profile.wall_times([]) is None
    w = profile.wall_times([float(s) for s in range(1, 11)])
    assert w is not None
    assert (w.runs, w.median_s, w.p90_s, w.longest_s) == (10, 5.0, 9.0, 10.0)
    assert w.to_json() == {"runs": 10, "median_s": 5.0, "p90_s": 9.0, "longest_s": 10.0}


def test_est_s_is_used_before_any_measurement_and_the_longer_wins_after() -> None:
    times = RunTimes([])
    assert times.expected_s("t.x", None) is None  # nothing known: no time backfill
    assert times.expected_s("t.x", 30.0) == 32.0  # the declared time, rounded up
    times.note("t.x", 100.0)
    assert times.expected_s("t.x", 30.0) == 100.0  # says less than its type ran: not believed
    assert times.expected_s("t.x", None) == 100.0
    assert times.expected_s("t.other", 30.0) == 32.0  # per type
    # the estimate is the longest of the latest runs
    times.note("t.x", 40.0)
    # says more than its type ran (issue 31: est_s 45 on a history of 3.5 s): believed
    assert times.expected_s("t.x", 500.0) == profile.est_class(500.0)
    # a started job holds its GPU for what it declared, not rounded up
    assert times.holding_s("t.other", 30.0) == 30.0 and times.holding_s("t.x", 30.0) == 100.0
    assert times.holding_s("t.x", 450.0) == 450.0


def test_a_holders_end_is_its_declared_est_s_not_the_rounded_one() -> None:
    """x declares (and takes) 100 s; rounded, it would be expected to end at 107.6 s,
    and b (its type measured at 104 s) would start and keep the head out until
    105 s. With x's end as declared, b waits for the head."""
    trace = [
        TraceJob("b0", "t.b", -300.0, 104.0, 4 * GIB, coresident=True),  # measures t.b
        TraceJob("x", "t.x", 0.0, 100.0, 10 * GIB, coresident=True, est_s=100.0),
        TraceJob("head", "t.head", 0.5, 10.0, 20 * GIB),
        TraceJob("b", "t.b", 1.0, 104.0, 4 * GIB, coresident=True),
    ]
    r = simulate([SimGpu("G", 24 * GIB)], trace, plan)
    assert r.jobs["head"].start_s == 100.0
    assert r.jobs["b"].start_s == 110.0


def _held_back_trace(est_q: float | None, *, measured_first: bool = False) -> list[TraceJob]:
    """x (10 GiB, shares, runs 100 s) holds the GPU; head (20 GiB, the GPU to itself)
    waits and gets it held back; q (4 GiB, shares, runs 16 s) arrives behind it."""
    trace = [
        TraceJob("x", "t.hold", 0.0, 100.0, 10 * GIB, coresident=True, est_s=100.0),
        TraceJob("head", "t.big", 1.0, 10.0, 20 * GIB),
        TraceJob("q", "t.quick", 2.0, 16.0, 4 * GIB, coresident=True, est_s=est_q),
    ]
    if measured_first:  # a run of t.quick that took 128 s ended before all this
        trace = [
            TraceJob("q0", "t.quick", -200.0, 128.0, 4 * GIB, coresident=True),
            *trace,
        ]
    return trace


def test_a_job_declaring_est_s_backfills_a_held_back_gpu_before_its_type_is_measured() -> None:
    gpus = [SimGpu("G", 24 * GIB)]
    r = simulate(gpus, _held_back_trace(16.0), plan)
    assert r.jobs["q"].start_s == 2.0  # 2 + 16 <= 100, when head could start
    assert r.jobs["head"].start_s == 100.0  # not delayed by q
    # without est_s (and no measurement) it waits behind the head
    r = simulate(gpus, _held_back_trace(None), plan)
    assert r.jobs["q"].start_s == 110.0
    # a declaration that would not end in time does not backfill either
    r = simulate(gpus, _held_back_trace(200.0), plan)
    assert r.jobs["q"].start_s == 110.0


def test_the_measured_run_time_wins_over_a_job_declaring_less() -> None:
    """t.quick's one measured run took 128 s: q's claim of 16 s is not believed,
    and it does not start on the GPU held back for the head."""
    r = simulate([SimGpu("G", 24 * GIB)], _held_back_trace(16.0, measured_first=True), plan)
    assert r.jobs["q0"].end_s == -72.0
    assert r.jobs["head"].start_s == 100.0
    assert r.jobs["q"].start_s == 110.0


NOW = 1000.0


def _held(job_id: str, gib: int, expected_end: float | None) -> Holding:
    return Holding(
        f"{job_id}/1", "t.held", gib * GIB, True, job_id=job_id, since=NOW - 1,
        expected_end=expected_end,
    )  # fmt: skip


def _queued(
    job_id: str, gib: int, seq: int, *, shares: bool, expected_s: float | None = None
) -> QueuedJob:
    return QueuedJob(
        job_id, f"t.{job_id}", Lane.VRAM, gib * GIB, 0, seq, shares, expected_s=expected_s
    )


def test_a_holder_without_an_estimate_may_end_at_once_and_let_the_head_fit_sooner() -> None:
    """u (no estimate) and k (ends in 100 s) hold 4 GiB each; the head (17 GiB,
    shares) fits once either has gone; b (8 GiB, 50 s) does not fit beside it.
    Were u taken as staying, the head would "fit in 100 s" and b would start; but
    u may end now, and then b would keep the head out for 50 s. So b waits."""
    g = GpuView("G", 24 * GIB, holdings=(_held("u", 4, None), _held("k", 4, NOW + 100)))
    head = _queued("head", 17, 0, shares=True)
    b = _queued("b", 8, 1, shares=True, expected_s=50.0)
    decisions = {d.job_id: d for d in plan(Snapshot((head, b), (g,)), NOW)}
    assert isinstance(decisions["head"], Wait) and decisions["head"].reserved_gpu == "G"
    assert isinstance(decisions["b"], Wait)
    # with u's end known (after k's), the head fits when k ends: b ends before that
    g = GpuView("G", 24 * GIB, holdings=(_held("u", 4, NOW + 200), _held("k", 4, NOW + 100)))
    decisions = {d.job_id: d for d in plan(Snapshot((head, b), (g,)), NOW)}
    assert decisions["b"] == Start("b", "G")


def test_a_holder_without_an_estimate_does_not_stop_a_backfill_that_ends_in_time() -> None:
    """The head needs the GPU to itself: it cannot start before k ends, in 100 s,
    whenever u ends; b (50 s) is gone by then, so it starts."""
    g = GpuView("G", 24 * GIB, holdings=(_held("u", 4, None), _held("k", 4, NOW + 100)))
    head = _queued("head", 20, 0, shares=False)
    b = _queued("b", 4, 1, shares=True, expected_s=50.0)
    decisions = {d.job_id: d for d in plan(Snapshot((head, b), (g,)), NOW)}
    assert decisions["b"] == Start("b", "G")
    slow = _queued("b", 4, 1, shares=True, expected_s=150.0)
    assert isinstance(plan(Snapshot((head, slow), (g,)), NOW)[1], Wait)


class _BackfillWatch:
    """``plan``, noting every start on a GPU held back for a job ahead of it in
    the order that is not beside it (the "expected to end first" rule): the job,
    the held-back job, the GPU, the jobs holding it then, and the time."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str, str, list[str], float]] = []

    def __call__(self, snap: Snapshot, now: float) -> Sequence[Decision]:
        decisions = plan(snap, now)
        rank = {j.id: i for i, j in enumerate(order(snap.queued))}
        heads = {
            d.reserved_gpu: d.job_id
            for d in decisions
            if isinstance(d, Wait) and d.reserved_gpu is not None
        }
        on = {g.uuid: [h.job_id or h.holder for h in g.holdings] for g in snap.gpus}
        for d in decisions:  # in queue order, as the pass decided them
            if not isinstance(d, Start) or d.gpu_uuid is None:
                continue
            head = heads.get(d.gpu_uuid)
            if head is not None and rank[d.job_id] > rank[head] and d.backfill_for is None:
                self.found.append((d.job_id, head, d.gpu_uuid, list(on[d.gpu_uuid]), now))
            on[d.gpu_uuid].append(d.job_id)
        return decisions


def _fits_at(
    head: TraceJob, holders: list[TraceJob], r: SimResult, capacity: int, now: float
) -> float:
    """When ``head`` could start beside ``holders`` as they really ended."""
    left = sorted(holders, key=lambda t: r.jobs[t.id].end_s or math.inf)
    at = now
    while left and not (
        head.vram_bytes + sum(t.vram_bytes for t in left) <= capacity
        and head.coresident
        and all(t.coresident for t in left)
    ):
        at = max(at, r.jobs[left.pop(0).id].end_s or math.inf)
    return at


@st.composite
def exact_traces(draw: st.DrawFn) -> tuple[list[SimGpu], list[TraceJob]]:
    """Types with one run time each, jobs that declare it or nothing: every
    estimate is right (a queued job's est_s is planned rounded up, a holding's
    end as declared)."""
    kinds = draw(
        st.lists(
            st.tuples(
                st.sampled_from([4, 6, 10, 16, 20]),
                st.booleans(),
                st.sampled_from([1.0, 2.0, 3.0, 5.0, 7.5, 13.0, 30.0, 64.0]),
            ),
            min_size=2,
            max_size=4,
        )
    )
    trace = []
    for i in range(draw(st.integers(4, 20))):
        k = draw(st.integers(0, len(kinds) - 1))
        gib, shares, run_s = kinds[k]
        trace.append(
            TraceJob(
                f"j{i}",
                f"t.k{k}",
                float(draw(st.integers(0, 20))),
                run_s,
                gib * GIB,
                coresident=shares,
                priority=draw(st.integers(0, 1)),
                est_s=run_s if draw(st.booleans()) else None,
            )
        )
    gpus = [SimGpu(f"G{n}", 24 * GIB) for n in range(draw(st.integers(1, 2)))]
    return gpus, trace


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=exact_traces())
def test_property_a_backfill_never_delays_the_held_back_job_when_estimates_are_right(
    scenario: tuple[list[SimGpu], list[TraceJob]],
) -> None:
    gpus, trace = scenario
    watch = _BackfillWatch()
    r = simulate(gpus, trace, watch, SimOptions(reclaim_delay_s=0.0))
    by_id = {t.id: t for t in trace}
    for job_id, head_id, gpu, holders, now in watch.found:
        ended = r.jobs[job_id].end_s
        assert ended is not None
        # the held-back job could start on that GPU, as the others really ended,
        # no earlier than the backfilled job was gone
        could = _fits_at(by_id[head_id], [by_id[h] for h in holders], r, 24 * GIB, now)
        assert ended <= could, (job_id, head_id, gpu, holders, now, ended, could)
        head = r.jobs[head_id]
        if head.gpu == gpu and head.start_s is not None:
            assert head.start_s >= ended


def test_the_property_sees_backfills_by_declared_estimates() -> None:
    """The watch above does find the rule at work (not a vacuous property)."""
    watch = _BackfillWatch()
    simulate([SimGpu("G", 24 * GIB)], _held_back_trace(16.0), watch)
    assert [(b, h, g) for b, h, g, _, _ in watch.found] == [("q", "head", "G")]
