"""One reaper for the host attempts: a thread that waits on their main processes.

:class:`Reaper` watches every attempt :meth:`HostLauncher.start
<gpuwarden.launch.host.HostLauncher.start>` started, each by a pidfd (Linux 5.3;
elsewhere a 10 ms ``waitid`` poll), in one ``poll()`` with a wake pipe: an exit
is seen the moment it happens, a stop request (:class:`StopSignal`) or a timeout
at once, and nothing runs per attempt while it runs but a cheap walk of its
process tree now and then (:func:`tree_pids`: ``/proc/PID/task/*/children``, no
scan of the process table).

The broker process is made a child subreaper (``PR_SET_CHILD_SUBREAPER``): a
process an attempt leaves behind whose parent exits is reparented to the broker,
not to init, so every process of an attempt stays in the broker's tree. That is
what lets the normal end (the main process exited by itself) check for leftovers
without the whole-table scans of the stop path (:func:`quick_leftovers`). An
attempt with leftovers, a timeout or a stop goes to a thread of its own for the
stop (SIGTERM, grace, SIGKILL, confirmed gone), which keeps those scans.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.launch.base import ATTEMPT_ENV

log = logging.getLogger(__name__)

#: linux/prctl.h
_PR_SET_CHILD_SUBREAPER = 36
#: without pidfds, how often the reaper looks at the main processes
POLL_S = 0.01
#: how often a plain threading.Event given as ``stop`` is looked at
STOP_POLL_S = 0.05

_subreaper_lock = threading.Lock()
#: this process's answer, once asked (the pid it was asked in: a fork asks again)
_subreaper: dict[int, bool] = {}


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (once); False
    where the system cannot (then leftovers are looked for by scans)."""
    me = os.getpid()
    with _subreaper_lock:
        if me not in _subreaper:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                _subreaper[me] = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
            except (OSError, AttributeError):
                _subreaper[me] = False
        return _subreaper[me]


def is_subreaper() -> bool:
    """Whether :func:`become_subreaper` made this process one."""
    with _subreaper_lock:
        return _subreaper.get(os.getpid(), False)


class StopSignal(threading.Event):
    """A :class:`threading.Event` that tells listeners when it is set: the reaper
    is woken by a stop at once instead of looking at the event now and then."""

    def __init__(self) -> None:
        super().__init__()
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)
        if self.is_set():
            callback()

    def set(self) -> None:
        super().set()
        for callback in list(self._listeners):
            with contextlib.suppress(Exception):
                callback()


# -- /proc, read cheaply ---------------------------------------------------------


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), [] when it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    out: list[int] = []
    for task in tasks:
        try:
            out.extend(int(x) for x in (task / "children").read_bytes().split())
        except (OSError, ValueError):
            continue
    return out


def stat(pid: int) -> tuple[str, int, int, int] | None:
    """``(state, ppid, pgid, sid)`` of ``pid``, or None when it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3])


def carries(pid: int, marker: str) -> bool:
    """True when ``pid``'s environment holds ``ATTEMPT_ENV=marker``."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{ATTEMPT_ENV}={marker}".encode() in env.split(b"\0")


def tree_pids(root: int) -> list[int]:
    """Every descendant of ``root`` now (``root`` not included)."""
    out: list[int] = []
    todo = children(root)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children(pid))
    return out


def quick_leftovers(
    main: int, marker: str, remembered: Iterable[int], others: Iterable[int]
) -> list[int] | None:
    """The live processes of the attempt whose main process ``main`` has exited
    (its zombie not reaped yet), found without scanning the process table: the
    ``remembered`` descendants, and every process under this (subreaper)
    process that is in ``main``'s group or session or carries ``marker``,
    skipping the trees of the ``others`` (the main processes of other attempts).
    None when this process is no subreaper: then only a scan can tell.

    Zombies of the attempt that were reparented here are reaped on the way."""
    if not become_subreaper():
        return None
    me, skip = os.getpid(), set(others)
    found = [p for p in remembered if _alive(p)]
    todo = [c for c in children(me) if c not in skip and c != main] + children(main)
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        st = stat(pid)
        if st is None:
            continue
        state, ppid, pgid, sid = st
        todo.extend(children(pid))
        ours = main in (pgid, sid)
        if state in ("Z", "X"):
            if ours and ppid == me and pid != sid:  # an orphan of the attempt: ours to reap
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            continue
        if ours or carries(pid, marker):
            found.append(pid)
    return sorted(set(found))


