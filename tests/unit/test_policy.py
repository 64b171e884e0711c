"""The admission and ordering policy: ``plan(snapshot, now)`` -> one decision per job.

The first part checks single planning passes against DESIGN.md's admission rules;
the second replays random traces through ``core.simulate`` and checks what must
hold over time (budget, release exactly once, every job settled, no starvation).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from gpuwarden.core.ledger import Holding, HoldState, Ledger, compatible
from gpuwarden.core.model import GIB, MIB, Lane
from gpuwarden.core.policy import (
    Decision,
    GpuView,
    QueuedJob,
    Refuse,
    Snapshot,
    Start,
    Wait,
    fits_soonest_key,
    never_fits,
    order,
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

NOW = 1_000_000.0


def cpu(job_id: str, *, priority: int = 0, seq: int = 0) -> QueuedJob:
    return QueuedJob(job_id, "echo.echo", Lane.CPU, 0, priority, seq)


def vram(
    job_id: str,
    gib: float,
    *,
    priority: int = 0,
    seq: int = 0,
    coresident: bool = False,
    warm: bool = False,
    type: str = "llm.chat",
) -> QueuedJob:
    return QueuedJob(job_id, type, Lane.VRAM, int(gib * GIB), priority, seq, coresident, warm)


def co(job_id: str, gib: float, *, seq: int = 0, priority: int = 0) -> QueuedJob:
    return vram(job_id, gib, seq=seq, priority=priority, coresident=True, type="embed.embed")


def held(
    job_id: str,
    gib: float,
    *,
    coresident: bool = False,
    state: HoldState = HoldState.RUNNING,
    type: str | None = None,
    since: float = 0.0,
    expected_end: float | None = None,
    backfill_for: str | None = None,
) -> Holding:
    t = type or ("embed.embed" if coresident else "llm.chat")
    return Holding(
        f"{job_id}/1",
        t,
        int(gib * GIB),
        coresident,
        state,
        job_id,
        since=since,
        expected_end=expected_end,
        backfill_for=backfill_for,
    )


def gpu(
    uuid: str,
    total_gib: float,
    *holdings: Holding,
    reserve_gib: float = 0,
    foreign_gib: float = 0,
    degraded: str = "",
) -> GpuView:
    return GpuView(
        uuid,
        int(total_gib * GIB),
        int(reserve_gib * GIB),
        int(foreign_gib * GIB),
        tuple(holdings),
        degraded,
    )


def snap(
    *jobs: QueuedJob,
    gpus: Sequence[GpuView] = (),
    running_cpu: int = 0,
    cpu_slots: int = 4,
    accepting: bool = True,
    vram_paused: str = "",
) -> Snapshot:
    return Snapshot(tuple(jobs), tuple(gpus), running_cpu, cpu_slots, accepting, vram_paused)


def by_id(decisions: Sequence[Decision]) -> dict[str, Decision]:
    out = {d.job_id: d for d in decisions}
    assert len(out) == len(decisions), "a job got more than one decision"
    return out


def wait_of(decisions: Sequence[Decision], job_id: str) -> Wait:
    d = by_id(decisions)[job_id]
    assert isinstance(d, Wait), d
    return d


# --- ordering --------------------------------------------------------------------------


def test_order_priority_then_warm_then_arrival() -> None:
    jobs = (
        vram("cold-early", 1, seq=1),
        vram("warm-late", 1, seq=9, warm=True),
        vram("urgent-cold", 1, priority=5, seq=20),
        vram("urgent-warm", 1, priority=5, seq=30, warm=True),
        vram("cold-first", 1, seq=0),
        vram("low-warm", 1, priority=-1, seq=0, warm=True),
    )
    assert [j.id for j in order(jobs)] == [
        "urgent-warm",
        "urgent-cold",
        "warm-late",
        "cold-first",
        "cold-early",
        "low-warm",
    ]


def test_decisions_come_in_order() -> None:
    decisions = plan(
        snap(cpu("late", seq=9), cpu("urgent", priority=10, seq=10), cpu("early", seq=1)), NOW
    )
    assert [d.job_id for d in decisions] == ["urgent", "early", "late"]
    assert all(isinstance(d, Start) for d in decisions)


def test_the_one_gpu_goes_to_the_higher_priority() -> None:
    decisions = by_id(
        plan(
            snap(vram("low", 10, seq=0), vram("high", 10, priority=1, seq=5), gpus=[gpu("G", 16)]),
            NOW,
        )
    )
    assert decisions["high"] == Start("high", "G")
    assert isinstance(decisions["low"], Wait)


def test_the_one_gpu_goes_to_the_warm_job_among_equal_priority() -> None:
    decisions = by_id(
        plan(
            snap(vram("cold", 10, seq=0), vram("warm", 10, seq=5, warm=True), gpus=[gpu("G", 16)]),
            NOW,
        )
    )
    assert decisions["warm"] == Start("warm", "G")
    assert isinstance(decisions["cold"], Wait)


def test_the_one_gpu_goes_to_the_earliest_of_equal_priority() -> None:
    decisions = by_id(
        plan(snap(vram("second", 1, seq=2), vram("first", 1, seq=1), gpus=[gpu("G", 8)]), NOW)
    )
    assert decisions["first"] == Start("first", "G")
    assert isinstance(decisions["second"], Wait)


# --- cpu lane --------------------------------------------------------------------------


def test_cpu_slots_limit() -> None:
    jobs = [cpu(f"j{i}", seq=i) for i in range(4)]
    assert plan(snap(*jobs, running_cpu=1, cpu_slots=3), NOW) == [
        Start("j0", None),
        Start("j1", None),
        Wait("j2", "all 3 cpu slots are in use"),
        Wait("j3", "all 3 cpu slots are in use"),
    ]


def test_the_one_free_cpu_slot_goes_to_the_highest_priority() -> None:
    decisions = by_id(
        plan(snap(cpu("low", seq=1), cpu("high", priority=1, seq=2), cpu_slots=1), NOW)
    )
    assert decisions["high"] == Start("high", None)
    assert decisions["low"] == Wait("low", "all 1 cpu slots are in use")


def test_cpu_jobs_never_take_a_gpu_and_vram_jobs_no_cpu_slot() -> None:
    decisions = plan(
        snap(vram("v1", 1), co("v2", 1, seq=1), cpu("c", seq=2), gpus=[gpu("G", 8)], cpu_slots=1),
        NOW,
    )
    assert by_id(decisions)["v1"] == Start("v1", "G")
    assert isinstance(by_id(decisions)["v2"], Wait)  # v1 needs G to itself
    assert by_id(decisions)["c"] == Start("c", None)


def test_cpu_jobs_go_on_while_vram_is_paused_or_gpus_degraded() -> None:
    decisions = plan(
        snap(
            vram("a", 1), cpu("c", seq=1), gpus=[gpu("G", 80)], vram_paused="the GPU probe failed"
        ),
        NOW,
    )
    assert decisions == [
        Wait("a", "VRAM admission is paused: the GPU probe failed"),
        Start("c", None),
    ]
    decisions = plan(
        snap(vram("a", 1), cpu("c", seq=1), gpus=[gpu("G", 80, degraded="xid 79")]), NOW
    )
    assert by_id(decisions)["c"] == Start("c", None)


# --- budget ----------------------------------------------------------------------------


def test_gpu_view_budget_arithmetic() -> None:
    g = gpu("G", 24, held("a", 8, coresident=True), reserve_gib=1, foreign_gib=3)
    assert g.capacity == 20 * GIB
    assert g.held_bytes == 8 * GIB
    assert g.free_bytes == 12 * GIB
    over = gpu("G", 8, held("a", 6, coresident=True), foreign_gib=5)
    assert over.capacity == 3 * GIB
    assert over.free_bytes == 0  # never negative
    assert gpu("G", 8, foreign_gib=9).capacity == 0


def test_budget_is_total_minus_reserve_minus_foreign_minus_ledger() -> None:
    g = gpu("G", 24, held("a", 8, coresident=True), reserve_gib=1, foreign_gib=3)
    assert plan(snap(co("fits", 12), gpus=[g]), NOW) == [Start("fits", "G")]
    one_byte_more = QueuedJob("over", "embed.embed", Lane.VRAM, 12 * GIB + 1, 0, 0, True)
    decision = plan(snap(one_byte_more, gpus=[g]), NOW)[0]
    assert isinstance(decision, Wait)


def test_wait_reason_names_the_holders_the_foreign_memory_and_the_reserve() -> None:
    g = gpu("G", 24, held("a", 8, coresident=True), reserve_gib=1, foreign_gib=3)
    reason = plan(snap(co("big", 14), gpus=[g]), NOW)[0].reason  # type: ignore[union-attr]
    assert reason.startswith("needs 14.0 GiB on one GPU; G has 12.0 GiB free: ")
    assert "8.0 GiB held by embed.embed (a), running" in reason
    assert "3.0 GiB by other processes" in reason
    assert "1.0 GiB kept in reserve" in reason


def test_small_footprints_are_shown_in_mib() -> None:
    job = QueuedJob("a", "t", Lane.VRAM, 300 * MIB, 0, 0)
    assert plan(snap(job), NOW) == [Wait("a", "needs 300 MiB on one GPU; this node has no GPU")]


def test_starts_in_one_pass_count_against_the_budget() -> None:
    decisions = plan(
        snap(co("a", 10, seq=0), co("b", 10, seq=1), co("c", 6, seq=2), gpus=[gpu("G", 16)]), NOW
    )
    d = by_id(decisions)
    assert d["a"] == Start("a", "G")
    assert isinstance(d["b"], Wait)
    assert "G has 6.0 GiB free: 10.0 GiB held by embed.embed (a)" in d["b"].reason
    # b holds G back (first blocked), and c (6 GiB) beside b (10) fits G's 16: it may go
    assert d["c"] == Start("c", "G", backfill_for="b")


# --- best fit, and two GPUs never add up ------------------------------------------------


def test_best_fit_among_gpus() -> None:
    gpus = [gpu("G-big", 30), gpu("G-small", 10), gpu("G-mid", 20)]
    assert plan(snap(vram("a", 8), gpus=gpus), NOW) == [Start("a", "G-small")]
    assert plan(snap(vram("b", 15), gpus=gpus), NOW) == [Start("b", "G-mid")]
    assert plan(snap(vram("c", 25), gpus=gpus), NOW) == [Start("c", "G-big")]


def test_best_fit_counts_what_is_held() -> None:
    gpus = [
        gpu("G0", 24, held("x", 4, coresident=True)),
        gpu("G1", 24, held("y", 14, coresident=True)),
    ]
    # 20 GiB free on G0, 10 on G1: a 9 GiB co-resident job leaves least unused on G1
    assert plan(snap(co("a", 9), gpus=gpus), NOW) == [Start("a", "G1")]


def test_best_fit_ties_break_by_uuid() -> None:
    assert plan(snap(vram("a", 8), gpus=[gpu("G-b", 16), gpu("G-a", 16)]), NOW) == [
        Start("a", "G-a")
    ]


def test_best_fit_over_several_jobs() -> None:
    gpus = [gpu("G-big", 30), gpu("G-small", 10), gpu("G-mid", 20)]
    decisions = plan(
        snap(vram("x", 8, seq=1), vram("y", 12, seq=2), vram("z", 25, seq=3), gpus=gpus), NOW
    )
    assert decisions == [Start("x", "G-small"), Start("y", "G-mid"), Start("z", "G-big")]


def test_free_memory_on_two_gpus_never_adds_up() -> None:
    gpus = [
        gpu("G0", 24, held("x", 14, coresident=True)),
        gpu("G1", 24, held("y", 14, coresident=True)),
    ]
    d = wait_of(plan(snap(co("a", 16), gpus=gpus), NOW), "a")
    assert d.reason.startswith("needs 16.0 GiB on one GPU; ")
    assert "G0 has 10.0 GiB free" in d.reason
    assert "G1 has 10.0 GiB free" in d.reason


def test_no_gpus() -> None:
    assert plan(snap(vram("a", 2), cpu("c", seq=1)), NOW) == [
        Wait("a", "needs 2.0 GiB on one GPU; this node has no GPU"),
        Start("c", None),
    ]


# --- co-residence ----------------------------------------------------------------------


def test_coresident_jobs_share_a_gpu() -> None:
    g = gpu("G", 24, held("x", 8, coresident=True), held("y", 4, coresident=True))
    assert plan(snap(co("a", 6), gpus=[g]), NOW) == [Start("a", "G")]


def test_a_coresident_job_never_joins_an_exclusive_holder() -> None:
    g = gpu("G", 80, held("x", 8, coresident=False))
    d = wait_of(plan(snap(co("a", 1), gpus=[g]), NOW), "a")
    assert "G is held by llm.chat (x), running, which does not share its GPU" in d.reason


def test_an_exclusive_job_never_joins_anyone() -> None:
    g = gpu("G", 80, held("x", 1, coresident=True))
    d = wait_of(plan(snap(vram("a", 1), gpus=[g]), NOW), "a")
    assert (
        "G is not empty (embed.embed (x), running) and llm.chat needs a GPU to itself" in d.reason
    )
    g2 = gpu("G", 80, held("x", 1, coresident=False))
    assert isinstance(plan(snap(vram("a", 1), gpus=[g2]), NOW)[0], Wait)


def test_an_exclusive_job_takes_an_empty_gpu_over_a_shared_one_with_room() -> None:
    gpus = [gpu("G0", 80, held("x", 1, coresident=True)), gpu("G1", 24)]
    assert plan(snap(vram("a", 10), gpus=gpus), NOW) == [Start("a", "G1")]


def test_co_residence_holds_for_starts_in_the_same_pass() -> None:
    decisions = plan(snap(vram("excl", 2, seq=0), co("c", 2, seq=1), gpus=[gpu("G", 80)]), NOW)
    assert decisions[0] == Start("excl", "G")
    assert isinstance(decisions[1], Wait)
    assert "does not share its GPU" in decisions[1].reason
    decisions = plan(snap(co("c", 2, seq=0), vram("excl", 2, seq=1), gpus=[gpu("G", 80)]), NOW)
    assert decisions[0] == Start("c", "G")
    assert isinstance(decisions[1], Wait)
    assert "needs a GPU to itself" in decisions[1].reason


def test_reclaim_gate_reclaiming_memory_blocks_an_exclusive_job() -> None:
    ended = held("x", 2, coresident=True, state=HoldState.RECLAIMING)
    d = wait_of(plan(snap(vram("a", 4), gpus=[gpu("G", 80, ended)]), NOW), "a")
    assert "ended, its memory not yet shown free" in d.reason
    assert "needs a GPU to itself" in d.reason


def test_reclaim_gate_an_exclusive_holder_still_reclaiming_blocks_everyone() -> None:
    ended = held("x", 2, coresident=False, state=HoldState.RECLAIMING)
    d = wait_of(plan(snap(co("a", 4), gpus=[gpu("G", 80, ended)]), NOW), "a")
    assert (
        "llm.chat (x), ended, its memory not yet shown free, which does not share its GPU"
        in d.reason
    )


def test_reclaiming_coresident_memory_still_counts_but_does_not_block_a_coresident_job() -> None:
    ended = held("x", 20, coresident=True, state=HoldState.RECLAIMING)
    assert plan(snap(co("a", 4), gpus=[gpu("G", 24, ended)]), NOW) == [Start("a", "G")]
    d = wait_of(plan(snap(co("b", 5), gpus=[gpu("G", 24, ended)]), NOW), "b")
    assert "G has 4.0 GiB free: 20.0 GiB held by embed.embed (x), ended" in d.reason


def test_a_warm_coresident_server_is_a_holder_like_any_other() -> None:
    warm = held("w", 6, coresident=True, state=HoldState.WARM, type="embed.embed")
    assert plan(snap(co("a", 4), gpus=[gpu("G", 24, warm)]), NOW) == [Start("a", "G")]
    assert isinstance(plan(snap(vram("b", 4), gpus=[gpu("G", 24, warm)]), NOW)[0], Wait)


# --- reservation -----------------------------------------------------------------------


def test_the_first_blocked_job_holds_back_a_gpu() -> None:
    g = gpu("G", 24, held("x", 10, coresident=True))
    d = wait_of(plan(snap(vram("head", 20), gpus=[g]), NOW), "head")
    assert d.reserved_gpu == "G"
    assert d.reason.endswith("G is held back for it until it fits")


def test_a_later_job_may_not_start_where_it_could_delay_the_head() -> None:
    g = gpu("G", 24, held("x", 10, coresident=True))
    decisions = plan(snap(vram("head", 20, seq=0), co("small", 2, seq=1), gpus=[g]), NOW)
    small = wait_of(decisions, "small")
    assert small.reserved_gpu is None
    assert "G is held back for job head, which waits for it and must not be delayed" in small.reason


def test_a_later_job_may_start_beside_a_coresident_head_when_both_fit() -> None:
    g = gpu("G", 24, held("x", 12, coresident=True))
    decisions = plan(snap(co("head", 16, seq=0), co("small", 4, seq=1), gpus=[g]), NOW)
    assert wait_of(decisions, "head").reserved_gpu == "G"
    assert by_id(decisions)["small"] == Start("small", "G", backfill_for="head")  # 4 + 16 <= 24


def test_a_later_job_may_not_start_beside_a_coresident_head_when_both_do_not_fit() -> None:
    g = gpu("G", 24, held("x", 12, coresident=True))
    decisions = plan(snap(co("head", 16, seq=0), co("mid", 10, seq=1), gpus=[g]), NOW)
    assert "held back for job head" in wait_of(decisions, "mid").reason  # 10 + 16 > 24


def test_an_exclusive_later_job_never_starts_on_the_reserved_gpu() -> None:
    # the head is co-resident and waits for room; the GPU is empty of anything else
    g = gpu("G", 24, held("x", 12, coresident=True))
    decisions = plan(snap(co("head", 16, seq=0), vram("excl", 1, seq=1), gpus=[g]), NOW)
    assert isinstance(by_id(decisions)["excl"], Wait)


def test_later_jobs_start_freely_on_other_gpus() -> None:
    gpus = [
        gpu("G0", 24, held("x", 12, coresident=True)),
        gpu("G1", 24, held("y", 14, coresident=True)),
    ]
    decisions = plan(snap(vram("head", 20, seq=0), co("small", 8, seq=1), gpus=gpus), NOW)
    assert wait_of(decisions, "head").reserved_gpu == "G0"  # the one with less held
    assert by_id(decisions)["small"] == Start("small", "G1")


def test_reservation_goes_where_the_least_is_held_among_gpus_big_enough() -> None:
    gpus = [
        gpu("G-small", 16),  # too small for the head: never reserved
        gpu("G0", 40, held("x", 30, coresident=True)),
        gpu("G1", 40, held("y", 25, coresident=True)),
        gpu("G2", 40, held("z", 1, coresident=False), degraded="xid 79"),  # degraded: skipped
    ]
    d = wait_of(plan(snap(vram("head", 20), gpus=gpus), NOW), "head")
    assert d.reserved_gpu == "G1"


def test_only_the_first_blocked_jobs_hold_back_a_gpu() -> None:
    """Issue 14: a GPU is held back for the head of the queue only (or the first
    ``max_reservations`` blocked jobs), never one per blocked job until every card
    is held and drains while shared jobs wait."""
    gpus = [
        gpu("G0", 24, held("x", 10, coresident=True)),
        gpu("G1", 24, held("y", 12, coresident=True)),
        gpu("G2", 24, held("z", 14, coresident=True)),
    ]
    jobs = (
        vram("h1", 20, seq=0),
        vram("h2", 20, seq=1),  # the same class as h1: waits behind it
        vram("h3", 18, seq=2, type="llm.other"),
        co("small", 4, seq=3),
    )
    decisions = plan(snap(*jobs, gpus=gpus), NOW)
    assert wait_of(decisions, "h1").reserved_gpu == "G0"
    for later in ("h2", "h3"):
        assert wait_of(decisions, later).reserved_gpu is None
    assert "G0 is not empty" in wait_of(decisions, "h2").reason
    # the shared job may use the GPUs nobody holds back (the tightest fit of them)
    assert by_id(decisions)["small"] == Start("small", "G2")

    two = plan(dataclasses.replace(snap(*jobs, gpus=gpus), max_reservations=2), NOW)
    assert wait_of(two, "h1").reserved_gpu == "G0"
    assert wait_of(two, "h2").reserved_gpu is None  # same class: the head holds for it
    assert wait_of(two, "h3").reserved_gpu == "G1"
    assert by_id(two)["small"] == Start("small", "G2")


def test_the_held_gpu_is_the_one_where_the_fewest_jobs_must_end() -> None:
    """Issue 14: the GPU it fits soonest, not the one with the least memory held: a
    whole-card job waits for every holder to end, and each is a wait of its own."""
    gpus = [
        gpu("G0", 24, held("a", 2, coresident=True), held("b", 2, coresident=True)),
        gpu("G1", 24, held("c", 10, coresident=True)),
    ]
    d = wait_of(plan(snap(vram("head", 20), gpus=gpus), NOW), "head")
    assert d.reserved_gpu == "G1"  # one job to wait for, not two (though 10 GiB > 4)


def test_the_held_gpu_counts_only_the_jobs_that_must_end_for_a_shared_head() -> None:
    # G0: ending its youngest 6 GiB job leaves room for 10 GiB beside the others;
    # on G1 one job must end as well, but it is the older: likely to run longer
    gpus = [
        gpu(
            "G0",
            24,
            held("x1", 6, coresident=True, since=NOW - 300),
            held("x2", 6, coresident=True, since=NOW - 200),
            held("x3", 6, coresident=True, since=NOW - 5),
        ),
        gpu("G1", 24, held("y1", 16, coresident=True, since=NOW - 100)),
    ]
    d = wait_of(plan(snap(co("head", 10), gpus=gpus), NOW), "head")
    assert d.reserved_gpu == "G0"  # though it holds more (18 GiB against 16)
    assert fits_soonest_key(co("head", 10), 24 * GIB, list(gpus[0].holdings)) == (1, -(NOW - 5))
    assert fits_soonest_key(co("head", 10), 24 * GIB, list(gpus[1].holdings)) == (1, -(NOW - 100))


def test_the_held_gpu_among_equal_counts_is_the_one_whose_jobs_are_youngest() -> None:
    """Run times are heavy-tailed: a job that has run long is likely to run long yet."""
    gpus = [
        gpu("G0", 24, held("old", 4, coresident=True, since=NOW - 3600)),
        gpu("G1", 24, held("young", 12, coresident=True, since=NOW - 60)),
    ]
    d = wait_of(plan(snap(vram("head", 20), gpus=gpus), NOW), "head")
    assert d.reserved_gpu == "G1"


def test_memory_being_reclaimed_is_no_job_to_wait_for() -> None:
    gpus = [
        gpu("G0", 24, held("a", 2, coresident=True)),
        gpu("G1", 24, held("b", 20, state=HoldState.RECLAIMING)),
    ]
    d = wait_of(plan(snap(vram("head", 20), gpus=gpus), NOW), "head")
    assert d.reserved_gpu == "G1"  # nothing runs there: it fits once the memory shows free


def test_jobs_started_beside_the_head_do_not_count_against_its_gpu() -> None:
    # s1 started beside the head on G0 in an earlier pass: it fits with the head, so
    # only x must end there, as y on G1; x is the younger, so G0 stays held back
    gpus = [
        gpu(
            "G0",
            24,
            held("x", 12, coresident=True, since=NOW - 50),
            held("s1", 4, coresident=True, since=NOW - 1, backfill_for="head"),
        ),
        gpu("G1", 24, held("y", 14, coresident=True, since=NOW - 60)),
    ]
    head = co("head", 16)
    assert fits_soonest_key(head, 24 * GIB, list(gpus[0].holdings)) == (1, -(NOW - 50))
    d = wait_of(plan(snap(head, gpus=gpus), NOW), "head")
    assert d.reserved_gpu == "G0"  # (counting s1 as a job to wait for, G1 would be)


def test_a_job_keeps_the_gpu_held_back_for_it_in_the_previous_pass() -> None:
    """Once a GPU drains for a job it stays held back for it, though another GPU, on
    which new jobs keep starting, may look sooner: trading it away would start the
    drain again, pass after pass (see ``test_no_starvation_without_the_memory``)."""
    gpus = [
        gpu("G0", 24, held("young", 12, coresident=True, since=NOW - 1)),
        gpu("G1", 24, held("old", 12, coresident=True, since=NOW - 3600)),
    ]
    fresh = snap(vram("head", 20), gpus=gpus)
    assert wait_of(plan(fresh, NOW), "head").reserved_gpu == "G0"
    kept = dataclasses.replace(fresh, held_back=(("head", "G1"), ("gone", "G0")))
    assert wait_of(plan(kept, NOW), "head").reserved_gpu == "G1"
    # a GPU that can no longer be held back for it is traded for the soonest
    gpus[1] = dataclasses.replace(gpus[1], degraded="xid 79")
    lost = dataclasses.replace(kept, gpus=tuple(gpus))
    assert wait_of(plan(lost, NOW), "head").reserved_gpu == "G0"
    # and a higher-priority job that cannot start takes the reservation over
    urgent = vram("urgent", 20, priority=5, seq=1, type="llm.other")
    over = dataclasses.replace(kept, queued=(*kept.queued, urgent))
    decisions = plan(over, NOW)
    assert wait_of(decisions, "urgent").reserved_gpu == "G0"
    assert wait_of(decisions, "head").reserved_gpu is None


def test_a_held_gpu_takes_a_shared_job_expected_to_end_before_the_head_fits() -> None:
    """A GPU held back for a whole-card job still takes a shared job that cannot
    delay it: one whose run-time estimate ends before the holder there is expected
    to end. One that may end later waits."""
    g = gpu("G", 24, held("x", 10, coresident=True, expected_end=NOW + 100))
    quick = dataclasses.replace(co("quick", 4, seq=1), expected_s=50.0)
    slow = dataclasses.replace(co("slow", 4, seq=2), type="embed.slow", expected_s=200.0)
    unknown = dataclasses.replace(co("unknown", 4, seq=3), type="embed.new")
    decisions = plan(snap(vram("head", 20, seq=0), quick, slow, unknown, gpus=[g]), NOW)
    assert wait_of(decisions, "head").reserved_gpu == "G"
    assert by_id(decisions)["quick"] == Start("quick", "G")
    assert "held back for job head" in wait_of(decisions, "slow").reason
    assert "held back for job head" in wait_of(decisions, "unknown").reason


def test_a_higher_priority_job_is_not_held_back_by_a_lower_ones_reservation() -> None:
    # one pass: the urgent job comes first in order, so no reservation binds it
    g = gpu("G", 24, held("x", 10, coresident=True))
    decisions = plan(
        snap(vram("head", 20, seq=0), co("urgent", 4, seq=1, priority=9), gpus=[g]), NOW
    )
    assert by_id(decisions)["urgent"] == Start("urgent", "G")


def test_backfilled_jobs_together_must_not_delay_the_head() -> None:
    """POLICY BUG (policy.py ``_cannot_delay``): each backfill is checked alone
    (``job + head <= capacity``), never with the other backfills on that GPU. Here
    s1 and s2 (6 GiB each) both start beside a 16 GiB co-resident head on a 24 GiB
    GPU: once x ends, 12 GiB are held by them and the head (16) still does not fit,
    so it waits for them too. Over passes a stream of such jobs starves the head
    (see ``test_no_starvation_a_stream_of_small_coresident_jobs``)."""
    g = gpu("G", 24, held("x", 12, coresident=True))
    decisions = plan(
        snap(co("head", 16, seq=0), co("s1", 6, seq=1), co("s2", 6, seq=2), gpus=[g]), NOW
    )
    started = [d.job_id for d in decisions if isinstance(d, Start)]
    backfilled = sum(6 for _ in started)
    assert backfilled + 16 <= 24, f"{started} start beside the head and together delay it"


# --- refusal, degraded, paused ---------------------------------------------------------


def test_refused_when_bigger_than_every_gpu_less_its_reserve() -> None:
    gpus = [gpu("G0", 24, reserve_gib=1), gpu("G1", 16)]
    d = by_id(plan(snap(vram("big", 23.5), gpus=gpus), NOW))["big"]
    assert isinstance(d, Refuse)
    assert "needs 23.5 GiB on one GPU, more than any GPU here offers" in d.reason
    assert "the largest has 23.0 GiB after the reserve" in d.reason
    assert "can never run on this node" in d.reason
    assert plan(snap(vram("exact", 23), gpus=gpus), NOW) == [Start("exact", "G0")]


def test_foreign_memory_makes_a_job_wait_never_refused() -> None:
    g = gpu("G", 24, foreign_gib=20)
    d = wait_of(plan(snap(vram("a", 10), gpus=[g]), NOW), "a")
    assert "20.0 GiB by other processes" in d.reason
    assert d.reserved_gpu is None  # it cannot fit while the foreign memory stays


def test_a_refused_job_holds_nothing_back() -> None:
    decisions = plan(
        snap(vram("huge", 100, seq=0), co("small", 2, seq=1), gpus=[gpu("G", 24)]), NOW
    )
    assert isinstance(by_id(decisions)["huge"], Refuse)
    assert by_id(decisions)["small"] == Start("small", "G")


def test_never_fits() -> None:
    assert never_fits(10 * GIB, []) is None
    assert never_fits(10 * GIB, [gpu("G", 10)]) is None
    assert never_fits(10 * GIB, [gpu("G", 10, reserve_gib=1)]) is not None


def test_degraded_gpu_is_skipped_with_its_reason() -> None:
    gpus = [gpu("G0", 80, degraded="the reclaim gate timed out"), gpu("G1", 24)]
    assert plan(snap(vram("a", 10), gpus=gpus), NOW) == [Start("a", "G1")]
    d = wait_of(plan(snap(vram("a", 30), gpus=gpus), NOW), "a")
    assert "G0 is degraded (the reclaim gate timed out)" in d.reason
    assert d.reserved_gpu is None


def test_vram_paused_makes_every_vram_job_wait() -> None:
    decisions = plan(snap(vram("a", 1), gpus=[gpu("G", 80)], vram_paused="NVML not found"), NOW)
    assert decisions == [Wait("a", "VRAM admission is paused: NVML not found")]


def test_not_accepting_means_everything_waits() -> None:
    decisions = plan(snap(cpu("c"), vram("v", 1, seq=1), gpus=[gpu("G", 80)], accepting=False), NOW)
    assert decisions == [
        Wait("c", "the broker is shutting down"),
        Wait("v", "the broker is shutting down"),
    ]


def test_empty_queue() -> None:
    assert plan(snap(gpus=[gpu("G", 8)]), NOW) == []


def test_plan_is_deterministic_and_ignores_now() -> None:
    s = snap(
        vram("a", 3, seq=2), cpu("b", seq=1), co("c", 3, seq=0), gpus=[gpu("G", 8), gpu("H", 8)]
    )
    assert plan(s, NOW) == plan(s, NOW + 3600)


def test_snapshot_gpus_json_round_trip() -> None:
    g = gpu("G", 24, held("x", 2, coresident=True), reserve_gib=1, foreign_gib=3, degraded="d")
    s = snap(gpus=[g])
    assert [GpuView.from_json(d) for d in s.gpus_json()] == [g]


# --- one planning pass against the rules, on random snapshots ---------------------------


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    gpus = []
    for i in range(draw(st.integers(0, 3))):
        total = draw(st.sampled_from([8, 16, 24, 40]))
        holdings = tuple(
            held(
                f"h{i}{k}",
                draw(st.sampled_from([1, 2, 4, 8])),
                coresident=draw(st.booleans()),
                state=draw(st.sampled_from(list(HoldState))),
                since=draw(st.sampled_from([0.0, NOW - 100, NOW - 10])),
            )
            for k in range(draw(st.integers(0, 3)))
        )
        gpus.append(
            gpu(
                f"G{i}",
                total,
                *holdings,
                reserve_gib=draw(st.sampled_from([0, 1])),
                foreign_gib=draw(st.sampled_from([0, 0, 3])),
                degraded=draw(st.sampled_from(["", "", "", "lost"])),
            )
        )
    jobs = []
    for i in range(draw(st.integers(0, 10))):
        if draw(st.integers(0, 5)) == 0:
            jobs.append(cpu(f"j{i}", priority=draw(st.integers(0, 2)), seq=i))
        else:
            jobs.append(
                vram(
                    f"j{i}",
                    draw(st.sampled_from([1, 2, 3, 6, 9, 14, 20, 30, 50])),
                    priority=draw(st.integers(0, 2)),
                    seq=draw(st.integers(0, 20)),
                    coresident=draw(st.booleans()),
                    warm=draw(st.booleans()),
                )
            )
    cpu_slots = draw(st.integers(1, 4))
    s = snap(
        *jobs,
        gpus=gpus,
        running_cpu=draw(st.integers(0, cpu_slots + 1)),
        cpu_slots=cpu_slots,
        accepting=draw(st.sampled_from([True, True, True, False])),
        vram_paused=draw(st.sampled_from(["", "", "", "probe failed"])),
    )
    return dataclasses.replace(s, max_reservations=draw(st.sampled_from([1, 1, 0, 2, 3])))


@settings(max_examples=300, deadline=None)
@given(s=snapshots())
def test_one_pass_follows_the_rules(s: Snapshot) -> None:
    decisions = plan(s, NOW)
    jobs = {j.id: j for j in s.queued}
    assert [d.job_id for d in decisions] == [j.id for j in order(s.queued)]
    # replay the pass: what each GPU holds, and who holds it back, as decided so far
    holdings = {g.uuid: list(g.holdings) for g in s.gpus}
    view = {g.uuid: g for g in s.gpus}
    reserved: dict[str, QueuedJob] = {}
    cpu_free = s.cpu_slots - s.running_cpu
    for d in decisions:
        job = jobs[d.job_id]
        if isinstance(d, Wait | Refuse):
            assert d.reason
        if not s.accepting:
            assert isinstance(d, Wait)
            continue
        if job.lane is Lane.CPU:
            assert not isinstance(d, Refuse)
            assert isinstance(d, Start) == (cpu_free > 0)
            if isinstance(d, Start):
                assert d.gpu_uuid is None
                cpu_free -= 1
            continue
        if s.vram_paused:
            assert isinstance(d, Wait)
            continue
        too_big = bool(s.gpus) and all(
            job.vram_bytes > g.total_bytes - g.reserve_bytes for g in s.gpus
        )
        assert isinstance(d, Refuse) == too_big
        if isinstance(d, Start):
            assert d.gpu_uuid is not None
            g = view[d.gpu_uuid]
            assert not g.degraded
            assert job.vram_bytes <= g.capacity - sum(h.bytes for h in holdings[g.uuid])
            assert compatible(job.coresident, holdings[g.uuid])
            head = reserved.get(g.uuid)
            if head is not None:  # the rule as policy.py states it
                assert job.coresident and head.coresident
                assert job.vram_bytes + head.vram_bytes <= g.capacity
            holdings[g.uuid].append(
                Holding(
                    "new",
                    job.type,
                    job.vram_bytes,
                    job.coresident,
                    since=NOW,
                    backfill_for=d.backfill_for,
                )
            )
        elif isinstance(d, Wait):
            for g in s.gpus:  # no GPU could have taken it
                could = (
                    not g.degraded
                    and job.vram_bytes <= g.capacity - sum(h.bytes for h in holdings[g.uuid])
                    and compatible(job.coresident, holdings[g.uuid])
                    and g.uuid not in reserved
                )
                assert not could, f"{job.id} waits though {g.uuid} could take it"
            if d.reserved_gpu is not None:
                g = view[d.reserved_gpu]
                assert d.reserved_gpu not in reserved
                assert not g.degraded
                assert g.capacity >= job.vram_bytes
                # the GPU it fits soonest among those it could have had
                others = [
                    o
                    for o in s.gpus
                    if o.uuid not in reserved and not o.degraded and o.capacity >= job.vram_bytes
                ]

                def soonest(o: GpuView, job: QueuedJob = job) -> tuple[int, float, int, str]:
                    here = holdings[o.uuid]
                    key = fits_soonest_key(job, o.capacity, here)
                    return (*key, sum(h.bytes for h in here), o.uuid)

                assert min(others, key=soonest) is g
                # where it would fit once only memory being reclaimed is gone, it is
                # held back on such a GPU
                if any(soonest(o)[0] == 0 for o in others):
                    assert _fits_after_reclaim(job, g.capacity, holdings[g.uuid])
                reserved[d.reserved_gpu] = job
    # only the first few blocked jobs hold a GPU back
    assert len(reserved) <= s.max_reservations


def _fits_after_reclaim(job: QueuedJob, capacity: int, holdings: list[Holding]) -> bool:
    left = [h for h in holdings if h.state is not HoldState.RECLAIMING]
    return (
        compatible(job.coresident, left) and job.vram_bytes + sum(h.bytes for h in left) <= capacity
    )


# --- replayed through core.simulate ---------------------------------------------------


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


def gib(x: float) -> int:
    return int(x * GIB)


def test_sim_a_simple_run() -> None:
    trace = [
        TraceJob("a", "llm", 0.0, 10.0, gib(10)),
        TraceJob("b", "llm", 1.0, 10.0, gib(10)),
        TraceJob("c", "echo", 0.0, 3.0, lane=Lane.CPU),
    ]
    r = simulate([SimGpu("G", gib(24))], trace, plan)
    assert (r.jobs["a"].start_s, r.jobs["a"].end_s) == (0.0, 10.0)
    assert (r.jobs["b"].start_s, r.jobs["b"].end_s) == (10.0, 20.0)  # exclusive: after a
    assert r.jobs["c"].gpu is None
    assert r.makespan_s == 20.0
    assert r.model_loads == 2
    assert r.oom_crashes == 0
    assert r.outcomes() == Counter({Outcome.DONE: 3})
    assert sorted(r.completions) == [3.0, 10.0, 19.0]
    assert len(r.ledger) == 0


def test_sim_reclaim_delay_holds_back_an_exclusive_job() -> None:
    trace = [TraceJob("a", "llm", 0.0, 10.0, gib(10)), TraceJob("b", "llm", 1.0, 10.0, gib(10))]
    r = simulate([SimGpu("G", gib(24))], trace, plan, SimOptions(reclaim_delay_s=2.5))
    assert r.jobs["b"].start_s == 12.5


def test_sim_wait_reason_while_reclaiming() -> None:
    trace = [TraceJob("a", "llm", 0.0, 10.0, gib(10)), TraceJob("b", "llm", 10.0, 1.0, gib(1))]
    r = simulate(
        [SimGpu("G", gib(24))],
        trace,
        plan,
        SimOptions(reclaim_delay_s=5.0, record_history=True),
    )
    at_ten = [s for s in r.history if s.t == 10.0]
    assert at_ten and at_ten[0].holdings[0].state is HoldState.RECLAIMING
    assert r.jobs["b"].start_s == 15.0


def test_sim_oom_when_the_real_peak_exceeds_the_declaration() -> None:
    # two co-resident jobs, declared 10 GiB, really 14: the second crashes on load,
    # is retried (something else used the GPU) and runs once the first is gone
    trace = [
        TraceJob("a", "sd", 0.0, 10.0, gib(10), actual_peak_bytes=gib(14), coresident=True),
        TraceJob("b", "sd", 1.0, 10.0, gib(10), actual_peak_bytes=gib(14), coresident=True),
    ]
    opts = SimOptions(reclaim_delay_s=1.0, retry_delay_s=5.0, measure=False)
    r = simulate([SimGpu("G", gib(24))], trace, plan, opts)
    assert r.oom_crashes >= 1
    assert r.jobs["b"].oom_crashes == r.oom_crashes
    assert r.jobs["b"].outcome is Outcome.DONE
    assert r.model_loads == 2 + r.oom_crashes
    assert len(r.ledger) == 0


def test_sim_measuring_grows_the_holding_and_raises_the_footprint() -> None:
    # declared 10 GiB, really 14: a runs alone, so its peak raises the type's
    # footprint; b and c then do not both fit 24 GiB and nothing crashes
    trace = [
        TraceJob("a", "sd", 0.0, 10.0, gib(10), actual_peak_bytes=gib(14), coresident=True),
        TraceJob("b", "sd", 11.0, 10.0, gib(10), actual_peak_bytes=gib(14), coresident=True),
        TraceJob("c", "sd", 11.0, 10.0, gib(10), actual_peak_bytes=gib(14), coresident=True),
    ]
    ledger = CheckedLedger()
    opts = SimOptions(measure=True, record_history=True)
    r = simulate([SimGpu("G", gib(24))], trace, plan, opts, ledger=ledger)
    assert r.history[0].holdings[0].bytes == gib(14)  # the holding grew to the peak
    assert r.footprints == {"sd": gib(14)}
    assert r.oom_crashes == 0
    assert (r.jobs["b"].start_s, r.jobs["c"].start_s) == (11.0, 21.0)
    # without measuring, b and c load side by side and one of them crashes
    r = simulate([SimGpu("G", gib(24))], trace, plan, SimOptions(measure=False))
    assert r.oom_crashes >= 1


def test_sim_a_job_that_shared_its_gpu_does_not_raise_the_footprint() -> None:
    trace = [
        TraceJob("a", "sd", 0.0, 10.0, gib(8), actual_peak_bytes=gib(9), coresident=True),
        TraceJob("b", "emb", 1.0, 2.0, gib(2), coresident=True),
    ]
    r = simulate([SimGpu("G", gib(24))], trace, plan, SimOptions(measure=True))
    assert r.footprints == {}


def test_sim_oom_alone_fails_and_raises_the_footprint() -> None:
    trace = [
        TraceJob("a", "huge", 0.0, 10.0, gib(10), actual_peak_bytes=gib(30)),
        TraceJob("b", "huge", 5.0, 10.0, gib(10), actual_peak_bytes=gib(30)),
    ]
    r = simulate([SimGpu("G", gib(24))], trace, plan)
    assert r.jobs["a"].outcome is Outcome.FAILED
    assert "with the GPU to itself" in r.jobs["a"].reason
    assert r.jobs["a"].attempts == 1
    assert r.jobs["b"].outcome is Outcome.REFUSED
    assert "can never run on this node" in r.jobs["b"].reason


def test_sim_oom_retries_are_bounded() -> None:
    trace = [
        TraceJob("a", "x", 0.0, 100.0, gib(4), actual_peak_bytes=gib(20), coresident=True),
        TraceJob("b", "x", 1.0, 10.0, gib(4), actual_peak_bytes=gib(20), coresident=True),
    ]
    opts = SimOptions(max_retries=2, retry_delay_s=1.0, measure=False)
    r = simulate([SimGpu("G", gib(24))], trace, plan, opts)
    assert r.jobs["b"].outcome is Outcome.FAILED
    assert r.jobs["b"].attempts == 3
    assert "gave up after 3 attempts" in r.jobs["b"].reason


def test_sim_leak_degrades_the_gpu_for_good() -> None:
    trace = [
        TraceJob("a", "llm", 0.0, 10.0, gib(10), leak_bytes=gib(1)),
        TraceJob("b", "llm", 1.0, 10.0, gib(10)),
    ]
    ledger = CheckedLedger()
    opts = SimOptions(reclaim_delay_s=1.0, reclaim_timeout_s=30.0)
    r = simulate([SimGpu("G", gib(24))], trace, plan, opts, ledger=ledger)
    assert r.jobs["b"].outcome is Outcome.WAITING
    assert "degraded" in r.jobs["b"].reason
    assert "G" in r.degraded
    assert [h.holder for h in r.leaked] == ["a/1"]
    assert r.leaked[0].state is HoldState.RECLAIMING
    assert ledger.releases == Counter()


def test_sim_a_leak_on_one_gpu_leaves_the_others_working() -> None:
    trace = [
        TraceJob("a", "llm", 0.0, 10.0, gib(20), leak_bytes=gib(1)),
        TraceJob("b", "llm", 1.0, 10.0, gib(10)),
        TraceJob("c", "llm", 50.0, 10.0, gib(10)),
    ]
    r = simulate([SimGpu("G0", gib(24)), SimGpu("G1", gib(24))], trace, plan)
    assert r.jobs["a"].gpu == "G0"
    assert r.jobs["c"].gpu == "G1"
    assert r.outcomes()[Outcome.DONE] == 3


def test_sim_cancel_queued_and_running() -> None:
    trace = [
        TraceJob("run", "llm", 0.0, 100.0, gib(10), cancel_at_s=5.0),
        TraceJob("queued", "llm", 1.0, 10.0, gib(10), cancel_at_s=2.0),
        TraceJob("next", "llm", 3.0, 10.0, gib(10)),
        TraceJob("early", "llm", 9.0, 10.0, gib(10), cancel_at_s=4.0),
    ]
    r = simulate([SimGpu("G", gib(24))], trace, plan)
    assert (r.jobs["run"].outcome, r.jobs["run"].end_s) == (Outcome.CANCELLED, 5.0)
    assert r.jobs["queued"].outcome is Outcome.CANCELLED
    assert r.jobs["queued"].start_s is None
    assert r.jobs["early"].outcome is Outcome.CANCELLED
    assert r.jobs["next"].start_s == 5.0
    assert r.makespan_s == 15.0
    assert len(r.ledger) == 0


def test_sim_own_failure_is_not_retried() -> None:
    r = simulate([SimGpu("G", gib(8))], [TraceJob("a", "t", 0.0, 4.0, gib(1), fails=True)], plan)
    assert (r.jobs["a"].outcome, r.jobs["a"].attempts) == (Outcome.FAILED, 1)
    assert r.jobs["a"].completion_s == 4.0
    assert r.completions == []


def test_sim_foreign_memory_counts_until_it_goes() -> None:
    opts = SimOptions(foreign=(ForeignAlloc("G", 0.0, gib(20), end_s=30.0),))
    r = simulate([SimGpu("G", gib(24))], [TraceJob("a", "t", 1.0, 5.0, gib(8))], plan, opts)
    assert r.jobs["a"].start_s == 30.0


def test_sim_cpu_slots() -> None:
    trace = [TraceJob(f"c{i}", "echo", 0.0, 10.0, lane=Lane.CPU) for i in range(3)]
    r = simulate([], trace, plan, SimOptions(cpu_slots=2))
    assert sorted(j.start_s for j in r.jobs.values() if j.start_s is not None) == [0.0, 0.0, 10.0]


def test_sim_rejects_a_planner_that_breaks_the_protocol() -> None:
    trace = [TraceJob("a", "t", 0.0, 1.0, gib(1))]
    with pytest.raises(SimError, match="unknown GPU"):
        simulate([SimGpu("G", gib(8))], trace, lambda s, now: [Start("a", "nope")])
    with pytest.raises(SimError, match="not queued"):
        simulate([SimGpu("G", gib(8))], trace, lambda s, now: [Start("zzz", "G")])
    with pytest.raises(SimError, match="vram job"):
        simulate([SimGpu("G", gib(8))], trace, lambda s, now: [Start("a", None)])
    with pytest.raises(SimError, match="two trace jobs"):
        simulate([SimGpu("G", gib(8))], trace * 2, plan)


def test_sim_an_unbrokered_planner_crashes_jobs() -> None:
    def everything_now(s: Snapshot, now: float) -> list[Decision]:
        return [Start(j.id, s.gpus[0].uuid) for j in s.queued]

    trace = [TraceJob(f"j{i}", "t", float(i), 100.0, gib(10)) for i in range(4)]
    r = simulate([SimGpu("G", gib(24))], trace, everything_now, SimOptions(max_retries=0))
    assert r.oom_crashes == 2
    assert r.outcomes() == Counter({Outcome.DONE: 2, Outcome.FAILED: 2})


# --- properties over random traces -------------------------------------------------------


SIZES = [1, 2, 3, 6, 9, 14, 20]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[SimGpu], list[TraceJob], SimOptions]:
    gpus = [
        SimGpu(f"G{i}", gib(draw(st.sampled_from([8, 16, 24]))), gib(draw(st.sampled_from([0, 1]))))
        for i in range(draw(st.integers(1, 3)))
    ]
    leaks = draw(st.booleans())
    trace = []
    for i in range(draw(st.integers(1, 25))):
        arrival = draw(st.integers(0, 60)) / 2
        duration = draw(st.integers(1, 40)) / 2
        if draw(st.integers(0, 6)) == 0:
            trace.append(TraceJob(f"c{i}", "echo", arrival, duration, lane=Lane.CPU))
            continue
        declared = gib(draw(st.sampled_from([*SIZES, 30])))
        peak = draw(
            st.sampled_from([declared, declared, declared, declared // 2, declared * 5 // 4])
        )
        trace.append(
            TraceJob(
                f"j{i}",
                f"t{declared // GIB}",
                arrival,
                duration,
                declared,
                actual_peak_bytes=peak,
                coresident=draw(st.booleans()),
                priority=draw(st.sampled_from([0, 0, 5])),
                fails=draw(st.integers(0, 9)) == 0,
                leak_bytes=gib(0.5) if leaks and draw(st.integers(0, 7)) == 0 else 0,
                cancel_at_s=arrival + draw(st.integers(0, 40)) / 2
                if draw(st.integers(0, 7)) == 0
                else None,
            )
        )
    foreign = tuple(
        ForeignAlloc(
            draw(st.sampled_from(gpus)).uuid,
            draw(st.integers(0, 40)) / 2,
            gib(draw(st.sampled_from([1, 4, 10]))),
            end_s=60.0 + draw(st.integers(0, 20)),
        )
        for _ in range(draw(st.integers(0, 2)))
    )
    opts = SimOptions(
        reclaim_delay_s=draw(st.sampled_from([0.0, 0.5, 2.0])),
        reclaim_timeout_s=10.0,
        max_retries=draw(st.integers(0, 3)),
        retry_delay_s=draw(st.sampled_from([0.0, 1.0])),
        measure=draw(st.booleans()),
        foreign=foreign,
        cpu_slots=draw(st.integers(1, 3)),
        record_history=True,
    )
    return gpus, trace, opts


def check_settled(gpus: list[SimGpu], trace: list[TraceJob], r: SimResult) -> None:
    """(c) every job ended, was refused with a reason, or waits only for degraded GPUs."""
    leaks = any(t.leak_bytes for t in trace)
    for t in trace:
        rec = r.jobs[t.id]
        if rec.outcome in (Outcome.FAILED, Outcome.REFUSED):
            assert rec.reason, rec
        if rec.outcome is Outcome.REFUSED:
            need = max(t.vram_bytes, r.footprints.get(t.type, 0))
            assert all(need > g.total_bytes - g.reserve_bytes for g in gpus), rec
        if rec.outcome is Outcome.WAITING:
            assert leaks, f"{t.id} still waits with no leak anywhere: {rec.reason}"
            assert t.lane is Lane.VRAM
            need = max(t.vram_bytes, r.footprints.get(t.type, 0))
            usable = [g.uuid for g in gpus if g.total_bytes - g.reserve_bytes >= need]
            assert usable and all(u in r.degraded for u in usable), (rec, r.degraded)
            assert "degraded" in rec.reason, rec.reason


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_property_budget_release_and_settlement(
    scenario: tuple[list[SimGpu], list[TraceJob], SimOptions],
) -> None:
    gpus, trace, opts = scenario
    ledger = CheckedLedger()
    r = simulate(gpus, trace, plan, opts, ledger=ledger)

    # (a) whenever an attempt is admitted, the GPU's holdings fit its budget; with
    # honest footprints and no foreign memory, at every instant, and nothing crashes
    honest = not opts.foreign and all(t.peak_bytes <= t.vram_bytes for t in trace)
    for s in r.history:
        if s.started:
            assert s.admitted_bytes <= s.capacity, s
        if honest:
            assert s.held_bytes <= s.capacity, s
    if honest:
        assert r.oom_crashes == 0

    # (b) every holding is released exactly once, except memory never shown free,
    # which stays held (reclaiming) on a GPU marked degraded
    assert set(ledger.holds.values()) <= {1}
    assert set(ledger.releases.values()) <= {1}
    assert sum(ledger.holds.values()) == r.model_loads
    leaked = {h.holder for h in r.leaked}
    assert set(ledger.holds) == set(ledger.releases) | leaked
    assert not set(ledger.releases) & leaked
    for h in r.leaked:
        assert h.state is HoldState.RECLAIMING
        # (its job may have been retried after an OOM, and wait for that GPU now)
        t = next(t for t in trace if t.id == h.job_id)
        assert t.leak_bytes > 0
        assert ledger.gpu_of(h.holder) in r.degraded
    assert set(r.degraded) == {ledger.gpu_of(h) for h in leaked}

    # (c) every job is started or refused with a reason
    check_settled(gpus, trace, r)


def test_no_starvation_a_stream_of_small_coresident_jobs() -> None:
    """(d) POLICY BUG, the same as ``test_backfilled_jobs_together_must_not_delay_the_head``:
    a 16 GiB co-resident head arrives at 5.25 s behind a stream of 6 GiB co-resident
    jobs (one a second, 2.5 s each) on a 24 GiB GPU. Those running when it arrives
    are gone by 7.5 s, but each newcomer passes ``_cannot_delay`` alone (6 + 16 <= 24)
    and two or three always overlap, so the head only starts when the stream ends."""
    trace = [TraceJob(f"s{i}", "small", float(i), 2.5, gib(6), coresident=True) for i in range(60)]
    trace.insert(6, TraceJob("head", "big", 5.25, 10.0, gib(16), coresident=True))
    r = simulate([SimGpu("G", gib(24))], trace, plan)
    assert r.jobs["head"].start_s is not None
    assert r.jobs["head"].start_s <= 7.5, f"the head started at {r.jobs['head'].start_s}"


def test_no_starvation_an_exclusive_head_drains_its_gpu() -> None:
    trace = [TraceJob(f"s{i}", "small", float(i), 2.5, gib(6), coresident=True) for i in range(60)]
    trace.insert(6, TraceJob("head", "big", 5.25, 10.0, gib(16)))
    r = simulate([SimGpu("G", gib(24))], trace, plan, SimOptions(reclaim_delay_s=0.5))
    assert r.jobs["head"].start_s == 8.0  # s4, s5 end at 6.5, 7.5; reclaimed 0.5 s later


STREAM_S = 200.0


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # a long trace shrinks slowly
)
@given(
    size=st.integers(1, 6),
    duration=st.integers(2, 10).map(lambda n: n / 2),
    quarters=st.integers(1, 4),
    head_at=st.integers(2, 20).map(lambda n: n / 2 + 0.125),
    head_gib=st.integers(12, 22),
    head_coresident=st.booleans(),
    reclaim=st.sampled_from([0.0, 0.5]),
)
def test_property_no_starvation_behind_a_stream_of_smaller_jobs(
    size: int,
    duration: float,
    quarters: int,
    head_at: float,
    head_gib: int,
    head_coresident: bool,
    reclaim: float,
) -> None:
    """(d) A big job at equal priority starts within a bound set by the jobs that
    arrived before it, however long the stream of smaller ones after it lasts: one
    ``size`` GiB co-resident job every ``quarters/4 * duration`` s on a 24 GiB GPU,
    so that at least one always runs, for 200 s."""
    gap = quarters / 4 * duration
    trace: list[TraceJob] = []
    head = TraceJob("head", "big", head_at, 10.0, gib(head_gib), coresident=head_coresident)
    t = 0.0
    while t < STREAM_S:
        if t >= head_at and head not in trace[-1:] and trace[-1].arrival_s < head_at:
            trace.append(head)
        trace.append(TraceJob(f"s{len(trace)}", "small", t, duration, gib(size), coresident=True))
        t += gap
    r = simulate([SimGpu("G", gib(24))], trace, plan, SimOptions(reclaim_delay_s=reclaim))
    rec = r.jobs["head"]
    before = [t for t in trace if t.arrival_s < head_at]
    bound = head_at + (len(before) + 1) * (duration + reclaim)
    assert bound < STREAM_S - 20  # the stream outlasts the bound: a real check
    assert rec.start_s is not None
    assert rec.start_s <= bound, f"the head arrived at {head_at}, started at {rec.start_s}"


def _with_reservations(k: int) -> Callable[[Snapshot, float], list[Decision]]:
    def planner(snapshot: Snapshot, now: float) -> list[Decision]:
        return plan(dataclasses.replace(snapshot, max_reservations=k), now)

    return planner


def test_no_starvation_on_several_gpus_a_stream_of_shared_jobs() -> None:
    """(d) Issue 14: one GPU held back for the head (not every GPU) still drains for
    it. A 16 GiB whole-card job arrives at 5.25 s while 8 GiB shared jobs arrive
    every 0.5 s for 200 s (2.5 s each) on two 24 GiB GPUs: about five run at a time,
    so neither GPU empties by itself. Plain backfill (no reservation) starts the head
    only when the stream ends; with one reservation it starts once the jobs running
    on its GPU have ended and their memory is shown free."""
    trace = [TraceJob(f"s{i}", "small", i * 0.5, 2.5, gib(8), coresident=True) for i in range(400)]
    trace.insert(11, TraceJob("head", "big", 5.25, 10.0, gib(16)))
    gpus = [SimGpu("G0", gib(24)), SimGpu("G1", gib(24))]
    opts = SimOptions(reclaim_delay_s=0.5)
    r = simulate(gpus, trace, plan, opts)
    start = r.jobs["head"].start_s
    assert start is not None and start <= 5.25 + 2.5 + 0.5, f"the head started at {start}"
    # the shared jobs still flow on the other GPU
    for t in trace:
        began = r.jobs[t.id].start_s
        assert began is not None and began - t.arrival_s <= 10.0, t.id
    starved = simulate(gpus, trace, _with_reservations(0), opts).jobs["head"].start_s
    assert starved is not None and starved >= 195.0  # the check above is a real one


def test_no_starvation_without_the_memory_of_the_held_gpu() -> None:
    """(d) Why ``Snapshot.held_back`` exists: 6 GiB shared jobs keep three 24 GiB
    GPUs 90 % busy, each GPU's oldest job ending and a new one starting in turn. A
    planner that chose the held GPU afresh on every pass would move the reservation
    to whichever GPU's jobs look youngest, so no GPU ever drains for the 19 GiB
    whole-card job (it starts when the stream ends); one that keeps its GPU starts
    it once the jobs there have ended."""
    gap = 5.0 / (3 * 4 * 0.9)
    trace = [TraceJob(f"s{i}", "small", i * gap, 5.0, gib(6), coresident=True) for i in range(432)]
    trace.append(TraceJob("head", "big", 10.125, 10.0, gib(19)))
    gpus = [SimGpu(f"G{i}", gib(24)) for i in range(3)]

    def forgetful(snapshot: Snapshot, now: float) -> list[Decision]:
        return plan(dataclasses.replace(snapshot, held_back=()), now)

    start = simulate(gpus, trace, plan).jobs["head"].start_s
    assert start is not None and start <= 10.125 + 2 * 5.0, f"the head started at {start}"
    starved = simulate(gpus, trace, forgetful).jobs["head"].start_s
    assert starved is not None and starved >= 190.0


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
    n_gpus=st.integers(2, 4),
    size=st.sampled_from([4, 6, 8]),
    duration=st.integers(4, 10).map(lambda n: n / 2),
    load=st.sampled_from([0.7, 0.8, 0.9]),
    head_at=st.integers(2, 20).map(lambda n: n / 2 + 0.125),
    head_gib=st.integers(12, 22),
    head_coresident=st.booleans(),
    reclaim=st.sampled_from([0.0, 0.5]),
)
def test_property_no_starvation_on_several_gpus(
    n_gpus: int,
    size: int,
    duration: float,
    load: float,
    head_at: float,
    head_gib: int,
    head_coresident: bool,
    reclaim: float,
) -> None:
    """(d) With several GPUs and one held back for the head only, a big job behind a
    stream of shared ones that keeps ``load`` of every GPU busy starts within a bound
    set by the jobs that had not ended when it arrived, however long the stream."""
    slots = n_gpus * (24 // size)
    gap = duration / (slots * load)
    trace: list[TraceJob] = []
    t = 0.0
    while t < STREAM_S:
        trace.append(TraceJob(f"s{len(trace)}", "small", t, duration, gib(size), coresident=True))
        t += gap
    trace.append(TraceJob("head", "big", head_at, 10.0, gib(head_gib), coresident=head_coresident))
    gpus = [SimGpu(f"G{i}", gib(24)) for i in range(n_gpus)]
    r = simulate(gpus, trace, plan, SimOptions(reclaim_delay_s=reclaim))
    ahead = [j for j in trace if j.arrival_s < head_at and (r.jobs[j.id].end_s or 0.0) > head_at]
    bound = head_at + (len(ahead) + 1) * (duration + reclaim)
    assume(bound < STREAM_S - 20)  # the stream outlasts the bound: a real check
    start = r.jobs["head"].start_s
    assert start is not None
    assert start <= bound, f"the head arrived at {head_at}, started at {start}"


def test_no_job_goes_to_a_warm_server_on_a_degraded_gpu() -> None:
    from gpuwarden.core.policy import WarmView

    server = Holding("warm:m:1", "m.m", 6 * GIB, state=HoldState.WARM)
    g = GpuView("G", 24 * GIB, holdings=(server,), degraded="memory of job x was not released")
    job = QueuedJob("j", "m.m", Lane.VRAM, 6 * GIB, 0, 1, serve=True, warm=True)
    warm = (WarmView("m.m", "G", "warm:m:1", busy=False, idle_since=NOW - 1),)
    [d] = plan(Snapshot(queued=(job,), gpus=(g,), warm=warm), NOW)
    assert isinstance(d, Wait) and "takes no job: memory of job x was not released" in d.reason
    ok = GpuView("G", 24 * GIB, holdings=(server,))
    [d] = plan(Snapshot(queued=(job,), gpus=(ok,), warm=warm), NOW)
    assert d == Start("j", "G", warm=True)
