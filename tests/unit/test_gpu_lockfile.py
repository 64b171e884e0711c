"""The GPU lock file: its template, /proc/locks parsing, a flock held by another process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwarden.gpu.lockfile import (
    GpuLockError,
    Holder,
    LockTemplate,
    holders_in,
    lock_state,
    open_lock,
    try_lock,
    waiters_in,
)


def test_template_placeholders() -> None:
    assert str(LockTemplate("/run/g/GPU-<uuid>.lock").path("abc")) == "/run/g/GPU-abc.lock"
    assert str(LockTemplate("/run/g/{uuid}.lock").path("x-1")) == "/run/g/x-1.lock"


@pytest.mark.parametrize(
    "bad", ["run/GPU-<uuid>", "/run/GPU.lock", "/run/<uuid>/x", "/a/../<uuid>"]
)
def test_template_refused(bad: str) -> None:
    with pytest.raises(GpuLockError):
        LockTemplate(bad)


@pytest.mark.parametrize("uuid", ["", "a/b", "..", "x\0y"])
def test_uuid_refused(uuid: str) -> None:
    with pytest.raises(GpuLockError):
        LockTemplate("/run/<uuid>.lock").path(uuid)


def test_holders_in_proc_locks() -> None:
    dev = os.makedev(0x103, 0x2)
    text = (
        "1: FLOCK  ADVISORY  WRITE 4242 103:02:777 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 5151 103:02:777 0 EOF\n"
        "2: POSIX  ADVISORY  WRITE 6161 103:02:777 0 EOF\n"
        "3: FLOCK  ADVISORY  WRITE 7171 103:02:778 0 EOF\n"
        "garbage\n"
    )
    assert holders_in(text, dev, 777) == [4242]
    assert holders_in(text, dev, 999) == []


def test_waiters_in_proc_locks() -> None:
    dev = os.makedev(0x103, 0x2)
    text = (
        "1: FLOCK  ADVISORY  WRITE 4242 103:02:777 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 5151 103:02:777 0 EOF\n"
        "1: -> FLOCK  ADVISORY  READ  5252 103:02:777 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 5151 103:02:777 0 EOF\n"
        "2: -> POSIX  ADVISORY  WRITE 6161 103:02:777 0 EOF\n"
        "3: -> FLOCK  ADVISORY  WRITE 7171 103:02:778 0 EOF\n"
        "4: -> FLOCK\n"
        "5: -> FLOCK  ADVISORY  WRITE x 103:02:777 0 EOF\n"
    )
    assert waiters_in(text, dev, 777) == [5151, 5252]
    assert waiters_in(text, dev, 778) == [7171]
    assert holders_in(text, dev, 778) == []
    assert Holder(5151, "gpuwarden gpu lock").wants_reason() == (
        "GPU wanted by PID 5151 (gpuwarden gpu lock), which waits for its lock"
    )


def test_lock_state_sees_a_real_waiter(tmp_path: pytest.TempPathFactory) -> None:
    """This process holds the lock; a child blocks on LOCK_EX: it is the waiter."""
    tpl = LockTemplate(f"{tmp_path}/locks/GPU-<uuid>.lock")
    fd = open_lock(tpl, "GPU-0")
    try:
        assert try_lock(fd, shared=True) is None
        code = "import fcntl,os,sys; f=os.open(sys.argv[1],os.O_RDWR); fcntl.flock(f,fcntl.LOCK_EX)"
        child = subprocess.Popen([sys.executable, "-c", code, str(tpl.path("GPU-0"))])
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                holder, waiter = lock_state(fd, Path("/proc/locks").read_text())
                if waiter is not None:
                    break
                time.sleep(0.02)
            assert holder is None  # this process itself is not named
            assert waiter is not None and waiter.pid == child.pid
            assert child.poll() is None  # it really blocks
        finally:
            child.kill()
            child.wait()
    finally:
        os.close(fd)


def test_lock_held_by_another_process_names_it(tmp_path: pytest.TempPathFactory) -> None:
    tpl = LockTemplate(f"{tmp_path}/locks/GPU-<uuid>.lock")
    path = tpl.path("GPU-0")
    os.close(open_lock(tpl, "GPU-0"))  # makes the root-only folder and the file
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        fd = open_lock(tpl, "GPU-0")
        try:
            with pytest.raises(BlockingIOError):  # the fault is real: the lock is held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got = try_lock(fd)
            assert got is not None and got.pid == holder.pid
            assert got.reason().startswith(f"GPU locked by PID {holder.pid} (")
            assert holder.stdin is not None
            holder.stdin.close()
            assert holder.wait(timeout=30) == 0
            assert try_lock(fd) is None
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "locks").stat().st_mode & 0o777 == 0o700


def test_symlink_refused(tmp_path: pytest.TempPathFactory) -> None:
    tpl = LockTemplate(f"{tmp_path}/l/<uuid>.lock")
    (tmp_path / "l").mkdir(mode=0o700)
    (tmp_path / "l" / "G.lock").symlink_to(tmp_path / "target")
    with pytest.raises(GpuLockError, match="symlink"):
        open_lock(tpl, "G")
    assert not (tmp_path / "target").exists()


HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""
