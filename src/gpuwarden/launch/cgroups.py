"""Per-sandbox pids cgroups for bubblewrap.

``RLIMIT_NPROC`` counts the processes of a uid across the whole host, and every
sandbox runs as the same uid: as the only process limit it is shared by all
sandboxes of the node (and any other process of that uid). Where the broker may
create cgroups with the pids controller, each bubblewrap sandbox gets one of its
own, ``<pids hierarchy>/gpuwarden/<sandbox name>``, with ``pids.max`` set to
``[sandbox] pids``; its root-side starter joins it before it drops to the
sandbox's user, so every process of the sandbox is counted there.

cgroup v1 (a ``cgroup`` mount with the ``pids`` controller) is used when there
is one; otherwise cgroup v2 when the pids controller is available at the v2
root. Podman and docker make their own (``--pids-limit``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

__all__ = [
    "PARENT",
    "CgroupTree",
    "PidsCgroups",
    "cgroup_mounts",
    "cgroup_processes",
    "enable_controller",
    "find_hierarchy",
    "find_pids_cgroups",
    "kill_cgroup",
    "remove_cgroup",
    "v2_controllers",
    "writable",
    "write_control",
]

log = logging.getLogger(__name__)

#: the folder under the pids hierarchy that holds gpuwarden's sandboxes
PARENT = "gpuwarden"
#: how long the removal of a cgroup waits for its last processes to be gone
REMOVE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class CgroupTree:
    """Cgroups of one controller that gpuwarden makes, one per sandbox or
    attempt: ``root/gpuwarden/<name>``. Subclasses name the controller and
    write its limits."""

    root: Path
    version: int

    #: the controller (``pids``, ``memory``)
    CONTROLLER: ClassVar[str] = ""
    #: what one of them is, in the warning of a failed removal
    WHAT: ClassVar[str] = "the cgroup"

    @property
    def parent(self) -> Path:
        return self.root / PARENT

    def path(self, name: str) -> Path:
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise ValueError(f"not a cgroup name: {name!r}")
        return self.parent / name

    def make(self, name: str) -> Path:
        """Make (or reuse, after a crash) the cgroup ``name``, the controller
        enabled down the way on cgroup v2; its limits are the caller's."""
        if self.version == 2:
            enable_controller(self.root, self.CONTROLLER)
        self.parent.mkdir(mode=0o755, exist_ok=True)
        if self.version == 2:
            enable_controller(self.parent, self.CONTROLLER)
        path = self.path(name)
        path.mkdir(mode=0o755, exist_ok=True)
        return path

    def processes(self, path: Path) -> list[int]:
        """The processes in the cgroup now (none once it is removed)."""
        return cgroup_processes(path)

    def kill_all(self, path: Path, wait_s: float = REMOVE_WAIT_S) -> list[int]:
        """SIGKILL whatever is still in the cgroup and wait for it to empty.
        Returns the pids that were still there at the end of the wait."""
        return kill_cgroup(path, wait_s)

    def remove(self, path: Path, wait_s: float = REMOVE_WAIT_S) -> bool:
        """Remove the (empty) cgroup; True once it is gone."""
        return remove_cgroup(path, wait_s, what=self.WHAT)


@dataclass(frozen=True, slots=True)
class PidsCgroups(CgroupTree):
    """Where per-sandbox pids cgroups are made: ``root/gpuwarden/<name>``."""

    CONTROLLER: ClassVar[str] = "pids"
    WHAT: ClassVar[str] = "the sandbox's pids cgroup"

    def describe(self) -> str:
        return f"a pids cgroup per sandbox under {self.parent} (cgroup v{self.version})"

    def create(self, name: str, pids_max: int) -> Path:
        """Make (or reuse, after a crash) the cgroup ``name`` with ``pids.max``."""
        path = self.make(name)
        write_control(path / "pids.max", str(pids_max))
        return path

    def pids_max(self, path: Path) -> int | None:
        """The cgroup's ``pids.max`` (None: ``max``, no limit)."""
        text = (path / "pids.max").read_text().strip()
        return None if text == "max" else int(text)


def cgroup_processes(path: Path) -> list[int]:
    """The processes in the cgroup ``path`` now (none once it is removed)."""
    try:
        text = (path / "cgroup.procs").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def kill_cgroup(path: Path, wait_s: float = REMOVE_WAIT_S) -> list[int]:
    """SIGKILL whatever is still in the cgroup ``path`` and wait for it to empty.
    Returns the pids that were still there at the end of the wait."""
    deadline = time.monotonic() + wait_s
    while True:
        left = cgroup_processes(path)
        if not left or time.monotonic() >= deadline:
            return left
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def remove_cgroup(path: Path, wait_s: float = REMOVE_WAIT_S, *, what: str = "the cgroup") -> bool:
    """Remove the (empty) cgroup ``path``; True once it is gone. A process that has
    just exited may keep it busy for a moment: retried until ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                log.warning("could not remove %s %s: %s", what, path, exc)
                return False
        time.sleep(0.05)


def write_control(path: Path, text: str) -> None:
    """Write a cgroup control file (never through a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enable_controller(folder: Path, controller: str) -> None:
    """cgroup v2: let ``folder``'s children use ``controller``."""
    control = folder / "cgroup.subtree_control"
    if controller not in control.read_text().split():
        write_control(control, f"+{controller}")


def find_pids_cgroups(mounts: str | None = None, *, euid: int | None = None) -> PidsCgroups | None:
    """Where this process may make per-sandbox pids cgroups, or None.

    ``mounts`` is ``/proc/self/mounts`` text (read when None). cgroup v1 with a
    ``pids`` mount comes first; then cgroup v2 with ``pids`` in the root's
    ``cgroup.controllers``. Either must be writable by this process (``euid``:
    root, or a delegated hierarchy)."""
    found = find_hierarchy("pids", mounts, euid=euid)
    return None if found is None else PidsCgroups(*found)


def cgroup_mounts(controller: str, mounts: str | None = None) -> tuple[Path | None, Path | None]:
    """(the cgroup v1 mount with ``controller``, the first cgroup2 mount), either
    None; ``mounts`` is ``/proc/self/mounts`` text (read when None)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None, None
    v1: Path | None = None
    v2: Path | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        target, fstype, options = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup" and controller in options and v1 is None:
            v1 = Path(target)
        elif fstype == "cgroup2" and v2 is None:
            v2 = Path(target)
    return v1, v2


def find_hierarchy(
    controller: str, mounts: str | None = None, *, euid: int | None = None
) -> tuple[Path, int] | None:
    """(root, cgroup version) where this process may make cgroups with
    ``controller``, or None: a writable cgroup v1 mount of it first, then a
    writable cgroup v2 mount with it in the root's ``cgroup.controllers``."""
    v1, v2 = cgroup_mounts(controller, mounts)
    uid = os.geteuid() if euid is None else euid
    if v1 is not None and writable(v1, uid):
        return v1, 1
    if v2 is not None and writable(v2, uid) and controller in v2_controllers(v2):
        return v2, 2
    return None


def v2_controllers(root: Path) -> list[str]:
    """The controllers a cgroup v2 root offers (none when it cannot be read)."""
    try:
        return (root / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def writable(folder: Path, uid: int) -> bool:
    """Whether ``uid`` may make gpuwarden's cgroups under the hierarchy ``folder``."""
    parent = folder / PARENT
    target = parent if parent.is_dir() else folder
    if uid == 0:
        return target.is_dir() and not _read_only(folder)
    return os.access(target, os.W_OK | os.X_OK)


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return True
