"""The GPU lock files (``gpu_lock``), as the broker loop keeps and honours them.

:class:`GpuLocks` looks, at most every :data:`LOOK_S`, at who outside the broker
holds or waits for each GPU's lock (``/proc/locks``: one read, never a blocking
call), and marks those GPUs ``locked`` in the planner's view (their reason:
``GPU locked by PID N (cmd)``, or ``GPU wanted by PID N (cmd), which waits for
its lock``). It writes ``gpu_locked`` once when an outside process starts to keep
a GPU, and ``gpu_unlocked`` when it stops.

When an attempt starts, :meth:`GpuLocks.take` opens each of its GPUs' lock files
and takes the ``flock`` without blocking (the mode: ``core/gpulock.py``), before
the start is written: if an outsider took the lock since the last look, nothing
is written and the job stays queued, with the lock's reason. The descriptors
(``O_CLOEXEC``: never a job's) are kept with the attempt and closed by
:func:`release` when its end is drained, its processes gone.

Everything here runs on the loop's thread.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from gpuwarden.core.gpulock import LockMode
from gpuwarden.core.policy import GpuView
from gpuwarden.gpu.lockfile import (
    GpuLockError,
    Holder,
    LockTemplate,
    lock_state,
    open_lock,
    read_proc_locks,
    try_lock,
)
from gpuwarden.node.running import Emit

__all__ = ["LOOK_S", "GpuLocks", "release"]

#: how often the lock files are looked at (per GPU, at most)
LOOK_S = 0.5


class GpuLocks:
    """Who outside the broker keeps each GPU (``gpu_lock``); off without a template."""

    def __init__(
        self,
        template: LockTemplate | None,
        *,
        emit: Emit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.template = template
        self.emit = emit
        self.clock = clock
        #: per GPU an outsider keeps: the reason the plan gives
        self.reasons: dict[str, str] = {}
        #: per GPU an outsider keeps: its PID (0: unknown, or the file unusable)
        self._pids: dict[str, int] = {}
        self._next = 0.0

    @classmethod
    def of(cls, template: str, group: str, emit: Emit) -> GpuLocks:
        """The locks of ``gpu_lock`` (``template``, "": off) and ``gpu_lock_group``."""
        return cls(LockTemplate(template, group) if template else None, emit=emit)

    def refresh(self, uuids: Iterable[str], *, force: bool = False) -> bool:
        """Look at the GPUs' locks if :data:`LOOK_S` has passed since the last look
        (``force``: now). True when what the plan is told changed."""
        if self.template is None:
            return False
        now = self.clock()
        if not force and now < self._next:
            return False
        self._next = now + LOOK_S
        text = read_proc_locks()
        changed = False
        for uuid in uuids:
            changed |= self._note(uuid, *self._look(uuid, text))
        return changed

    def _look(self, uuid: str, text: str) -> tuple[int, str, str]:
        """An outsider's PID, command and reason for ``uuid`` ((0, "", "") if none)."""
        try:  # opened at each look: a lock file replaced since is the one looked at
            fd = open_lock(self._template(), uuid)
            try:
                holder, waiter = lock_state(fd, text)
            finally:
                os.close(fd)
        except (GpuLockError, OSError) as exc:
            return 0, "", f"its lock file cannot be used: {exc}"
        if holder is not None:
            return holder.pid, holder.cmd, holder.reason()
        if waiter is not None:
            return waiter.pid, waiter.cmd, waiter.wants_reason()
        return 0, "", ""

    def _template(self) -> LockTemplate:
        assert self.template is not None
        return self.template

    def _note(self, uuid: str, pid: int, cmd: str, reason: str) -> bool:
        """Keep ``uuid``'s reason; say in the event log when its outsider changed."""
        before = self.reasons.get(uuid, "")
        was = self._pids.get(uuid)
        now_pid = pid if reason else None
        if was is not None and was != now_pid:
            self.emit("gpu_unlocked", gpu=uuid, pid=was)
        if now_pid is not None and now_pid != was:
            self.emit("gpu_locked", gpu=uuid, pid=pid, cmd=cmd, reason=reason)
        if reason:
            self.reasons[uuid] = reason
            self._pids[uuid] = pid
        else:
            self.reasons.pop(uuid, None)
            self._pids.pop(uuid, None)
        return before != reason

    def mark(self, views: Sequence[GpuView]) -> tuple[GpuView, ...]:
        """The views, each GPU an outsider keeps marked ``locked`` with its reason."""
        return tuple(
            replace(v, locked=self.reasons[v.uuid]) if v.uuid in self.reasons else v for v in views
        )

    def take(self, uuids: Sequence[str], mode: LockMode | None) -> list[int] | None:
        """Lock each of ``uuids`` (``mode``; None or off: nothing to take): the open
        descriptors, to keep until the attempt's end is drained. None when one is
        kept by an outsider (as last seen, or found now): nothing is kept, and that
        GPU's reason says who."""
        if self.template is None or mode is None:
            return []
        taken: list[int] = []
        for uuid in uuids:
            fd: int | None = None
            try:
                if uuid in self.reasons:
                    raise _Kept(None)
                fd = open_lock(self.template, uuid)
                holder = try_lock(fd, shared=mode is LockMode.SHARED)
                if holder is not None:
                    raise _Kept(holder)
            except (_Kept, GpuLockError, OSError) as exc:
                release([*taken, *([] if fd is None else [fd])])
                if isinstance(exc, _Kept) and exc.holder is not None:
                    h = exc.holder
                    self._note(uuid, h.pid, h.cmd, h.reason())
                elif not isinstance(exc, _Kept):
                    self._note(uuid, 0, "", f"its lock file cannot be used: {exc}")
                return None
            taken.append(fd)
        return taken


class _Kept(Exception):
    """A GPU's lock is kept by an outsider (``holder``: found now; None: as last seen)."""

    def __init__(self, holder: Holder | None) -> None:
        super().__init__("kept")
        self.holder = holder


def release(fds: list[int]) -> None:
    """Close an attempt's lock descriptors: its locks are released."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
