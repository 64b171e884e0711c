"""node/queue.py's Shelves: the index's classes as sized lineups' shelves, kept in
step with the index between passes."""

from __future__ import annotations

from gpuwarden.core.queueindex import QueueIndex
from gpuwarden.node.queue import Shelves


def test_shelves_follow_the_index() -> None:
    index: QueueIndex[tuple[str, int, int | None, str]] = QueueIndex()
    for seq, (size, owner) in enumerate([(4, "a"), (2, "a"), (4, "b"), (8, "a"), (2, "a")]):
        index.add(f"j{seq}", seq, ("cmd", 0, size, owner))
    shelves = Shelves(index)
    assert {o: sorted(c) for o, c in shelves.groups()[("cmd", 0)].items()} == {
        "a": [2, 4, 8],
        "b": [4],
    }
    shelf = shelves.shelf(("cmd", 0), "a", 1.5, lambda own: own or 0, None)
    assert (shelf.sizes, shelf.heads, shelf.usage) == ([2, 4, 8], ["j1", "j0", "j3"], 1.5)
    assert shelf.tree.min_in(0, 3) == (0, 0, 1)  # j0, of size 4, came first
    index.remove("j1")  # a head goes: its leaf follows, nothing is built again
    again = shelves.shelf(("cmd", 0), "a", 0.0, lambda own: own or 0, None)
    assert again.tree is shelf.tree and again.heads == ["j4", "j0", "j3"]
    assert again.tree.min_in(0, 1) == (4, 0, 0)
    assert [j for _, j in again.members(0)] == ["j4"]
    index.remove("j3")  # a size goes: the shelf is built again
    last = shelves.shelf(("cmd", 0), "a", 0.0, lambda own: own or 0, None)
    assert last.tree is not shelf.tree and (last.sizes, last.heads) == ([2, 4], ["j4", "j0"])
    assert sorted(shelves.plan_keys(("cmd", 0))) == [("cmd", 0, 2), ("cmd", 0, 4)]
