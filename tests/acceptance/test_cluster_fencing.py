"""Self-fencing and adoption on agents, for real (issue 28; SPEC.md section 1,
"Attempts outlive the broker", and section 16): a coordinator on PostgreSQL and
two agents, each a process of its own, running ``testmods.ledger`` jobs that
count their own work in a file no broker touches.

- An agent killed with SIGKILL (confirmed dead) leaves its job running under
  the job's supervisor, which stops it at the lease's end; the coordinator
  gives the job to the other agent only after the lease and the fence grace:
  the first copy is gone before the second starts, and the work is done once.
- An agent killed and started again within the lease takes its job back: one
  attempt, the same process, done once."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_cluster import Cluster, _events, wait_for
from tests.acceptance.test_cluster_preemption import running_cluster
from tests.acceptance.test_outlive import alive, lines

pytestmark = pytest.mark.timeout(180)

LEASE_S = 8
FENCE_GRACE_S = 4


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("xfence")
    agents = {"f1": {"vram_gib": 24}, "f2": {"vram_gib": 24}}
    with running_cluster(
        pg_url, tmp, agents, lease_s=LEASE_S, cluster_config={"fence_grace_s": FENCE_GRACE_S}
    ) as c:
        yield c


def holder(c: Cluster, job_id: str) -> str | None:
    rows = c.sql("SELECT node FROM leases WHERE job_id = %s", job_id)
    return str(rows[0][0]) if rows else None


def submit(c: Cluster, job_id: str, ledger: Path, until: Path) -> None:
    params = {"ledger": str(ledger), "seconds": 120, "until": str(until)}
    with c.client() as client:
        client.submit("testmods.ledger", params, id=job_id)


def state(c: Cluster, job_id: str) -> str:
    return str(c.sql("SELECT state FROM jobs WHERE id = %s", job_id)[0][0])


def test_a_dead_agent_s_job_is_stopped_at_its_lease_end_before_it_runs_elsewhere(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    submit(c, "fence1", ledger, release)
    first = wait_for("the job to start", lambda: [ln for ln in lines(ledger) if ln[0] == "start"])
    pid = first[0][3]
    node = wait_for("its lease", lambda: holder(c, "fence1"))
    agent = c.agents[node]
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGKILL)
    assert agent.proc.wait(10) == -signal.SIGKILL  # the fault: the agent is dead
    assert alive(pid)  # its job is not (yet)
    killed_at = time.monotonic()
    dead_at: float | None = None
    while True:  # watch both: the first copy's end, the second copy's start
        now = time.monotonic()
        if dead_at is None and not alive(pid):
            dead_at = now
        starts = [ln for ln in lines(ledger) if ln[0] == "start"]
        if len(starts) == 2:
            break
        assert now - killed_at < 90, "the job never ran again elsewhere"
        time.sleep(0.05)
    assert dead_at is not None, "a second copy started while the first still ran"
    assert dead_at - killed_at <= LEASE_S + 3  # stopped by its supervisor at the lease's end
    second = starts[1]
    assert second[3] != pid
    assert holder(c, "fence1") != node  # the other agent runs it now
    release.touch()
    wait_for("the job to end", lambda: state(c, "fence1") == "done", timeout=60)
    done = [ln for ln in lines(ledger) if ln[0] == "done"]
    assert [ln[3] for ln in done] == [second[3]]  # the work, done once, by the second copy
    first_record = (
        agent.state / "jobs" / "fence1" / "attempt-1" / "supervisor" / "exit.json"
    ).read_text()
    assert '"fenced":true' in first_record.replace(" ", "")
    c.start_agent(agent, None)  # back for the next test


def test_an_agent_restarted_within_the_lease_takes_its_job_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    wait_for(
        "both agents", lambda: len(c.sql("SELECT name FROM nodes WHERE state = 'active'")) == 2
    )
    submit(c, "back1", ledger, release)
    first = wait_for("the job to start", lambda: [ln for ln in lines(ledger) if ln[0] == "start"])
    pid = first[0][3]
    node = wait_for("its lease", lambda: holder(c, "back1"))
    agent = c.agents[node]
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGKILL)
    assert agent.proc.wait(10) == -signal.SIGKILL  # the fault
    c.start_agent(agent, None)
    wait_for(
        "the new agent to take the job back",
        lambda: any(
            e.get("event") == "attempt_adopted" and e.get("job") == "back1"
            for e in _events(agent.log)
        ),
        timeout=30,
    )
    assert alive(pid)
    time.sleep(LEASE_S + FENCE_GRACE_S)  # past the old lease: the new agent renewed it
    assert alive(pid) and holder(c, "back1") == node
    release.touch()
    wait_for("the job to end", lambda: state(c, "back1") == "done", timeout=60)
    assert Counter(ln[0] for ln in lines(ledger)) == Counter({"start": 1, "done": 1})
    assert [ln[3] for ln in lines(ledger)] == [pid, pid]
    attempts = c.sql("SELECT count(*) FROM attempts WHERE job_id = %s", "back1")
    assert attempts[0][0] == 1
