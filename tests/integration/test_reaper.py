"""The one reaper of host attempts (``HostLauncher.start``): a normal end is
seen without a scan of the process table, leftovers are still found (the broker
is a child subreaper, so orphans come to it), a stop reaches it at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from gpuwarden.launch import host, reaper
from gpuwarden.launch.base import LaunchRequest, LaunchResult
from gpuwarden.launch.host import HostLauncher
from gpuwarden.launch.reaper import StopSignal

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pidfds and /proc")

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

#: forks a child that leaves the session (setsid) and outlives the main process,
#: which exits 0 at once: the child is reparented to the nearest subreaper
ORPHAN = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(60)
    os._exit(0)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.005)
"""


def request(tmp_path: Path, argv: list[str], **kw: float) -> LaunchRequest:
    name = f"r-{uuid.uuid4().hex[:8]}"
    return LaunchRequest(
        job_id=name,
        attempt=1,
        argv=tuple(argv),
        cwd=str(tmp_path),
        env=dict(ENV),
        attempt_dir=str(tmp_path / name),
        timeout_s=kw.get("timeout_s", 30.0),
        kill_grace_s=0.2,
        instance="reaper-test",
    )


def start(req: LaunchRequest, stop: threading.Event | None = None) -> LaunchResult:
    got: list[LaunchResult] = []
    HostLauncher().start(req, stop or StopSignal(), None, got.append).join(60)
    assert len(got) == 1, got
    return got[0]


def test_a_normal_end_scans_no_process_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scans: list[int] = []
    real = host._all_processes

    def counted() -> list[psutil.Process]:
        scans.append(1)
        return real()

    monkeypatch.setattr(host, "_all_processes", counted)
    result = start(request(tmp_path, ["/bin/true"]))
    assert result.exit_code == 0 and not result.stopped and not result.timed_out
    assert result.reaped == () and result.survivors == ()
    assert scans == []  # no whole-table scan on the way from exit to result


def test_an_orphan_that_left_the_session_is_found_and_stopped(tmp_path: Path) -> None:
    pidfile = tmp_path / "orphan.pid"
    result = start(request(tmp_path, [sys.executable, "-c", ORPHAN, str(pidfile)]))
    orphan = int(pidfile.read_text())
    assert result.exit_code == 0
    assert orphan in result.reaped, result
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == "zombie"


def test_quick_leftovers_finds_an_orphan_by_its_marker(tmp_path: Path) -> None:
    assert reaper.become_subreaper()
    marker = f"reaper-test/{uuid.uuid4().hex[:8]}/1"
    pidfile = tmp_path / "orphan.pid"
    env = {**ENV, "GPUWARDEN_ATTEMPT": marker}
    main = psutil.Popen(
        [sys.executable, "-c", ORPHAN, str(pidfile)], env=env, start_new_session=True
    )
    try:
        os.waitid(os.P_PID, main.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        orphan = int(pidfile.read_text())
        # it left the group and the session: only its marker (and that it came to
        # this subreaper) says whose it is
        assert reaper.quick_leftovers(main.pid, marker, [], []) == [orphan]
        assert reaper.quick_leftovers(main.pid, "someone/else/1", [], []) == []
    finally:
        for pid in (int(pidfile.read_text()),) if pidfile.exists() else ():
            psutil.Process(pid).kill()
            os.waitpid(pid, 0)
        main.wait()


def test_a_stop_reaches_a_running_attempt(tmp_path: Path) -> None:
    stop = StopSignal()
    got: list[LaunchResult] = []
    ended = HostLauncher().start(request(tmp_path, ["/bin/sleep", "60"]), stop, None, got.append)
    assert ended.is_alive()
    stop.set()
    ended.join(60)
    assert len(got) == 1 and got[0].stopped and got[0].exit_code is not None, got


def test_a_timeout_ends_the_attempt(tmp_path: Path) -> None:
    result = start(request(tmp_path, ["/bin/sleep", "60"], timeout_s=0.2))
    assert result.timed_out and not result.stopped


def test_a_command_that_cannot_start_posts_a_launch_error(tmp_path: Path) -> None:
    result = start(request(tmp_path, [str(tmp_path / "missing")]))
    assert result.launch_error and result.exit_code is None


#: like ORPHAN, but the child exits by itself soon after its parent
SHORT_ORPHAN = ORPHAN.replace("time.sleep(60)", "time.sleep(0.2)")


def test_an_adopted_zombie_from_another_session_is_reaped(tmp_path: Path) -> None:
    assert reaper.become_subreaper()
    pidfile = tmp_path / "orphan.pid"
    parent = subprocess.Popen([sys.executable, "-c", SHORT_ORPHAN, str(pidfile)])
    assert parent.wait(30) == 0
    orphan = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while (st := reaper.stat(orphan)) is not None and st[0] != "Z":
        assert time.monotonic() < deadline, st
        time.sleep(0.01)
    assert st is not None and st[1] == os.getpid(), st  # adopted here, now a zombie
    with host._live_lock:
        host.reap_adopted()
    assert reaper.stat(orphan) is None  # reaped: gone from the process table
