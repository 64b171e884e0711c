"""Diagnostic grants (SPEC.md section 16) on every store backend, with injected time:
one exact queued job may start once on a draining node; the grant is consumed in the
start's transaction, a second job is not offered, a cancel revokes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster import report as rp
from gpuwarden.cluster.coordinator import LeaseRefused
from gpuwarden.cluster.nodeview import Timing
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError, UserError
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore, NodeState

REPO = Path(__file__).resolve().parents[2]
TIMING = Timing(lease_s=10.0, offline_after_s=20.0, affinity_wait_s=30.0)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load([REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"])


@pytest.fixture
def s(store: Store) -> ClusterStore:
    assert isinstance(store, ClusterStore)
    return store


def enrol(s: ClusterStore, name: str, gib: float) -> None:
    token_id = f"{abs(hash(name)) % 16**12:012x}"
    s.create_token(
        token_id=token_id, name=name, role=Role.NODE, secret_hash="x", now=0.0,
        created_by="local", node=name,
    )  # fmt: skip
    co.enroll(s, name, token_id=token_id, capabilities={}, now=0.0)
    total = int(gib * GIB)
    gpu = {"uuid": "GPU-0", "name": "sim", "total_bytes": total, "free_bytes": total,
           "usable_bytes": total}  # fmt: skip
    s.touch_node(name, {"gpus": [gpu], "warm": [], "busy": 0, "max_jobs": 4}, 0.0)


def job(job_id: str) -> JobSpec:
    return JobSpec(
        id=job_id, type="testmods.gpu", params={"gib": 1, "seconds": 0.3, "leak": False},
        vram_bytes=GIB,
    )  # fmt: skip


def claim(s: ClusterStore, reg: Registry, name: str, now: float) -> list[dict[str, Any]]:
    record = s.get_node(name)
    assert record is not None
    return co.claim(s, reg, name, nv.node_view(record), now, lease_s=10.0, timing=TIMING)


def drained(s: ClusterStore, name: str) -> None:
    co.drain(s, name, now=1.0)
    record = s.get_node(name)
    assert record is not None and record.state is NodeState.DRAINING


def test_store_grant_is_consumed_once_and_one_open_per_node(s: ClusterStore) -> None:
    enrol(s, "n", 24)
    s.submit([job("a"), job("b")], now=1.0)
    g = s.add_grant("n", "a", granted_by="tok", reason="check the fan", now=2.0)
    assert g is not None and g.open and g.job_id == "a"
    assert s.add_grant("n", "b", granted_by="tok", reason="x", now=2.0) is None
    _, attempt = s.start_granted("a", node="n", gpu_uuid="GPU-0", now=3.0)
    assert attempt.number == 1
    [used] = s.grants_of_job("a")
    assert used.used_at == 3.0 and used.attempt == 1 and not used.open
    assert s.open_grant("n") is None and s.granted_used_on("n") == {"a"}
    # a second consume finds no open grant: refused, nothing written
    with pytest.raises(TransitionError):
        s.start_granted("b", node="n", gpu_uuid="GPU-0", now=4.0)
    b = s.get_job("b")
    assert b is not None and b.state is JobState.QUEUED and s.attempts("b") == []


def test_store_cancel_revokes_the_grant(s: ClusterStore) -> None:
    enrol(s, "n", 24)
    s.submit([job("c")], now=1.0)
    assert s.add_grant("n", "c", granted_by=None, reason="probe", now=2.0) is not None
    s.request_cancel("c", now=3.0)
    [g] = s.grants_of_job("c")
    assert g.revoked_at == 3.0 and g.revoked_reason == "the job was cancelled"
    assert s.open_grant("n") is None
    with pytest.raises(TransitionError):
        s.start_granted("c", node="n", gpu_uuid=None, now=4.0)


def test_grant_is_refused_unless_draining_and_queued(s: ClusterStore) -> None:
    enrol(s, "n", 24)
    s.submit([job("a")], now=1.0)
    with pytest.raises(UserError, match="draining"):
        co.diagnostic(s, "n", "a", by=None, reason="r", now=1.0)
    drained(s, "n")
    with pytest.raises(UserError, match="queued"):
        co.diagnostic(s, "n", "nope", by=None, reason="r", now=1.0)
    with pytest.raises(UserError, match="reason"):
        co.diagnostic(s, "n", "a", by=None, reason="  ", now=1.0)
    with pytest.raises(co.UnknownNode):
        co.diagnostic(s, "other", "a", by=None, reason="r", now=1.0)


def test_drained_node_runs_only_the_granted_job_once(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    s.submit([job("a"), job("b")], now=1.0)
    drained(s, "n")
    assert claim(s, registry, "n", 2.0) == []  # drained: nothing without a grant
    co.diagnostic(s, "n", "b", by="owner", reason="after the fan swap", now=2.0)
    with pytest.raises(UserError, match="open diagnostic grant already"):
        co.diagnostic(s, "n", "a", by="owner", reason="second", now=2.0)
    assert any("diagnostic grant on node n" in line for line in rp.grant_lines(s, "b"))
    record = s.get_node("n")
    assert record is not None  # its heartbeat tells the draining agent to claim for b
    assert co.heartbeat(s, "n", record.report, 2.5, 10.0)["grant"] == "b"
    [payload] = claim(s, registry, "n", 3.0)
    assert payload["id"] == "b"  # only the granted job, though "a" came first
    assert claim(s, registry, "n", 3.0) == []
    assert co.start(s, "n", "b", lease_id=payload["lease_id"], gpu_uuid="GPU-0", now=4.0) == {
        "attempt": 1
    }
    assert s.open_grant("n") is None
    record = s.get_node("n")
    assert record is not None and record.state is NodeState.DRAINING  # stays closed
    # its attempt fails and is retried: never on that node, not even by the node itself
    got = co.finish(
        s, registry, "n", "b", lease_id=payload["lease_id"], state=JobState.QUEUED,
        outcome="failed", reason="boom", now=5.0,
    )  # fmt: skip
    assert got == {"state": "queued", "lease_kept": False}
    assert claim(s, registry, "n", 6.0) == []
    co.resume(s, "n", now=7.0)
    ids = [p["id"] for p in claim(s, registry, "n", 8.0)]
    assert ids == ["a"]  # b ran there once under the grant: never offered again
    assert any("never retried there" in line for line in rp.grant_lines(s, "b"))


def test_a_diagnostic_waits_for_the_nodes_other_jobs_and_runs_alone(
    s: ClusterStore, registry: Registry
) -> None:
    """Issue 31: a grant was taken while the node still ran a job, and the
    diagnostic ran beside it. The node must have no other allocation."""
    enrol(s, "n", 24)
    s.submit([job("busy"), job("diag")], now=1.0)
    [running] = claim(s, registry, "n", 1.5)[:1]
    assert running["id"] == "busy"
    assert co.start(s, "n", "busy", lease_id=running["lease_id"], gpu_uuid="GPU-0", now=1.6)
    for p in claim(s, registry, "n", 1.7):  # anything else leased: given back at the drain
        assert p["id"] == "diag"
    drained(s, "n")
    co.diagnostic(s, "n", "diag", by="owner", reason="after the fan swap", now=2.0)
    assert claim(s, registry, "n", 3.0) == []  # "busy" still runs there: not beside it
    assert any("alone, once the node's other jobs" in ln for ln in rp.grant_lines(s, "diag"))
    got = co.finish(
        s, registry, "n", "busy", lease_id=running["lease_id"], state=JobState.DONE,
        outcome="succeeded", reason="", now=4.0,
    )  # fmt: skip
    assert got["state"] == "done"
    [payload] = claim(s, registry, "n", 5.0)  # the node is empty now: it runs
    assert payload["id"] == "diag"


def test_cancel_revokes_and_the_job_never_starts(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    s.submit([job("c")], now=1.0)
    drained(s, "n")
    co.diagnostic(s, "n", "c", by="owner", reason="r", now=2.0)
    [payload] = claim(s, registry, "n", 3.0)
    s.request_cancel("c", now=3.5)
    [g] = s.grants_of_job("c")
    assert g.revoked_at == 3.5
    with pytest.raises(LeaseRefused):
        co.start(s, "n", "c", lease_id=payload["lease_id"], gpu_uuid=None, now=4.0)
    assert s.attempts("c") == []
    c = s.get_job("c")
    assert c is not None and c.state is JobState.CANCELLED
