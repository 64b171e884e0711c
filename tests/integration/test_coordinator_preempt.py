"""Preemption across hosts at the lease boundary (gpuwarden.cluster.coordinator:
heartbeat, preempt), on every store backend, with injected time: the coordinator
chooses a node's reported preemptible job for a waiting one no node has room for,
marks its lease (not renewed), records the event with the job that caused it,
leases the waiting job to that node and answers ``preempts`` until the victim's
end is reported."""

from __future__ import annotations

from typing import Any

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster import report as rp
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import ClusterStore
from tests.integration.test_coordinator import TIMING, enrol, registry, report, s

__all__ = ["registry", "s"]  # the fixtures


def train(job_id: str, priority: int = 0, type_: str = "trainmods.train") -> JobSpec:
    return JobSpec(id=job_id, type=type_, params={"steps": 1000}, priority=priority)


def urgent(job_id: str, priority: int = 10) -> JobSpec:
    return JobSpec(id=job_id, type="trainmods.urgent", params={}, priority=priority)


def running(s: ClusterStore, reg: Registry, job: JobSpec, now: float) -> str:
    """Submit ``job``, lease it to node n and report its start; its lease id."""
    s.submit([job], now=now)
    record = s.get_node("n")
    assert record is not None
    [payload] = co.claim(s, reg, "n", nv.node_view(record), now, lease_s=10.0, timing=TIMING)
    lease_id = str(payload["lease_id"])
    co.start(s, "n", job.id, lease_id=lease_id, gpu_uuid="GPU-0", now=now)
    return lease_id


def with_victims(*victims: dict[str, Any], free: float = 4) -> dict[str, Any]:
    rep = report(24, free=free)
    rep["busy"] = len(victims)
    rep["victims"] = list(victims)
    return rep


def victim(job: str, *, priority: int = 0, run_s: float = 100.0, **kw: Any) -> dict[str, Any]:
    return {
        "job": job,
        "gpu": "GPU-0",
        "priority": priority,
        "run_s": run_s,
        "min_run_s": 0.0,
        "signal": "SIGUSR1",
        "grace_s": 20.0,
        "bytes": 16 * GIB,
        **kw,
    }


def beat(
    s: ClusterStore, reg: Registry, rep: dict[str, Any], now: float, held: list[str]
) -> dict[str, Any]:
    answer = co.heartbeat(s, "n", rep, now, 10.0, held=held, registry=reg, timing=TIMING)
    return {"preempts": [], "jobs": [], **answer}  # each only when there is one


def test_a_waiting_job_preempts_a_preemptible_job_at_the_lease_boundary(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 24, free=24)
    lease_id = running(s, registry, train("t"), 1.0)
    s.submit([urgent("u")], now=2.0)
    rep = with_victims(victim("t"))
    answer = beat(s, registry, rep, 3.0, ["t"])
    # the waiting job is leased to the node whose room the preemption makes
    assert [j["id"] for j in answer["jobs"]] == ["u"]
    u_lease = s.lease_of("u")
    assert u_lease is not None and u_lease.node == "n"
    assert answer["preempts"] == [
        {
            "id": "t",
            "for_job": "u",
            "signal": "SIGUSR1",
            "grace_s": 20.0,
            "gpu": "GPU-0",
            "reason": "job u, of higher priority, needs its memory on GPU-0 of node n",
        }
    ]
    [event] = [e for e in s.events() if e.kind == "preemption_requested"]
    assert event.job_id == "t"
    assert event.detail["for_job"] == "u" and event.detail["node"] == "n"
    assert {"job", "attempt", "for_job", "signal", "gpu", "grace_s", "reason"} <= set(event.detail)
    # not renewed from now on, but it lasts through its grace (20 s) and one more
    # lease (10 s) to report its end: 3 + 20 + 10
    lease = s.lease_of("t")
    assert lease is not None and lease.preempt_for == "u" and lease.expires_at == 33.0
    # the next heartbeats do not renew it, ask again (the agent asks once), choose no more
    again = beat(s, registry, rep, 5.0, ["t", "u"])
    assert [p["id"] for p in again["preempts"]] == ["t"] and again["jobs"] == []
    lease = s.lease_of("t")
    assert lease is not None and lease.expires_at == 33.0
    assert len([e for e in s.events() if e.kind == "preemption_requested"]) == 1
    assert rp.explain_placement(s, registry, s.get_job("u"), 5.0) == [  # type: ignore[arg-type]
        "it is leased to node n and waits for job t to checkpoint on node n (preempted for "
        "it: a lower-priority job of a preemptible type)"
    ]
    running_why = rp.explain_running(s, s.get_job("t"), 5.0)  # type: ignore[arg-type]
    assert running_why[0].startswith("on node n, asked to checkpoint for job u")
    # it checkpointed: queued again on the node, no retry spent, the lease kept and renewed
    got = co.finish(
        s, registry, "n", "t", lease_id=lease_id, state=JobState.QUEUED,
        outcome="checkpointed", reason="checkpointed on SIGUSR1 (exit 6)", now=6.0,
    )  # fmt: skip
    assert got == {"state": "queued", "lease_kept": True}
    lease = s.lease_of("t")
    assert lease is not None and lease.preempt_for is None
    after = beat(s, registry, with_victims(), 7.0, ["t", "u"])
    assert after["preempts"] == [] and after["jobs"] == []
    lease = s.lease_of("t")
    assert lease is not None and lease.expires_at == 17.0


