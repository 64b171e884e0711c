"""The host launcher with real processes: exit codes, output, launch errors, and
that every process of an attempt is gone when run() returns."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from gpuwarden.core.clip import clip
from gpuwarden.launch import host
from gpuwarden.launch.base import ATTEMPT_ENV, LaunchRequest, LaunchResult
from gpuwarden.launch.host import (
    HostLauncher,
    find_attempt_processes,
    read_clipped,
    stop_processes,
)

PY = sys.executable
BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

# A job that ignores SIGTERM (inherited by its forks) and leaves three kinds of
# processes: a child in its group, a grandchild that left the group (setsid) and
# was orphaned by a double fork, and itself. Each writes its pid to argv[1].
TREE_JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pidfile = sys.argv[1]
    def record(kind):
        with open(pidfile, "a") as f:
            f.write(f"{kind} {os.getpid()}\\n")
    record("main")
    if os.fork() == 0:
        record("child")
        time.sleep(60)
        os._exit(0)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            record("escaped")
            time.sleep(60)
            os._exit(0)
        os._exit(0)
    print("tree started", flush=True)
    time.sleep(60)
    """
)


def request(
    tmp_path: Path,
    argv: list[str],
    *,
    name: str = "job",
    timeout_s: float = 10.0,
    env: dict[str, str] | None = None,
    clip_chars: int = 16384,
    kill_grace_s: float = 0.3,
    cwd: Path | None = None,
) -> LaunchRequest:
    # job ids (so markers) unique per run: another test run on this host must not
    # find, and stop, this run's processes by their marker
    return LaunchRequest(
        job_id=f"{name}-{uuid.uuid4().hex[:8]}",
        attempt=1,
        argv=tuple(argv),
        cwd=str(cwd or tmp_path),
        env=dict(BASE_ENV if env is None else env),
        attempt_dir=str(tmp_path / name / "1"),
        timeout_s=timeout_s,
        clip_chars=clip_chars,
        kill_grace_s=kill_grace_s,
    )


#: how ``run`` below runs an attempt: "thread" (``HostLauncher.run``, blocking, as
#: warm servers and sandboxes do) or "reaper" (``HostLauncher.start`` and the one
#: reaper, as the broker runs host attempts); every test here runs both ways
_VIA = {"path": "thread"}


@pytest.fixture(autouse=True, params=["thread", "reaper"])
def _launch_path(request: pytest.FixtureRequest) -> None:
    _VIA["path"] = request.param


def run(req: LaunchRequest, stop: threading.Event | None = None) -> LaunchResult:
    stop = stop or threading.Event()
    if _VIA["path"] == "thread":
        return HostLauncher().run(req, stop)
    got: list[LaunchResult] = []
    HostLauncher().start(req, stop, None, got.append).join(60)
    assert len(got) == 1, got
    return got[0]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def recorded_pids(pidfile: Path) -> dict[str, int]:
    lines = pidfile.read_text().split()
    return {kind: int(pid) for kind, pid in zip(lines[::2], lines[1::2], strict=True)}


