"""The queue as the broker loop keeps it: queued jobs grouped into classes. Pure.

A *class* holds the queued jobs that a planning pass cannot tell apart but for
their arrival order: the same type, priority and footprint (the key is the
caller's; the loop uses ``(type, priority, declared footprint)``). Within a
class the jobs are kept in arrival order (``seq``), so a pass looks at each
class's head only: when the head of a class cannot start, no later job of the
same class can in that pass either (they need exactly what it needs, and the
room only shrinks as the pass goes on). A pass over a queue of 100,000 jobs in
a few dozen classes is then a pass over a few dozen heads.

Adding and removing a job are O(log n) (a heap per class, removal by a lazy
mark, compacted when half of a class is marks). Walking a class in order
(:meth:`QueueIndex.members`) does not change it and costs O(k log k) for the
first k jobs.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["NONE", "Leaf", "MinTree", "QueueIndex"]

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Class:
    heap: list[tuple[int, str]] = field(default_factory=list)  # (seq, job id)
    gone: set[str] = field(default_factory=set)  # removed, still in the heap

    def live(self) -> int:
        return len(self.heap) - len(self.gone)

    def settle(self) -> None:
        """Drop removed jobs from the top (and compact when they are half)."""
        if len(self.gone) * 2 > len(self.heap):
            self.heap = [e for e in self.heap if e[1] not in self.gone]
            heapq.heapify(self.heap)
            self.gone.clear()
            return
        while self.heap and self.heap[0][1] in self.gone:
            self.gone.discard(heapq.heappop(self.heap)[1])


class QueueIndex(Generic[K]):
    """Queued jobs by class, each class in arrival order."""

    def __init__(self) -> None:
        self._classes: dict[K, _Class] = {}
        self._key_of: dict[str, K] = {}
        self._seq_of: dict[str, int] = {}
        #: classes whose jobs changed since the last :meth:`take_touched`
        self._touched: set[K] = set()

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._key_of

    def add(self, job_id: str, seq: int, key: K) -> None:
        """Put a job in its class (again: a job already here is moved)."""
        if job_id in self._key_of:
            if self._key_of[job_id] == key and self._seq_of[job_id] == seq:
                return
            self.remove(job_id)
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = _Class()
        if job_id in cls.gone:  # re-added before its old entry was compacted away
            cls.gone.discard(job_id)
            cls.heap = [e for e in cls.heap if e[1] != job_id]
            heapq.heapify(cls.heap)
        heapq.heappush(cls.heap, (seq, job_id))
        self._touched.add(key)
        self._key_of[job_id] = key
        self._seq_of[job_id] = seq

    def remove(self, job_id: str) -> bool:
        """Take a job out (it started, ended or left the queue). False if absent."""
        key = self._key_of.pop(job_id, None)
        if key is None:
            return False
        del self._seq_of[job_id]
        self._touched.add(key)
        cls = self._classes[key]
        cls.gone.add(job_id)
        cls.settle()
        if not cls.live():
            del self._classes[key]
        return True

    def key_of(self, job_id: str) -> K | None:
        return self._key_of.get(job_id)

    def seq_of(self, job_id: str) -> int | None:
        return self._seq_of.get(job_id)

    def classes(self) -> list[K]:
        return list(self._classes)

    def size(self, key: K) -> int:
        cls = self._classes.get(key)
        return 0 if cls is None else cls.live()

    def head(self, key: K) -> tuple[int, str] | None:
        cls = self._classes.get(key)
        return cls.heap[0] if cls is not None and cls.heap else None

    def members(self, key: K) -> Iterator[tuple[int, str]]:
        """The class's jobs as ``(seq, id)``, in arrival order, lazily; the index
        must not change while this is walked."""
        cls = self._classes.get(key)
        if cls is None or not cls.heap:
            return
        heap, gone = cls.heap, cls.gone
        frontier = [(heap[0], 0)]
        while frontier:
            entry, i = heapq.heappop(frontier)
            if entry[1] not in gone:
                yield entry
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    def take_touched(self) -> set[K]:
        """The classes whose jobs changed since the last call (a clear touches all)."""
        out, self._touched = self._touched, set()
        return out

    def clear(self) -> None:
        self._touched.update(self._classes)
        self._classes.clear()
        self._key_of.clear()
        self._seq_of.clear()


#: a leaf of a :class:`MinTree`: ``(head seq, tie, position)``; an empty one is ``NONE``
Leaf = tuple[int, int, int]
NONE: Leaf = (1 << 62, 0, -1)


class MinTree:
    """The smallest leaf of any range of a fixed row of leaves (a segment tree):
    ``min_in`` and ``set`` cost O(log n). A copy is one list copy, so a planning
    pass changes a copy and leaves the one the index keeps as it was."""

    __slots__ = ("size", "t")

    def __init__(self, leaves: list[Leaf]) -> None:
        size = 1
        while size < len(leaves):
            size *= 2
        self.size = size
        t = [NONE] * (2 * size)
        t[size : size + len(leaves)] = leaves
        for i in range(size - 1, 0, -1):
            a, b = t[2 * i], t[2 * i + 1]
            t[i] = a if a <= b else b
        self.t = t

    def copy(self) -> MinTree:
        out = MinTree.__new__(MinTree)
        out.size, out.t = self.size, list(self.t)
        return out

    def set(self, pos: int, leaf: Leaf) -> None:
        t = self.t
        i = pos + self.size
        t[i] = leaf
        i //= 2
        while i:
            a, b = t[2 * i], t[2 * i + 1]
            t[i] = a if a <= b else b
            i //= 2

    def min_in(self, lo: int, hi: int) -> Leaf:
        """The smallest leaf at positions ``lo`` to ``hi - 1`` (``NONE`` if none)."""
        t = self.t
        best = NONE
        lo += self.size
        hi += self.size
        while lo < hi:
            if lo & 1:
                best = min(best, t[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = min(best, t[hi])
            lo //= 2
            hi //= 2
        return best
