"""Host RAM admission: the pure rule (issue 18).

A job may ask for a RAM cap (``ram_gib``), a floor of host RAM that must stay
available beside it (``ram_floor_gib``) and a minimum of MemAvailable right
before it starts (``ram_start_min_gib``). The floor that holds on a node is the
largest of the node's own (``[broker] ram_floor_gib``), the job's and every
running job's. A job is admitted when MemAvailable minus that floor still holds
its cap, and MemAvailable is at least its start minimum. The planner asks this
with the loop's sample of the tick; the launcher asks it again with a fresh
sample right before the start. No I/O here: the sample comes in.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RamNeed", "RamView", "admit", "floor_of"]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class RamNeed:
    """What one job asks of the host's RAM, in bytes (0: nothing asked)."""

    cap_bytes: int = 0
    floor_bytes: int = 0
    start_min_bytes: int = 0

    @property
    def asks(self) -> bool:
        return bool(self.cap_bytes or self.floor_bytes or self.start_min_bytes)


@dataclass(frozen=True, slots=True)
class RamView:
    """The node's RAM as sampled: MemAvailable (None: not sampled), the node's
    floor and the floors of the jobs running there."""

    available_bytes: int | None
    node_floor_bytes: int = 0
    running_floors: tuple[int, ...] = ()


def floor_of(view: RamView, need: RamNeed) -> int:
    """The floor that holds if the job starts: the node's, the job's and every
    running job's, whichever is largest."""
    return max((view.node_floor_bytes, need.floor_bytes, *view.running_floors))


def admit(view: RamView, need: RamNeed) -> str | None:
    """None when the job may start beside what runs; else why not (a wait reason)."""
    available = view.available_bytes
    if available is None:
        return None
    if need.start_min_bytes and available < need.start_min_bytes:
        return (
            f"host RAM: {_gib(available)} available, "
            f"the job needs {_gib(need.start_min_bytes)} to start (ram_start_min_gib)"
        )
    floor = floor_of(view, need)
    if available - floor < need.cap_bytes or available < floor:
        return (
            f"host RAM: {_gib(available)} available, a floor of {_gib(floor)} must stay "
            f"free beside the job's cap of {_gib(need.cap_bytes)}"
        )
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
