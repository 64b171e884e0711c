"""The GPU lock file (``gpu_lock``): an ``flock`` that tools outside the queue honour.

A node may name ``gpu_lock = "/run/gpuwarden/<uuid>.lock"``. A job that has
a GPU to itself holds ``flock(LOCK_EX)`` on that GPU's file for its run; a tool
outside the queue (``gpuwarden gpu lock UUID -- CMD``, a notebook that takes the
same lock) holds it while it uses the GPU. Who holds a lock is read from
``/proc/locks`` (flock holders by device and inode) and ``/proc/PID/cmdline``.

Who may lock: a lock file is mode 0660 (:data:`LOCK_MODE`), the broker's user's
and its group's: ``gpu_lock_group`` names that group (without one, the broker's
own, root's), and only its members (and root) may open the file and take the
``flock``. Anyone who may open a lock file, even to read, can keep a GPU from the
queue with an ``flock``: so no one else may open one. The folder is the broker's:
made when missing (0700, or 0750 with the group), and refused when someone
other than the broker's user may write it (sticky or not: there anyone could
make the lock file first) or it belongs to another user. A lock file is opened
with ``O_NOFOLLOW`` (never a link), must be a regular file, and is given its
mode and group by the broker when it is the broker's; one that belongs to
another user is refused. A holder's command line is never part of a reason
(:meth:`Holder.reason`): reasons are shown to every submitter; the
``gpu_locked`` event, which only owners and operators read, carries it.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.errors import GpuwardenError

__all__ = [
    "LOCK_MODE",
    "GpuLockError",
    "Holder",
    "LockTemplate",
    "check_group",
    "folder_problem",
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
#: a lock file's mode: its owner (the broker's user) and its group may open it
LOCK_MODE = 0o660
#: the lock folder's mode when the broker makes it: with a group, and without
FOLDER_MODE_GROUP = 0o750
FOLDER_MODE = 0o700
#: a group: its name, or its number
_GROUP = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]{1,10})$")


class GpuLockError(GpuwardenError):
    """A ``gpu_lock`` template or lock file the broker may not use."""


def check_group(group: str) -> None:
    """Refuse a ``gpu_lock_group`` that is not a group's name or number (whether
    the group exists is looked up when a lock file is opened)."""
    if group and not _GROUP.fullmatch(group):
        raise GpuLockError(f"gpu_lock_group {group!r}: not a group name or number")


@dataclass(frozen=True, slots=True)
class LockTemplate:
    """A ``gpu_lock`` path template: absolute, with ``<uuid>`` or ``{uuid}`` in its
    name; and ``group`` (``gpu_lock_group``): the group that may lock ("": the
    broker's own)."""

    template: str
    group: str = ""

    def __post_init__(self) -> None:
        check_group(self.group)
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

    def gid(self) -> int | None:
        """The group's number (None: no group set); an unknown group is refused."""
        if not self.group:
            return None
        if self.group.isdigit():
            return int(self.group)
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise GpuLockError(f"gpu_lock_group {self.group!r}: no such group here") from None

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
        """The wait reason: ``GPU locked by PID N``. Never the command line: wait
        reasons reach every submitter (``explain``, ``status``, a job's reason);
        the ``gpu_locked`` event carries it for owners and operators."""
        return f"GPU locked by PID {self.pid}"

    def wants_reason(self) -> str:
        """The wait reason while this process waits for the lock (nothing new starts
        on the GPU, so that it gets it once the jobs there end); no command line."""
        return f"GPU wanted by PID {self.pid}, which waits for its lock"


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


def folder_problem(st: os.stat_result) -> str:
    """What is wrong with a lock folder, as ``lstat`` gives it ("" when nothing):
    not a folder, someone else may write it (sticky or not), another user's."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink; links are not used"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_mode & 0o022:
        mode = f"{stat.S_IMODE(st.st_mode):04o}"
        return (
            f"may be written by others (mode {mode}): anyone could make a GPU's lock "
            "file there and keep the GPU"
        )
    if st.st_uid not in (0, os.geteuid()):
        return f"belongs to uid {st.st_uid}, neither root nor the broker's user"
    return ""


def _folder(folder: Path, gid: int | None) -> None:
    """Make the lock folder if it is missing (0700; with a group 0750, that group's,
    so that its members reach the files); refuse one someone else may write."""
    try:
        folder.mkdir(mode=FOLDER_MODE if gid is None else FOLDER_MODE_GROUP, parents=True)
    except FileExistsError:
        pass
    else:
        if gid is not None:
            os.chown(folder, -1, gid, follow_symlinks=False)
            folder.chmod(FOLDER_MODE_GROUP)  # the umask may have taken bits away
    problem = folder_problem(folder.lstat())
    if problem:
        raise GpuLockError(f"gpu_lock folder {folder} {problem}")


def open_lock(template: LockTemplate, uuid: str) -> int:
    """Open (create) GPU ``uuid``'s lock file, never following a link. A file of the
    broker's user is given mode :data:`LOCK_MODE` and the template's group; one of
    another user (neither root nor this process's) is refused."""
    gid = template.gid()
    _folder(template.folder, gid)
    path = template.path(uuid)
    try:
        fd = os.open(path, _O_LOCK, LOCK_MODE)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise GpuLockError(f"{path} is a symlink; links are not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GpuLockError(f"{path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            raise GpuLockError(
                f"{path} belongs to uid {st.st_uid}: remove it (the broker makes it again)"
            )
        if st.st_uid == os.geteuid() and st.st_nlink == 1:
            # made by the broker before (perhaps 0644, by an older one): who may lock
            if gid is not None and st.st_gid != gid:
                os.fchown(fd, -1, gid)
            if stat.S_IMODE(st.st_mode) != LOCK_MODE:
                os.fchmod(fd, LOCK_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_lock(fd: int, *, shared: bool = False) -> Holder | None:
    """Take ``flock(LOCK_EX|LOCK_NB)`` (``shared``: ``LOCK_SH``) on ``fd``: None when
    taken, else who holds it (``Holder(0, "")`` when the holder cannot be found)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder_of(fd) or Holder(0, "")
    return None
