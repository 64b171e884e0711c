"""The supervisor of one attempt: the job's only parent, outside the broker.

Run as ``python -I -S supervisor.py``: standard library only, imports nothing of
gpuwarden's (it must start fast and keep working while the broker is gone or
being upgraded). Its files live in the attempt's ``supervisor/`` folder.

This module also holds the helpers the broker uses on those files.
"""

from __future__ import annotations

import os

#: the supervisor's folder inside an attempt's folder
FOLDER = "supervisor"
#: the lease file: the wall-clock time (seconds since the epoch, as text) until
#: which the job may run; a supervisor past it stops its job (self-fencing)
LEASE = "lease"


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_lease(attempt_dir: str, until: float) -> None:
    """Tell the supervisor of the attempt in ``attempt_dir`` that its job may run
    until ``until`` (wall-clock seconds since the epoch)."""
    folder = os.path.join(attempt_dir, FOLDER)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    write_atomic(os.path.join(folder, LEASE), f"{until:.3f}\n")


def read_lease(attempt_dir: str) -> float | None:
    """The lease end written by :func:`write_lease`, or None (none, or unreadable)."""
    try:
        fd = os.open(os.path.join(attempt_dir, FOLDER, LEASE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace")
    finally:
        os.close(fd)
    try:
        return float(text.strip())
    except ValueError:
        return None
