"""Host RAM admission: the pure rule (issue 18).

A job may ask for a RAM cap (``ram_gib``), a floor of host RAM that must stay
available beside it (``ram_floor_gib``) and a minimum of MemAvailable right
before it starts (``ram_start_min_gib``). The floor that holds on a node is the
largest of the node's own (``[broker] ram_floor_gib``), the job's and every
running job's. A job is admitted when what is available, less the floor, still
holds its cap, and MemAvailable is at least its start minimum.

What is available is MemAvailable less what running jobs were promised and
have not taken yet: each running job with a cap may still grow to it, so the
part of its cap it does not use now is counted as taken (:func:`promised`).
Within one planning pass each start takes its cap from what is left
(:meth:`RamView.after_start`), so two jobs are never admitted against the same
free memory. The planner asks this with the loop's sample; the broker asks it
again with a fresh sample right before the launch. No I/O here: the sample
comes in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "MAX_RAM_GIB",
    "NO_RAM",
    "RAM_KEYS",
    "UNSAMPLED",
    "RamNeed",
    "RamView",
    "admit",
    "check_ram_gib",
    "floor_of",
    "gib_text",
    "never_admits",
    "promised",
]

GIB = 1 << 30
#: the largest RAM figure a job may name, in GiB (64 TiB)
MAX_RAM_GIB = 65536
#: a job's RAM keys (manifest, API body), in the order SPEC.md lists them
RAM_KEYS = ("ram_gib", "ram_floor_gib", "ram_start_min_gib")


@dataclass(frozen=True, slots=True)
class RamNeed:
    """What one job asks of the host's RAM, in bytes (0: nothing asked)."""

    cap_bytes: int = 0
    floor_bytes: int = 0
    start_min_bytes: int = 0

    @property
    def asks(self) -> bool:
        return bool(self.cap_bytes or self.floor_bytes or self.start_min_bytes)

    def to_json(self) -> dict[str, int]:
        """The keys it sets, in bytes (``ram_cap_bytes``, ...); {} when it asks nothing."""
        out = {
            "ram_cap_bytes": self.cap_bytes,
            "ram_floor_bytes": self.floor_bytes,
            "ram_start_min_bytes": self.start_min_bytes,
        }
        return {k: v for k, v in out.items() if v}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RamNeed:
        return cls(
            int(d.get("ram_cap_bytes") or 0),
            int(d.get("ram_floor_bytes") or 0),
            int(d.get("ram_start_min_bytes") or 0),
        )

    def gib_keys(self) -> dict[str, float]:
        """The keys it sets as a manifest or API body writes them (GiB)."""
        values = (self.cap_bytes, self.floor_bytes, self.start_min_bytes)
        return {k: v / GIB for k, v in zip(RAM_KEYS, values, strict=True) if v}


@dataclass(frozen=True, slots=True)
class RamView:
    """The node's RAM as sampled: MemAvailable (None: not sampled), what running
    jobs were promised and have not taken yet, the node's floor and the floors of
    the jobs running there."""

    available_bytes: int | None
    node_floor_bytes: int = 0
    running_floors: tuple[int, ...] = ()
    promised_bytes: int = 0
    #: the host's RAM in all (MemTotal; None: not known): what no job can pass
    total_bytes: int | None = None

    @property
    def free_bytes(self) -> int | None:
        """What a new job may count on: MemAvailable less what was promised."""
        if self.available_bytes is None:
            return None
        return self.available_bytes - self.promised_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "available_bytes": self.available_bytes,
            "node_floor_bytes": self.node_floor_bytes,
            "running_floors": list(self.running_floors),
            "promised_bytes": self.promised_bytes,
            "total_bytes": self.total_bytes,
        }

    @classmethod
    def from_json(cls, d: Any) -> RamView:
        """A published view read back; anything unreadable is an unsampled view."""
        if not isinstance(d, dict):
            return cls(None)
        try:
            available, total = d.get("available_bytes"), d.get("total_bytes")
            return cls(
                None if available is None else int(available),
                int(d.get("node_floor_bytes") or 0),
                tuple(int(f) for f in d.get("running_floors") or ()),
                int(d.get("promised_bytes") or 0),
                None if total is None else int(total),
            )
        except (TypeError, ValueError):
            return cls(None)

    def after_start(self, need: RamNeed) -> RamView:
        """The view once a job with ``need`` has started (within one pass): its cap
        is promised, its floor holds beside the others."""
        if not need.asks:
            return self
        return replace(
            self,
            running_floors=(*self.running_floors, need.floor_bytes),
            promised_bytes=self.promised_bytes + need.cap_bytes,
        )


