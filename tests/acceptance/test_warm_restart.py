"""Acceptance: a warm server keeps its loaded model across a restart of the broker
(issue 28; SPEC.md, "Warm servers across a restart").

Real ``gpuwarden serve`` processes on the simulated GPU and a real warm server
(``testmods.warm_counted``) that writes one line per model load into its
module's model folder, a file the broker never touches. Each test first asserts
that its fault happened (the broker stopped on SIGTERM, or died of SIGKILL,
while the server's process ran on), then judges by the server's own lines and
by the PID that served each job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_chaos import Rig
from tests.acceptance.test_cli import run, wait_for, write_config

pytestmark = pytest.mark.timeout(240)

TYPE = "testmods.warm_counted"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    r.config = write_config(tmp_path, extra=f'[modules.testmods]\nmodel_dir = "{model}"\n')
    yield r
    r.cleanup()


def loads(rig: Rig) -> list[int]:
    """The PID of each model load, in order, as the server wrote them."""
    path = rig.tmp / "model" / "loads"
    if not path.exists():
        return []
    return [int(line.split()[1]) for line in path.read_text().splitlines() if line.strip()]


def submit(rig: Rig, jid: str, sleep_s: float = 0.05) -> None:
    r = run("--config", rig.config, "submit", TYPE, "--id", jid, "--sleep_s", str(sleep_s))
    assert r.returncode == 0, r.stderr


def job(rig: Rig, jid: str) -> tuple[str | None, int]:
    """(state, attempts) of the job, read from the store."""
    with contextlib.closing(rig.db()) as db:
        row = db.execute("SELECT state, attempts FROM jobs WHERE id = ?", (jid,)).fetchone()
    return (row["state"], row["attempts"]) if row else (None, 0)


def outcomes(rig: Rig, jid: str) -> list[str | None]:
    with contextlib.closing(rig.db()) as db:
        q = "SELECT outcome FROM attempts WHERE job_id = ? ORDER BY number"
        return [r["outcome"] for r in db.execute(q, (jid,))]


def done(rig: Rig, jid: str, timeout: float = 90) -> None:
    wait_for(
        lambda: job(rig, jid)[0] in ("done", "failed", "quarantined"), f"{jid} to end", timeout
    )
    assert job(rig, jid)[0] == "done", outcomes(rig, jid)


def served_by(rig: Rig, jid: str) -> int:
    """The PID of the server process that ran the job's last attempt."""
    attempts = job(rig, jid)[1]
    out = rig.state / "jobs" / jid / f"attempt-{attempts}" / "out" / "served.json"
    return int(json.loads(out.read_text())["pid"])


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def records(rig: Rig) -> list[Path]:
    folder = rig.state / "warm" / "servers"
    return sorted(folder.glob("*.json")) if folder.exists() else []


def first_job_then(rig: Rig) -> int:
    """Start a broker, run one job on a fresh server: the server's PID."""
    first = rig.serve()
    first.wait_started()
    submit(rig, "j1")
    done(rig, "j1")
    assert len(loads(rig)) == 1
    pid = loads(rig)[0]
    assert served_by(rig, "j1") == pid
    wait_for(lambda: len(records(rig)) == 1, "the server's record")
    return pid


def second_broker_serves_on(rig: Rig, pid: int) -> None:
    """A new broker takes the server over and runs the next job on it, with no
    new load."""
    second = rig.serve()
    second.wait_started()
    wait_for(lambda: bool(second.events("warm_server_adopted")), "the server taken over", 60)
    submit(rig, "j2")
    done(rig, "j2")
    assert loads(rig) == [pid], "the model was loaded again"
    assert served_by(rig, "j2") == pid
    assert not second.events("warm_server_loaded")


def test_a_routine_stop_leaves_the_idle_server_to_the_next_broker(rig: Rig) -> None:
    pid = first_job_then(rig)
    first = rig.brokers[0]
    assert first.stop() == 0  # the fault: a routine stop (SIGTERM)
    assert first.events("warm_server_left"), first.events()
    assert not first.events("warm_server_stopped")
    assert alive(pid), "the server died with the broker"
    second_broker_serves_on(rig, pid)


def test_a_killed_broker_leaves_its_server_to_the_next(rig: Rig) -> None:
    pid = first_job_then(rig)
    assert rig.brokers[0].kill() == -signal.SIGKILL  # the fault
    assert alive(pid), "the server died with the broker"
    assert len(records(rig)) == 1
    second_broker_serves_on(rig, pid)


def test_a_forged_record_is_not_taken_over(rig: Rig) -> None:
    pid = first_job_then(rig)
    assert rig.brokers[0].kill() == -signal.SIGKILL
    assert alive(pid)
    # the record now names another process of this host, with that process's own
    # start time: only the marker and the supervisor's own record give it away
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (path,) = records(rig)
        data = json.loads(path.read_text())
        stat = Path(f"/proc/{other.pid}/stat").read_text()
        data["pid"] = other.pid
        data["start_ticks"] = int(stat[stat.rindex(")") + 2 :].split()[19])
        path.write_text(json.dumps(data))
        second = rig.serve()
        second.wait_started()
        refused = second.events("warm_record_refused")
        assert [r["reason"] for r in refused] == [
            f"process {other.pid} is not the server's supervisor"
        ], second.events()
        assert not second.events("warm_server_adopted") and not second.events(
            "warm_server_adopting"
        )
        assert alive(other.pid), "a process a record named was signalled"
        assert not records(rig)
        wait_for(lambda: not alive(pid), "the server no broker took over to be stopped")
        submit(rig, "j2")
        done(rig, "j2")
        assert len(loads(rig)) == 2 and served_by(rig, "j2") == loads(rig)[1] != pid
    finally:
        other.kill()
        other.wait(10)


def test_a_job_in_flight_when_the_broker_dies_is_retried_on_the_same_server(
    rig: Rig,
) -> None:
    pid = first_job_then(rig)
    first = rig.brokers[0]
    submit(rig, "long", sleep_s=8)
    wait_for(lambda: job(rig, "long")[0] == "running", "the long job to run")
    assert first.kill() == -signal.SIGKILL  # the fault: killed mid-job
    assert job(rig, "long") == ("running", 1)
    assert alive(pid)
    second = rig.serve()
    second.wait_started()
    # interrupted, and run again: on the same server once it has finished
    done(rig, "long", timeout=120)
    assert outcomes(rig, "long") == ["interrupted", "succeeded"]
    assert served_by(rig, "long") == pid
    assert loads(rig) == [pid], "the model was loaded again"
    assert second.events("warm_server_adopted")


def test_a_server_that_does_not_come_back_is_stopped(rig: Rig) -> None:
    pid = first_job_then(rig)
    assert rig.brokers[0].kill() == -signal.SIGKILL
    os.kill(pid, signal.SIGSTOP)  # the fault: it can no longer answer
    try:
        wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T", "stopped")
        second = rig.serve()
        second.wait_started()
        assert second.events("warm_server_adopting")  # its record and process checked out
        # given its type's timeout_s + 30 s to come back, then stopped
        wait_for(lambda: bool(second.events("warm_server_stopped")), "the server stopped", 150)
        (stopped,) = second.events("warm_server_stopped")
        assert "did not come back" in str(stopped["reason"]), stopped
        wait_for(lambda: not alive(pid), "its process gone")
        assert not records(rig) and not second.events("warm_server_adopted")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
