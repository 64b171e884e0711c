"""Connections into a sandbox's network namespace (service jobs).

A bubblewrap sandbox has a network namespace of its own (``--unshare-all``): the
host cannot connect to a port its process listens on. The broker (root) opens
the connection inside that namespace: a short-lived thread joins it with
``setns(2)`` (which changes only the calling thread's namespace), creates and
connects the socket there, and ends; the socket stays in the sandbox's namespace
and can be used from any thread. An attempt with no namespace of its own (run
unsandboxed) is reached on the host's ``127.0.0.1``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import threading
from pathlib import Path

#: ``CLONE_NEWNET`` from ``<sched.h>``
CLONE_NEWNET = 0x40000000
#: the most processes of one attempt's tree looked at for its namespace
_TREE_MAX = 4096

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _net_inode(pid: int | str) -> int | None:
    try:
        return Path(f"/proc/{pid}/ns/net").stat().st_ino
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return out


def namespace_pid(pid: int) -> int | None:
    """A process of ``pid``'s tree (``pid`` first, then its descendants, breadth
    first) whose network namespace is not the broker's own; None: the tree is
    in the broker's namespace (an unsandboxed attempt), or it is gone."""
    own = _net_inode("self")
    queue, seen = [pid], 0
    while queue and seen < _TREE_MAX:
        p = queue.pop(0)
        seen += 1
        inode = _net_inode(p)
        if inode is not None and inode != own:
            return p
        queue.extend(_children(p))
    return None


def connect(pid: int | None, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to ``127.0.0.1:port`` in the network namespace of process
    ``pid`` (None: the broker's own). Raise :class:`OSError` when it cannot be
    made (refused, timed out, the process gone)."""
    if pid is None:
        return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    box: dict[str, socket.socket | BaseException] = {}

    def inside() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(
                        err, f"setns into the network namespace of {pid}: {os.strerror(err)}"
                    )
            finally:
                os.close(fd)
            box["sock"] = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=inside, name=f"netns-{pid}", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    got = box.get("sock")
    if isinstance(got, socket.socket):
        return got
    error = box.get("error")
    if isinstance(error, OSError):
        raise error
    if error is not None:
        raise OSError(f"could not connect inside the namespace of {pid}: {error!r}")
    raise TimeoutError(f"connecting inside the namespace of {pid} took over {timeout_s:g} s")