def wait_for_lines(path: Path, count: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never got {count} lines")


# --- exit codes and output ---------------------------------------------------


def test_exit_zero_captures_stdout_and_stderr(tmp_path: Path) -> None:
    code = "import sys; print('hello out'); print('hello err', file=sys.stderr)"
    req = request(tmp_path, [PY, "-c", code])
    before = time.time()
    res = run(req)
    assert res.exit_code == 0
    assert res.launch_error is None
    assert not res.timed_out and not res.stopped
    assert res.stdout == "hello out\n"
    assert res.stderr == "hello err\n"
    assert res.pid is not None and gone(res.pid)
    assert res.reaped == ()
    assert before <= res.started_at <= res.ended_at <= time.time()
    assert (Path(req.attempt_dir) / "stdout.log").read_text() == "hello out\n"
    assert (Path(req.attempt_dir) / "stderr.log").read_text() == "hello err\n"


def test_nonzero_exit_code(tmp_path: Path) -> None:
    res = run(
        request(tmp_path, [PY, "-c", "import sys; print('bad', file=sys.stderr); sys.exit(3)"])
    )
    assert res.exit_code == 3
    assert res.stderr == "bad\n"
    assert not res.timed_out and not res.stopped and res.launch_error is None


def test_killed_by_signal_gives_negative_exit_code(tmp_path: Path) -> None:
    res = run(request(tmp_path, [PY, "-c", "import os; os.kill(os.getpid(), 9)"]))
    assert res.exit_code == -signal.SIGKILL


def test_stdin_is_devnull(tmp_path: Path) -> None:
    res = run(request(tmp_path, [PY, "-c", "import sys; print(repr(sys.stdin.read()))"]))
    assert res.stdout == "''\n"


# --- launch errors -------------------------------------------------------------


def test_missing_command_is_a_launch_error(tmp_path: Path) -> None:
    res = run(request(tmp_path, ["no-such-command-gpuwarden"]))
    assert res.exit_code is None
    assert res.pid is None
    assert res.launch_error == "cannot start 'no-such-command-gpuwarden': No such file or directory"


def test_not_executable_is_a_launch_error(tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    res = run(request(tmp_path, [str(script)]))
    assert res.exit_code is None
    assert res.launch_error is not None
    assert "Permission denied" in res.launch_error


def test_missing_cwd_is_a_launch_error(tmp_path: Path) -> None:
    res = run(request(tmp_path, [PY, "-c", "pass"], cwd=tmp_path / "nowhere"))
    assert res.exit_code is None
    assert res.launch_error is not None
    assert res.launch_error.startswith(f"cannot start {PY!r}: No such file or directory")
    assert "nowhere" in res.launch_error


def test_empty_argv_is_a_launch_error(tmp_path: Path) -> None:
    res = run(request(tmp_path, []))
    assert res.exit_code is None
    assert res.launch_error is not None


# --- the whole tree is stopped -----------------------------------------------------


def test_timeout_stops_the_whole_tree_including_escaped_grandchild(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    req = request(tmp_path, [PY, "-c", TREE_JOB, str(pidfile)], timeout_s=1.0, kill_grace_s=0.3)
    t0 = time.monotonic()
    res = run(req)
    elapsed = time.monotonic() - t0
    pids = recorded_pids(pidfile)
    assert set(pids) == {"main", "child", "escaped"}
    assert res.timed_out and not res.stopped
    assert res.exit_code == -signal.SIGKILL  # it ignored SIGTERM
    assert res.stdout == "tree started\n"
    for kind, pid in pids.items():
        assert gone(pid), f"{kind} process {pid} is still alive"
    # the supervisor stopped the job's own group at the timeout; the broker found
    # and stopped the one that had left both the group and the tree
    assert pids["escaped"] in res.reaped
    assert 1.0 <= elapsed < 4.0


def test_stop_event_stops_the_whole_tree(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    req = request(tmp_path, [PY, "-c", TREE_JOB, str(pidfile)], timeout_s=60.0, kill_grace_s=0.3)
    stop = threading.Event()

    def stop_when_started() -> None:
        wait_for_lines(pidfile, 3)
        stop.set()

    setter = threading.Thread(target=stop_when_started)
    setter.start()
    t0 = time.monotonic()
    res = run(req, stop)
    elapsed = time.monotonic() - t0
    setter.join()
    assert res.stopped and not res.timed_out
    for kind, pid in recorded_pids(pidfile).items():
        assert gone(pid), f"{kind} process {pid} is still alive"
        assert pid in res.reaped
    assert elapsed < 5.0


def test_stop_that_terminates_quickly_does_not_wait_for_the_grace(tmp_path: Path) -> None:
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    res = run(request(tmp_path, ["sleep", "30"], kill_grace_s=5.0), stop)
    assert res.stopped
    assert res.exit_code == -signal.SIGTERM
    assert time.monotonic() - t0 < 2.0


def test_stop_already_set_starts_nothing(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    marker_file = tmp_path / "ran"
    res = run(request(tmp_path, ["touch", str(marker_file)]), stop)
    assert res.stopped
    assert res.exit_code is None and res.pid is None and res.launch_error is None
    assert not marker_file.exists()


BACKGROUND_IN_GROUP = "sleep 30 & echo $! > {pidfile}; exit 0"
BACKGROUND_ESCAPED = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(sys.argv[1], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(30)
            os._exit(0)
        os._exit(0)
    import time
    time.sleep(0.2)   # let the escaped one write its pid
    """
)


@pytest.mark.parametrize("how", ["same group", "setsid and double fork"])
def test_leftover_background_process_is_killed_after_a_normal_exit(
    tmp_path: Path, how: str
) -> None:
    pidfile = tmp_path / "bg.pid"
    if how == "same group":
        argv = ["sh", "-c", BACKGROUND_IN_GROUP.format(pidfile=pidfile)]
    else:
        argv = [PY, "-c", BACKGROUND_ESCAPED, str(pidfile)]
    res = run(request(tmp_path, argv))
    bg = int(pidfile.read_text())
    assert res.exit_code == 0
    assert not res.timed_out and not res.stopped
    assert gone(bg)
    assert bg in res.reaped


def test_escaped_process_is_found_by_its_marker_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no snapshot after the first (taken before the job forks): only the marker can find it
    monkeypatch.setattr(host, "SNAPSHOT_FIRST_S", 1000.0)
    pidfile = tmp_path / "bg.pid"
    res = run(request(tmp_path, [PY, "-c", BACKGROUND_ESCAPED, str(pidfile)]))
    bg = int(pidfile.read_text())
    assert gone(bg)
    assert bg in res.reaped


def test_descendant_without_group_or_marker_is_found_by_the_snapshots(tmp_path: Path) -> None:
    # a child that leaves the group and drops the marker from its environment
    code = textwrap.dedent(
        """
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os.execve("/bin/sleep", ["sleep", "30"], {})
        with open(sys.argv[1], "w") as f:
            f.write(str(pid))
        time.sleep(0.5)
        """
    )
    pidfile = tmp_path / "child.pid"
    res = run(request(tmp_path, [PY, "-c", code, str(pidfile)]))
    child = int(pidfile.read_text())
    assert res.exit_code == 0
    assert gone(child)
    assert child in res.reaped


# run() cannot wait for a main process that survived: Popen warns when collected
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_process_that_survives_sigkill_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # simulate a process stuck in the kernel: signals have no effect
    monkeypatch.setattr(host, "_signal", lambda procs, sig: None)
    monkeypatch.setattr(host, "_killpg", lambda pgid, sig: None)
    monkeypatch.setattr(host, "KILL_CONFIRM_S", 0.3)
    stuck = subprocess.Popen(["sleep", "30"])
    try:
        reaped, survivors = stop_processes([psutil.Process(stuck.pid)], 0.1)
        assert (reaped, survivors) == ([], [stuck.pid])
        # a stop (not a timeout: the attempt's supervisor would enforce that
        # itself): the broker's signals reach nothing, so the supervisor survives
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        res = run(request(tmp_path, ["sleep", "30"], timeout_s=60, kill_grace_s=0.1), stop)
        assert time.monotonic() - t0 < 3.0
        assert res.stopped
        assert res.exit_code is None
        assert res.pid is not None
        assert res.pid in res.survivors  # the supervisor, and the job under it
        listed = ", ".join(map(str, res.survivors))
        assert f"processes {listed} survived SIGKILL" in res.stderr
        for pid in res.survivors:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(res.pid, 0)
    finally:
        stuck.kill()
        stuck.wait()


# --- output clipping -------------------------------------------------------------


def test_huge_output_is_clipped_keeping_head_and_tail(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.stdout.write('BEGIN-' + 'x' * 5_000_000 + '-END')\n"
        "sys.stderr.write('e' * 3_000_000 + 'LAST')\n"
    )
    res = run(request(tmp_path, [PY, "-c", code], clip_chars=1000))
    assert res.exit_code == 0
    assert res.stdout.startswith("BEGIN-xxx")
    assert res.stdout.endswith("xxx-END")
    assert f"[... {5_000_010 - 1000} bytes clipped ...]" in res.stdout
    assert len(res.stdout) < 1100
    assert res.stderr.endswith("eeeLAST")
    assert "clipped" in res.stderr


def test_read_clipped_small_files(tmp_path: Path) -> None:
    f = tmp_path / "out.log"
    assert read_clipped(tmp_path / "missing.log", 10) == ""
    f.write_bytes(b"")
    assert read_clipped(f, 10) == ""
    f.write_bytes(b"0123456789")
    assert read_clipped(f, 10) == "0123456789"  # exactly at the limit: unclipped
    assert read_clipped(f, 11) == "0123456789"
    assert read_clipped(f, 9) == "0123\n[... 1 bytes clipped ...]\n56789"
    assert read_clipped(f, 0) == "\n[... 10 bytes clipped ...]\n"
    assert read_clipped(f, 1) == "\n[... 9 bytes clipped ...]\n9"
    with pytest.raises(ValueError):
        read_clipped(f, -1)


@pytest.mark.parametrize("limit", [0, 1, 2, 5, 9, 10, 11, 100])
@pytest.mark.parametrize("size", [0, 1, 10, 50, 1000])
def test_read_clipped_matches_clip_on_ascii(tmp_path: Path, size: int, limit: int) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(size))
    f = tmp_path / "out.log"
    f.write_text(text)
    # the same cut; a file's marker counts bytes (here, one per character)
    assert read_clipped(f, limit) == clip(text, limit).replace(
        "characters clipped", "bytes clipped"
    )


def test_read_clipped_multibyte_and_invalid_utf8(tmp_path: Path) -> None:
    f = tmp_path / "out.log"
    text = "█" * 10  # 3 bytes each
    f.write_text(text, encoding="utf-8")
    assert read_clipped(f, 10) == text  # 30 bytes but 10 characters: not clipped
    clipped = read_clipped(f, 4)
    assert clipped == "██\n[... 18 bytes clipped ...]\n██"
    f.write_bytes(b"ok\xff\xfeok")
    assert read_clipped(f, 100) == "ok\ufffd\ufffdok"
    # a big file whose cut falls inside multi-byte characters: no broken characters
    f.write_bytes("é".encode() * 100_000 + "ü".encode() * 100_000)
    clipped = read_clipped(f, 101)
    assert clipped.startswith("é" * 50 + "\n[... ")
    assert clipped.endswith("...]\n" + "ü" * 51)
    assert "\ufffd" not in clipped


# --- environment -----------------------------------------------------------------


def test_env_is_exactly_the_request_env_plus_the_marker(tmp_path: Path) -> None:
    env_cmd = shutil.which("env")
    assert env_cmd is not None
    req = request(tmp_path, [env_cmd], env={"FOO": "bar baz", "EMPTY": ""}, name="envjob")
    res = run(req)
    assert res.exit_code == 0
    got = dict(line.split("=", 1) for line in res.stdout.splitlines())
    assert got == {"FOO": "bar baz", "EMPTY": "", ATTEMPT_ENV: req.marker}


# --- concurrency -----------------------------------------------------------------


def test_two_concurrent_attempts_do_not_interfere(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    # a: a tree that times out and is killed while b is still running
    req_a = request(
        tmp_path, [PY, "-c", TREE_JOB, str(pidfile)], name="a", timeout_s=0.6, kill_grace_s=0.3
    )
    # b: runs past a's kill, leaves nothing behind, and exits 4
    code_b = (
        "import os, time; time.sleep(1.5); "
        "print(os.environ['GPUWARDEN_ATTEMPT']); raise SystemExit(4)"
    )
    req_b = request(tmp_path, [PY, "-c", code_b], name="b", timeout_s=10.0)
    results: dict[str, LaunchResult] = {}

    def go(key: str, req: LaunchRequest) -> None:
        results[key] = run(req)

    threads = [
        threading.Thread(target=go, args=("a", req_a)),
        threading.Thread(target=go, args=("b", req_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    a, b = results["a"], results["b"]
    assert a.job_id == req_a.job_id and a.timed_out and a.stdout == "tree started\n"
    for pid in recorded_pids(pidfile).values():
        assert gone(pid)
    assert b.job_id == req_b.job_id and not b.timed_out and not b.stopped
    assert b.exit_code == 4
    assert b.stdout == f"{req_b.marker}\n"
    assert b.reaped == ()
    assert b.pid not in a.reaped


# --- the helpers the broker reuses at restart ------------------------------------------


def test_find_and_stop_attempt_processes(tmp_path: Path) -> None:
    marker = f"restart-{uuid.uuid4().hex[:8]}/7"
    env = {**BASE_ENV, ATTEMPT_ENV: marker}
    ignore_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    )
    procs = [
        subprocess.Popen([PY, "-c", ignore_term], env=env, start_new_session=True),
        subprocess.Popen(["sleep", "30"], env=env, start_new_session=True),
    ]
    other = subprocess.Popen(
        ["sleep", "30"], env={**BASE_ENV, ATTEMPT_ENV: marker + "0"}, start_new_session=True
    )
    try:
        time.sleep(0.2)  # let python install its handler
        found = find_attempt_processes(marker)
        assert sorted(p.pid for p in found) == sorted(p.pid for p in procs)
        reaped, survivors = stop_processes(found, 0.3, marker=marker)
        assert survivors == []
        assert sorted(reaped) == sorted(p.pid for p in procs)
        assert all(gone(p.pid) for p in procs)
        assert find_attempt_processes(marker) == []
        assert other.poll() is None  # a different attempt is left alone
    finally:
        for p in [*procs, other]:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_stop_processes_with_nothing_alive() -> None:
    assert stop_processes([], 0.1) == ([], [])


def test_read_clipped_follows_no_link_and_opens_no_fifo(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not the job's")
    (tmp_path / "stdout.log").symlink_to(secret)
    os.mkfifo(tmp_path / "stderr.log")
    assert (tmp_path / "stdout.log").is_symlink()  # the attack is in place
    assert "not the job's" not in read_clipped(tmp_path / "stdout.log", 100)
    assert "symlink" in read_clipped(tmp_path / "stdout.log", 100)
    assert "fifo" in read_clipped(tmp_path / "stderr.log", 100)  # and it did not block
