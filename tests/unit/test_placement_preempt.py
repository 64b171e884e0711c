"""Preemption across hosts (core/placement.py: preemptions_for): which running jobs
a node is asked to checkpoint, for which queued job that no node has room for."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.placement import GpuRoom, NodeView, Offerable, preemptions_for
from gpuwarden.core.preempt import Victim

NOW = 10_000.0


def gpu(uuid: str, gib: float, free: float) -> GpuRoom:
    return GpuRoom(uuid, "sim", int(gib * GIB), int(free * GIB), int(gib * GIB))


def job(i: int, gib: float, priority: int = 10, **kw: object) -> Offerable:
    fields: dict[str, object] = {
        "id": f"j{i}",
        "type": "m.t",
        "lane": Lane.VRAM,
        "vram_bytes": int(gib * GIB),
        "priority": priority,
        "seq": i,
        "submitted_at": 100.0,
    }
    fields.update(kw)
    return Offerable(**fields)  # type: ignore[arg-type]


def victim(
    job_id: str, gib: float, *, gpu_uuid: str = "g0", priority: int = 0, **kw: object
) -> Victim:
    fields: dict[str, object] = {
        "job_id": job_id,
        "holder": job_id,
        "gpu_uuid": gpu_uuid,
        "priority": priority,
        "since": NOW - 1000,
        "min_run_s": 300.0,
        "bytes": int(gib * GIB),
    }
    fields.update(kw)
    return Victim(**fields)  # type: ignore[arg-type]


def node(*victims: Victim, free: float = 2, name: str = "n1", **kw: object) -> NodeView:
    return NodeView(name, gpus=(gpu("g0", 24, free),), victims=victims, max_jobs=1, busy=1, **kw)  # type: ignore[arg-type]


def test_a_waiting_job_of_higher_priority_asks_the_preemptible_job_in_its_way() -> None:
    n = node(victim("train", 20))
    [got] = preemptions_for(n, [job(1, 16)], [], now=NOW)
    assert got.node == "n1" and got.for_job == "j1" and got.choice.gpu_uuid == "g0"
    assert [v.job_id for v in got.choice.victims] == ["train"]


def test_nothing_when_some_node_has_room_for_it_now() -> None:
    other = NodeView("n2", gpus=(gpu("h0", 24, 24),))
    assert preemptions_for(node(victim("train", 20)), [job(1, 16)], [other], now=NOW) == []
    # a node with room but no free slot does not count as room
    full = dataclasses.replace(other, busy=4)
    assert len(preemptions_for(node(victim("train", 20)), [job(1, 16)], [full], now=NOW)) == 1


def test_never_equal_or_higher_priority_nor_younger_than_min_run() -> None:
    assert preemptions_for(node(victim("v", 20, priority=10)), [job(1, 16)], [], now=NOW) == []
    young = victim("v", 20, since=NOW - 100)
    assert preemptions_for(node(young), [job(1, 16)], [], now=NOW) == []


def test_not_when_the_victims_do_not_make_room() -> None:
    # 2 GiB free + 10 GiB of the victim < 16 GiB: the rest is held by something not preemptible
    assert preemptions_for(node(victim("v", 10)), [job(1, 16)], [], now=NOW) == []


def test_a_job_already_waited_for_asks_nothing_more_and_its_gpu_is_held() -> None:
    asked = victim("v", 20, preempting_for="j1")
    other = victim("w", 20, gpu_uuid="g1")
    n = NodeView(
        "n1", gpus=(gpu("g0", 24, 2), gpu("g1", 24, 2)), victims=(asked, other), max_jobs=2, busy=2
    )
    assert preemptions_for(n, [job(1, 16)], [], now=NOW) == []
    # another job gets the other GPU, never the held one
    [got] = preemptions_for(n, [job(1, 16), job(2, 16)], [], now=NOW)
    assert got.for_job == "j2" and got.choice.gpu_uuid == "g1"


def test_one_gpu_yields_to_one_job_a_pass_highest_priority_first() -> None:
    n = node(victim("a", 10), victim("b", 10), free=4)
    got = preemptions_for(n, [job(1, 8, priority=5), job(2, 8, priority=9)], [], now=NOW)
    assert [(c.for_job, len(c.choice.victims)) for c in got] == [("j2", 1)]


def test_the_fewest_then_cheapest_victims() -> None:
    n = node(victim("big", 14, priority=3), victim("a", 6), victim("b", 6), free=2)
    [got] = preemptions_for(n, [job(1, 12)], [], now=NOW)
    assert [v.job_id for v in got.choice.victims] == ["big"]


def test_draining_nodes_warm_types_and_cpu_jobs_ask_nothing() -> None:
    v = victim("train", 20)
    assert preemptions_for(node(v, accepting=False), [job(1, 16)], [], now=NOW) == []
    assert preemptions_for(node(v), [job(1, 0, lane=Lane.CPU)], [], now=NOW) == []
    assert preemptions_for(node(v, warm=frozenset({"m.t"})), [job(1, 16)], [], now=NOW) == []
    assert preemptions_for(node(v, types=frozenset({"x.y"})), [job(1, 16)], [], now=NOW) == []


_victims = st.lists(
    st.builds(
        victim,
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(1, 20),
        gpu_uuid=st.sampled_from(["g0", "g1"]),
        priority=st.integers(0, 10),
        since=st.floats(NOW - 2000, NOW),
    ),
    max_size=5,
    unique_by=lambda v: v.job_id,
)
_queued = st.lists(
    st.builds(job, st.integers(0, 50), st.integers(1, 24), priority=st.integers(0, 10)),
    max_size=5,
    unique_by=lambda j: j.id,
)


@settings(max_examples=200, deadline=None)
@given(_victims, _queued, st.integers(0, 24))
def test_property_only_reported_eligible_victims_each_once(
    victims: list[Victim], queued: list[Offerable], free: int
) -> None:
    n = NodeView("n1", gpus=(gpu("g0", 24, free), gpu("g1", 24, free)), victims=tuple(victims))
    got = preemptions_for(n, queued, [], now=NOW)
    by_id = {j.id: j for j in queued}
    seen: list[str] = []
    for c in got:
        waiting = by_id[c.for_job]
        room = free * GIB + sum(v.bytes for v in c.choice.victims)
        assert room >= waiting.vram_bytes  # the victims make room for it
        assert waiting.vram_bytes > free * GIB  # it had no room without them
        for v in c.choice.victims:
            assert v in victims  # never a job that is not (reported as) preemptible
            assert v.priority < waiting.priority  # never equal or higher priority
            assert NOW - v.since >= v.min_run_s  # never before its min_run_s
            assert v.gpu_uuid == c.choice.gpu_uuid
            seen.append(v.job_id)
    assert len(seen) == len(set(seen))  # never asked twice
    assert len({c.choice.gpu_uuid for c in got}) == len(got)