def _alive(pid: int) -> bool:
    st = stat(pid)
    return st is not None and st[0] not in ("Z", "X")


# -- the reaper ---------------------------------------------------------------------


@dataclass(eq=False)
class Watched:
    """One attempt the reaper watches. ``check(now)`` is called on the reaper's
    thread whenever it wakes (an exit, a stop, a due time); it returns True when
    the attempt is over and must be dropped, and says when it wants to be
    looked at again by setting ``due`` (monotonic seconds, None: only on events)."""

    pid: int
    check: Callable[[float, bool], bool]
    stop: threading.Event
    due: float | None = None
    pidfd: int | None = None
    polled: bool = field(default=False)


class Reaper:
    """The thread that watches every host attempt's main process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adding: list[Watched] = []
        self._watched: dict[int, Watched] = {}  # by pid
        self._wake_r = self._wake_w = -1  # made with the thread, at the first watch
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def pids(self) -> list[int]:
        """The main processes watched now."""
        with self._lock:
            return [*self._watched, *(w.pid for w in self._adding)]

    def watch(self, w: Watched) -> None:
        """Watch ``w`` from now on (any thread)."""
        with contextlib.suppress(OSError, AttributeError):
            w.pidfd = os.pidfd_open(w.pid)
        if isinstance(w.stop, StopSignal):
            w.stop.listen(self.poke)
        else:
            w.polled = True
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._thread, self._pid = None, os.getpid()
                self._watched.clear()
            self._adding.append(w)
            if self._thread is None:
                become_subreaper()
                self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)
                self._thread.start()
        self.poke()

    def poke(self) -> None:
        """Wake the reaper's thread (a stop was asked)."""
        if self._wake_w < 0:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"!")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd: dict[int, Watched] = {}
        while True:
            with self._lock:
                for w in self._adding:
                    self._watched[w.pid] = w
                    if w.pidfd is not None:
                        poller.register(w.pidfd, select.POLLIN)
                        by_fd[w.pidfd] = w
                self._adding.clear()
                watched = list(self._watched.values())
            ready = {fd for fd, _ in poller.poll(_timeout_ms(watched))}
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            now = time.monotonic()
            for w in watched:
                exited = w.pidfd in ready if w.pidfd is not None else True
                try:
                    over = w.check(now, exited)
                except Exception:  # never leave the reaper: the check posts its own end
                    log.exception("the reaper's check of PID %s failed", w.pid)
                    over = True
                if over:
                    with self._lock:
                        self._watched.pop(w.pid, None)
                    if w.pidfd is not None:
                        poller.unregister(w.pidfd)
                        by_fd.pop(w.pidfd, None)
                        os.close(w.pidfd)


def _timeout_ms(watched: list[Watched]) -> int:
    """How long the reaper may sleep: until the first due time; POLL_S with a
    main process it cannot wait on; STOP_POLL_S with a stop it is not told of."""
    now = time.monotonic()
    wait: float | None = None
    for w in watched:
        limits = [w.due - now] if w.due is not None else []
        if w.pidfd is None:
            limits.append(POLL_S)
        if w.polled:
            limits.append(STOP_POLL_S)
        for limit in limits:
            wait = limit if wait is None else min(wait, limit)
    if wait is None:
        return -1
    return max(0, int(wait * 1000) + 1)


#: the one reaper of this process
REAPER = Reaper()
