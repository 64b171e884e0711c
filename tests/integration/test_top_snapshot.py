"""``gpuwarden top``'s snapshot read from a store (every backend): what a broker
published, the queue in order, the latest failures; on a coordinator's store, its
enrolled nodes as ``status`` shows them, rendered at 80 columns."""

from __future__ import annotations

import time

from rich.console import Console

from gpuwarden.cli.top import snapshot_store
from gpuwarden.cli.topview import render
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.store.base import NodeStatus, Store
from gpuwarden.store.cluster import ClusterStore

GPU = "GPU-sim-0000-12345678"


def _frame(store: Store, now: float) -> str:
    snap = snapshot_store(store, "/state", now)
    console = Console(record=True, width=80, file=open("/dev/null", "w"), color_system=None)  # noqa: SIM115
    console.print(render(snap, 80))
    return " ".join(console.export_text().split())


def _submit(store: Store, *ids: str, now: float) -> None:
    store.submit([JobSpec(id=i, type="echo.echo", params={"text": i}) for i in ids], now=now)


def test_a_brokers_status_and_the_queue_and_failures_from_the_store(store: Store) -> None:
    now = time.time()
    _submit(store, "q-1", "q-2", "bad-1", now=now - 30)
    store.transition("bad-1", JobState.FAILED, now=now - 5, reason="the job exited with code 4")
    payload = {
        "probe": "sim",
        "gpus": [{"uuid": GPU, "name": "sim", "total_bytes": 24 * GIB, "used_bytes": 0,
                  "reserve_bytes": 0, "foreign_bytes": 0, "holdings": [], "degraded": ""}],
        "waiting": {"q-1": "needs 30.0 GiB on one GPU; no GPU of this node has that much"},
    }  # fmt: skip
    store.put_node_status(NodeStatus(node="vm", pid=42, updated_at=now - 1, payload=payload))
    snap = snapshot_store(store, "/state", now)
    assert [j.id for j in snap.queued] == ["q-1", "q-2"]  # queue order
    assert [(j.id, j.reason) for j in snap.failures] == [("bad-1", "the job exited with code 4")]
    assert snap.counts == {"queued": 2, "failed": 1} and snap.cluster is None
    assert snap.unexplained() == ["q-2"]
    frame = _frame(store, now)
    assert "node vm PID 42" in frame and "0.0/24.0 GiB held" in frame
    assert "q-1 echo.echo 30s needs 30.0 GiB on one GPU" in frame
    assert "bad-1 echo.echo 5s the job exited with code 4" in frame


def test_a_coordinators_store_shows_its_enrolled_nodes(store: Store) -> None:
    assert isinstance(store, ClusterStore)
    now = time.time()
    store.upsert_node("gpu-2", token_id="a" * 12, capabilities={}, now=now - 60)
    report = {
        "probe": "nvml",
        "gpus": [{"uuid": GPU, "name": "H100", "total_bytes": 80 * GIB, "used_bytes": 9 * GIB,
                  "ledger_bytes": 8 * GIB, "free_bytes": 71 * GIB, "degraded": "Xid 79"}],
        "warm_servers": [{"type": "testmods.warm", "gpu": GPU, "state": "idle"}],
    }  # fmt: skip
    store.touch_node("gpu-2", report, now - 2)
    _submit(store, "c-1", now=now - 10)
    snap = snapshot_store(store, "/state", now)
    assert snap.cluster is not None and [c["node"] for c in snap.cluster] == ["gpu-2"]
    frame = _frame(store, now)
    assert "node gpu-2 active heartbeat 2.0 s ago 0 running" in frame
    assert f"DEGRADED {GPU} on gpu-2: Xid 79" in frame
    assert "8.0/80.0 GiB held" in frame and "9.0 GiB used" in frame
    assert "warm testmods.warm on" in frame
    assert "no broker is running" not in frame  # a coordinator runs no broker of its own
    assert "c-1 echo.echo 10s waits for an enrolled node to take it" in frame