def test_checkpoints_never_quarantine_the_job_on_the_coordinator(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 24, free=24)
    lease_id = running(s, registry, train("t"), 1.0)  # trainmods.train: max_retries = 0
    for n in range(3):
        got = co.finish(
            s, registry, "n", "t", lease_id=lease_id, state=JobState.QUEUED,
            outcome="checkpointed", reason="checkpointed", now=2.0 + n,
        )  # fmt: skip
        assert got == {"state": "queued", "lease_kept": True}
        co.start(s, "n", "t", lease_id=lease_id, gpu_uuid="GPU-0", now=2.5 + n)


def test_a_job_not_reported_preemptible_is_never_chosen(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 24, free=24)
    running(s, registry, urgent("busy", priority=0), 1.0)  # not preemptible: not a victim
    s.submit([urgent("u", priority=10)], now=2.0)
    rep = with_victims(free=4)  # it holds the GPU, and the node reports no victim
    rep["running"] = [{"job": "busy", "type": "trainmods.urgent", "gpu": "GPU-0"}]
    answer = beat(s, registry, rep, 3.0, ["busy"])
    assert answer["preempts"] == [] and answer["jobs"] == []
    # a victim that holds no started lease here is not chosen either
    answer = beat(s, registry, with_victims(victim("elsewhere")), 4.0, ["busy"])
    assert answer["preempts"] == [] and answer["jobs"] == []
    assert not [e for e in s.events() if e.kind == "preemption_requested"]
    lease = s.lease_of("busy")
    assert lease is not None and lease.preempt_for is None and lease.expires_at == 14.0


def test_not_for_equal_priority_too_young_or_when_a_node_has_room(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 24, free=24)
    running(s, registry, train("t", priority=10), 1.0)
    s.submit([urgent("u", priority=10)], now=2.0)
    assert beat(s, registry, with_victims(victim("t", priority=10)), 3.0, ["t"])["jobs"] == []
    young = victim("t", min_run_s=300.0, run_s=10.0)
    assert beat(s, registry, with_victims(young), 4.0, ["t"])["jobs"] == []
    enrol(s, "other", 24, now=4.0)  # room for it elsewhere: no preemption
    assert beat(s, registry, with_victims(victim("t")), 5.0, ["t"])["jobs"] == []
    assert not [e for e in s.events() if e.kind == "preemption_requested"]


def test_an_agent_that_never_reacts_loses_the_lease_to_the_sweep(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 24, free=24)
    running(s, registry, train("t"), 1.0)
    s.submit([urgent("u")], now=2.0)
    assert beat(s, registry, with_victims(victim("t")), 3.0, ["t"])["preempts"]
    beat(s, registry, with_victims(victim("t")), 8.0, ["t", "u"])  # u renewed, t not
    # within its grace and one more lease (until 3 + 20 + 10) the victim is not lost
    beat(s, registry, with_victims(victim("t")), 17.0, ["t", "u"])
    assert co.sweep(s, 20.0, registry=registry)["interrupted"] == 0
    assert s.lease_of("t") is not None
    beat(s, registry, with_victims(victim("t")), 26.0, ["t", "u"])
    beat(s, registry, with_victims(victim("t")), 30.0, ["t", "u"])
    swept = co.sweep(s, 34.0, registry=registry)
    assert swept["interrupted"] == 1
    assert s.lease_of("t") is None
    lease = s.lease_of("u")
    assert lease is not None and lease.live(34.0)
