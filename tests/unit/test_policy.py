"""The admission and ordering policy: plan(snapshot, now) -> one decision per queued job."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.core.model import GIB, MIB, Lane
from gpuwarden.core.policy import (
    Decision,
    GpuState,
    QueuedJob,
    Snapshot,
    Start,
    Wait,
    order,
    plan,
)

NOW = 1_000_000.0


def cpu(job_id: str, *, priority: int = 0, seq: int = 0) -> QueuedJob:
    return QueuedJob(job_id, "echo.echo", Lane.CPU, 0, priority, seq)


def vram(job_id: str, gib: float, *, priority: int = 0, seq: int = 0) -> QueuedJob:
    return QueuedJob(job_id, "llm.chat", Lane.VRAM, int(gib * GIB), priority, seq)


def gpu(
    uuid: str, total_gib: float, used_gib: float = 0.0, running: tuple[str, ...] = ()
) -> GpuState:
    return GpuState(uuid, int(total_gib * GIB), int(used_gib * GIB), running)


def snap(
    *jobs: QueuedJob,
    gpus: tuple[GpuState, ...] = (),
    running_cpu: int = 0,
    cpu_slots: int = 4,
    accepting: bool = True,
    vram_paused: str = "",
) -> Snapshot:
    return Snapshot(tuple(jobs), gpus, running_cpu, cpu_slots, accepting, vram_paused)


def by_id(decisions: list[Decision]) -> dict[str, Decision]:
    out = {d.job_id: d for d in decisions}
    assert len(out) == len(decisions), "a job got more than one decision"
    return out


# --- ordering -------------------------------------------------------------------------


def test_order_priority_then_arrival() -> None:
    jobs = (
        cpu("a", priority=0, seq=1),
        cpu("b", priority=5, seq=4),
        cpu("c", priority=5, seq=2),
        cpu("d", priority=-1, seq=0),
        cpu("e", priority=0, seq=0),
    )
    assert [j.id for j in order(jobs)] == ["c", "b", "e", "a", "d"]


def test_decisions_follow_priority_then_arrival() -> None:
    decisions = plan(
        snap(cpu("late", seq=9), cpu("urgent", priority=10, seq=10), cpu("early", seq=1)),
        NOW,
    )
    assert [d.job_id for d in decisions] == ["urgent", "early", "late"]
    assert all(isinstance(d, Start) for d in decisions)


def test_the_one_free_slot_goes_to_the_highest_priority() -> None:
    decisions = by_id(
        plan(snap(cpu("low", seq=1), cpu("high", priority=1, seq=2), cpu_slots=1), NOW)
    )
    assert decisions["high"] == Start("high", None)
    assert decisions["low"] == Wait("low", "all 1 cpu slots are in use")


def test_the_one_gpu_goes_to_the_earliest_of_equal_priority() -> None:
    decisions = by_id(
        plan(snap(vram("second", 1, seq=2), vram("first", 1, seq=1), gpus=(gpu("G", 8),)), NOW)
    )
    assert decisions["first"] == Start("first", "G")
    assert isinstance(decisions["second"], Wait)


# --- cpu lane -------------------------------------------------------------------------


def test_cpu_slots_limit() -> None:
    jobs = [cpu(f"j{i}", seq=i) for i in range(4)]
    decisions = plan(snap(*jobs, running_cpu=1, cpu_slots=3), NOW)
    assert decisions == [
        Start("j0", None),
        Start("j1", None),
        Wait("j2", "all 3 cpu slots are in use"),
        Wait("j3", "all 3 cpu slots are in use"),
    ]


def test_cpu_slots_all_taken() -> None:
    decisions = plan(snap(cpu("a"), running_cpu=2, cpu_slots=2), NOW)
    assert decisions == [Wait("a", "all 2 cpu slots are in use")]


def test_cpu_jobs_never_take_a_gpu() -> None:
    decisions = plan(snap(cpu("a"), vram("v", 1, seq=1), gpus=(gpu("G", 8),)), NOW)
    assert decisions == [Start("a", None), Start("v", "G")]


def test_vram_jobs_do_not_use_cpu_slots() -> None:
    decisions = plan(
        snap(
            vram("v1", 1), vram("v2", 1, seq=1), cpu("c", seq=2), gpus=(gpu("G", 8),), cpu_slots=1
        ),
        NOW,
    )
    assert by_id(decisions)["c"] == Start("c", None)


# --- vram lane ------------------------------------------------------------------------


def test_one_vram_job_per_gpu_in_one_plan() -> None:
    decisions = plan(snap(vram("a", 1), vram("b", 1, seq=1), gpus=(gpu("G", 80),)), NOW)
    assert decisions == [
        Start("a", "G"),
        Wait("b", "needs 1.0 GiB on one GPU; G runs another job"),
    ]


def test_a_gpu_that_already_runs_a_job_takes_no_other() -> None:
    decisions = plan(snap(vram("a", 1), gpus=(gpu("G", 80, 2, running=("old",)),)), NOW)
    assert decisions == [Wait("a", "needs 1.0 GiB on one GPU; G runs another job")]


def test_foreign_usage_counts() -> None:
    # 20 GiB used by processes gpuwarden does not know about: only 4 GiB are free.
    g = gpu("G", 24, 20)
    assert plan(snap(vram("big", 8), gpus=(g,)), NOW) == [
        Wait("big", "needs 8.0 GiB on one GPU; G has 4.0 GiB free")
    ]
    assert plan(snap(vram("exact", 4), gpus=(g,)), NOW) == [Start("exact", "G")]
    one_byte_more = QueuedJob("over", "t", Lane.VRAM, 4 * GIB + 1, 0, 0)
    assert isinstance(plan(snap(one_byte_more, gpus=(g,)), NOW)[0], Wait)


def test_used_beyond_total_means_nothing_free() -> None:
    g = gpu("G", 8, 9)
    assert g.free_bytes == 0
    assert plan(snap(vram("a", 1), gpus=(g,)), NOW) == [
        Wait("a", "needs 1.0 GiB on one GPU; G has 0 B free")
    ]


def test_best_fit_among_gpus() -> None:
    gpus = (gpu("G-big", 30), gpu("G-small", 10), gpu("G-mid", 20))
    assert plan(snap(vram("a", 8), gpus=gpus), NOW) == [Start("a", "G-small")]
    assert plan(snap(vram("b", 15), gpus=gpus), NOW) == [Start("b", "G-mid")]
    assert plan(snap(vram("c", 25), gpus=gpus), NOW) == [Start("c", "G-big")]


def test_best_fit_ties_break_by_uuid() -> None:
    gpus = (gpu("G-b", 16), gpu("G-a", 16))
    assert plan(snap(vram("a", 8), gpus=gpus), NOW) == [Start("a", "G-a")]


def test_best_fit_over_several_jobs() -> None:
    gpus = (gpu("G-big", 30), gpu("G-small", 10), gpu("G-mid", 20))
    decisions = plan(
        snap(vram("x", 8, seq=1), vram("y", 12, seq=2), vram("z", 25, seq=3), gpus=gpus), NOW
    )
    assert decisions == [Start("x", "G-small"), Start("y", "G-mid"), Start("z", "G-big")]


def test_best_fit_skips_a_busy_gpu() -> None:
    gpus = (gpu("G-small", 10, running=("old",)), gpu("G-big", 40))
    assert plan(snap(vram("a", 1), gpus=gpus), NOW) == [Start("a", "G-big")]


def test_free_memory_on_two_gpus_never_adds_up() -> None:
    gpus = (gpu("G0", 24, 14), gpu("G1", 24, 14))  # 10 GiB free on each, 20 together
    assert plan(snap(vram("a", 16), gpus=gpus), NOW) == [
        Wait("a", "needs 16.0 GiB on one GPU; G0 has 10.0 GiB free; G1 has 10.0 GiB free")
    ]


def test_wait_reason_mixes_busy_and_too_small() -> None:
    gpus = (gpu("G0", 24, running=("old",)), gpu("G1", 8, 7.5))
    assert plan(snap(vram("a", 2), gpus=gpus), NOW) == [
        Wait("a", "needs 2.0 GiB on one GPU; G0 runs another job; G1 has 512 MiB free")
    ]


def test_no_gpus() -> None:
    decisions = plan(snap(vram("a", 2), cpu("c", seq=1)), NOW)
    assert decisions == [
        Wait("a", "needs 2.0 GiB on one GPU; this node has no GPU"),
        Start("c", None),
    ]


def test_small_footprint_shown_in_mib() -> None:
    job = QueuedJob("a", "t", Lane.VRAM, 300 * MIB, 0, 0)
    assert plan(snap(job), NOW) == [Wait("a", "needs 300 MiB on one GPU; this node has no GPU")]


def test_vram_paused() -> None:
    decisions = plan(
        snap(
            vram("a", 1),
            cpu("c", seq=1),
            gpus=(gpu("G", 80),),
            vram_paused="the GPU probe failed: NVML not found",
        ),
        NOW,
    )
    assert decisions == [
        Wait("a", "VRAM admission is paused: the GPU probe failed: NVML not found"),
        Start("c", None),  # cpu jobs go on
    ]


def test_not_accepting_means_everything_waits() -> None:
    decisions = plan(
        snap(cpu("c"), vram("v", 1, seq=1), gpus=(gpu("G", 80),), accepting=False), NOW
    )
    assert decisions == [
        Wait("c", "the broker is shutting down"),
        Wait("v", "the broker is shutting down"),
    ]


def test_empty_queue() -> None:
    assert plan(snap(gpus=(gpu("G", 8),)), NOW) == []


def test_every_queued_job_gets_exactly_one_decision() -> None:
    jobs = [cpu(f"c{i}", seq=i) for i in range(6)] + [
        vram(f"v{i}", 4 + i, priority=i % 3, seq=10 + i) for i in range(6)
    ]
    decisions = plan(snap(*jobs, gpus=(gpu("G0", 24), gpu("G1", 12)), cpu_slots=2), NOW)
    assert Counter(d.job_id for d in decisions) == Counter(j.id for j in jobs)
    starts = [d for d in decisions if isinstance(d, Start)]
    assert sorted(d.job_id for d in starts if d.gpu_uuid is None) == ["c0", "c1"]
    assert sorted(d.gpu_uuid or "" for d in starts if d.gpu_uuid) == ["G0", "G1"]


def test_plan_is_deterministic() -> None:
    s = snap(
        vram("a", 3, seq=2), cpu("b", seq=1), vram("c", 3, seq=0), gpus=(gpu("G", 8), gpu("H", 8))
    )
    assert plan(s, NOW) == plan(s, NOW + 3600)


# --- property ------------------------------------------------------------------------


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    n_gpus = draw(st.integers(0, 4))
    gpus = []
    for i in range(n_gpus):
        total = draw(st.integers(1, 80)) * GIB
        used = draw(st.integers(0, total + GIB))
        running = tuple(f"r{i}-{k}" for k in range(draw(st.integers(0, 2))))
        gpus.append(GpuState(f"GPU-{i}", total, used, running))
    n_jobs = draw(st.integers(0, 12))
    jobs = []
    for i in range(n_jobs):
        lane = draw(st.sampled_from([Lane.CPU, Lane.VRAM]))
        need = 0 if lane is Lane.CPU else draw(st.integers(1, 90 * GIB))
        jobs.append(
            QueuedJob(f"j{i}", "t", lane, need, draw(st.integers(-3, 3)), draw(st.integers(0, 50)))
        )
    cpu_slots = draw(st.integers(1, 6))
    return Snapshot(
        queued=tuple(jobs),
        gpus=tuple(gpus),
        running_cpu=draw(st.integers(0, cpu_slots + 1)),
        cpu_slots=cpu_slots,
        accepting=draw(st.booleans()),
        vram_paused=draw(st.sampled_from(["", "", "", "degraded"])),
    )


@settings(max_examples=300, deadline=None)
@given(s=snapshots())
def test_plan_properties(s: Snapshot) -> None:
    decisions = plan(s, NOW)
    jobs = {j.id: j for j in s.queued}
    gpus = {g.uuid: g for g in s.gpus}

    # every queued job gets exactly one decision, and nothing else does
    assert sorted(d.job_id for d in decisions) == sorted(jobs)

    starts = [d for d in decisions if isinstance(d, Start)]
    for d in decisions:
        if isinstance(d, Wait):
            assert d.reason  # a reason a person can read

    if not s.accepting:
        assert starts == []

    gpu_starts = [d for d in starts if d.gpu_uuid is not None]
    cpu_starts = [d for d in starts if d.gpu_uuid is None]

    # no GPU gets two starts, or a start while it runs something
    assert len({d.gpu_uuid for d in gpu_starts}) == len(gpu_starts)
    for d in gpu_starts:
        g = gpus[d.gpu_uuid or ""]
        job = jobs[d.job_id]
        assert not g.running
        assert job.lane is Lane.VRAM
        assert job.vram_bytes <= g.free_bytes  # fits the probe-free memory
        assert not s.vram_paused

    # cpu starts never exceed the free slots and are cpu-lane jobs
    assert len(cpu_starts) <= max(0, s.cpu_slots - s.running_cpu)
    assert all(jobs[d.job_id].lane is Lane.CPU for d in cpu_starts)

    # a job that waits is not one that could have been started on a free slot ahead of
    # a lower-priority job on the cpu lane
    ordered_cpu = [j.id for j in order(s.queued) if j.lane is Lane.CPU]
    started_cpu = {d.job_id for d in cpu_starts}
    assert [j for j in ordered_cpu if j in started_cpu] == ordered_cpu[: len(started_cpu)]
