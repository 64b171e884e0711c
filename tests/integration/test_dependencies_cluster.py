"""Job dependencies across hosts: a coordinator never offers a held job; the end an
agent reports releases (or fails) its dependents in the same transaction, and the
next claim offers the released one. On every backend."""

from __future__ import annotations

import pytest

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster import report as rp
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from tests.integration.test_coordinator import REPO, TIMING, claim, enrol


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load([REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"])


@pytest.fixture
def s(store: Store) -> ClusterStore:
    assert isinstance(store, ClusterStore)
    return store


def echo(job_id: str, *after: str, exit_code: int = 0) -> JobSpec:
    return JobSpec(
        id=job_id, type="echo.echo", params={"text": job_id, "exit_code": exit_code}, after=after
    )


def run_on(
    s: ClusterStore, reg: Registry, node: str, job_id: str, state: JobState, now: float
) -> None:
    record = s.get_node(node)
    assert record is not None
    [payload] = [
        p
        for p in co.claim(s, reg, node, nv.node_view(record), now, lease_s=10.0, timing=TIMING)
        if p["id"] == job_id
    ]
    co.start(s, node, job_id, lease_id=payload["lease_id"], gpu_uuid=None, now=now)
    co.finish(
        s, reg, node, job_id, lease_id=payload["lease_id"], state=state,
        outcome="succeeded" if state is JobState.DONE else "job_failed",
        reason=state.value, now=now + 1,
    )  # fmt: skip


def test_a_held_job_is_never_offered_until_its_dependency_holds(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n1", 24)
    s.submit(
        [echo("a"), echo("b", "afterok:a"), echo("c", "afterok:b"), echo("d", "afternotok:b")],
        now=1.0,
    )
    job_b = s.get_job("b")
    assert job_b is not None
    lines = rp.explain(job_b, s, registry, 1, 2.0)
    assert "it waits: waits for job a (queued)" in lines
    run_on(s, registry, "n1", "a", JobState.DONE, now=2.0)
    assert claim(s, registry, "n1", 4.0) == ["b"]  # released by a's end; c and d still held
    s.drop_lease("b")
    run_on(s, registry, "n1", "b", JobState.FAILED, now=5.0)
    c = s.get_job("c")
    assert c is not None and c.state is JobState.FAILED
    assert c.reason == "dependency afterok:b can never hold: b failed"
    assert claim(s, registry, "n1", 8.0) == ["d"]
