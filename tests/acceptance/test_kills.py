"""Acceptance: real ``gpuwarden serve`` processes killed with SIGKILL (issue 11).

- The event log (``serve --log``) holds every event of the store exactly once,
  across kills at random moments, a ``copytruncate`` rotation while the broker
  runs, and a restart that logs into another file.
- Jobs interrupted by the broker's own death are re-queued without spending
  their retries: two kills while the same jobs run quarantine none of them.

The rig (a config, a queue root, the record of every bundle handed over, the
final audit) is the crash campaign's, tests/acceptance/test_chaos.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.core.model import JobSpec
from tests import supervisors
from tests.acceptance.test_chaos import Rig, Serve, echo, finish
from tests.acceptance.test_cli import wait_for


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.cleanup()


def logged_ids(*logs: Path) -> Counter[int]:
    """The event ids the log files hold (a line without one is no store event)."""
    ids: Counter[int] = Counter()
    for log in logs:
        if not log.exists():
            continue
        for line in log.read_text().splitlines():
            record = json.loads(line)  # every line is whole: a cut-short one was repaired
            if "id" in record:
                ids[record["id"]] += 1
    return ids


def store_ids(rig: Rig) -> list[int]:
    with contextlib.closing(rig.db()) as db:
        return [r[0] for r in db.execute("SELECT id FROM events ORDER BY id")]


def test_the_event_log_holds_each_event_once_across_sigkills_and_a_rotation(rig: Rig) -> None:
    rng = random.Random(11)
    log = rig.tmp / "events.jsonl"
    rotated = rig.tmp / "events.jsonl.1"
    other = rig.tmp / "elsewhere.jsonl"
    kills = 0
    for r in range(6):
        bundles = [[echo(f"r{r}-{i}-{j}") for j in range(rng.randint(1, 3))] for i in range(8)]
        for jobs in bundles[:4]:
            rig.drop(jobs)
        # one run logs into another file: the stream goes on there
        b = Serve(rig.config, other if r == 4 else log)
        rig.brokers.append(b)
        b.wait_started()
        for jobs in bundles[4:]:
            rig.drop(jobs)
            time.sleep(rng.uniform(0, 0.05))
        if r == 2:  # logrotate's copytruncate, while the broker writes
            time.sleep(0.3)
            rotated.write_bytes(log.read_bytes())
            with log.open("r+b") as f:
                f.truncate(0)
        time.sleep(rng.uniform(0.2, 1.5))
        assert b.proc.poll() is None, b.stderr.read_text()
        b.proc.send_signal(signal.SIGKILL)
        assert b.proc.wait(30) == -signal.SIGKILL  # killed, no cleanup
        kills += 1
    assert rotated.stat().st_size > 0  # the rotation really took lines away

    findings = finish(rig)
    findings.assert_clean()
    wanted = store_ids(rig)
    files = {rotated, log, other, *(b.log for b in rig.brokers)}  # the last run's too
    got = logged_ids(*files)
    assert kills == 6 and wanted
    lost = sorted(set(wanted) - set(got))
    doubled = sorted(i for i, n in got.items() if n > 1)
    assert not lost, f"{len(lost)} events never reached the log: {lost[:20]}"
    assert not doubled, f"{len(doubled)} events logged twice: {doubled[:20]}"
    assert set(got) == set(wanted)


def test_two_broker_deaths_while_jobs_run_quarantine_none_of_them(rig: Rig) -> None:
    # testmods.hold allows no retry: under the old rule an interruption spent one
    # and quarantined them. Held until the test releases them: they are running
    # when each broker dies, never ended by a sleep first
    release = rig.tmp / "release"
    jobs = [
        JobSpec(id=f"long-{i}", type="testmods.hold", params={"until": str(release)})
        for i in range(3)
    ]
    rig.drop(jobs)
    for death in (1, 2):
        b = rig.serve()
        b.wait_started()

        def running_again(b: object = b, death: int = death) -> bool:
            moves = [
                e
                for e in rig.brokers[-1].events("transition")
                if e.get("to") == "running" and e.get("attempt") == death
            ]
            return len(moves) == len(jobs)

        wait_for(running_again, f"every job running (attempt {death})")
        time.sleep(0.5)
        assert b.kill() == -signal.SIGKILL
        # the jobs' supervisors die too, as with the host going down: nothing is
        # left to take the attempts back, so each is interrupted
        ours = os.fsencode(str(rig.tmp) + "/")
        killed = [p for p, args in supervisors.supervisors().items() if args[4].startswith(ours)]
        assert len(killed) == len(jobs)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        with contextlib.closing(rig.db()) as db:
            running = [r[0] for r in db.execute("SELECT id FROM jobs WHERE state = 'running'")]
        assert sorted(running) == sorted(j.id for j in jobs)  # died while they ran

    release.touch()
    findings = finish(rig, timeout=60)
    findings.assert_clean()
    assert findings.states == {"done": len(jobs)}
    with contextlib.closing(rig.db()) as db:
        for job in jobs:
            outcomes = [
                (r["outcome"], r["reason"])
                for r in db.execute(
                    "SELECT outcome, reason FROM attempts WHERE job_id = ? ORDER BY number",
                    (job.id,),
                )
            ]
            assert [o for o, _ in outcomes] == ["interrupted", "interrupted", "succeeded"]
            assert "re-queued without spending a retry (interruption 1/5)" in outcomes[0][1]
            assert "(interruption 2/5)" in outcomes[1][1]
