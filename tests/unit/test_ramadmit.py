"""The RAM admission rule (core/ramadmit.py): pure, with a property test."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.core.model import Lane
from gpuwarden.core.policy import QueuedJob, Snapshot, Start, plan
from gpuwarden.core.ramadmit import (
    GIB,
    NO_RAM,
    RamNeed,
    RamView,
    admit,
    floor_of,
    never_admits,
    promised,
)

_bytes = st.integers(min_value=0, max_value=512 * GIB)


@given(
    available=_bytes,
    node_floor=_bytes,
    running=st.lists(_bytes, max_size=5),
    cap=_bytes,
    floor=_bytes,
    start_min=_bytes,
)
def test_never_admits_past_the_largest_floor(
    available: int, node_floor: int, running: list[int], cap: int, floor: int, start_min: int
) -> None:
    view = RamView(available, node_floor, tuple(running))
    need = RamNeed(cap, floor, start_min)
    kept = max([node_floor, floor, *running])
    admitted = admit(view, need) is None
    if admitted:
        assert available - kept >= cap
        assert available >= start_min
    else:
        assert available - kept < cap or available < start_min
    assert floor_of(view, need) == kept


def test_the_floor_of_a_running_job_holds_for_the_next() -> None:
    need = RamNeed(cap_bytes=4 * GIB)
    assert admit(RamView(10 * GIB, 1 * GIB), need) is None
    reason = admit(RamView(10 * GIB, 1 * GIB, (8 * GIB,)), need)
    assert reason is not None and "floor of 8.00 GiB" in reason


def test_start_minimum_is_named() -> None:
    reason = admit(RamView(2 * GIB), RamNeed(start_min_bytes=3 * GIB))
    assert reason is not None and "ram_start_min_gib" in reason


def test_unsampled_ram_admits() -> None:
    assert admit(RamView(None, 8 * GIB), RamNeed(cap_bytes=64 * GIB)) is None


def test_running_caps_promise_what_they_do_not_use_yet() -> None:
    assert promised([(4 * GIB, 1 * GIB), (2 * GIB, 3 * GIB), (0, 5 * GIB)]) == 3 * GIB
    view = RamView(10 * GIB, promised_bytes=promised([(4 * GIB, 1 * GIB)]))
    assert admit(view, RamNeed(cap_bytes=7 * GIB)) is None
    reason = admit(view, RamNeed(cap_bytes=8 * GIB))
    assert reason == (
        "host RAM: 10.00 GiB available (3.00 GiB of it promised to running jobs' caps), "
        "a floor of 0.00 GiB must stay free beside the job's cap of 8.00 GiB"
    )


def test_a_start_takes_its_cap_and_leaves_its_floor() -> None:
    view = RamView(10 * GIB).after_start(RamNeed(cap_bytes=4 * GIB, floor_bytes=3 * GIB))
    assert view.promised_bytes == 4 * GIB and view.running_floors == (3 * GIB,)
    assert admit(view, RamNeed(cap_bytes=3 * GIB)) is None  # 10 - 4 - 3 = 3
    assert admit(view, RamNeed(cap_bytes=4 * GIB)) is not None
    assert RamView(10 * GIB).after_start(NO_RAM) == RamView(10 * GIB)


@given(
    available=st.integers(min_value=0, max_value=64 * GIB),
    node_floor=st.integers(min_value=0, max_value=8 * GIB),
    caps=st.lists(st.integers(min_value=0, max_value=16 * GIB), min_size=1, max_size=12),
    floors=st.lists(st.integers(min_value=0, max_value=8 * GIB), min_size=12, max_size=12),
)
def test_a_pass_never_admits_more_caps_than_the_memory_left(
    available: int, node_floor: int, caps: list[int], floors: list[int]
) -> None:
    """Whatever the queue: the caps a pass starts, with the largest floor of what
    started and the node's, fit in MemAvailable."""
    queued = tuple(
        QueuedJob(f"j{i}", "t.cpu", Lane.CPU, 0, 0, i, ram=RamNeed(cap, floors[i], 0))
        for i, cap in enumerate(caps)
    )
    snapshot = Snapshot(
        queued, (), cpu_slots=64, ram=RamView(available, node_floor_bytes=node_floor)
    )
    started = {d.job_id for d in plan(snapshot, 0.0) if isinstance(d, Start)}
    jobs = [j for j in queued if j.id in started]
    kept = max([node_floor, *(j.ram.floor_bytes for j in jobs)])
    assert sum(j.ram.cap_bytes for j in jobs) <= max(0, available - kept) or not jobs
    for d in plan(snapshot, 0.0):
        if not isinstance(d, Start):
            assert d.reason.startswith("host RAM: ")  # the only thing that holds a cpu job here


@given(total=_bytes, node_floor=_bytes, cap=_bytes, floor=_bytes, start_min=_bytes, data=st.data())
def test_a_need_never_admitted_is_refused_however_much_is_free(
    total: int, node_floor: int, cap: int, floor: int, start_min: int, data: st.DataObject
) -> None:
    """What ``never_admits`` refuses at submission, ``admit`` refuses with any
    amount of the host's RAM free and nothing running; what it takes, ``admit``
    takes on the empty host."""
    need = RamNeed(cap, floor, start_min)
    why = never_admits(RamView(None, node_floor, total_bytes=total), need)
    if why is None:
        assert admit(RamView(total, node_floor), need) is None
    else:
        available = data.draw(st.integers(min_value=0, max_value=total))
        assert admit(RamView(available, node_floor), need) is not None
    assert never_admits(RamView(None, node_floor), need) is None  # total unknown: no check
