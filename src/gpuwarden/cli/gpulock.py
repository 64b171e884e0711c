"""``gpuwarden gpu lock UUID -- CMD``: run a command outside the queue under the
GPU's lock file (``gpu_lock``), the same ``flock`` the broker's jobs hold.

It takes ``LOCK_EX`` on the GPU's lock file, waiting as long as a job of the
broker (or another tool) holds it, and says what it waits for; the broker sees it
wait and starts nothing new on that GPU meanwhile. Then it runs CMD as its child
with the lock held, passes SIGINT and SIGTERM on to it, and exits with CMD's exit
status. The lock's descriptor is not inherited by CMD (``O_CLOEXEC``): the lock
ends with this process, so a leftover CMD daemonised into the background cannot
keep the GPU from the queue forever, and the holder the broker names is this
process, the one that says which command it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from gpuwarden.app import make_probe
from gpuwarden.cli.common import Commands, config_of, err
from gpuwarden.config import Config
from gpuwarden.errors import UserError
from gpuwarden.gpu.lockfile import (
    GpuLockError,
    Holder,
    LockTemplate,
    holder_of,
    open_lock,
    try_lock,
)

__all__ = ["add_lock", "cmd_gpu_lock"]

#: a GPU's UUID as NVML and the simulated GPU name it (``GPU-`` and hex, dashes)
_UUID = re.compile(r"GPU-[A-Za-z0-9][A-Za-z0-9-]{0,126}")
#: how often a waiting ``gpu lock`` looks whether its lock's holder changed
_LOOK_S = 0.5


def add_lock(gpu_sub: Commands) -> None:
    lock = gpu_sub.add_parser(
        "lock",
        help="run a command outside the queue with the GPU's lock held (gpu_lock)",
        description="Wait for the GPU's lock file (the node's gpu_lock), take it "
        "exclusively, run CMD with it held, and exit with CMD's exit status. While "
        "it waits, the broker starts nothing new on that GPU.",
    )
    lock.add_argument("gpu", help="the GPU's UUID (as `gpuwarden status` shows it) or index")
    lock.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    lock.set_defaults(func=cmd_gpu_lock)


def cmd_gpu_lock(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise UserError("gpu lock needs a command: gpuwarden gpu lock UUID -- CMD [ARGS...]")
    config = config_of(args)
    if not config.gpu_lock:
        raise UserError(
            'this node has no gpu_lock: set gpu_lock = "/run/gpuwarden/<uuid>.lock" '
            "in its config (SPEC.md section 8)"
        )
    uuid = _gpu_uuid(args.gpu, config, mock_gpu=bool(args.mock_gpu))
    try:
        fd = open_lock(LockTemplate(config.gpu_lock, config.gpu_lock_group), uuid)
    except GpuLockError as exc:
        raise UserError(f"the lock file of {uuid} cannot be used: {exc}") from None
    except PermissionError:
        who = f"members of group {config.gpu_lock_group}" if config.gpu_lock_group else "root"
        raise UserError(
            f"the lock file of {uuid} may not be opened by this user: only {who} may take "
            "a GPU's lock (gpu_lock_group)"
        ) from None
    try:
        _wait_for(fd, uuid)
        return _run(cmd)
    finally:
        os.close(fd)


def _gpu_uuid(given: str, config: Config, *, mock_gpu: bool) -> str:
    """A GPU's UUID: as given, checked, or the probe's GPU of that index."""
    if given.isdigit():
        probe = make_probe(config, mock_gpu=mock_gpu)
        try:
            uuids = [r.uuid for r in probe.read()]
        finally:
            probe.close()
        if int(given) >= len(uuids):
            raise UserError(f"no GPU {given} here; the probe shows {len(uuids)} GPU(s)")
        return uuids[int(given)]
    if not _UUID.fullmatch(given):
        raise UserError(
            f"{given!r} is not a GPU UUID (GPU-... as `gpuwarden status` shows it) nor a GPU index"
        )
    return given


def _wait_for(fd: int, uuid: str) -> None:
    """Take ``LOCK_EX`` on ``fd``: at once, else with a blocking ``flock`` (Ctrl-C
    or SIGTERM ends the wait), saying what it waits for as the holder changes."""
    holder = try_lock(fd)
    if holder is None:
        return
    _say(uuid, holder)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(fd, uuid, holder, done), daemon=True)
    watcher.start()
    try:
        with _term_as_interrupt():
            fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        done.set()
        watcher.join()
    err.print(f"took the lock of GPU {uuid}", markup=False)


def _say(uuid: str, holder: Holder) -> None:
    who = f"PID {holder.pid} ({holder.cmd})" if holder.cmd else f"PID {holder.pid}"
    if not holder.pid:
        who = "a process that cannot be named"
    err.print(f"waiting for the lock of GPU {uuid}: held by {who}", markup=False)


def _watch(fd: int, uuid: str, said: Holder, done: threading.Event) -> None:
    """While the main thread waits in ``flock``: say when the holder changes."""
    while not done.wait(_LOOK_S):
        now = holder_of(fd)
        if now is not None and now != said:
            _say(uuid, now)
            said = now


@contextlib.contextmanager
def _term_as_interrupt() -> Iterator[None]:
    """SIGTERM ends a wait as Ctrl-C does (KeyboardInterrupt: exit 130, nothing run)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _run(cmd: list[str]) -> int:
    """Run CMD with the lock held; SIGINT and SIGTERM go to it; its exit status."""
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:
        raise UserError(f"cannot run {cmd[0]!r}: {exc.strerror or exc}") from None

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    before = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    sys.stdout.flush()
    return code if code >= 0 else 128 - code
