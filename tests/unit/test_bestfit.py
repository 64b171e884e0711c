"""core/bestfit.py's FreeOrder: after any sequence of changes, its rows hold exactly
the GPUs put and not dropped or held, sorted, and ``tightest`` is what a scan of
every such GPU finds (least free memory that holds the job, ties by UUID)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.core.bestfit import FreeOrder

#: a change: ("put", pos, free, empty) | ("drop", pos) | ("hold", pos)
changes = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 40), st.booleans()),
        st.tuples(st.just("drop"), st.integers(0, 7)),
        st.tuples(st.just("hold"), st.integers(0, 7)),
    ),
    max_size=40,
)


def uuid(pos: int) -> str:
    return f"G{(pos * 5) % 8}"  # not in position order: ties go by UUID first


@given(changes, st.integers(0, 45), st.booleans())
def test_rows_and_tightest_match_a_scan(ops: list[tuple], need: int, coresident: bool) -> None:
    order = FreeOrder()
    state: dict[int, tuple[int, bool]] = {}  # pos -> (free, empty): in the rows
    held: set[int] = set()
    for op in ops:
        if op[0] == "put":
            _, pos, free, empty = op
            order.put(pos, free, uuid(pos), empty=empty)
            state[pos] = (free, empty)
        elif op[0] == "drop":
            order.drop(op[1])
            state.pop(op[1], None)
        else:
            order.hold(op[1])
            state.pop(op[1], None)
            held.add(op[1])
    assert order.shared == sorted((f, uuid(p), p) for p, (f, _) in state.items())
    assert order.empty == sorted((f, uuid(p), p) for p, (f, e) in state.items() if e)
    assert order.held == sorted(held)
    fits = [
        (f - need, uuid(p), p) for p, (f, e) in state.items() if f >= need and (coresident or e)
    ]
    assert order.tightest(need, coresident) == (min(fits)[2] if fits else None)


def test_a_held_gpu_leaves_the_rows_once() -> None:
    order = FreeOrder()
    order.put(0, 10, "G0", empty=True)
    order.put(1, 4, "G1", empty=False)
    assert order.tightest(3, True) == 1 and order.tightest(3, False) == 0
    order.hold(0)
    order.hold(0)
    assert order.held == [0] and order.tightest(3, False) is None
    assert order.tightest(5, True) is None  # G1 has 4 free; G0 is held back
