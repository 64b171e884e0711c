"""Faults of the host: a full, read-only or failing disk. They are nobody's fault
and they pass: work they meet waits and is tried again, never refused for good.

:func:`host_fault` says whether an error is one (an ``OSError`` with ENOSPC,
EDQUOT, EROFS or EIO, itself or among its causes); :class:`Backoff` is the wait
between tries of one piece of work (1 s, doubling, at most 60 s);
:func:`disk_full` says whether the file system under a path is full, as
``statvfs`` reports it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "FIRST_WAIT_S",
    "HOST_ERRNOS",
    "MOST_WAIT_S",
    "Backoff",
    "Waiting",
    "disk_full",
    "host_fault",
]

#: the errors of a host's disk: what waits for them waits for the host, not the work
HOST_ERRNOS = {
    errno.ENOSPC: "space on its disk (ENOSPC: no space left on device)",
    errno.EDQUOT: "room in its disk quota (EDQUOT: disk quota exceeded)",
    errno.EROFS: "its file system to be writable again (EROFS: read-only file system)",
    errno.EIO: "its disk to answer (EIO: input/output error)",
}

#: the first wait after a host fault, and the longest (the wait doubles between)
FIRST_WAIT_S = 1.0
MOST_WAIT_S = 60.0

#: a file system with less free than this (bytes, or a fraction of its size,
#: whichever is larger) is full for :func:`disk_full`
FULL_BYTES = 16 * 1024 * 1024
FULL_FRACTION = 0.005


def host_fault(exc: BaseException | None) -> str | None:
    """What ``exc`` waits for, when it (or an error it was raised from) is a fault
    of the host's disk; None when it is not."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in HOST_ERRNOS:
            return f"{HOST_ERRNOS[exc.errno]}: {exc}"
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def disk_full(path: str | os.PathLike[str]) -> str | None:
    """Whether the file system under ``path`` is full (little free space, or no
    free inode), said as a person reads it; None when it is not, or when
    ``statvfs`` cannot tell."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    if size > 0 and free < max(FULL_BYTES, size * FULL_FRACTION):
        return (
            f"the node's disk under {os.fspath(path)} is full "
            f"({free / 2**20:.1f} MiB free of {size / 2**20:.0f} MiB)"
        )
    if st.f_files > 0 and st.f_favail == 0:
        return f"the node's disk under {os.fspath(path)} has no free inode"
    return None


K = TypeVar("K")


@dataclass(frozen=True)
class Waiting:
    """One piece of work waiting for the host: until when, what for, since when."""

    until: float
    wait_s: float
    why: str
    since: float
    tries: int


class Backoff(Generic[K]):
    """The waits of pieces of work (by key) that met a host fault: each next wait
    twice the last, from ``first_s`` to at most ``most_s``."""

    def __init__(self, first_s: float = FIRST_WAIT_S, most_s: float = MOST_WAIT_S) -> None:
        self.first_s = first_s
        self.most_s = most_s
        self._waits: dict[K, Waiting] = {}

    def hold(self, key: K, now: float, why: str) -> Waiting:
        """``key`` met a host fault at ``now``: it waits, longer than last time."""
        last = self._waits.get(key)
        wait_s = self.first_s if last is None else min(last.wait_s * 2, self.most_s)
        since = now if last is None else last.since
        tries = 1 if last is None else last.tries + 1
        waiting = Waiting(until=now + wait_s, wait_s=wait_s, why=why, since=since, tries=tries)
        self._waits[key] = waiting
        return waiting

    def waits(self, key: K, now: float) -> bool:
        """True while ``key`` must not be tried yet."""
        w = self._waits.get(key)
        return w is not None and now < w.until

    def due(self, now: float) -> list[K]:
        """The keys whose wait is over (they may be tried again)."""
        return [k for k, w in self._waits.items() if now >= w.until]

    def get(self, key: K) -> Waiting | None:
        return self._waits.get(key)

    def clear(self, key: K) -> Waiting | None:
        """``key`` went through (or is gone): it waits no more. Returns its last wait."""
        return self._waits.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._waits

    def __len__(self) -> int:
        return len(self._waits)
