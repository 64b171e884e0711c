"""The RAM admission rule (core/ramadmit.py): pure, with a property test."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.core.ramadmit import GIB, RamNeed, RamView, admit, floor_of

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
