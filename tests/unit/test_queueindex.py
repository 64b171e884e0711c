"""The loop's queue index: classes of queued jobs, each in arrival order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.core.queueindex import NONE, MinTree, QueueIndex


def test_members_come_in_arrival_order_and_removal_is_seen() -> None:
    q = QueueIndex()
    for seq, job in [(5, "e"), (1, "a"), (3, "c"), (2, "b"), (4, "d")]:
        q.add(job, seq, "k")
    q.add("x", 0, "other")
    assert [j for _, j in q.members("k")] == ["a", "b", "c", "d", "e"]
    assert q.head("k") == (1, "a")
    assert q.remove("a") and q.remove("c")
    assert not q.remove("a")  # already gone
    assert [j for _, j in q.members("k")] == ["b", "d", "e"]
    assert q.head("k") == (2, "b")
    assert (len(q), q.size("k"), q.key_of("x")) == (4, 3, "other")
    assert q.remove("x") and "other" not in q.classes()


def test_a_job_added_again_moves_to_its_new_class_and_seq() -> None:
    q = QueueIndex()
    q.add("a", 1, "k")
    q.add("b", 2, "k")
    q.remove("a")
    q.add("a", 9, "k")  # re-queued before its old entry was compacted away
    assert [m for m in q.members("k")] == [(2, "b"), (9, "a")]
    q.add("a", 9, "j")
    assert [m for m in q.members("k")] == [(2, "b")]
    assert [m for m in q.members("j")] == [(9, "a")]


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove"]),
        st.integers(0, 15),  # job
        st.integers(0, 40),  # seq
        st.integers(0, 2),  # class
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_the_index_matches_a_plain_model(ops: list[tuple[str, int, int, int]]) -> None:
    q = QueueIndex()
    model: dict[str, tuple[int, int]] = {}
    for op, j, seq, key in ops:
        job = f"j{j}"
        if op == "add":
            q.add(job, seq, key)
            model[job] = (seq, key)
        else:
            assert q.remove(job) == (job in model)
            model.pop(job, None)
        assert len(q) == len(model)
        for k in range(3):
            want = sorted((s, i) for i, (s, kk) in model.items() if kk == k)
            assert list(q.members(k)) == want
            assert q.size(k) == len(want)
            assert q.head(k) == (want[0] if want else None)


@settings(max_examples=200)
@given(
    seqs=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    sets=st.lists(st.tuples(st.integers(0, 39), st.integers(-1, 50)), max_size=10),
    lo=st.integers(0, 40),
    hi=st.integers(0, 40),
)
def test_min_tree_is_the_least_leaf_of_a_range(
    seqs: list[int], sets: list[tuple[int, int]], lo: int, hi: int
) -> None:
    leaves = [(s, 0, pos) for pos, s in enumerate(seqs)]
    tree = MinTree(leaves)
    copy = tree.copy()
    for pos, seq in sets:
        if pos < len(leaves):
            leaves[pos] = NONE if seq < 0 else (seq, 0, pos)
            copy.set(pos, leaves[pos])
    hi = min(hi, len(leaves))
    lo = min(lo, hi)
    assert copy.min_in(lo, hi) == min(leaves[lo:hi], default=NONE)
    # the copy changed, the tree did not
    assert tree.min_in(0, len(seqs)) == min((s, 0, p) for p, s in enumerate(seqs))
