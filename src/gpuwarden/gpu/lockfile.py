"""The GPU lock file (``gpu_lock``): an ``flock`` that tools outside the queue honour.

A node may name ``gpu_lock = "/run/gpuwarden/GPU-<uuid>.lock"``. A job that has
a GPU to itself holds ``flock(LOCK_EX)`` on that GPU's file for its run; a tool
outside the queue (``gpuwarden gpu lock UUID -- CMD``, a notebook that takes the
same lock) holds it while it uses the GPU. Who holds a lock is read from
``/proc/locks`` (flock holders by device and inode) and ``/proc/PID/cmdline``.

The folder is the broker's: made root-only when missing, and a lock file is
opened with ``O_NOFOLLOW`` (never a link) and must be a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.errors import GpuwardenError

__all__ = [
    "GpuLockError",
    "Holder",
    "LockTemplate",
    "holder_of",
    "holders_in",
    "lock_state",
    "open_lock",
    "read_proc_locks",
    "try_lock",
    "waiters_in",
]

_PLACEHOLDERS = ("<uuid>", "{uuid}")
_O_LOCK = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK


class GpuLockError(GpuwardenError):
    """A ``gpu_lock`` template or lock file the broker may not use."""


@dataclass(frozen=True, slots=True)
class LockTemplate:
    """A ``gpu_lock`` path template: absolute, with ``<uuid>`` or ``{uuid}`` in its name."""

    template: str

    def __post_init__(self) -> None:
        t = self.template
        if not t.startswith("/"):
            raise GpuLockError(f"gpu_lock {t!r}: must be an absolute path")
        if not any(p in t for p in _PLACEHOLDERS):
            raise GpuLockError(f"gpu_lock {t!r}: must contain <uuid> or {{uuid}}")
        head = t.rpartition("/")[0]
        if any(p in head for p in _PLACEHOLDERS):
            raise GpuLockError(f"gpu_lock {t!r}: <uuid> may only be in the file's name")
        if ".." in head.split("/"):
            raise GpuLockError(f"gpu_lock {t!r}: must not name '..'")

    @property
    def folder(self) -> Path:
        return Path(self.template.rpartition("/")[0] or "/")

    def path(self, uuid: str) -> Path:
        """The lock file of GPU ``uuid``; a UUID with ``/`` or a NUL is refused."""
        if not uuid or "/" in uuid or "\0" in uuid or uuid in (".", ".."):
            raise GpuLockError(f"{uuid!r} is not a GPU UUID")
        out = self.template
        for p in _PLACEHOLDERS:
            out = out.replace(p, uuid)
        return Path(out)


@dataclass(frozen=True, slots=True)
class Holder:
    """A process that holds a lock: its PID and its command line."""

    pid: int
    cmd: str

    def reason(self) -> str:
        """The wait reason: ``GPU locked by PID N (cmd)``."""
        return (
            f"GPU locked by PID {self.pid} ({self.cmd})"
            if self.cmd
            else (f"GPU locked by PID {self.pid}")
        )

    def wants_reason(self) -> str:
        """The wait reason while this process waits for the lock (nothing new starts
        on the GPU, so that it gets it once the jobs there end)."""
        who = f"PID {self.pid} ({self.cmd})" if self.cmd else f"PID {self.pid}"
        return f"GPU wanted by {who}, which waits for its lock"


def _flock_pids(proc_locks: str, dev: int, ino: int, *, waiting: bool) -> list[int]:
    """The PIDs of the ``FLOCK`` lines of ``/proc/locks`` text on the inode ``ino``
    of device ``dev``: its holders, or (``waiting``) its waiters, the ``->`` lines."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    pids: list[int] = []
    for line in proc_locks.splitlines():
        fields = line.split()
        is_waiter = len(fields) > 1 and fields[1] == "->"
        if is_waiter != waiting:
            continue
        if is_waiter:
            fields = fields[1:]
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        major, _, rest = fields[5].partition(":")
        minor, _, inode = rest.partition(":")
        try:
            same = f"{int(major, 16):02x}:{int(minor, 16):02x}:{int(inode)}" == want
            pid = int(fields[4])
        except ValueError:
            continue
        if same and pid > 0 and pid not in pids:
            pids.append(pid)
    return pids


def holders_in(proc_locks: str, dev: int, ino: int) -> list[int]:
    """The PIDs that ``/proc/locks`` text lists as holding an ``FLOCK`` on the
    inode ``ino`` of device ``dev`` (waiters, ``->`` lines, are not holders)."""
    return _flock_pids(proc_locks, dev, ino, waiting=False)


def waiters_in(proc_locks: str, dev: int, ino: int) -> list[int]:
    """The PIDs that ``/proc/locks`` text lists as waiting for an ``FLOCK`` on the
    inode ``ino`` of device ``dev`` (the ``->`` lines under a holder's line)."""
    return _flock_pids(proc_locks, dev, ino, waiting=True)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:4096]
    except OSError:
        return ""
    return " ".join(p.decode("utf-8", "replace") for p in raw.split(b"\0") if p)[:200]


def read_proc_locks() -> str:
    """``/proc/locks`` as text ("" where it cannot be read)."""
    try:
        return Path("/proc/locks").read_text()
    except OSError:
        return ""


def lock_state(fd: int, proc_locks: str) -> tuple[Holder | None, Holder | None]:
    """Who other than this process holds, and who waits for, the lock of the open
    lock file ``fd``, as ``proc_locks`` (``/proc/locks``' text) says."""
    st = os.fstat(fd)
    me = os.getpid()
    found: list[Holder | None] = []
    for pids in (
        holders_in(proc_locks, st.st_dev, st.st_ino),
        waiters_in(proc_locks, st.st_dev, st.st_ino),
    ):
        pid = next((p for p in pids if p != me), None)
        found.append(None if pid is None else Holder(pid, _cmdline(pid)))
    return found[0], found[1]


def holder_of(fd: int) -> Holder | None:
    """Who holds the lock of the open lock file ``fd`` (None: nobody says)."""
    text = read_proc_locks()
    return lock_state(fd, text)[0] if text else None


def _folder(folder: Path) -> None:
    """Make the lock folder root-only if it is missing; refuse one others may write."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=True)
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise GpuLockError(f"gpu_lock folder {folder} is not a folder")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise GpuLockError(f"gpu_lock folder {folder} is writable by others")


def open_lock(template: LockTemplate, uuid: str) -> int:
    """Open (create, mode 0644) GPU ``uuid``'s lock file, never following a link."""
    _folder(template.folder)
    path = template.path(uuid)
    try:
        fd = os.open(path, _O_LOCK, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise GpuLockError(f"{path} is a symlink; links are not followed") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise GpuLockError(f"{path} is not a regular file")
    return fd


def try_lock(fd: int, *, shared: bool = False) -> Holder | None:
    """Take ``flock(LOCK_EX|LOCK_NB)`` (``shared``: ``LOCK_SH``) on ``fd``: None when
    taken, else who holds it (``Holder(0, "")`` when the holder cannot be found)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder_of(fd) or Holder(0, "")
    return None
