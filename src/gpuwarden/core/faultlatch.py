"""The fault latch: what a critical Xid leaves on a GPU until an operator clears it.

A latch is kept in two places: the store (the truth) and a small file in the
node's state folder (for a node whose store cannot be read at its start). At a
broker's start the two are reconciled by :func:`restore`; the reason a latched
GPU waits with is :func:`latched_reason`. Pure: the time comes in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: the longest reason an operator gives when clearing a fault
CLEAR_REASON_MAX = 500


@dataclass(frozen=True, slots=True)
class Latch:
    """One open latch: a GPU's critical Xid, and when it was latched."""

    gpu: str
    xid: int
    latched_at: float

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "xid": self.xid, "latched_at": self.latched_at}

    @classmethod
    def from_json(cls, d: Any) -> Latch | None:
        """A latch as the file holds it, or None for an entry that is not one."""
        if not isinstance(d, dict):
            return None
        gpu, xid, at = d.get("gpu"), d.get("xid"), d.get("latched_at")
        if not isinstance(gpu, str) or not gpu or type(xid) is not int:
            return None
        if not isinstance(at, int | float) or isinstance(at, bool):
            return None
        return cls(gpu, xid, float(at))


def when(ts: float) -> str:
    """A latch's time as a person reads it (UTC)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def latched_reason(latch: Latch) -> str:
    """Why VRAM admission stays paused on a latched GPU, and what ends it."""
    return (
        f"Xid {latch.xid} (latched since {when(latch.latched_at)}): check `nvidia-smi -q` "
        f"and the kernel log (dmesg) on this host; once fixed, "
        f"`gpuwarden gpu clear {latch.gpu} --reason TEXT` ends it (a broker restart does not)"
    )


def restore(
    stored: Sequence[Latch] | None,
    filed: Iterable[Latch],
    known: Iterable[tuple[str, float]] = (),
) -> tuple[list[Latch], list[Latch]]:
    """At a broker's start: the open latches, and those of them the store lacks.

    ``stored``: the store's open latches of this node (None: the store could not be
    read; the file's latches hold then). ``filed``: the file's. ``known``: every
    ``(gpu, latched_at)`` the store has, closed ones too. The store is the truth,
    but a latch in the file that the store never had (its write was lost) is kept,
    and returned second so that it is written; one the store has closed stays closed.
    One latch per GPU: the store's, else the earliest in the file."""
    filed = sorted(filed, key=lambda f: f.latched_at)
    if stored is None:
        out: dict[str, Latch] = {}
        for f in filed:
            out.setdefault(f.gpu, f)
        return list(out.values()), []
    seen = set(known) | {(s.gpu, s.latched_at) for s in stored}
    open_ = {s.gpu: s for s in stored}
    lost: list[Latch] = []
    for f in filed:
        if f.gpu not in open_ and (f.gpu, f.latched_at) not in seen:
            open_[f.gpu] = f
            lost.append(f)
    return list(open_.values()), lost
