"""The host's RAM as the loop plans with it (SPEC.md section 11, "Host RAM").

:class:`HostRam` samples MemAvailable (``psutil.virtual_memory().available``,
which is ``/proc/meminfo``'s MemAvailable on Linux) at most every
``every_s`` for the plan, and :meth:`HostRam.fresh` reads it again right before
a launch. :func:`ram_view` builds the rule's view (:mod:`gpuwarden.core.ramadmit`)
from a sample and the running attempts: the largest floor among them, and what
their caps still promise beyond what their process trees use now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from gpuwarden.core.model import JobType, LaunchMode
from gpuwarden.core.ramadmit import RamNeed, RamView, promised

__all__ = ["HostRam", "RunningRam", "effective_need", "mem_available", "mem_total", "ram_view"]

#: how old the plan's sample may be
SAMPLE_S = 0.25


def mem_available() -> int:
    return int(psutil.virtual_memory().available)


def mem_total() -> int:
    return int(psutil.virtual_memory().total)


class HostRam:
    """MemAvailable, sampled for the plan at most every ``every_s``; ``read`` is
    the source (the tests give one of their own)."""

    def __init__(
        self,
        read: Callable[[], int] = mem_available,
        every_s: float = SAMPLE_S,
        total: Callable[[], int] = mem_total,
    ) -> None:
        self.read = read
        self.every_s = every_s
        self._last: tuple[float, int] | None = None
        #: MemTotal, read once: what no job's RAM request may pass
        self.total_bytes = total()

    def sample(self, now: float) -> int:
        if self._last is None or now - self._last[0] >= self.every_s or now < self._last[0]:
            self._last = (now, self.read())
        return self._last[1]

    def fresh(self, now: float) -> int:
        """Read it again now (right before a launch)."""
        self._last = (now, self.read())
        return self._last[1]


def effective_need(jobtype: JobType, need: RamNeed) -> RamNeed:
    """What a job asks of the host's RAM as the node admits it: its own cap, else
    its type's ``ram_gib`` (a warm server's jobs share its process: they add no
    cap of their own)."""
    if jobtype.launch is LaunchMode.SERVE:
        return RamNeed(0, need.floor_bytes, need.start_min_bytes)
    if need.cap_bytes or not jobtype.ram_bytes:
        return need
    return RamNeed(jobtype.ram_bytes, need.floor_bytes, need.start_min_bytes)


@dataclass(frozen=True, slots=True)
class RunningRam:
    """A running attempt as RAM admission sees it: what it asked and what its
    process tree uses now (0: not sampled yet, so its whole cap is promised)."""

    need: RamNeed
    used_bytes: int = 0


def ram_view(
    available: int | None,
    node_floor: int,
    running: Iterable[RunningRam],
    total: int | None = None,
) -> RamView:
    running = list(running)
    return RamView(
        available,
        node_floor,
        tuple(r.need.floor_bytes for r in running if r.need.floor_bytes),
        promised((r.need.cap_bytes, r.used_bytes) for r in running),
        total,
    )
