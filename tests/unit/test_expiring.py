"""api/expiring.py: entries end at their time, the oldest go past the limit."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.api.expiring import Expiring


@dataclass(frozen=True)
class Entry:
    name: str
    expires_at: float


def test_an_entry_lives_until_its_time_and_take_uses_it_up() -> None:
    now = [100.0]
    book: Expiring[Entry] = Expiring(10, lambda: now[0])
    book.add("k", Entry("a", 110.0))
    assert book.get("k") == Entry("a", 110.0)
    now[0] = 110.0
    assert book.get("k") is None
    assert len(book) == 0  # an expired entry read is gone
    book.add("t", Entry("b", 200.0))
    assert book.get("t", take=True) == Entry("b", 200.0)
    assert book.get("t") is None


def test_past_the_limit_the_oldest_go_first_and_expired_ones_before_them() -> None:
    now = [0.0]
    book: Expiring[Entry] = Expiring(3, lambda: now[0])
    for i in range(3):
        book.add(f"k{i}", Entry(str(i), 100.0))
    book.add("k3", Entry("3", 100.0))
    assert book.get("k0") is None
    assert [book.get(f"k{i}") is not None for i in (1, 2, 3)] == [True, True, True]
    book.add("short", Entry("s", 5.0))  # k1 goes: the limit
    now[0] = 6.0
    book.add("k4", Entry("4", 100.0))  # "short" expired: it goes, k2 stays
    assert book.get("k2") is not None
    assert book.pop("k4") is True
    assert book.pop("k4") is False
