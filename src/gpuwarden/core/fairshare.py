"""Fair share in VRAM-hours: each owner's recent use, decaying. Pure.

An owner's use is the GiB-hours of VRAM its attempts held (the bytes a job held
on the ledger times its attempt's run time), decaying with a half-life: use
``u`` counted at ``t0`` is worth ``u * 2 ** (-(t - t0) / half_life)`` at ``t``.
Among queued jobs of equal priority, the one whose owner used least goes first
(:func:`gpuwarden.core.policy.order`); priority still beats fair share, and an
owner's own jobs keep their arrival order.

:class:`Usage` is the small per-owner table the broker loop keeps: one value and
the time it was last brought up to date per owner, decayed lazily when it is
read or added to. A half-life of 0 turns fair share off (every owner reads 0).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwarden.core.model import GIB

__all__ = [
    "DEFAULT_HALF_LIFE_S",
    "Usage",
    "claim_rank",
    "decayed",
    "gib_hours",
    "hide_owners",
    "reported_held",
    "share_rows",
    "standing",
    "why_behind",
]

#: the default half-life of a use: 7 days
DEFAULT_HALF_LIFE_S = 7 * 24 * 3600.0
#: the owner of a job no API token submitted (the CLI on the host, a bundle)
LOCAL = ""


def decayed(value: float, since: float, now: float, half_life_s: float) -> float:
    """``value`` counted at ``since``, as it counts at ``now``."""
    if half_life_s <= 0:
        return 0.0
    if now <= since:
        return value
    return float(value * 0.5 ** ((now - since) / half_life_s))


def gib_hours(held_bytes: int, started_at: float, ended_at: float) -> float:
    """The GiB-hours of ``held_bytes`` held from ``started_at`` to ``ended_at``."""
    return max(0, held_bytes) / GIB * max(0.0, ended_at - started_at) / 3600.0


def claim_rank(priority: int, usage: float, seq: int) -> tuple[int, float, int]:
    """A queued job's place among the jobs a coordinator offers: higher priority
    first, then the owner who used least, then arrival (``seq``)."""
    return (-priority, usage, seq)


def reported_held(held_bytes: int | None, node_total_bytes: int) -> int:
    """The VRAM a node says an ended attempt held, as a coordinator counts it: never
    below 0, never more than all the node's GPUs hold (a node is trusted only so
    far)."""
    if held_bytes is None:
        return 0
    return max(0, min(int(held_bytes), max(0, node_total_bytes)))


@dataclass(slots=True)
class _Entry:
    value: float
    as_of: float


class Usage:
    """Each owner's decayed use in GiB-hours (``owner`` None reads as :data:`LOCAL`)."""

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._by_owner: dict[str, _Entry] = {}

    @property
    def enabled(self) -> bool:
        return self.half_life_s > 0

    def __len__(self) -> int:
        return len(self._by_owner)

    def add(self, owner: str | None, gib_h: float, now: float) -> None:
        """Count ``gib_h`` GiB-hours of use for ``owner`` at ``now``."""
        if not self.enabled or gib_h <= 0:
            return
        key = owner or LOCAL
        e = self._by_owner.get(key)
        if e is None:
            self._by_owner[key] = _Entry(gib_h, now)
            return
        if now >= e.as_of:
            e.value = decayed(e.value, e.as_of, now, self.half_life_s) + gib_h
            e.as_of = now
        else:  # counted late (an end older than the last): decay it to the entry's time
            e.value += decayed(gib_h, now, e.as_of, self.half_life_s)

    def of(self, owner: str | None, now: float) -> float:
        """``owner``'s use at ``now`` (0 for an owner never seen)."""
        e = self._by_owner.get(owner or LOCAL)
        if e is None or not self.enabled:
            return 0.0
        return decayed(e.value, e.as_of, now, self.half_life_s)

    def table(self, now: float) -> dict[str, float]:
        """Every owner's use at ``now``."""
        return {o: self.of(o, now) for o in self._by_owner}

    def load(self, rows: Iterable[tuple[str | None, float, float]]) -> None:
        """Take in stored use: ``(owner, GiB-hours, as of)`` rows (added up)."""
        for owner, value, as_of in rows:
            self.add(owner, value, as_of)


def standing(use: Mapping[str, float]) -> dict[str, int]:
    """Each owner's rank among owners: 1 for the least use (who goes first)."""
    ranked = sorted(use, key=lambda o: (use[o], o))
    return {o: n for n, o in enumerate(ranked, start=1)}


def share_rows(
    use: Mapping[str, float], counts: Mapping[str, tuple[int, int]]
) -> list[dict[str, Any]]:
    """What ``gpuwarden share`` shows: each owner (owner "" is local) with its use in
    GiB-hours now, its queued and running jobs, and its standing (1: goes first at
    equal priority), least use first. ``counts``: ``(queued, running)`` by owner."""
    owners = set(use) | set(counts)
    ranks = standing({o: use.get(o, 0.0) for o in owners})
    return [
        {
            "owner": o,
            "gib_h": round(use.get(o, 0.0), 4),
            "queued": counts.get(o, (0, 0))[0],
            "running": counts.get(o, (0, 0))[1],
            "standing": ranks[o],
        }
        for o in sorted(owners, key=ranks.__getitem__)
    ]


def why_behind(mine: str, my_use: float, other: str, other_use: float) -> str | None:
    """Why a job of ``mine`` waits behind a job of ``other`` at equal priority
    because of fair share, or None when fair share is not why."""
    if other == mine or other_use >= my_use:
        return None
    return (
        f"fair share: owner {other or 'local'} has used less: "
        f"{other_use:.2f} GiB-h against {my_use:.2f}"
    )


_OWNER_IN_TEXT = re.compile(r"owner (?P<owner>\S+) has used less")


def hide_owners(text: str, own: str | None) -> str:
    """``text`` (an explain line) with every owner but ``own`` named ``another owner``
    (a submitter sees no other token's id)."""

    def swap(m: re.Match[str]) -> str:
        return m.group(0) if m.group("owner") == own else "another owner has used less"

    return _OWNER_IN_TEXT.sub(swap, text)
