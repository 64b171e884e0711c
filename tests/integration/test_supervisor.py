"""The attempt's supervisor as a script (``launch/supervisor.py``), run the way the
host launcher runs it, and the broker's reading of its files (``launch/host.py``:
``recorded_end``, ``live_supervisor``)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.launch import supervisor
from gpuwarden.launch.host import live_supervisor, recorded_end

SCRIPT = str(Path(supervisor.__file__).resolve())
PY = sys.executable


def start(
    tmp_path: Path,
    argv: list[str],
    *,
    timeout_s: float = math.inf,
    grace_s: float = 0.5,
    marker: str = "test/job/1",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    folder = tmp_path / "supervisor"
    folder.mkdir(exist_ok=True)
    return subprocess.Popen(
        [PY, "-I", "-S", SCRIPT, str(folder), repr(timeout_s), repr(grace_s), marker, "--", *argv],
        cwd=tmp_path,
        env=env if env is not None else {"PATH": os.environ["PATH"]},
        stdout=(tmp_path / "stdout.log").open("wb"),
        stderr=(tmp_path / "stderr.log").open("wb"),
        start_new_session=True,
    )


def record(tmp_path: Path) -> dict[str, object]:
    return json.loads((tmp_path / "supervisor" / "exit.json").read_text())


def wait_file(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.02)


def test_the_job_s_exit_code_and_exactly_its_environment(tmp_path: Path) -> None:
    p = start(tmp_path, ["sh", "-c", "env; exit 7"], env={"PATH": "/usr/bin:/bin", "A": "b c"})
    assert p.wait(20) == 7
    env = dict(ln.split("=", 1) for ln in (tmp_path / "stdout.log").read_text().splitlines())
    env.pop("PWD", None)
    env.pop("SHLVL", None)
    env.pop("_", None)
    assert env == {"PATH": "/usr/bin:/bin", "A": "b c", "GPUWARDEN_ATTEMPT": "test/job/1"}
    rec = record(tmp_path)
    assert rec["exit_code"] == 7 and not rec["stopped"] and not rec["timed_out"]
    # the supervisor itself does not carry the marker: it is not the job
    started = json.loads((tmp_path / "supervisor" / "started.json").read_text())
    assert started["pid"] == p.pid and started["marker"] == "test/job/1"


def test_a_signal_ends_the_job_as_subprocess_says_it(tmp_path: Path) -> None:
    p = start(tmp_path, ["sh", "-c", "kill -KILL $$"])
    assert p.wait(20) == 128 + signal.SIGKILL
    assert record(tmp_path)["exit_code"] == -signal.SIGKILL


def test_a_command_that_cannot_start_is_a_launch_error(tmp_path: Path) -> None:
    p = start(tmp_path, ["no-such-command-gpuwarden"])
    assert p.wait(20) == 127
    rec = record(tmp_path)
    assert rec["exit_code"] is None
    assert rec["launch_error"] == (
        "cannot start 'no-such-command-gpuwarden': No such file or directory"
    )


def test_sigterm_stops_the_job_with_its_grace_then_kills_it(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    p = start(tmp_path, ["sh", "-c", f"trap '' TERM; touch {ready}; sleep 30"], grace_s=0.3)
    wait_file(ready)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 128 + signal.SIGKILL  # it ignored SIGTERM
    assert 0.3 <= time.monotonic() - t0 < 10
    rec = record(tmp_path)
    assert rec["stopped"] and rec["exit_code"] == -signal.SIGKILL


def test_the_timeout_is_enforced_without_a_broker(tmp_path: Path) -> None:
    t0 = time.monotonic()
    p = start(tmp_path, ["sleep", "30"], timeout_s=0.5, grace_s=0.2)
    assert p.wait(20) == 128 + signal.SIGTERM
    assert 0.5 <= time.monotonic() - t0 < 10
    rec = record(tmp_path)
    assert rec["timed_out"] and rec["exit_code"] == -signal.SIGTERM


def test_signals_are_passed_on_and_noted(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    job = f"trap 'echo got-usr1; exit 6' USR1; touch {ready}; while :; do sleep 0.05; done"
    p = start(tmp_path, ["sh", "-c", job])
    wait_file(ready)
    os.killpg(p.pid, signal.SIGUSR1)  # as the broker's preemption sends it
    assert p.wait(20) == 6
    assert "got-usr1" in (tmp_path / "stdout.log").read_text()
    assert record(tmp_path)["signals"] == ["SIGUSR1"]


def test_a_lease_that_passes_stops_the_job(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    supervisor.write_lease(str(tmp_path), time.time() + 1.5)
    assert supervisor.read_lease(str(tmp_path)) is not None
    p = start(tmp_path, ["sh", "-c", f"touch {ready}; sleep 60"], grace_s=0.2)
    wait_file(ready)
    time.sleep(0.5)
    assert p.poll() is None  # the lease holds for now
    assert p.wait(20) == 128 + signal.SIGTERM
    assert record(tmp_path)["fenced"] is True


def test_a_renewed_lease_keeps_the_job_running(tmp_path: Path) -> None:
    supervisor.write_lease(str(tmp_path), time.time() + 1.0)
    p = start(tmp_path, ["sleep", "3"])
    for _ in range(6):
        time.sleep(0.5)
        supervisor.write_lease(str(tmp_path), time.time() + 1.0)
    assert p.wait(20) == 0
    assert record(tmp_path)["fenced"] is False


def test_what_the_job_leaves_in_its_group_dies_with_a_stop(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    p = start(
        tmp_path,
        ["sh", "-c", f"(trap '' TERM; sleep 60) & echo $! > {pidfile}; sleep 60"],
        grace_s=0.2,
    )
    wait_file(pidfile)
    time.sleep(0.1)
    child = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    p.wait(20)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists():
        state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        if state == "Z":
            break
        assert time.monotonic() < deadline, "the job's child outlived the stop"
        time.sleep(0.02)


# -- the broker's reading of the files ---------------------------------------------


def test_a_live_supervisor_is_known_by_its_start_time_and_marker(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    p = start(tmp_path, ["sh", "-c", f"touch {ready}; sleep 30"], marker="n/j/1")
    try:
        wait_file(ready)
        live = live_supervisor(str(tmp_path), "n/j/1")
        assert live is not None and live.pid == p.pid
        assert live_supervisor(str(tmp_path), "n/j/2") is None  # another attempt's
        started = tmp_path / "supervisor" / "started.json"
        data = json.loads(started.read_text())
        # a record naming another live process (a reused pid) is not believed
        started.write_text(json.dumps({**data, "pid": os.getpid()}))
        assert live_supervisor(str(tmp_path), "n/j/1") is None
        started.write_text(json.dumps({**data, "start_ticks": data["start_ticks"] + 1}))
        assert live_supervisor(str(tmp_path), "n/j/1") is None
        started.write_text(json.dumps({**data, "boot_id": "another-boot"}))
        assert live_supervisor(str(tmp_path), "n/j/1") is None
        started.unlink()
        started.symlink_to(tmp_path / "elsewhere.json")
        (tmp_path / "elsewhere.json").write_text(json.dumps(data))
        assert live_supervisor(str(tmp_path), "n/j/1") is None  # a link is not followed
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        b'{"v": 2, "exit_code": 0}',
        b'{"v": 1, "exit_code": "0"}',
        b'{"v": 1, "exit_code": true}',
        b" " * 70000 + b'{"v": 1, "exit_code": 0}',
    ],
)
def test_a_damaged_or_forged_exit_record_is_not_believed(tmp_path: Path, content: bytes) -> None:
    folder = tmp_path / "supervisor"
    folder.mkdir()
    (folder / "exit.json").write_bytes(content)
    got = recorded_end(str(tmp_path))
    assert got is None or got.exit_code is None


def test_an_exit_record_behind_a_link_is_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "supervisor"
    folder.mkdir()
    (tmp_path / "real.json").write_text('{"v": 1, "exit_code": 0}')
    (folder / "exit.json").symlink_to(tmp_path / "real.json")
    assert recorded_end(str(tmp_path)) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_the_supervisor_s_own_json_is_json(value: object) -> None:
    text = supervisor.to_json(value)
    if isinstance(value, float) and math.isinf(value):
        assert text == "null"
        return
    assert json.loads(text) == _finite(value)


def _finite(value: object) -> object:
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def test_a_supervisor_folder_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "exit.json").write_text('{"v": 1, "exit_code": 0}')
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "supervisor").symlink_to(elsewhere)  # the attack, planted first
    assert (attempt / "supervisor" / "exit.json").read_text().startswith("{")
    assert recorded_end(str(attempt)) is None
