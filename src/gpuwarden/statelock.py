"""One broker per state directory, enforced by an exclusive lock on a file in it;
and the state directory kept the broker's alone (mode 0700)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path
from typing import IO

from gpuwarden.errors import StateDirLockedError
from gpuwarden.eventlog import CURSOR_FILE

log = logging.getLogger("gpuwarden.statelock")

#: files in the state directory only the broker's user may read or write (the
#: SQLite store and its journal, the lock, the event log's cursor)
PRIVATE_FILES = (
    "gpuwarden.db",
    "gpuwarden.db-wal",
    "gpuwarden.db-shm",
    "broker.lock",
    CURSOR_FILE,
)
#: the broker's own folders in it (attempts, warm servers)
PRIVATE_DIRS = ("jobs", "warm")


def secure_state_dir(state_dir: Path) -> list[str]:
    """Make the state directory its owner's alone: created with mode 0700 when it
    is missing; an existing one, its :data:`PRIVATE_FILES` and :data:`PRIVATE_DIRS`
    lose every group and other permission. Returns what was tightened (``path:
    old mode -> new mode``), and logs it: other users could read job parameters,
    outputs and logs until now. Links are not followed, except the state directory
    itself when the operator made it one."""
    if not state_dir.exists():
        state_dir.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process was quicker
            state_dir.mkdir(mode=0o700)
    changed: list[str] = []
    _tighten(state_dir, changed, follow=True)
    for name in (*PRIVATE_FILES, *PRIVATE_DIRS):
        _tighten(state_dir / name, changed, follow=False)
    if changed:
        log.warning(
            "tightened permissions in the state directory so that only its owner can read it: %s",
            ", ".join(changed),
        )
    return changed


def _tighten(path: Path, changed: list[str], *, follow: bool) -> None:
    try:
        st = path.stat(follow_symlinks=follow)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        path.chmod(mode & ~0o077)  # not a link (checked): lchmod is not on Linux
        changed.append(f"{path}: {mode:o} -> {mode & ~0o077:o}")


class StateLock:
    """Held for the broker's lifetime; the kernel drops it when the process dies."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "broker.lock"
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        secure_state_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fh = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            pid = fh.read().strip() or "unknown"
            fh.close()
            raise StateDirLockedError(
                f"another gpuwarden broker (PID {pid}) already runs on state directory "
                f"{self.path.parent}; stop it first, or give this one another state_dir"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def holder_pid(state_dir: Path) -> int | None:
    """The PID written by the broker holding the lock, or None if nobody holds it."""
    path = state_dir / "broker.lock"
    if not path.exists():
        return None
    with path.open("r", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = fh.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fh, fcntl.LOCK_UN)
        return None
