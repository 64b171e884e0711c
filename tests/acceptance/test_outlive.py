"""Acceptance: jobs outlive the broker (issue 28; SPEC.md, "Attempts outlive the
broker"). Real ``gpuwarden serve`` processes on the simulated GPU, real jobs
(``testmods.ledger``) that count their own work in a file the broker never
touches: 'start', 'done' and 'checkpoint' lines, one per event. Each test first
asserts that its fault happened (the broker died of SIGKILL, or stopped at once
on SIGTERM while its jobs ran on), then judges by the jobs' own lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_chaos import Rig
from tests.acceptance.test_cli import GW, env, run, wait_for, write_config
from tests.conftest import need_tool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.cleanup()


def lines(ledger: Path) -> list[tuple[str, str, str, int]]:
    """(event, job, attempt, pid) of each whole line the jobs wrote."""
    if not ledger.exists():
        return []
    out = []
    for line in ledger.read_text().splitlines():
        what, job, attempt, pid = line.split()
        out.append((what, job, attempt, int(pid)))
    return out


def count(ledger: Path, what: str) -> Counter[str]:
    return Counter(job for w, job, _, _ in lines(ledger) if w == what)


def submit(
    rig: Rig, jid: str, ledger: Path, seconds: float, *, kind: str = "ledger", until: str = ""
) -> None:
    """``seconds``: how long the job runs at most; ``until``: a file that ends it
    sooner (the test makes it when it is ready for the job to end)."""
    r = run(
        "--config", rig.config, "submit", f"testmods.{kind}", "--id", jid,
        "--ledger", ledger, "--seconds", str(seconds), "--until", until,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def jobs(rig: Rig) -> dict[str, dict[str, object]]:
    r = run("--config", rig.config, "jobs", "--json", "--all")
    assert r.returncode == 0, r.stderr
    return {j["id"]: j for j in json.loads(r.stdout)}


def attempts(rig: Rig, jid: str) -> list[dict[str, object]]:
    with contextlib.closing(rig.db()) as db:
        return [
            dict(r)
            for r in db.execute(
                "SELECT number, outcome, reason FROM attempts WHERE job_id = ? ORDER BY number",
                (jid,),
            )
        ]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"


def states(rig: Rig) -> dict[str, str]:
    with contextlib.closing(rig.db()) as db:
        return {r["id"]: r["state"] for r in db.execute("SELECT id, state FROM jobs")}


def started(rig: Rig, ledger: Path, ids: list[str]) -> dict[str, int]:
    """Wait until every job in ``ids`` wrote its 'start' line: job -> its pid."""
    wait_for(lambda: set(ids) <= set(count(ledger, "start")), "the jobs to start", 60)
    return {job: pid for w, job, _, pid in lines(ledger) if w == "start" and job in ids}


def settle(rig: Rig, ids: list[str]) -> dict[str, str]:
    b = rig.brokers[-1]
    wait_for(
        lambda: all(states(rig).get(j) in ("done", "failed") for j in ids),
        "the jobs to end",
        90,
    )
    assert b.stop() == 0
    return states(rig)


def test_sigkill_while_jobs_run_then_restart_adopts_them(rig: Rig, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    first = rig.serve()
    first.wait_started()
    ids = ["cpu1", "cpu2", "gpu1"]
    release = tmp_path / "release"
    submit(rig, "cpu1", ledger, 60, until=str(release))
    submit(rig, "cpu2", ledger, 60, until=str(release))
    submit(rig, "gpu1", ledger, 60, kind="ledger_gpu", until=str(release))
    pids = started(rig, ledger, ids)
    assert first.kill() == -signal.SIGKILL  # the fault: the broker died mid-job
    assert all(alive(p) for p in pids.values()), "a job died with the broker"
    second = rig.serve()
    second.wait_started()
    adopted = {e["job"] for e in second.events("attempt_adopted")}
    assert adopted == set(ids), second.events()
    release.touch()
    assert settle(rig, ids) == dict.fromkeys(ids, "done")
    # each job did its work once, in the one process that started before the kill
    assert count(ledger, "start") == Counter(ids)
    assert count(ledger, "done") == Counter(ids)
    assert {job: pid for w, job, _, pid in lines(ledger) if w == "done"} == pids
    for jid in ids:
        assert [a["outcome"] for a in attempts(rig, jid)] == ["succeeded"]


def test_jobs_that_end_while_no_broker_runs_are_judged_from_their_record(
    rig: Rig, tmp_path: Path
) -> None:
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    first = rig.serve()
    first.wait_started()
    submit(rig, "ok", ledger, 90, until=str(release))
    r = run(
        "--config", rig.config, "submit", "testmods.ledger", "--id", "bad",
        "--ledger", ledger, "--seconds", "90", "--exit_code", "3", "--until", release,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    started(rig, ledger, ["ok", "bad"])
    assert first.kill() == -signal.SIGKILL
    release.touch()  # both end while no broker runs
    wait_for(lambda: set(count(ledger, "done")) == {"ok", "bad"}, "the jobs to end", 30)
    assert states(rig) == {"ok": "running", "bad": "running"}  # nobody saw them end
    second = rig.serve()
    second.wait_started()
    assert {e["job"] for e in second.events("attempt_end_recovered")} == {"ok", "bad"}
    assert settle(rig, ["ok", "bad"]) == {"ok": "done", "bad": "failed"}
    assert count(ledger, "start") == Counter(["ok", "bad"])  # neither ran again
    assert [a["outcome"] for a in attempts(rig, "ok")] == ["succeeded"]
    [bad] = attempts(rig, "bad")
    assert bad["outcome"] == "job_failed" and "3" in str(bad["reason"])


def test_a_graceful_stop_leaves_jobs_running_and_the_next_start_takes_them(
    rig: Rig, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    first = rig.serve()
    first.wait_started()
    release = tmp_path / "release"
    submit(rig, "long", ledger, 60, until=str(release))
    [pid] = started(rig, ledger, ["long"]).values()
    t0 = time.monotonic()
    assert first.stop() == 0  # SIGTERM, as `systemctl restart` sends
    assert time.monotonic() - t0 < 10  # it did not wait out the job
    assert alive(pid), "the routine stop stopped the job"
    assert [e.get("left_running") for e in first.events("broker_stopped")] == [1]
    second = rig.serve()
    second.wait_started()
    assert [e["job"] for e in second.events("attempt_adopted")] == ["long"]
    release.touch()
    assert settle(rig, ["long"]) == {"long": "done"}
    assert lines(ledger)[-1][:2] == ("done", "long")
    assert count(ledger, "start") == Counter(["long"])


def test_stop_jobs_stops_them_as_before(rig: Rig, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    log = tmp_path / "events-stop.jsonl"
    proc = subprocess.Popen(
        [*GW, "--config", str(rig.config), "serve", "--stop-jobs", "--log", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env(),
        start_new_session=True,
    )
    try:
        wait_for(lambda: log.exists() and "broker_started" in log.read_text(), "serve")
        submit(rig, "long", ledger, 60)
        [pid] = started(rig, ledger, ["long"]).values()
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)  # the second signal: now
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not alive(pid)
    assert "done" not in {w for w, *_ in lines(ledger)}


def test_a_killed_supervisor_interrupts_its_attempt_once(rig: Rig, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    b = rig.serve()
    b.wait_started()
    submit(rig, "s1", ledger, 60, until=str(tmp_path / "release"))
    [pid] = started(rig, ledger, ["s1"]).values()
    sup = json.loads(
        (rig.state / "jobs" / "s1" / "attempt-1" / "supervisor" / "started.json").read_text()
    )
    os.kill(sup["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(sup["pid"]), "the supervisor to die")  # the fault
    wait_for(lambda: count(ledger, "start")["s1"] == 2, "the retry")
    (tmp_path / "release").touch()
    assert settle(rig, ["s1"]) == {"s1": "done"}
    assert not alive(pid)
    outcomes = [a["outcome"] for a in attempts(rig, "s1")]
    assert outcomes == ["interrupted", "succeeded"]
    assert "supervisor" in str(attempts(rig, "s1")[0]["reason"])
    assert count(ledger, "start") == Counter({"s1": 2})
    assert count(ledger, "done") == Counter({"s1": 1})  # the first never finished


def test_a_checkpoint_taken_while_no_broker_runs_is_honoured(rig: Rig, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    first = rig.serve()
    first.wait_started()
    release = tmp_path / "release"
    submit(rig, "pre", ledger, 60, until=str(release))
    started(rig, ledger, ["pre"])
    sup = json.loads(
        (rig.state / "jobs" / "pre" / "attempt-1" / "supervisor" / "started.json").read_text()
    )
    assert first.kill() == -signal.SIGKILL
    # the preemption's signal, as the broker sends it (to the supervisor's group),
    # arrives and the job checkpoints while no broker runs
    os.killpg(sup["pid"], signal.SIGUSR1)
    wait_for(lambda: count(ledger, "checkpoint")["pre"] == 1, "the checkpoint")
    wait_for(lambda: not alive(sup["pid"]), "the supervisor to end")
    release.touch()  # the resumed attempt may end
    second = rig.serve()
    second.wait_started()
    assert settle(rig, ["pre"]) == {"pre": "done"}
    outcomes = [a["outcome"] for a in attempts(rig, "pre")]
    assert outcomes == ["checkpointed", "succeeded"], attempts(rig, "pre")
    assert [w for w, *_ in lines(ledger)] == ["start", "checkpoint", "start", "done"]


@pytest.fixture(params=["bubblewrap", "podman"])
def boxed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    """A node whose container types run in bubblewrap or podman."""
    runtime: str = request.param
    if runtime == "bubblewrap":
        need_tool("bwrap")
        extra = 'container_runtime = "bubblewrap"\n'
    else:
        base = request.getfixturevalue("podman_base_image")
        inspect = ["podman", "image", "inspect", "--format", "{{.Id}}", base]
        image = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.strip()
        extra = f'container_runtime = "podman"\nsandbox_image = "{image}"\n'
    r = Rig(tmp_path)
    r.config = write_config(tmp_path, grace=5, extra=extra)
    yield r
    r.cleanup()


def boxed_lines(rig: Rig, jid: str) -> list[str]:
    """What the sandboxed job wrote, over all its attempts (each in its own
    output folder, which the broker never writes)."""
    found = []
    for ledger in sorted((rig.state / "jobs" / jid).glob("attempt-*/out/ledger")):
        found += [ln.split()[0] for ln in ledger.read_text().splitlines()]
    return found


def test_sigkill_while_sandboxed_jobs_run_then_restart_adopts_them(boxed: Rig) -> None:
    rig = boxed
    first = rig.serve()
    first.wait_started()
    r = run(
        "--config", rig.config, "submit", "testmods.ledger_box", "--id", "box",
        "--seconds", "90", "--until", "release",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    wait_for(lambda: boxed_lines(rig, "box") == ["start"], "the sandboxed job to start", 90)
    assert first.kill() == -signal.SIGKILL  # the fault
    second = rig.serve()
    second.wait_started()
    assert [e["job"] for e in second.events("attempt_adopted")] == ["box"], second.events()
    (rig.state / "jobs" / "box" / "attempt-1" / "out" / "release").touch()
    assert settle(rig, ["box"]) == {"box": "done"}
    assert boxed_lines(rig, "box") == ["start", "done"]  # once, in the first attempt
    assert [a["outcome"] for a in attempts(rig, "box")] == ["succeeded"]


def test_a_multi_gpu_job_s_holding_is_back_before_anything_is_planned(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    rig.config.write_text(rig.config.read_text().replace("[sim_gpu]\n", "[sim_gpu]\ncount = 2\n"))
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    try:
        first = rig.serve()
        first.wait_started()
        submit(rig, "p1", ledger, 90, kind="ledger_pair", until=str(release))
        started(rig, ledger, ["p1"])
        assert first.kill() == -signal.SIGKILL  # the fault
        submit(rig, "p2", ledger, 90, kind="ledger_pair", until=str(release))  # while down
        second = rig.serve()
        second.wait_started()
        assert [e["job"] for e in second.events("attempt_adopted")] == ["p1"]
        # p1 holds both GPUs again: p2 must wait, however long we look
        time.sleep(2)
        assert count(ledger, "start") == Counter(["p1"])
        why = run("--config", rig.config, "explain", "p2")
        assert "p1" in why.stdout, why.stdout
        release.touch()
        assert settle(rig, ["p1", "p2"]) == {"p1": "done", "p2": "done"}
        assert count(ledger, "start") == Counter(["p1", "p2"])
        assert count(ledger, "done") == Counter(["p1", "p2"])
    finally:
        rig.cleanup()


def test_a_kill_right_after_the_launch_before_its_pid_is_stored(rig: Rig, tmp_path: Path) -> None:
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    first = rig.serve(fault="after_launch@1")  # SIGKILL right after the process runs
    first.wait_started()
    submit(rig, "fast", ledger, 90, until=str(release))
    assert first.wait_dead(30) == -signal.SIGKILL  # the fault
    with contextlib.closing(rig.db()) as db:
        [(pid,)] = db.execute("SELECT pid FROM attempts WHERE job_id = 'fast'").fetchall()
    assert pid is None  # the store never heard of its process
    started(rig, ledger, ["fast"])  # but it runs, under its supervisor
    second = rig.serve()
    second.wait_started()
    assert [e["job"] for e in second.events("attempt_adopted")] == ["fast"], second.events()
    release.touch()
    assert settle(rig, ["fast"]) == {"fast": "done"}
    assert count(ledger, "start") == Counter(["fast"])
    assert [a["outcome"] for a in attempts(rig, "fast")] == ["succeeded"]
