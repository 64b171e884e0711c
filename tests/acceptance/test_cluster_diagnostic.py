"""A diagnostic grant with a real coordinator (PostgreSQL) and agent: on a drained
node the granted job runs once, a second job is not run there, the node stays
draining; a second grant is revoked by a cancel and its job never starts."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.acceptance.test_cluster import Cluster, gpu_job, wait_for
from tests.acceptance.test_cluster_preemption import running_cluster

pytestmark = pytest.mark.timeout(300)
EVERY_S = 10 / 6  # the agents' heartbeat interval (lease_s / 6)


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(pg_url, tmp_path_factory.mktemp("xdiag"), {"d24": {"vram_gib": 24}}) as c:
        yield c


def grants(c: Cluster, job_id: str) -> list[tuple[object, ...]]:
    return c.sql(
        "SELECT node, used_at, attempt, revoked_at, revoked_reason FROM node_grants "
        "WHERE job_id = %s ORDER BY id",
        job_id,
    )


def test_a_grant_runs_one_job_once_on_a_drained_node_and_a_cancel_revokes_another(
    cluster: Cluster,
) -> None:
    c = cluster
    assert c.gw("node", "drain", "d24", "--url", c.urls[0]).returncode == 0
    assert c.nodes()["d24"]["state"] == "draining"  # the fault: the node is really closed
    with c.client() as client:
        gpu_job(client, "diag-b", 1)
        gpu_job(client, "diag-a", 1)
    got = c.gw(
        "node", "diagnostic", "d24", "diag-a", "--reason", "after the fan swap",
        "--url", c.urls[0],
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    wait_for("diag-a done", lambda: c.client().get("diag-a")["state"] == "done", timeout=60)
    a = c.client().get("diag-a")
    assert [x["node"] for x in a["attempts_detail"]] == ["d24"]
    [(node, used_at, attempt, revoked_at, _)] = grants(c, "diag-a")
    assert node == "d24" and used_at is not None and attempt == 1 and revoked_at is None
    # the node keeps heartbeating and claiming, and still runs nothing else
    seen = float(c.nodes()["d24"]["last_seen"])
    wait_for(
        "3 more heartbeats",
        lambda: float(c.nodes()["d24"]["last_seen"]) >= seen + 3 * EVERY_S,
        timeout=30,
    )
    b = c.client().get("diag-b")
    assert b["state"] == "queued" and b["attempts_detail"] == []
    assert c.nodes()["d24"]["state"] == "draining" and c.nodes()["d24"]["grant"] is None
    # a second grant, revoked by a cancel before the agent (stopped) could claim it
    agent = c.agents["d24"].proc
    assert agent is not None
    agent.send_signal(signal.SIGSTOP)
    try:
        with c.client() as client:
            gpu_job(client, "diag-c", 1)
        got = c.gw("node", "diagnostic", "d24", "diag-c", "--reason", "r", "--url", c.urls[0])
        assert got.returncode == 0, got.stderr
        assert c.nodes()["d24"]["grant"]["job"] == "diag-c"
        with c.client() as client:
            client.cancel("diag-c")
    finally:
        agent.send_signal(signal.SIGCONT)
    [(_, used_at, _, revoked_at, why)] = grants(c, "diag-c")
    assert used_at is None and revoked_at is not None and why == "the job was cancelled"
    cancelled = c.client().get("diag-c")
    assert cancelled["state"] == "cancelled" and cancelled["attempts_detail"] == []
    assert c.nodes()["d24"]["grant"] is None
