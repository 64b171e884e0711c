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

__all__ = ["PARENT", "PidsCgroups", "find_pids_cgroups"]

log = logging.getLogger(__name__)

#: the folder under the pids hierarchy that holds gpuwarden's sandboxes
PARENT = "gpuwarden"
#: how long the removal of a cgroup waits for its last processes to be gone
REMOVE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class PidsCgroups:
    """Where per-sandbox pids cgroups are made: ``root/gpuwarden/<name>``."""

    root: Path
    version: int

    @property
    def parent(self) -> Path:
        return self.root / PARENT

    def path(self, name: str) -> Path:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"not a cgroup name: {name!r}")
        return self.parent / name

    def describe(self) -> str:
        return f"a pids cgroup per sandbox under {self.parent} (cgroup v{self.version})"

    def create(self, name: str, pids_max: int) -> Path:
        """Make (or reuse, after a crash) the cgroup ``name`` with ``pids.max``."""
        if self.version == 2:
            _enable_pids(self.root)
        self.parent.mkdir(mode=0o755, exist_ok=True)
        if self.version == 2:
            _enable_pids(self.parent)
        path = self.path(name)
        path.mkdir(mode=0o755, exist_ok=True)
        _write(path / "pids.max", str(pids_max))
        return path

    def pids_max(self, path: Path) -> int | None:
        """The cgroup's ``pids.max`` (None: ``max``, no limit)."""
        text = (path / "pids.max").read_text().strip()
        return None if text == "max" else int(text)

    def processes(self, path: Path) -> list[int]:
        """The processes in the cgroup now (none once it is removed)."""
        try:
            text = (path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def kill_all(self, path: Path, wait_s: float = REMOVE_WAIT_S) -> list[int]:
        """SIGKILL whatever is still in the cgroup and wait for it to empty.
        Returns the pids that were still there at the end of the wait."""
        deadline = time.monotonic() + wait_s
        while True:
            left = self.processes(path)
            if not left or time.monotonic() >= deadline:
                return left
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def remove(self, path: Path, wait_s: float = REMOVE_WAIT_S) -> bool:
        """Remove the (empty) cgroup; True once it is gone. A process that has just
        exited may keep it busy for a moment: retried until ``wait_s`` passes."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    log.warning("could not remove the sandbox's pids cgroup %s: %s", path, exc)
                    return False
            time.sleep(0.05)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _enable_pids(folder: Path) -> None:
    """cgroup v2: let ``folder``'s children use the pids controller."""
    control = folder / "cgroup.subtree_control"
    if "pids" not in control.read_text().split():
        _write(control, "+pids")


def find_pids_cgroups(mounts: str | None = None, *, euid: int | None = None) -> PidsCgroups | None:
    """Where this process may make per-sandbox pids cgroups, or None.

    ``mounts`` is ``/proc/self/mounts`` text (read when None). cgroup v1 with a
    ``pids`` mount comes first; then cgroup v2 with ``pids`` in the root's
    ``cgroup.controllers``. Either must be writable by this process (``euid``:
    root, or a delegated hierarchy)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    v1: Path | None = None
    v2: Path | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        target, fstype, options = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup" and "pids" in options and v1 is None:
            v1 = Path(target)
        elif fstype == "cgroup2" and v2 is None:
            v2 = Path(target)
    uid = os.geteuid() if euid is None else euid
    if v1 is not None and _writable(v1, uid):
        return PidsCgroups(v1, 1)
    if v2 is not None and _writable(v2, uid):
        try:
            controllers = (v2 / "cgroup.controllers").read_text().split()
        except OSError:
            return None
        if "pids" in controllers:
            return PidsCgroups(v2, 2)
    return None


def _writable(folder: Path, uid: int) -> bool:
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
