"""The GPUs of one planning pass ordered by free memory, for best fit. Pure.

A pass starts a ``vram`` job on the GPU where it fits tightest: the least free
memory that still holds it, ties to the smaller UUID. Scanning every GPU for
every job a pass judges costs GPUs x jobs; :class:`FreeOrder` keeps the GPUs a
job may simply be put on in two sorted rows instead, so the tightest is one
bisect. Only a GPU nothing is held back for and that is not degraded is in a
row: ``shared``, where every holder shares its GPU (an empty one too), for a
co-resident job; ``empty``, nothing on it, for a job that needs a GPU to
itself. A GPU held back for a job (``held``) is judged by the caller, the slow
way (there are few): a job may start there only beside that job, or before it.
"""

from __future__ import annotations

from bisect import bisect_left, insort

__all__ = ["FreeOrder"]

#: a row's entry: ``(free bytes, uuid, position)``, sorted
Entry = tuple[int, str, int]


class FreeOrder:
    """GPUs by free memory: each position in at most one place of each kind
    (``shared`` and ``empty`` rows, or ``held``)."""

    __slots__ = ("_at", "empty", "held", "shared")

    def __init__(self) -> None:
        self.shared: list[Entry] = []
        self.empty: list[Entry] = []
        #: positions of GPUs held back for a job (in order), judged by the caller
        self.held: list[int] = []
        self._at: dict[int, Entry] = {}

    def put(self, pos: int, free: int, uuid: str, *, empty: bool) -> None:
        """GPU ``pos`` (not degraded, nothing held back for it, every holder
        co-resident) has ``free`` bytes free; ``empty``: nothing holds it."""
        self.drop(pos)
        entry = (free, uuid, pos)
        self._at[pos] = entry
        insort(self.shared, entry)
        if empty:
            insort(self.empty, entry)

    def drop(self, pos: int) -> None:
        """GPU ``pos`` takes no job simply put on it (any more)."""
        entry = self._at.pop(pos, None)
        if entry is None:
            return
        for row in (self.shared, self.empty):
            i = bisect_left(row, entry)
            if i < len(row) and row[i] == entry:
                del row[i]

    def hold(self, pos: int) -> None:
        """GPU ``pos`` is held back for a job: out of the rows, into ``held``."""
        self.drop(pos)
        i = bisect_left(self.held, pos)
        if i == len(self.held) or self.held[i] != pos:
            self.held.insert(i, pos)

    def tightest(self, need: int, coresident: bool) -> int | None:
        """The position of the row's GPU with the least free memory that is at
        least ``need`` (ties: the smaller UUID, then position), or None."""
        row = self.shared if coresident else self.empty
        i = bisect_left(row, (need,))
        return row[i][2] if i < len(row) else None
