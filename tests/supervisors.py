"""Attempts' supervisors a test left behind.

A broker's routine stop leaves its attempts running under their supervisors
(``[broker] on_stop = "leave"``): a test that stops a ``serve`` with SIGTERM
leaves them. :func:`stop_orphans` stops those whose broker is gone (the
conftest does it after every test), so that no test's job runs into the next.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from gpuwarden.launch import host

SCRIPT = b"/supervisor.py"


def supervisors() -> dict[int, list[bytes]]:
    """Every running supervisor of this host: pid -> its command line."""
    found: dict[int, list[bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        args = raw.split(b"\0")
        if len(args) > 3 and args[3].endswith(SCRIPT):
            found[int(name)] = args
    return found


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def orphans(under: Path) -> list[int]:
    """The supervisors of attempts under ``under`` (a test run's own folders: never
    another run's, nor a real broker's) whose broker is gone: their parent is
    init, or this test process without having started them (they came to it as
    its subreaper)."""
    me = os.getpid()
    prefix = os.fsencode(str(under).rstrip("/") + "/")
    return [
        pid
        for pid, args in supervisors().items()
        if args[4].startswith(prefix) and _ppid(pid) in (1, me) and pid not in host.live_mains()
    ]


def stop(pids: list[int], grace_s: float = 5.0) -> None:
    """Stop these supervisors (each stops its job), then kill what is left."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")


def stop_orphans(under: Path) -> list[int]:
    """Stop the supervisors of attempts under ``under`` whose broker is gone, and
    remove the containers they ran (a container outlives its podman client);
    their pids."""
    found = orphans(under)
    if found:
        names = [n for args in map(supervisors().get, found) if args and (n := container(args))]
        stop(found)
        for name in names:
            subprocess.run(["podman", "rm", "--force", name], capture_output=True, check=False)
    return found


def container(args: list[bytes]) -> str | None:
    """The container a supervisor's command runs (``podman run --name NAME``), if any."""
    if b"--name" in args and any(a.endswith((b"/podman", b"podman")) for a in args):
        at = args.index(b"--name")
        if at + 1 < len(args):
            return os.fsdecode(args[at + 1])
    return None