#: a job that asks nothing of the host's RAM
NO_RAM = RamNeed()
#: host RAM not sampled: every job is admitted as far as RAM goes
UNSAMPLED = RamView(None)


def promised(running: Iterable[tuple[int, int]]) -> int:
    """What running jobs may still take: for each ``(cap, used now)``, the part of
    its cap it does not use yet (a job without a cap, 0, promises nothing)."""
    return sum(max(0, cap - used) for cap, used in running if cap > 0)


def floor_of(view: RamView, need: RamNeed) -> int:
    """The floor that holds if the job starts: the node's, the job's and every
    running job's, whichever is largest."""
    return max((view.node_floor_bytes, need.floor_bytes, *view.running_floors))


def admit(view: RamView, need: RamNeed) -> str | None:
    """None when the job may start beside what runs; else why not (a wait reason)."""
    available, free = view.available_bytes, view.free_bytes
    if available is None or free is None:
        return None
    if need.start_min_bytes and available < need.start_min_bytes:
        return (
            f"host RAM: {gib_text(available)} available, "
            f"the job needs {gib_text(need.start_min_bytes)} to start (ram_start_min_gib)"
        )
    floor = floor_of(view, need)
    if free - floor < need.cap_bytes or free < floor:
        promised_part = (
            f" ({gib_text(view.promised_bytes)} of it promised to running jobs' caps)"
            if view.promised_bytes
            else ""
        )
        cap = f"beside the job's cap of {gib_text(need.cap_bytes)}" if need.cap_bytes else ""
        return (
            f"host RAM: {gib_text(available)} available{promised_part}, a floor of "
            f"{gib_text(floor)} must stay free{' ' + cap if cap else ''}"
        )
    return None


def never_admits(view: RamView, need: RamNeed) -> str | None:
    """Why a job asking ``need`` can never start on the host of ``view``, however
    much of its RAM is free (refused at submission, as a footprint no GPU holds
    is); None when it may some day, or the host's RAM is not known."""
    total = view.total_bytes
    if total is None:
        return None
    host = f"this host has {gib_text(total)} of RAM in all"
    if need.start_min_bytes > total:
        return (
            f"needs {gib_text(need.start_min_bytes)} of RAM available to start "
            f"(ram_start_min_gib), and {host}: ask for less"
        )
    floor = max(view.node_floor_bytes, need.floor_bytes)
    if need.cap_bytes + floor > total:
        return (
            f"asks for a RAM cap of {gib_text(need.cap_bytes)} (ram_gib) with a floor of "
            f"{gib_text(floor)} that must stay free beside it, and {host}: ask for less"
        )
    return None


def check_ram_gib(value: Any, key: str) -> int:
    """A job's RAM key (``ram_gib``, ``ram_floor_gib``, ``ram_start_min_gib``) in
    bytes, rounded up; ValueError saying what is wrong with it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number of GiB, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be greater than 0 GiB, got {value!r}")
    if value > MAX_RAM_GIB:
        raise ValueError(f"{key} must be at most {MAX_RAM_GIB} GiB, got {value!r}")
    return math.ceil(value * GIB)


def gib_text(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
