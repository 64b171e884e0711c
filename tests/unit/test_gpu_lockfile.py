"""The GPU lock file: its template, /proc/locks parsing, a flock held by another process."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.gpu.lockfile import (
    LOCK_MODE,
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
        "GPU wanted by PID 5151, which waits for its lock"  # no command line: submitters see it
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
            assert got.reason() == f"GPU locked by PID {holder.pid}"  # no command line
            assert "python" in got.cmd  # the event's (owners and operators) still has it
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


# -- who may lock (issue 30, item 10) -------------------------------------------------

ROOT = os.geteuid() == 0
NOBODY = 65534


def a_group() -> tuple[str, int]:
    """A group of this host that is neither root's nor nobody's: the lockers'."""
    for name in ("users", "staff", "adm", "daemon", "sys"):
        with contextlib.suppress(KeyError):
            g = grp.getgrnam(name)
            if g.gr_gid not in (0, NOBODY):
                return g.gr_name, g.gr_gid
    pytest.skip("no group here to lock with")


def test_a_lock_file_is_0660_and_its_folder_0700_without_a_group(tmp_path: Path) -> None:
    tpl = LockTemplate(f"{tmp_path}/locks/GPU-<uuid>.lock")
    os.close(open_lock(tpl, "G"))
    st = tpl.path("G").stat()
    assert stat.S_IMODE(st.st_mode) == LOCK_MODE == 0o660
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
    assert stat.S_IMODE((tmp_path / "locks").stat().st_mode) == 0o700


@pytest.mark.skipif(not ROOT, reason="gives files to a group (chown)")
def test_with_a_group_its_members_may_reach_and_open_the_lock(tmp_path: Path) -> None:
    name, gid = a_group()
    for group in (name, str(gid)):
        tpl = LockTemplate(f"{tmp_path}/{group}/GPU-<uuid>.lock", group)
        os.close(open_lock(tpl, "G"))
        st, folder = tpl.path("G").stat(), tpl.folder.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
        assert (stat.S_IMODE(folder.st_mode), folder.st_gid) == (0o750, gid)


def test_a_lock_file_an_older_broker_made_0644_is_made_0660(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir(mode=0o755)
    old = tmp_path / "locks" / "GPU-G.lock"
    old.touch(mode=0o644)
    old.chmod(0o644)
    os.close(open_lock(LockTemplate(f"{tmp_path}/locks/GPU-<uuid>.lock"), "G"))
    assert stat.S_IMODE(old.stat().st_mode) == 0o660


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o757])
def test_a_folder_others_may_write_is_refused_sticky_or_not(tmp_path: Path, mode: int) -> None:
    """In a folder others may write (even sticky, as /tmp or /run/lock), anyone could
    make a GPU's lock file first, of any mode, and keep the GPU."""
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(GpuLockError, match="may be written by others"):
        open_lock(LockTemplate(f"{folder}/GPU-<uuid>.lock"), "G")
    assert not (folder / "GPU-G.lock").exists()


@pytest.mark.skipif(not ROOT, reason="makes a file of another user's (chown)")
def test_a_lock_file_of_another_user_is_refused(tmp_path: Path) -> None:
    tpl = LockTemplate(f"{tmp_path}/locks/GPU-<uuid>.lock")
    os.close(open_lock(tpl, "G"))
    os.chown(tpl.path("G"), NOBODY, NOBODY)
    with pytest.raises(GpuLockError, match=f"belongs to uid {NOBODY}"):
        open_lock(tpl, "G")


def test_a_bad_or_unknown_group_is_refused() -> None:
    with pytest.raises(GpuLockError, match="not a group name"):
        LockTemplate("/run/g/<uuid>.lock", "a b")
    with pytest.raises(GpuLockError, match="no such group"):
        LockTemplate("/run/g/<uuid>.lock", "no-such-group-here").gid()


HOLD_RO = """
import fcntl, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except OSError as exc:
    print("refused", exc.errno, flush=True)
    raise SystemExit(0)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every uid can reach (pytest's are root's alone)."""
    made = Path(tempfile.mkdtemp(prefix="gw-gpulock-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.skipif(not ROOT, reason="runs a process as another user")
def test_a_read_only_flock_by_another_user_is_no_longer_possible(open_dir: Path) -> None:
    """The attack: a lock file as the broker made it before (0644, in a folder
    anyone may search): any user opens it to read and keeps the GPU with an
    flock. Once the broker has opened it, only its user and group may."""
    name, gid = a_group()
    folder = open_dir / "locks"
    folder.mkdir(mode=0o755)
    path = folder / "GPU-G.lock"
    path.touch(mode=0o644)
    path.chmod(0o644)
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    as_nobody: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []}

    def run(**who: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [python, "-c", HOLD_RO, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            **who,
        )

    attacker = run(**as_nobody)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "held"
        fd = os.open(path, os.O_RDWR)  # the attack happened: the GPU is kept
        assert try_lock(fd) is not None
        os.close(fd)
    finally:
        attacker.kill()
        attacker.wait()
    tpl = LockTemplate(f"{folder}/GPU-<uuid>.lock", name)
    fd = open_lock(tpl, "G")  # the broker's look: the file is made 0660, the group's
    try:
        again = run(**as_nobody)
        out, _ = again.communicate("", timeout=30)
        assert out.strip() == f"refused {errno.EACCES}"
        assert try_lock(fd) is None  # no one else keeps it
        fcntl.flock(fd, fcntl.LOCK_UN)
        member = run(**{**as_nobody, "extra_groups": [gid]})  # the group's members may
        try:
            assert member.stdout is not None and member.stdout.readline().strip() == "held"
            got = try_lock(fd)
            assert got is not None and got.pid == member.pid
            assert got.reason() == f"GPU locked by PID {member.pid}"  # no command line
        finally:
            member.kill()
            member.wait()
    finally:
        os.close(fd)
