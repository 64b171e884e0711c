"""Sized lineups (command jobs, each with its own footprint) decide exactly as one
class per footprint did: the same starts, GPUs, refusals, evictions, releases,
preemptions and held-back GPUs, and the same reason for each class's head."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    Decision,
    GpuView,
    QueuedJob,
    RangeWait,
    Snapshot,
    Wait,
    WarmView,
    lineups_of,
    order,
    plan,
    plan_pass,
    sized_lineups_of,
)
from gpuwarden.core.preempt import Victim

NOW = 1_000_000.0


def reference(snapshot: Snapshot) -> list[Decision]:
    """The pass as it was: one class per footprint (:func:`lineups_of`)."""
    lineups, groups = lineups_of(snapshot.queued)
    done = plan_pass(lineups, snapshot, NOW)
    by_id: dict[str, Decision] = {d.job_id: d for d in done.starts}
    by_id.update((d.job_id, d) for d in done.refusals)
    for w in done.waits:
        for job in groups[w.key]:
            by_id.setdefault(job.id, w.wait(job.id))
    return [*done.evictions, *(by_id[j.id] for j in order(snapshot.queued))]


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    gpus, warm = [], []
    for i in range(draw(st.integers(0, 4))):
        holdings = []
        for k in range(draw(st.integers(0, 4))):
            holdings.append(
                Holding(
                    f"h{i}{k}",
                    draw(st.sampled_from(["llm", "tts", "cmd"])),
                    draw(st.integers(1, 30)) * GIB // 2,
                    draw(st.booleans()),
                    state=draw(st.sampled_from([HoldState.RUNNING, HoldState.RECLAIMING])),
                    job_id=f"r{i}{k}",
                    since=draw(st.sampled_from([0.0, NOW - 100])),
                    expected_end=draw(st.sampled_from([None, NOW + 50, NOW + 500])),
                )
            )
        if draw(st.integers(0, 3)) == 0:
            holdings.append(Holding(f"warm{i}", f"srv{i}", 4 * GIB, True, HoldState.WARM))
            warm.append(WarmView(f"srv{i}", f"G{i}", f"warm{i}", busy=False, idle_since=NOW))
        gpus.append(
            GpuView(
                f"G{i}",
                draw(st.sampled_from([16, 24, 40])) * GIB,
                reserve_bytes=draw(st.sampled_from([0, GIB])),
                holdings=tuple(holdings),
                degraded=draw(st.sampled_from(["", "", "", "lost"])),
            )
        )
    jobs = []
    for i in range(draw(st.integers(0, 25))):
        jobs.append(
            QueuedJob(
                f"j{i}",
                draw(st.sampled_from(["cmd:a", "cmd:b[share]"])),
                Lane.VRAM,
                draw(st.integers(1, 90)) * GIB // 2,
                draw(st.sampled_from([0, 0, 5])),
                draw(st.integers(0, 40)),
                coresident=draw(st.booleans()),
                expected_s=draw(st.sampled_from([None, 30.0])),
                owner=draw(st.sampled_from(["", "ann"])),
                usage=0.0,
                gpus=draw(st.sampled_from([1, 1, 1, 2])),
            )
        )
    victims = tuple(
        Victim(h.job_id or "", g.uuid, h.holder, 0, since=0.0, preempting_for=None)
        for g in gpus
        for h in g.holdings
        if h.job_id and h.state is HoldState.RUNNING and draw(st.integers(0, 3)) == 0
    )
    return Snapshot(
        queued=tuple(jobs),
        gpus=tuple(gpus),
        warm=tuple(warm),
        max_reservations=draw(st.sampled_from([0, 1, 2])),
        victims=victims,
        held_back=tuple((f"j{i}", "G0") for i in range(draw(st.integers(0, 2)))),
    )


def _same(mine: Decision, theirs: Decision) -> None:
    if isinstance(mine, Wait) and isinstance(theirs, Wait):
        # a job of a class the pass no longer looked at: the same wait, and a reason
        assert mine.reserved_gpu == theirs.reserved_gpu
        assert mine.reason
        return
    assert mine == theirs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=snapshots())
def test_sized_lineups_decide_as_one_class_per_footprint(s: Snapshot) -> None:
    mine, theirs = plan(s, NOW), reference(s)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        _same(a, b)


def test_heads_get_the_reasons_they_got_before() -> None:
    """Waits of classes the pass judged keep their reasons word for word."""
    gpus = (GpuView("G0", 24 * GIB, holdings=(Holding("h", "x", 20 * GIB, True, job_id="r"),)),)
    jobs = tuple(
        QueuedJob(f"j{i}", "cmd:a", Lane.VRAM, (i + 1) * GIB, 0, i, coresident=True)
        for i in range(8)
    )
    s = Snapshot(queued=jobs, gpus=gpus)
    mine, theirs = plan(s, NOW), reference(s)
    assert mine == theirs  # j0..j3 start, j4 is judged; the rest wait as it does


def test_bigger_jobs_are_not_looked_at_once_a_smaller_one_waits() -> None:
    gpus = (GpuView("G0", 24 * GIB, holdings=(Holding("h", "x", 20 * GIB, True, job_id="r"),)),)
    jobs = tuple(
        QueuedJob(f"j{i}", "cmd:a", Lane.VRAM, (10 + i) * GIB, 0, i, coresident=True)
        for i in range(50)
    )
    s = dataclasses.replace(Snapshot(queued=jobs, gpus=gpus), max_reservations=0)
    lineups, _ = sized_lineups_of(jobs)
    done = plan_pass(lineups, s, NOW)
    # one class judged (j0, 10 GiB); the 49 bigger ones wait with it, unlooked at
    assert [w.job_id for w in done.waits if not isinstance(w, RangeWait)] == ["j0"]
    (rng,) = [w for w in done.waits if isinstance(w, RangeWait)]
    assert "needs 30.0 GiB" in rng.wait("j20").reason
    assert plan(s, NOW) == reference(s)
