"""Adoption on an agent, for real (SPEC.md section 19, "Adoption", and section 16,
"Services across hosts"): a coordinator and one agent, each a process of its own;
the agent runs a service, is killed with SIGKILL (confirmed dead) and started
again. The new agent takes the service back instead of stopping it: the same
process (same PID) keeps serving through the coordinator's ``/run/<name>/``, the
job has one attempt, no second process of it runs, and its lease (the same one)
is still this node's, renewed by the new agent's heartbeats."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.acceptance.test_cluster import Cluster, _events, wait_for
from tests.acceptance.test_cluster_preemption import running_cluster
from tests.acceptance.test_cluster_services import _service_processes

pytestmark = pytest.mark.timeout(150)

#: long enough that a restarted agent heartbeats again before its lease lapses on a
#: loaded machine
LEASE_S = 30


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("xadopt")
    with running_cluster(pg_url, tmp, {"a1": {"vram_gib": 24}}, lease_s=LEASE_S) as c:
        yield c


def _pid_served(c: Cluster) -> int | None:
    got = httpx.get(
        c.urls[0] + "/run/hello2/echo",
        headers={"Authorization": f"Bearer {c.owner}", "Accept": "application/json"},
        timeout=10,
    )
    return int(got.json()["pid"]) if got.status_code == 200 else None


def _lease(c: Cluster, job_id: str) -> tuple[str, str, float] | None:
    rows = c.sql("SELECT node, lease_id, expires_at FROM leases WHERE job_id = %s", job_id)
    return (str(rows[0][0]), str(rows[0][1]), float(rows[0][2])) if rows else None


def _alive(job_id: str) -> list[int]:
    return sorted(
        p.pid
        for p in _service_processes(job_id)
        if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE
    )


def test_a_restarted_agent_adopts_its_running_service(cluster: Cluster) -> None:
    c = cluster
    with c.client() as client:
        client.submit("testmods.web", {}, id="asvc1", service="hello2")
    try:
        pid = wait_for("the service at /run/hello2/", lambda: _pid_served(c), timeout=60)
        assert _alive("asvc1") == [pid]
        lease = _lease(c, "asvc1")
        assert lease is not None and lease[0] == "a1"
        agent = c.agents["a1"]
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGKILL)
        assert agent.proc.wait(10) == -signal.SIGKILL  # the agent is dead; its service is not
        assert _alive("asvc1") == [pid]
        killed_at = time.time()
        c.start_agent(agent, None)  # its saved credential
        # served again through the coordinator, by a forwarder of the new agent
        wait_for(
            "the adopted service at /run/hello2/",
            lambda: (
                _pid_served(c) == pid
                and (_lease(c, "asvc1") or ("", "", 0))[2] > killed_at + LEASE_S / 2
            ),
            timeout=60,
        )
        assert agent.proc.poll() is None
        assert _alive("asvc1") == [pid]  # the same process, alone
        after = _lease(c, "asvc1")
        assert after is not None and after[:2] == lease[:2]  # the same lease, still a1's
        with c.client() as client:
            job = client.get("asvc1")
        assert job["state"] == "running" and job["attempts"] == 1, job
        events = _events(agent.log)
        assert any(e.get("event") == "service_adopted" for e in events), events[-5:]
    finally:
        for p in _service_processes("asvc1"):
            if p.pid != os.getpid():
                p.kill()
