"""A serve worker's socket folder must be the broker's own: it may live in /tmp,
where anyone could have made the folder first."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden import safefs
from gpuwarden.launch.base import LaunchRequest
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.warmproc import ServeError, WarmProcess


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gw-sock-", dir="/tmp"))
    try:
        yield path
    finally:
        safefs.remove_tree(path)


def worker(folder: Path, socket_dir: Path) -> WarmProcess:
    req = LaunchRequest(
        job_id="warm-x",
        attempt=1,
        argv=(sys.executable, "-c", "pass"),
        cwd=str(folder),
        env={},
        attempt_dir=str(folder / "log"),
        timeout_s=math.inf,
        kill_grace_s=1,
        instance="socket-test",
    )
    return WarmProcess(HostLauncher(), req, socket_dir / "1.sock", epoch=1, stop_wait_s=1)


def test_a_socket_folder_others_may_write_to_is_refused(folder: Path) -> None:
    shared = folder / "s"
    shared.mkdir()
    shared.chmod(0o777)  # as if someone else had made it first, open to all
    assert shared.stat().st_mode & 0o777 == 0o777
    w = worker(folder, shared)
    with pytest.raises(ServeError) as caught:
        w.start(load_timeout_s=5)
    assert caught.value.kind == "start"
    assert "is not this broker's own" in str(caught.value)
    assert not (shared / "1.sock").exists()  # nothing was bound there
    assert w.launch_result is not None and w.launch_result.pid is None  # nothing started


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another uid")
def test_a_socket_folder_of_another_uid_is_refused(folder: Path) -> None:
    theirs = folder / "t"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ServeError, match="is not this broker's own"):
        worker(folder, theirs).start(load_timeout_s=5)


def test_a_socket_folder_that_is_a_link_is_refused(folder: Path) -> None:
    real = folder / "real"
    real.mkdir(mode=0o700)
    link = folder / "link"
    link.symlink_to(real)
    assert link.is_symlink()
    with pytest.raises(ServeError, match="is not this broker's own"):
        worker(folder, link).start(load_timeout_s=5)
    assert list(real.iterdir()) == []
