"""One broker per state directory, enforced by an exclusive lock on a file in it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from gpuwarden.errors import StateDirLockedError


class StateLock:
    """Held for the broker's lifetime; the kernel drops it when the process dies."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "broker.lock"
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = self.path.open("a+", encoding="utf-8")
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
