"""What an agent reports (cluster/agent.py: Agent.report) and what the coordinator
makes of it: its launch rules and modules beside the types it runs, per GPU what
the probe shows used and what its ledger holds, its running jobs under the
coordinator's ids, how often it beats. A real broker on a simulated GPU; the
coordinator's app in process (tests/integration/test_agent.py's rig)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cluster import report as rp
from gpuwarden.core.model import GIB
from gpuwarden.core.states import JobState
from tests.integration.test_agent import Rig, gpu_job, make_rig


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


def test_the_report_says_the_nodes_rules_and_what_runs_there(rig: Rig) -> None:
    rig.store.submit([gpu_job("g1", 60)], now=time.time())
    rig.until("g1 running", lambda: rig.job("g1").state is JobState.RUNNING)

    def reported() -> dict[str, Any]:
        node = rig.store.get_node("a")
        assert node is not None
        return node.report

    rig.until("g1 in the report", lambda: reported().get("running"))
    rep = reported()
    assert rep["launch_rules"] == {
        "runtime": "local",
        "allow_unsandboxed_containers": True,
        "allow_host_jobs": False,
    }
    assert rep["probe"] == "sim" and rep["probe_error"] == ""
    assert rep["heartbeat_every_s"] == rig.agent.heartbeat_every_s == 1.0  # a 6 s lease
    assert "echo.echo" in rep["modules"] and "testmods.gpu" in rep["types"]
    assert set(rep["types"]) <= set(rep["modules"])
    [run] = rep["running"]
    assert run["job"] == "g1" and run["type"] == "testmods.gpu" and run["gpu"]
    [gpu] = rep["gpus"]
    assert gpu["ledger_bytes"] == 2 * GIB and gpu["degraded"] == ""
    assert gpu["reserve_bytes"] == GIB // 2 and gpu["used_bytes"] >= 0
    # what `gpuwarden status` shows of it over the coordinator
    [node] = rp.cluster_status(rig.store, time.time(), offline_after_s=8.0)
    assert node["node"] == "a" and node["problem"] == ""
    assert [r["job"] for r in node["running"]] == ["g1"]
    assert node["running"][0]["gpu"] == gpu["uuid"]
    assert node["gpus"][0]["ledger_bytes"] == 2 * GIB
    rig.store.request_cancel("g1", now=time.time())
    rig.until("g1 cancelled", lambda: rig.job("g1").state is JobState.CANCELLED)
