"""The coordinator's service functions (gpuwarden.cluster.coordinator), on every
store backend, with injected time: claims, fenced reports, heartbeats, sweeps,
drain and revoke."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster import report as rp
from gpuwarden.cluster.coordinator import LeaseRefused
from gpuwarden.cluster.nodeview import Timing
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.placement import NodeView
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
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


def report(gib: float, *, free: float | None = None, warm: tuple[str, ...] = ()) -> dict[str, Any]:
    total = int(gib * GIB)
    return {
        "gpus": [
            {
                "uuid": "GPU-0",
                "name": "sim",
                "total_bytes": total,
                "free_bytes": int((gib if free is None else free) * GIB),
                "usable_bytes": total,
            }
        ],
        "warm": list(warm),
        "busy": 0,
        "max_jobs": 4,
        "labels": {},
        "accepting": True,
    }


def enrol(s: ClusterStore, name: str, gib: float, now: float = 0.0, **kw: Any) -> NodeView:
    token_id = f"{abs(hash(name)) % 16**12:012x}"
    s.create_token(
        token_id=token_id,
        name=name,
        role=Role.NODE,
        secret_hash="x",
        now=now,
        created_by="local",
        node=name,
    )
    co.enroll(s, name, token_id=token_id, capabilities={}, now=now)
    rep = report(gib, **kw)
    s.touch_node(name, rep, now)
    record = s.get_node(name)
    assert record is not None
    return nv.node_view(record)


def gpu_job(job_id: str, gib: float, seconds: float = 0.3) -> JobSpec:
    return JobSpec(
        id=job_id,
        type="testmods.gpu",
        params={"gib": gib, "seconds": seconds, "leak": False},
        vram_bytes=int(gib * GIB),
    )


def claim(s: ClusterStore, reg: Registry, name: str, now: float, **kw: Any) -> list[str]:
    record = s.get_node(name)
    assert record is not None
    got = co.claim(s, reg, name, nv.node_view(record), now, lease_s=10.0, timing=TIMING, **kw)
    return [j["id"] for j in got]


def test_claim_offers_only_what_fits_and_leases_it(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "small", 8)
    enrol(s, "big", 80)
    s.submit([gpu_job("j20", 20), gpu_job("j4", 4)], now=1.0)
    assert claim(s, registry, "small", 2.0) == ["j4"]
    assert claim(s, registry, "small", 2.0) == []  # leased already
    assert claim(s, registry, "big", 2.0) == ["j20"]
    lease = s.lease_of("j20")
    assert lease is not None and lease.node == "big" and lease.expires_at == 12.0


def test_claim_payload_and_types_filter(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    s.submit([gpu_job("a", 1)], now=1.0)
    record = s.get_node("n")
    assert record is not None
    none = co.claim(s, registry, "n", nv.node_view(record), 2.0, types=["echo.echo"])
    assert none == []
    [payload] = co.claim(s, registry, "n", nv.node_view(record), 2.0, lease_s=5.0)
    assert payload["id"] == "a" and payload["type"] == "testmods.gpu"
    assert payload["params"]["gib"] == 1 and payload["vram_bytes"] == GIB
    assert payload["expires_at"] == 7.0 and len(payload["lease_id"]) == 16


def test_claim_respects_max_jobs_and_want(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 80)
    s.submit(
        [JobSpec(id=f"e{i}", type="echo.echo", params={"text": "x"}) for i in range(6)], now=1.0
    )
    assert len(claim(s, registry, "n", 2.0, want=1)) == 1
    assert len(claim(s, registry, "n", 2.0)) == 3  # 4 slots, 1 held
    assert claim(s, registry, "n", 2.0) == []


def test_draining_or_revoked_node_gets_nothing(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    s.submit([gpu_job("a", 1)], now=1.0)
    co.drain(s, "n", now=1.5)
    assert claim(s, registry, "n", 2.0) == []
    co.revoke(s, registry, "n", now=3.0)
    assert claim(s, registry, "n", 4.0) == []
    with pytest.raises(UserError, match="revoked"):
        co.drain(s, "n", now=5.0)


def test_a_drain_gives_back_the_jobs_leased_there_that_have_not_started(
    s: ClusterStore, registry: Registry
) -> None:
    """Issue 31: a job leased before the drain started on the drained node 28 s
    after it. Unstarted leases go back; a started job runs on; its late start is
    refused (the agent then stops its copy)."""
    enrol(s, "n", 80)
    enrol(s, "m", 80)
    s.submit([gpu_job("run", 1), gpu_job("wait", 1)], now=1.0)
    assert claim(s, registry, "n", 2.0) == ["run", "wait"]
    leases = {j: s.lease_of(j) for j in ("run", "wait")}
    started = leases["run"]
    assert started is not None
    co.start(s, "n", "run", lease_id=started.lease_id, gpu_uuid=None, now=2.5)
    co.drain(s, "n", now=3.0)
    assert s.lease_of("wait") is None  # given back
    assert s.lease_of("run") is not None  # running: it finishes there
    [given] = [e for e in s.events(job_id="wait") if e.kind == "lease_given_back"]
    assert given.detail["reason"] == "its node n was drained before it started there"
    late = leases["wait"]
    assert late is not None
    with pytest.raises(LeaseRefused):  # the agent's start of it, if it comes, is refused
        co.start(s, "n", "wait", lease_id=late.lease_id, gpu_uuid=None, now=3.5)
    assert claim(s, registry, "m", 4.0) == ["wait"]  # another node takes it
    co.drain(s, "n", now=5.0)  # again: nothing more to give back
    assert s.lease_of("run") is not None


def test_warm_affinity_leaves_a_job_for_the_warm_node(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "cold", 24)
    enrol(s, "warm", 24, warm=("testmods.warm",))
    s.submit([JobSpec(id="w", type="testmods.warm", params={})], now=1.0)
    assert claim(s, registry, "cold", 2.0) == []
    # past the affinity wait, any node takes it
    assert claim(s, registry, "cold", 40.0) == ["w"]


def test_start_and_finish_are_fenced(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n1", 24)
    enrol(s, "n2", 24)
    s.submit([gpu_job("a", 1)], now=1.0)
    [payload] = co.claim(s, registry, "n1", nv.node_view(s.get_node("n1")), 2.0, lease_s=10.0)  # type: ignore[arg-type]
    lease_id = payload["lease_id"]
    with pytest.raises(LeaseRefused):
        co.start(s, "n2", "a", lease_id=lease_id, gpu_uuid=None, now=3.0)
    with pytest.raises(LeaseRefused):
        co.start(s, "n1", "a", lease_id="0" * 16, gpu_uuid=None, now=3.0)
    with pytest.raises(LeaseRefused, match="never reported started"):
        co.finish(
            s, registry, "n1", "a", lease_id=lease_id, state=JobState.DONE,
            outcome="succeeded", reason="done", now=3.0,
        )  # fmt: skip
    assert co.start(s, "n1", "a", lease_id=lease_id, gpu_uuid="GPU-0", now=3.0) == {"attempt": 1}
    # a repeated start (the first answer was lost) gets the same attempt
    assert co.start(s, "n1", "a", lease_id=lease_id, gpu_uuid="GPU-0", now=3.5) == {"attempt": 1}
    s.renew_leases("n1", 30.0, now=11.0)
    got = co.finish(
        s, registry, "n1", "a", lease_id=lease_id, state=JobState.DONE, outcome="succeeded",
        reason="done", now=13.0, exit_code=0, result={"message": "hi"}, stdout="out",
    )  # fmt: skip
    assert got == {"state": "done", "lease_kept": False}
    job = s.get_job("a")
    assert job is not None and job.state is JobState.DONE
    assert job.result == {"message": "hi", "node": "n1"}
    assert s.lease_of("a") is None
    [attempt] = s.attempts("a")
    assert attempt.node == "n1" and attempt.gpu_uuid == "GPU-0" and attempt.stdout == "out"
    with pytest.raises(LeaseRefused):  # once only
        co.finish(
            s, registry, "n1", "a", lease_id=lease_id, state=JobState.DONE,
            outcome="succeeded", reason="done", now=13.5,
        )  # fmt: skip


def test_a_silent_nodes_job_goes_elsewhere_only_after_the_lease_and_its_grace(
    s: ClusterStore, registry: Registry
) -> None:
    fenced = Timing(lease_s=10.0, offline_after_s=20.0, fence_grace_s=5.0)
    enrol(s, "n1", 24)
    enrol(s, "n2", 24)
    s.submit([gpu_job("a", 1), gpu_job("b", 1)], now=1.0)
    view = nv.node_view(s.get_node("n1"))  # type: ignore[arg-type]
    got = co.claim(s, registry, "n1", view, 2.0, lease_s=10.0, timing=fenced)
    assert sorted(p["id"] for p in got) == ["a", "b"]
    assert {p["expires_at"] for p in got} == {12.0}  # what the node is told
    lease = {p["id"]: p["lease_id"] for p in got}
    co.start(s, "n1", "a", lease_id=lease["a"], gpu_uuid=None, now=3.0)
    answer = co.heartbeat(s, "n1", {}, 4.0, 10.0, held=["a", "b"], timing=fenced)
    assert answer["leases"] == {"a": 10.0, "b": 10.0}  # the node's lease, not the grace
    # n1 goes silent: its lease ends at 14, its supervisors stop its jobs; until 19
    # nobody else may have them
    other = nv.node_view(s.get_node("n2"))  # type: ignore[arg-type]
    assert co.claim(s, registry, "n2", other, 18.0, lease_s=10.0, timing=fenced) == []
    assert co.sweep(s, 18.0, 60.0, registry=registry, timing=fenced)["interrupted"] == 0
    assert s.get_job("a").state is JobState.RUNNING  # type: ignore[union-attr]
    done = co.sweep(s, 19.5, 60.0, registry=registry, timing=fenced)
    assert done["interrupted"] == 1 and done["dropped"] == 1
    [attempt] = s.attempts("a")
    assert attempt.reason.startswith(
        "its node n1 stopped renewing its lease at 1970-01-01 00:00:04 UTC"
    ), attempt.reason
    got = co.claim(s, registry, "n2", other, 20.0, lease_s=10.0, timing=fenced)
    assert sorted(p["id"] for p in got) == ["a", "b"]


def test_a_report_repeated_after_the_coordinator_died_midway_is_taken(
    s: ClusterStore, registry: Registry
) -> None:
    """A start or finish is two writes (the attempt, then the lease): a coordinator
    killed between them leaves the first; the node's repeated report completes it
    instead of being refused (which would cost the job a second run)."""
    enrol(s, "n1", 24)
    s.submit([gpu_job("a", 1)], now=1.0)
    [payload] = co.claim(s, registry, "n1", nv.node_view(s.get_node("n1")), 2.0, lease_s=10.0)  # type: ignore[arg-type]
    lid = payload["lease_id"]
    s.start_attempt("a", node="n1", gpu_uuid=None, now=3.0)  # then the coordinator died
    lease = s.lease_of("a")
    assert lease is not None and not lease.started
    assert co.start(s, "n1", "a", lease_id=lid, gpu_uuid=None, now=4.0) == {"attempt": 1}
    lease = s.lease_of("a")
    assert lease is not None and lease.started and lease.attempt == 1
    s.finish_attempt(  # its end recorded; then the coordinator died again
        "a", 1, target=JobState.DONE, now=5.0, outcome="succeeded", reason="done"
    )
    got = co.finish(
        s, registry, "n1", "a", lease_id=lid, state=JobState.DONE, outcome="succeeded",
        reason="done", now=6.0,
    )  # fmt: skip
    assert got == {"state": "done", "lease_kept": False}
    assert s.lease_of("a") is None and len(s.attempts("a")) == 1
    with pytest.raises(LeaseRefused, match="superseded"):  # from then on: refused
        co.finish(
            s, registry, "n1", "a", lease_id=lid, state=JobState.DONE, outcome="succeeded",
            reason="done", now=7.0,
        )  # fmt: skip


def test_a_local_retry_keeps_the_lease_until_max_retries(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 24)
    s.submit([gpu_job("a", 1)], now=1.0)  # testmods.gpu: max_retries = 1
    [payload] = co.claim(s, registry, "n", nv.node_view(s.get_node("n")), 2.0, lease_s=100.0)  # type: ignore[arg-type]
    lid = payload["lease_id"]
    co.start(s, "n", "a", lease_id=lid, gpu_uuid=None, now=3.0)
    got = co.finish(
        s, registry, "n", "a", lease_id=lid, state=JobState.QUEUED, outcome="launch_error",
        reason="launch error: x; retrying (1/1)", now=4.0,
    )  # fmt: skip
    assert got == {"state": "queued", "lease_kept": True}
    lease = s.lease_of("a")
    assert lease is not None and not lease.started
    assert claim(s, registry, "n", 5.0) == []  # still this node's
    co.start(s, "n", "a", lease_id=lid, gpu_uuid=None, now=6.0)
    got = co.finish(
        s, registry, "n", "a", lease_id=lid, state=JobState.QUEUED, outcome="launch_error",
        reason="launch error: x", now=7.0,
    )  # fmt: skip
    assert got == {"state": "quarantined", "lease_kept": False}
    assert s.lease_of("a") is None


def test_heartbeat_renews_held_leases_and_says_what_to_stop(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 80)
    s.submit([gpu_job(i, 1) for i in ("a", "b", "c", "d")], now=1.0)
    assert sorted(claim(s, registry, "n", 2.0)) == ["a", "b", "c", "d"]
    co.start(s, "n", "c", lease_id=s.lease_of("c").lease_id, gpu_uuid=None, now=2.5)  # type: ignore[union-attr]
    s.request_cancel("b", now=3.0)  # queued: cancelled at once
    s.request_cancel("c", now=3.0)  # running: asked to stop
    answer = co.heartbeat(s, "n", report(80), 4.0, 10.0, held=["a", "b", "c", "zz"])
    assert answer["state"] == "active" and answer["lease_s"] == 10.0
    cancels = {c["id"]: c for c in answer["cancels"]}
    assert set(cancels) == {"b", "c", "zz"}
    assert cancels["b"]["lost"] and cancels["zz"]["lost"] and not cancels["c"]["lost"]
    assert s.lease_of("a").expires_at == 14.0  # type: ignore[union-attr]
    assert s.lease_of("d").expires_at == 12.0  # type: ignore[union-attr]  # not held: not renewed
    assert s.lease_of("b") is None
    with pytest.raises(co.UnknownNode):
        co.heartbeat(s, "ghost", {}, 5.0)


def test_sweep_requeues_unstarted_and_interrupts_started(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n1", 24)
    enrol(s, "n2", 24)
    s.submit([gpu_job("a", 1), gpu_job("b", 1)], now=1.0)
    assert claim(s, registry, "n1", 2.0) == ["a", "b"]
    lid = s.lease_of("b").lease_id  # type: ignore[union-attr]
    co.start(s, "n1", "b", lease_id=lid, gpu_uuid=None, now=3.0)
    assert co.sweep(s, 11.0, 20.0, registry=registry)["interrupted"] == 0  # not expired yet
    done = co.sweep(s, 12.5, 20.0, registry=registry)
    assert done["leader"] and done["dropped"] == 1 and done["interrupted"] == 1
    a, b = s.get_job("a"), s.get_job("b")
    assert a is not None and a.state is JobState.QUEUED and a.attempts == 0
    assert b is not None and b.state is JobState.QUEUED and b.attempts == 1
    [attempt] = s.attempts("b")
    assert attempt.outcome == "interrupted"
    assert attempt.reason.startswith("its node n1 stopped renewing its lease")
    assert attempt.reason.endswith("; retrying (1/1)")
    assert s.lost_nodes("b") == ["n1"] and s.leases() == []
    # the late report of n1 is refused: the attempt was ended by the sweep
    with pytest.raises(LeaseRefused):
        co.finish(
            s, registry, "n1", "b", lease_id=lid, state=JobState.DONE, outcome="succeeded",
            reason="done", now=13.0,
        )  # fmt: skip
    # placement now prefers n2 for b; n1 still gets a
    s.touch_node("n1", report(24), 13.0)
    s.touch_node("n2", report(24), 13.0)
    assert claim(s, registry, "n1", 13.5) == ["a"]
    assert claim(s, registry, "n2", 13.5) == ["b"]


def test_sweep_quarantines_past_max_retries(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    s.submit([gpu_job("a", 1)], now=1.0)
    for round_ in range(2):
        now = 2.0 + round_ * 20
        s.touch_node("n", report(24), now)
        [payload] = co.claim(s, registry, "n", nv.node_view(s.get_node("n")), now, lease_s=10.0)  # type: ignore[arg-type]
        co.start(s, "n", "a", lease_id=payload["lease_id"], gpu_uuid=None, now=now)
        co.sweep(s, now + 11, 100.0, registry=registry)
    job = s.get_job("a")
    assert job is not None and job.state is JobState.QUARANTINED and job.attempts == 2


def test_sweep_marks_stale_nodes_offline(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24, now=0.0)
    enrol(s, "d", 24, now=0.0)
    co.drain(s, "d", now=1.0)
    assert co.sweep(s, 15.0, 20.0)["offline"] == 0
    assert co.sweep(s, 21.0, 20.0)["offline"] == 1
    assert s.get_node("n").state is NodeState.OFFLINE  # type: ignore[union-attr]
    assert s.get_node("d").state is NodeState.DRAINING  # type: ignore[union-attr]
    co.heartbeat(s, "n", report(24), 22.0)
    assert s.get_node("n").state is NodeState.ACTIVE  # type: ignore[union-attr]


def test_revoke_takes_every_job_back(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    token = s.get_node("n").token_id  # type: ignore[union-attr]
    s.submit([gpu_job("a", 1), gpu_job("b", 1)], now=1.0)
    claim(s, registry, "n", 2.0)
    co.start(s, "n", "b", lease_id=s.lease_of("b").lease_id, gpu_uuid=None, now=3.0)  # type: ignore[union-attr]
    got = co.revoke(s, registry, "n", now=4.0)
    assert got == {"node": "n", "requeued": 1, "interrupted": 1}
    assert s.get_node("n").state is NodeState.REVOKED  # type: ignore[union-attr]
    assert s.get_token(token).revoked_at == 4.0  # type: ignore[arg-type, union-attr]
    assert [j.id for j in s.queued_jobs()] == ["a", "b"]
    assert "was revoked" in s.attempts("b")[0].reason
    answer = co.heartbeat(s, "n", {}, 5.0)
    assert answer["state"] == "revoked"


def test_enrolling_again_revokes_the_old_credential(s: ClusterStore) -> None:
    enrol(s, "n", 24)
    old = s.get_node("n").token_id  # type: ignore[union-attr]
    s.create_token(
        token_id="abcdefabcdef", name="n", role=Role.NODE, secret_hash="y", now=1.0,
        created_by="local", node="n",
    )  # fmt: skip
    co.enroll(s, "n", token_id="abcdefabcdef", capabilities={}, now=2.0)
    assert s.get_token(old).revoked_at == 2.0  # type: ignore[arg-type, union-attr]
    assert s.get_node("n").token_id == "abcdefabcdef"  # type: ignore[union-attr]


def test_sweep_cancels_a_requeued_job_with_a_cancel_request(
    s: ClusterStore, registry: Registry
) -> None:
    s.submit([gpu_job("a", 1)], now=1.0)
    s.start_attempt("a", node="x", gpu_uuid=None, now=2.0)
    s.request_cancel("a", now=3.0)
    s.finish_attempt("a", 1, target=JobState.QUEUED, now=4.0, outcome="interrupted", reason="r")
    assert co.sweep(s, 5.0)["cancelled"] == 1
    assert s.get_job("a").state is JobState.CANCELLED  # type: ignore[union-attr]


def test_explain_placement(s: ClusterStore, registry: Registry) -> None:
    s.submit([gpu_job("big", 40)], now=1.0)
    assert rp.explain_placement(s, registry, s.get_job("big"), 2.0, TIMING) == []  # type: ignore[arg-type]
    enrol(s, "small", 8, now=1.0)
    enrol(s, "mid", 24, now=1.0)
    [line] = rp.explain_placement(s, registry, s.get_job("big"), 2.0, TIMING)  # type: ignore[arg-type]
    assert line.startswith("no node can ever run it") and "mid:" in line
    enrol(s, "huge", 80, now=1.0, free=10)
    lines = rp.explain_placement(s, registry, s.get_job("big"), 2.0, TIMING)  # type: ignore[arg-type]
    room = (
        "node huge has no GPU with room for it now: it needs 40.0 GiB on one GPU, the most "
        "room it reported is 10.0 GiB"
    )
    never = "node small can never hold it: it needs 40.0 GiB on one GPU, its largest has 8.0 GiB"
    assert room in lines and never in lines, lines
    claim(s, registry, "huge", 2.0)
    s.touch_node("huge", report(80), 2.0)
    assert claim(s, registry, "huge", 2.0) == ["big"]
    [line] = rp.explain_placement(s, registry, s.get_job("big"), 3.0, TIMING)  # type: ignore[arg-type]
    assert "leased to node huge" in line


def _relabel(s: ClusterStore, name: str, now: float, **changes: Any) -> None:
    record = s.get_node(name)
    assert record is not None
    s.touch_node(name, {**record.report, **changes}, now)


def test_a_job_asking_for_a_node_is_offered_only_to_that_node(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "a", 24)
    enrol(s, "b", 24)
    job = gpu_job("pinned", 1)
    s.submit([replace(job, constraints={"node": "b"})], now=1.0)
    assert claim(s, registry, "a", 40.0) == []
    assert claim(s, registry, "b", 40.0) == ["pinned"]


def test_gpu_model_and_label_constraints_steer_placement(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "plain", 80)
    enrol(s, "h100", 80)
    enrol(s, "rack-b", 80)
    _relabel(
        s,
        "h100",
        0.0,
        gpus=[
            {
                "uuid": "GPU-9",
                "name": "NVIDIA H100 80GB HBM3",
                "total_bytes": 80 * GIB,
                "free_bytes": 80 * GIB,
                "usable_bytes": 80 * GIB,
            }
        ],
    )
    _relabel(s, "rack-b", 0.0, labels={"rack": "b"})
    model = gpu_job("wants-h100", 1)
    rack = gpu_job("wants-rack-b", 1)
    big = gpu_job("wants-big-gpu", 1)
    s.submit(
        [
            replace(model, constraints={"gpu_model": "h100"}),
            replace(rack, constraints={"labels": {"rack": "b"}}),
            replace(big, constraints={"min_gpu_vram_gib": 100}),
        ],
        now=1.0,
    )
    assert claim(s, registry, "plain", 40.0) == []
    assert claim(s, registry, "h100", 40.0) == ["wants-h100"]
    assert claim(s, registry, "rack-b", 40.0) == ["wants-rack-b"]
    job = s.get_job("wants-big-gpu")
    assert job is not None
    [why] = rp.explain_placement(s, registry, job, 5.0, TIMING)
    assert why.startswith("no node can ever run it: h100: the job asks for at least 100.0 GiB")
    assert "plain: the job asks for at least 100.0 GiB per GPU" in why


def test_labels_from_enrolment_count_until_a_report_has_them(
    s: ClusterStore, registry: Registry
) -> None:
    s.create_token(
        token_id="t-lab",
        name="lab",
        role=Role.NODE,
        secret_hash="x",
        now=0.0,
        created_by="local",
        node="lab",
    )
    co.enroll(s, "lab", token_id="t-lab", capabilities={"labels": {"site": "x"}}, now=0.0)
    rep = report(24)
    del rep["labels"]
    s.touch_node("lab", rep, 0.0)
    s.submit(
        [replace(gpu_job("site", 1), constraints={"labels": {"site": "x"}})],
        now=1.0,
    )
    assert claim(s, registry, "lab", 40.0) == ["site"]


def test_submission_refusal_judges_enrolled_nodes(s: ClusterStore, registry: Registry) -> None:
    job = replace(gpu_job("huge", 100), constraints={})
    assert co.submission_refusal(s, registry, job, 1.0) is None  # no node: it waits
    enrol(s, "n1", 80)
    assert co.submission_refusal(s, registry, job, 1.0) == (
        "no node can ever run it: n1: needs 100.0 GiB on one GPU; its largest has 80.0 GiB"
    )
    assert co.submission_refusal(s, registry, gpu_job("fits", 8), 1.0) is None
    pinned = replace(gpu_job("p", 8), constraints={"node": "n9"})
    assert co.submission_refusal(s, registry, pinned, 1.0) == (
        "no node can ever run it: n1: the job asks for node 'n9'"
    )
    co.revoke(s, registry, "n1", now=2.0)  # a revoked node is not judged: it waits
    assert co.submission_refusal(s, registry, pinned, 3.0) is None


# -- each node's own launch rules ---------------------------------------------------


def rules_report(gib: float, runtime: str, **allow: bool) -> dict[str, Any]:
    """A report as an agent sends it: the types it runs by its own rules."""
    from gpuwarden.core.launchrules import LaunchRules, Runtime

    rules = LaunchRules(runtime=Runtime(runtime), **allow)
    reg = Registry.load([REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"], rules)
    return {
        **report(gib),
        "types": sorted(t.name for t in reg.types.values() if rules.refusal(t) is None),
        "modules": sorted(reg.types),
        "launch_rules": rules.to_json(),
    }


@pytest.fixture
def open_registry() -> Registry:
    """The coordinator's: every type of its modules, judged by no rules of its own."""
    from gpuwarden.core.launchrules import LaunchRules

    return Registry.load(
        [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
        LaunchRules.unchecked(),
    )


def test_each_node_is_offered_what_its_own_launch_rules_allow(
    s: ClusterStore, open_registry: Registry
) -> None:
    enrol(s, "gpu-a", 24)
    enrol(s, "gpu-b", 24)
    s.touch_node("gpu-a", rules_report(24, "local"), 0.0)
    s.touch_node("gpu-b", rules_report(24, "bubblewrap"), 0.0)
    s.submit(
        [
            gpu_job("box", 1),  # testmods.gpu: a container type
            JobSpec(id="host", type="echo.echo", params={"text": "x"}),
            JobSpec(id="served", type="testmods.warm", params={}),
        ],
        now=1.0,
    )
    assert claim(s, open_registry, "gpu-a", 40.0) == ["host"]
    assert claim(s, open_registry, "gpu-b", 40.0) == ["box", "served"]


def test_submission_judges_by_the_nodes_rules_and_names_each_nodes_reason(
    s: ClusterStore, open_registry: Registry
) -> None:
    enrol(s, "gpu-a", 24)
    s.touch_node("gpu-a", rules_report(24, "local"), 0.0)
    box = gpu_job("box", 1)
    assert co.submission_refusal(s, open_registry, box, 1.0) == (
        "no node can ever run it: gpu-a: refuses container types (its runtime is local)"
    )
    host = JobSpec(id="host", type="echo.echo", params={"text": "x"})
    assert co.submission_refusal(s, open_registry, host, 1.0) is None
    enrol(s, "gpu-b", 24)
    s.touch_node("gpu-b", rules_report(24, "bubblewrap"), 0.0)
    assert co.submission_refusal(s, open_registry, box, 1.0) is None
    assert co.submission_refusal(s, open_registry, host, 1.0) is None
    pinned = replace(box, constraints={"node": "gpu-a"})
    assert co.submission_refusal(s, open_registry, pinned, 1.0) == (
        "no node can ever run it: gpu-a: refuses container types (its runtime is local); "
        "gpu-b: the job asks for node 'gpu-a'"
    )
    jobtype = open_registry.types["testmods.gpu"]
    assert co.type_refusal(s, open_registry, jobtype) is None
    co.revoke(s, open_registry, "gpu-b", now=2.0)
    why = co.type_refusal(s, open_registry, jobtype)
    assert why == "no node can ever run it: gpu-a: refuses container types (its runtime is local)"


def test_a_node_is_judged_by_the_rules_it_enrolled_with_before_its_first_report(
    s: ClusterStore, open_registry: Registry
) -> None:
    from gpuwarden.core.launchrules import LaunchRules

    s.create_token(
        token_id="t-new", name="new", role=Role.NODE, secret_hash="x", now=0.0,
        created_by="local", node="new",
    )  # fmt: skip
    caps = {
        "gpus": [{"uuid": "GPU-1", "name": "sim", "total_bytes": 24 * GIB}],
        "types": sorted(open_registry.types),
        "launch_rules": LaunchRules().to_json(),
    }
    co.enroll(s, "new", token_id="t-new", capabilities=caps, now=0.0)
    assert co.submission_refusal(s, open_registry, gpu_job("box", 1), 1.0) == (
        "no node can ever run it: new: refuses container types (its runtime is local)"
    )
    ghost = JobSpec(id="g", type="echo.echo", params={"text": "x"})
    caps_without_echo = {**caps, "types": ["testmods.gpu"]}
    co.enroll(s, "new", token_id="t-new", capabilities=caps_without_echo, now=0.0)
    assert co.submission_refusal(s, open_registry, ghost, 1.0) == (
        "no node can ever run it: new: has no module for echo.echo"
    )


def test_explain_says_which_node_refuses_the_type_and_why(
    s: ClusterStore, open_registry: Registry
) -> None:
    enrol(s, "gpu-a", 24, now=1.0)
    enrol(s, "gpu-b", 24, now=1.0)
    s.touch_node("gpu-a", rules_report(24, "local"), 1.0)
    s.touch_node("gpu-b", {**rules_report(24, "bubblewrap"), "busy": 4}, 1.0)
    s.submit([gpu_job("box", 1)], now=1.0)
    job = s.get_job("box")
    assert job is not None
    lines = rp.explain_placement(s, open_registry, job, 2.0, TIMING)
    assert lines == [
        "node gpu-a refuses container types (its runtime is local)",
        "node gpu-b is busy (4 of its 4 jobs)",
    ]
    co.drain(s, "gpu-b", now=2.0)
    lines = rp.explain_placement(s, open_registry, job, 2.5, TIMING)
    assert lines[1] == (
        "node gpu-b is draining: it takes no new work (`gpuwarden node resume gpu-b` gives "
        "it work again)"
    )


# -- silent nodes, resume, status -----------------------------------------------------


def test_a_node_whose_heartbeat_is_overdue_is_silent_and_its_jobs_say_so(
    s: ClusterStore, registry: Registry
) -> None:
    enrol(s, "n", 80, now=0.0)
    s.touch_node("n", {**report(80), "heartbeat_every_s": 1.0}, 0.0)
    s.submit([gpu_job("run", 1), gpu_job("wait", 1)], now=0.0)
    assert sorted(claim(s, registry, "n", 0.0)) == ["run", "wait"]  # leases end at 10.0
    co.start(s, "n", "run", lease_id=s.lease_of("run").lease_id, gpu_uuid="GPU-0", now=0.5)  # type: ignore[union-attr]
    record = s.get_node("n")
    assert record is not None
    assert nv.silence(record, s.leases(), 3.0) is None  # 2 beats and a second: on time
    got = rp.node_json(record, s.leases(), 4.0)
    assert got["state"] == "active" and got["condition"] == "silent for 4 s (lease ends in 6 s)"
    assert got["silent_s"] == 4.0 and got["lease_ends_in_s"] == 6.0
    assert rp.node_json(record, s.leases(), 11.0)["condition"] == (
        "silent for 11 s (its lease ended 1 s ago)"
    )
    running = s.get_job("run")
    assert running is not None
    assert rp.explain_running(s, running, 2.0) == [
        "on node n, heard from 2 s ago (lease ends in 8 s unless renewed)"
    ]
    [line] = rp.explain_running(s, running, 4.0)
    assert line.startswith("its node n is silent for 4 s (lease ends in 6 s): it may still run")
    waiting = s.get_job("wait")
    assert waiting is not None
    [line] = rp.explain_placement(s, registry, waiting, 4.0, TIMING)
    assert line.startswith("it is leased to node n, silent for 4 s (lease ends in 6 s)")
    # a heartbeat: heard from again
    co.heartbeat(s, "n", {**report(80), "heartbeat_every_s": 1.0}, 4.5, 10.0, held=["run"])
    record = s.get_node("n")
    assert record is not None and rp.node_json(record, s.leases(), 5.0)["condition"] == ""
    # an agent that says nothing of its interval is judged by the default (15 s)
    enrol(s, "quiet", 24, now=0.0)
    quiet = s.get_node("quiet")
    assert quiet is not None and nv.silence(quiet, [], 30.0) is None
    assert nv.silence(quiet, [], 32.0) == nv.Silence(32.0, None)
    assert nv.Silence(32.0, None).text() == "silent for 32 s"


def test_a_drained_node_can_be_resumed(s: ClusterStore, registry: Registry) -> None:
    enrol(s, "n", 24)
    s.submit([gpu_job("a", 1)], now=1.0)
    co.drain(s, "n", now=1.5)
    assert claim(s, registry, "n", 2.0) == []
    record, changed = co.resume(s, "n", now=3.0)
    assert changed and record.state is NodeState.ACTIVE
    s.touch_node("n", report(24), 3.0)
    assert claim(s, registry, "n", 40.0) == ["a"]
    record, changed = co.resume(s, "n", now=4.0)  # not draining: nothing to do
    assert not changed and record.state is NodeState.ACTIVE
    events = [e for e in s.events() if e.kind == "node_state"]
    assert [(e.detail["from"], e.detail["to"]) for e in events] == [
        ("active", "draining"),
        ("draining", "active"),
    ]
    with pytest.raises(co.UnknownNode):
        co.resume(s, "ghost", now=5.0)
    co.revoke(s, registry, "n", now=5.0)
    with pytest.raises(UserError, match="was revoked; enrol it again"):
        co.resume(s, "n", now=6.0)


def test_cluster_status_shows_each_node_and_its_first_problem(
    s: ClusterStore, registry: Registry
) -> None:
    gpu = {
        "uuid": "GPU-0", "name": "sim", "total_bytes": 24 * GIB, "free_bytes": 20 * GIB,
        "usable_bytes": 24 * GIB, "used_bytes": 3 * GIB, "ledger_bytes": 4 * GIB, "degraded": "",
    }  # fmt: skip
    live = {
        "gpus": [gpu], "warm": ["testmods.warm"], "heartbeat_every_s": 1.0, "max_jobs": 4,
        "warm_servers": [{"type": "testmods.warm", "gpu": "GPU-0", "state": "idle",
                          "jobs_served": 3}],
        "probe": "sim", "probe_error": "",
    }  # fmt: skip
    for name in ("ok", "sick", "blind", "gone", "late", "drained", "out"):
        enrol(s, name, 24, now=0.0)
        s.touch_node(name, live, 100.0)
    s.touch_node("sick", {**live, "gpus": [{**gpu, "degraded": "3 GiB leaked"}]}, 100.0)
    s.touch_node("blind", {**live, "probe_error": "NVML: driver gone"}, 100.0)
    s.touch_node("gone", live, 10.0)  # past offline_after_s (20 s here)
    s.touch_node("late", live, 96.0)  # 4 s: overdue, not offline
    co.drain(s, "drained", now=100.0)
    co.revoke(s, registry, "out", now=100.0)
    s.submit([gpu_job("r", 1)], now=100.0)
    s.touch_node("ok", live, 100.0)
    [payload] = co.claim(s, registry, "ok", nv.node_view(s.get_node("ok")), 100.0, lease_s=10.0)  # type: ignore[arg-type]
    co.start(s, "ok", "r", lease_id=payload["lease_id"], gpu_uuid="GPU-0", now=100.5)
    got = {n["node"]: n for n in rp.cluster_status(s, 101.0, offline_after_s=20.0)}
    assert {k: v["problem"] for k, v in got.items()} == {
        "ok": "",
        "sick": "1 GPU(s) degraded: VRAM admission paused there",
        "blind": "the GPU probe fails: VRAM admission paused",
        "gone": "offline: not heard from for 91 s",
        "late": "silent for 5 s",
        "drained": "",
        "out": "",
    }
    ok = got["ok"]
    assert ok["state"] == "active" and ok["heard_s_ago"] == 1.0 and ok["probe"] == "sim"
    assert ok["gpus"] == [
        {
            "uuid": "GPU-0", "name": "sim", "total_bytes": 24 * GIB, "used_bytes": 3 * GIB,
            "ledger_bytes": 4 * GIB, "free_bytes": 20 * GIB, "waiting_bytes": 0, "degraded": "",
        }
    ]  # fmt: skip
    assert ok["warm"] == [
        {"type": "testmods.warm", "gpu": "GPU-0", "state": "idle", "jobs_served": 3}
    ]
    [run] = ok["running"]
    assert run["job"] == "r" and run["attempt"] == 1 and run["gpu"] == "GPU-0"
    assert run["started_at"] == 100.5 and run["type"] == "testmods.gpu"
    assert got["drained"]["state"] == "draining" and got["out"]["state"] == "revoked"
