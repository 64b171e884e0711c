"""Fair share across hosts, the pure part: the order a coordinator offers queued jobs
in (core.fairshare.claim_rank, used by core.placement.offers_for) and how far a
node's word on what an attempt held is taken (core.fairshare.reported_held)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.core.fairshare import claim_rank, reported_held
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.placement import GpuRoom, NodeView, Offerable, offers_for


def node(slots: int = 1, gib: int = 80) -> NodeView:
    gpu = GpuRoom("GPU-0", "sim", gib * GIB, gib * GIB, gib * GIB)
    return NodeView("n", gpus=(gpu,), max_jobs=slots)


def offer(job_id: str, *, usage: float, priority: int = 0, seq: int = 0) -> Offerable:
    return Offerable(job_id, "echo.echo", Lane.CPU, 0, priority, seq, submitted_at=0.0, usage=usage)


def test_priority_then_least_use_then_arrival() -> None:
    assert claim_rank(5, 100.0, 9) < claim_rank(0, 0.0, 1)  # priority beats fair share
    assert claim_rank(0, 1.0, 9) < claim_rank(0, 2.0, 1)  # then the owner who used least
    assert claim_rank(0, 1.0, 1) < claim_rank(0, 1.0, 2)  # then arrival


def test_a_node_is_offered_the_light_owners_job_first_and_priority_still_wins() -> None:
    heavy = offer("heavy", usage=50.0, seq=1)
    light = offer("light", usage=0.5, seq=2)
    urgent = offer("urgent", usage=50.0, priority=3, seq=3)
    assert offers_for(node(1), [heavy, light], [], now=0.0) == ["light"]
    assert offers_for(node(1), [heavy, light, urgent], [], now=0.0) == ["urgent"]
    assert offers_for(node(3), [heavy, light, urgent], [], now=0.0) == [
        "urgent",
        "light",
        "heavy",
    ]
    # equal use (no one used anything): arrival order, as before fair share
    a, b = offer("a", usage=0.0, seq=2), offer("b", usage=0.0, seq=1)
    assert offers_for(node(2), [a, b], [], now=0.0) == ["b", "a"]


jobs_st = st.lists(
    st.tuples(st.integers(-2, 2), st.sampled_from([0.0, 0.5, 3.0, 40.0])),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(jobs_st)
def test_offers_follow_the_rank_whatever_the_input_order(jobs: list[tuple[int, float]]) -> None:
    queued = [offer(f"j{i}", usage=u, priority=p, seq=i) for i, (p, u) in enumerate(jobs)]
    want = [o.id for o in sorted(queued, key=lambda o: claim_rank(o.priority, o.usage, o.seq))]
    got = offers_for(node(len(queued)), list(reversed(queued)), [], now=0.0)
    assert got == want


def test_a_nodes_word_on_what_it_held_is_bounded_by_its_gpus() -> None:
    assert reported_held(4 * GIB, 80 * GIB) == 4 * GIB
    assert reported_held(10**15, 80 * GIB) == 80 * GIB  # more than all its GPUs: capped
    assert reported_held(-5, 80 * GIB) == 0
    assert reported_held(None, 80 * GIB) == 0
    assert reported_held(4 * GIB, 0) == 0  # a node without GPUs held no VRAM
