"""Fair share in VRAM-hours (core.fairshare) and its place in the queue order
(core.policy): the decay, the table, priority before fair share before arrival,
and a pure one-GPU loop in which owners with equal streams end with equal use."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpuwarden.core.fairshare import Usage, decayed, gib_hours, hide_owners, standing, why_behind
from gpuwarden.core.ledger import Holding
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    GpuView,
    Lineup,
    QueuedJob,
    Snapshot,
    Start,
    order,
    plan,
    plan_pass,
)
from gpuwarden.core.queueindex import QueueIndex
from gpuwarden.node.queue import owners_head, owners_members

DAY = 86400.0
WEEK = 7 * DAY


def job(
    job_id: str, owner: str, usage: float, *, priority: int = 0, seq: int = 0, gib: int = 20
) -> QueuedJob:
    return QueuedJob(
        job_id, "llm.chat", Lane.VRAM, gib * GIB, priority, seq, owner=owner, usage=usage
    )


def test_decay_halves_each_half_life() -> None:
    assert decayed(8.0, 0.0, WEEK, WEEK) == pytest.approx(4.0)
    assert decayed(8.0, 0.0, 3 * WEEK, WEEK) == pytest.approx(1.0)
    assert decayed(8.0, 10.0, 10.0, WEEK) == 8.0
    assert decayed(8.0, 10.0, 5.0, WEEK) == 8.0  # never grows backwards
    assert decayed(8.0, 0.0, 1.0, 0.0) == 0.0  # half-life 0: fair share off


def test_gib_hours_is_bytes_times_run_time() -> None:
    assert gib_hours(2 * GIB, 100.0, 100.0 + 1800.0) == pytest.approx(1.0)
    assert gib_hours(GIB, 10.0, 5.0) == 0.0


def test_usage_decays_lazily_and_adds() -> None:
    u = Usage(WEEK)
    u.add("a", 10.0, 0.0)
    u.add("a", 10.0, WEEK)  # the first 10 is worth 5 by then
    assert u.of("a", WEEK) == pytest.approx(15.0)
    assert u.of("a", 2 * WEEK) == pytest.approx(7.5)
    u.add("a", 4.0, 0.0)  # counted late: decayed to the entry's time (worth 2 then)
    assert u.of("a", WEEK) == pytest.approx(17.0)
    assert u.of("nobody", WEEK) == 0.0
    u.add(None, 1.0, 0.0)  # the local CLI counts as owner ""
    assert u.of("", 0.0) == 1.0
    assert u.table(0.0).keys() == {"a", ""}


def test_a_zero_half_life_counts_nothing() -> None:
    u = Usage(0.0)
    u.add("a", 10.0, 0.0)
    assert not u.enabled
    assert u.of("a", 0.0) == 0.0
    assert len(u) == 0


def test_standing_puts_the_least_use_first() -> None:
    assert standing({"a": 3.0, "b": 0.5, "c": 3.0}) == {"b": 1, "a": 2, "c": 3}


def test_least_use_goes_first_among_equal_priority() -> None:
    heavy = job("heavy", "a", 100.0, seq=1)
    light = job("light", "b", 1.0, seq=2)
    assert [j.id for j in order([heavy, light])] == ["light", "heavy"]
    # one GPU that fits one of them: the lighter owner's job starts
    snap = Snapshot(queued=(heavy, light), gpus=(GpuView("GPU-0", 24 * GIB),))
    starts = [d for d in plan(snap, 0.0) if isinstance(d, Start)]
    assert [s.job_id for s in starts] == ["light"]


def test_priority_beats_fair_share() -> None:
    heavy_urgent = job("urgent", "a", 1000.0, priority=5, seq=2)
    light = job("light", "b", 0.0, seq=1)
    snap = Snapshot(queued=(light, heavy_urgent), gpus=(GpuView("GPU-0", 24 * GIB),))
    starts = [d for d in plan(snap, 0.0) if isinstance(d, Start)]
    assert [s.job_id for s in starts] == ["urgent"]


def test_one_owner_keeps_arrival_order() -> None:
    jobs = [job(f"j{s}", "a", 3.0, seq=s) for s in (5, 1, 3)]
    assert [j.seq for j in order(jobs)] == [1, 3, 5]


@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # priority
            st.sampled_from(["a", "b", "c"]),  # owner
            st.integers(0, 1000),  # seq
        ),
        min_size=1,
        max_size=40,
        unique_by=lambda t: t[2],
    ),
    st.fixed_dictionaries({o: st.floats(0, 1e6, allow_nan=False) for o in ("a", "b", "c")}),
)
def test_order_is_priority_then_use_then_arrival(
    specs: list[tuple[int, str, int]], use: dict[str, float]
) -> None:
    jobs = [job(f"j{s}", o, use[o], priority=p, seq=s) for p, o, s in specs]
    got = order(jobs)
    for x, y in itertools.pairwise(got):
        assert x.priority >= y.priority  # priority always beats fair share
        if x.priority == y.priority:
            assert x.usage <= y.usage
            if x.owner == y.owner:
                assert x.seq < y.seq


def one_gpu_loop(
    owners: list[str], per_owner: int, past: dict[str, float], run_s: float, gib: int
) -> tuple[Usage, list[tuple[float, dict[str, float], set[str]]]]:
    """Equal streams of equal jobs on one GPU that fits one at a time, planned by
    core.policy with each owner's use as the loop keeps it. Returns the table and,
    after each end, (time, use, owners still queued)."""
    u = Usage(WEEK)
    for o, v in past.items():
        u.add(o, v, 0.0)
    queued = [
        (f"{o}{i}", o, i * len(owners) + n) for i in range(per_owner) for n, o in enumerate(owners)
    ]
    now, seen = 0.0, []
    gpu = GpuView("GPU-0", 24 * GIB)
    while queued:
        jobs = tuple(job(i, o, u.of(o, now), seq=s, gib=gib) for i, o, s in queued)
        starts = [d for d in plan(Snapshot(queued=jobs, gpus=(gpu,)), now) if isinstance(d, Start)]
        assert len(starts) == 1  # one at a time: it fits alone
        started = next(q for q in queued if q[0] == starts[0].job_id)
        queued.remove(started)
        now += run_s
        u.add(started[1], gib_hours(gib * GIB, now - run_s, now), now)
        seen.append((now, u.table(now), {q[1] for q in queued}))
    return u, seen


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 3),
    st.integers(4, 20),
    st.lists(st.integers(0, 3), min_size=3, max_size=3),
    st.floats(60.0, 4 * 3600.0),
)
def test_fair_share_converges_on_equal_use(
    n_owners: int, per_owner: int, past_jobs: list[int], run_s: float
) -> None:
    owners = ["a", "b", "c"][:n_owners]
    gib = 20
    one = gib_hours(gib * GIB, 0.0, run_s)  # one job's GiB-hours
    past = {o: k * one for o, k in zip(owners, past_jobs, strict=False) if k}
    u, seen = one_gpu_loop(owners, per_owner, past, run_s, gib)
    # once every owner has caught up (the most past use is at most 3 jobs, each
    # owner has at least 4), the owners still queued never differ by more than one job
    lead = max(past_jobs[:n_owners])
    for _, use, still in seen[(lead + 1) * n_owners :]:
        if len(still) == n_owners:
            values = [use.get(o, 0.0) for o in owners]
            assert max(values) - min(values) <= one * 1.0001
    # and at the end, with equal streams and equal past use, use is near-equal
    if not past:
        end = [u.of(o, seen[-1][0]) for o in owners]
        assert max(end) - min(end) <= one * 1.0001


def test_a_plan_class_merges_its_owners_least_use_first() -> None:
    """The loop's plan class holds the index's classes of several owners: their jobs
    come least use first, arrival order within an owner and among equal use."""
    index: QueueIndex[tuple[str, str]] = QueueIndex()
    for seq, owner in enumerate(["a", "b", "c", "a", "b", "c", "a"]):
        index.add(f"{owner}{seq}", seq, ("t", owner))
    keys = index.classes()
    use = {"a": 9.0, "b": 1.0}  # c never used: 0
    assert owners_head(index, keys, use) == (("t", "c"), (2, "c2"))
    got = [(m[1], m[3] if len(m) == 4 else None) for m in owners_members(index, keys, use)]
    assert got == [
        ("c2", 0.0),
        ("c5", 0.0),
        ("b1", 1.0),
        ("b4", 1.0),
        ("a0", 9.0),
        ("a3", 9.0),
        ("a6", 9.0),
    ]
    tie = {"a": 1.0, "b": 1.0, "c": 1.0}  # equal use: arrival order across owners
    assert [m[1] for m in owners_members(index, keys, tie)] == [
        f"{o}{s}" for s, o in enumerate("abcabca")
    ]
    one = [("t", "a")]  # one owner: the index's own (seq, id)
    assert list(owners_members(index, one, use)) == [(0, "a0"), (3, "a3"), (6, "a6")]


def test_a_submitter_is_not_shown_another_owners_id() -> None:
    line = "it waits behind another owner's jobs: fair share: owner tok-b has used less: 1.00"
    assert hide_owners(line, "tok-a").endswith("fair share: another owner has used less: 1.00")
    assert hide_owners(line, "tok-b") == line
    assert why_behind("tok-a", 5.0, "tok-b", 1.0) == (
        "fair share: owner tok-b has used less: 1.00 GiB-h against 5.00"
    )
    assert why_behind("tok-a", 1.0, "tok-b", 5.0) is None  # it is not why
    assert why_behind("", 1.0, "", 0.0) is None  # the same owner


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([4, 10, 20]),  # GiB
            st.integers(0, 1),  # priority
            st.sampled_from(["a", "b", "c"]),  # owner
        ),
        min_size=1,
        max_size=30,
    ),
    st.fixed_dictionaries({o: st.sampled_from([0.0, 1.0, 5.0]) for o in ("a", "b", "c")}),
    st.lists(st.sampled_from([0, 8, 16]), min_size=1, max_size=4),  # GiB held per GPU
)
def test_merged_owner_classes_start_what_plan_starts(
    specs: list[tuple[int, int, str]], use: dict[str, float], held: list[int]
) -> None:
    """The loop's plan classes (one per footprint and priority, its owners merged
    least use first) start the same jobs, in the same order, as plan() over every
    job with a class per owner: merging owners changes the work, not the result."""
    jobs = [
        dataclasses.replace(job(f"j{n}", o, use[o], priority=p, seq=n, gib=g), coresident=True)
        for n, (g, p, o) in enumerate(specs)
    ]
    gpus = tuple(
        GpuView(
            f"GPU-{i}",
            24 * GIB,
            holdings=(Holding(f"r{i}", "x.y", h * GIB, True, job_id=f"r{i}"),) if h else (),
        )
        for i, h in enumerate(held)
    )
    snap = Snapshot(queued=tuple(jobs), gpus=gpus)
    expected = [d.job_id for d in plan(snap, 0.0) if isinstance(d, Start)]
    assume(expected)
    index: QueueIndex[tuple[int, int, str]] = QueueIndex()
    by_id = {j.id: j for j in jobs}
    for j in jobs:
        index.add(j.id, j.seq, (j.vram_bytes, j.priority, j.owner))
    groups: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for key in index.classes():
        groups.setdefault(key[:2], []).append(key)
    lineups = []
    for plan_key, keys in groups.items():
        found = owners_head(index, keys, use)
        assert found is not None
        lineups.append(Lineup(plan_key, by_id[found[1][1]], owners_members(index, keys, use)))
    done = plan_pass(lineups, Snapshot(queued=(), gpus=gpus), 0.0)
    started = [s.job_id for s in done.starts]
    assert sorted(started) == sorted(expected)
    ranks = {j.id: (-j.priority, j.usage, j.seq) for j in jobs}
    assert started == sorted(started, key=ranks.__getitem__)
