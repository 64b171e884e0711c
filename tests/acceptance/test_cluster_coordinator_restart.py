"""A coordinator restart loses no route (issue 19; SPEC.md section 16, "Services
across hosts", "Route records"): a coordinator and one agent, each a process of
its own; the agent runs a service reached at ``/run/<name>/``. The coordinator
is killed with SIGKILL (confirmed dead) and started again on the same address
and store: the same process answers ``/run/<name>/`` through the new
coordinator, from the route rows it reads back, with no second process and the
job's one attempt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.acceptance.test_cluster import Cluster, _healthy, wait_for
from tests.acceptance.test_cluster_adoption import _alive, _pid_served
from tests.acceptance.test_cluster_preemption import running_cluster
from tests.acceptance.test_cluster_services import _service_processes

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("xrestart")
    with running_cluster(pg_url, tmp, {"r1": {"vram_gib": 24}}, lease_s=30) as c:
        yield c


def test_a_restarted_coordinator_serves_the_same_service_from_its_stored_routes(
    cluster: Cluster,
) -> None:
    c = cluster
    with c.client() as client:
        client.submit("testmods.web", {}, id="rsvc1", service="hello2")
    try:
        pid = wait_for("the service at /run/hello2/", lambda: _pid_served(c), timeout=60)
        rows = c.sql("SELECT job_id, node FROM service_routes WHERE name = %s", "hello2")
        assert rows == [("rsvc1", "r1")]
        coordinator = c.procs[0]
        coordinator.send_signal(signal.SIGKILL)
        assert coordinator.wait(10) == -signal.SIGKILL  # the coordinator is dead
        assert not _healthy(c.urls[0])
        port = c.urls[0].rsplit(":", 1)[1]
        with (c.tmp / "coordinator.stderr").open("ab") as err:
            again = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gpuwarden"),
                    *("--config", str(c.tmp / "coordinator.toml")),
                    *("coordinator", "--bind", f"127.0.0.1:{port}"),
                ],
                env=c.env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        c.procs[0] = again
        wait_for("the restarted coordinator", lambda: _healthy(c.urls[0]), timeout=60)
        # the first requests may come before the agent's next heartbeat: the stored
        # route serves them
        assert _pid_served(c) == pid
        assert _alive("rsvc1") == [pid]  # the same process, alone
        with c.client() as client:
            job = client.get("rsvc1")
        assert job["state"] == "running" and job["attempts"] == 1, job
    finally:
        for p in _service_processes("rsvc1"):
            if p.pid != os.getpid():
                p.kill()
