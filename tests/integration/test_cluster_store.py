"""The ClusterStore contract (nodes, leases, lost jobs). Every backend runs it."""

from __future__ import annotations

import threading

from gpuwarden.core.model import JobSpec
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.core.states import JobState
from gpuwarden.store.base import Store, Submission
from gpuwarden.store.cluster import ClusterStore, NodeState


def cs(store: Store) -> ClusterStore:
    assert isinstance(store, ClusterStore)
    return store


def submit(store: Store, *ids: str, now: float = 1.0) -> None:
    store.submit([JobSpec(id=i, type="echo.echo", params={"text": i}) for i in ids], now=now)


def test_enrol_a_node_and_enrol_it_again(store: Store) -> None:
    s = cs(store)
    node = s.upsert_node("gpu1", token_id="aaaaaaaaaaaa", capabilities={"gpus": [1]}, now=5.0)
    assert node.name == "gpu1" and node.state is NodeState.ACTIVE
    assert node.capabilities == {"gpus": [1]} and node.enrolled_at == 5.0
    s.touch_node("gpu1", {"busy": 2}, 6.0)
    s.set_node_state("gpu1", NodeState.REVOKED, now=7.0)
    again = s.upsert_node("gpu1", token_id="bbbbbbbbbbbb", capabilities={"gpus": [2]}, now=8.0)
    assert again.token_id == "bbbbbbbbbbbb" and again.state is NodeState.ACTIVE
    assert again.report == {} and again.capabilities == {"gpus": [2]}
    assert [n.name for n in s.list_nodes()] == ["gpu1"]
    assert s.get_node("nope") is None
    kinds = [e.kind for e in s.events()]
    assert kinds.count("node_enrolled") == 2 and "node_state" in kinds


def test_touch_keeps_the_report_and_brings_an_offline_node_back(store: Store) -> None:
    s = cs(store)
    assert s.touch_node("ghost", {}, 1.0) is None
    s.upsert_node("n", token_id="t" * 12, capabilities={}, now=1.0)
    assert s.set_node_state("n", NodeState.OFFLINE, now=2.0)
    got = s.touch_node("n", {"warm": ["a.b"]}, 3.0)
    assert got is not None and got.state is NodeState.ACTIVE
    assert got.report == {"warm": ["a.b"]} and got.last_seen == 3.0
    s.set_node_state("n", NodeState.DRAINING, now=4.0)
    got = s.touch_node("n", {}, 5.0)
    assert got is not None and got.state is NodeState.DRAINING


def test_set_node_state_only_from(store: Store) -> None:
    s = cs(store)
    s.upsert_node("n", token_id="t" * 12, capabilities={}, now=1.0)
    assert not s.set_node_state(
        "n", NodeState.OFFLINE, now=2.0, only_from=frozenset({NodeState.DRAINING})
    )
    assert s.set_node_state(
        "n", NodeState.OFFLINE, now=2.0, only_from=frozenset({NodeState.ACTIVE})
    )
    assert not s.set_node_state("n", NodeState.OFFLINE, now=3.0)  # no change
    assert not s.set_node_state("nope", NodeState.OFFLINE, now=3.0)
    node = s.get_node("n")
    assert node is not None and node.state is NodeState.OFFLINE


def test_lease_only_queued_unleased_jobs(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c", "d")
    s.start_attempt("c", node="x", gpu_uuid=None, now=2.0)  # running: not leasable
    s.request_cancel("d", now=2.0)  # cancelled
    got = s.lease_jobs("n1", ["b", "a", "c", "d", "zz"], lease_id="L1", expires_at=100.0, now=3.0)
    assert got == ["b", "a"]
    again = s.lease_jobs("n2", ["a", "b"], lease_id="L2", expires_at=100.0, now=4.0)
    assert again == []
    lease = s.lease_of("a")
    assert lease is not None and lease.node == "n1" and lease.lease_id == "L1"
    assert lease.expires_at == 100.0 and not lease.started and lease.attempt is None
    assert lease.live(99.0) and not lease.live(100.0)
    assert [ev.kind for ev in s.events(job_id="a")] == ["submitted", "leased"]


def test_an_expired_lease_is_replaced(store: Store) -> None:
    s = cs(store)
    submit(s, "a")
    assert s.lease_jobs("n1", ["a"], lease_id="L1", expires_at=10.0, now=1.0) == ["a"]
    assert s.lease_jobs("n2", ["a"], lease_id="L2", expires_at=30.0, now=9.0) == []
    assert s.lease_jobs("n2", ["a"], lease_id="L2", expires_at=30.0, now=10.0) == ["a"]
    lease = s.lease_of("a")
    assert lease is not None and lease.node == "n2" and lease.lease_id == "L2"


def test_a_job_with_a_cancel_request_is_not_leased(store: Store) -> None:
    s = cs(store)
    submit(s, "a")
    s.start_attempt("a", node="x", gpu_uuid=None, now=2.0)
    s.request_cancel("a", now=3.0)
    s.finish_attempt("a", 1, target=JobState.QUEUED, now=4.0, outcome="interrupted", reason="retry")
    job = s.get_job("a")
    assert job is not None and job.state is JobState.QUEUED and job.cancel_requested
    assert s.lease_jobs("n", ["a"], lease_id="L", expires_at=50.0, now=5.0) == []


def test_renew_only_live_leases_of_the_node(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c")
    s.lease_jobs("n1", ["a", "b"], lease_id="L1", expires_at=10.0, now=1.0)
    s.lease_jobs("n2", ["c"], lease_id="L2", expires_at=10.0, now=1.0)
    assert s.renew_leases("n1", 20.0, now=5.0, job_ids=["a"]) == 1
    assert s.renew_leases("n1", 25.0, now=5.0) == 2
    assert s.renew_leases("n1", 40.0, now=26.0) == 0  # expired: never brought back
    got = {lease.job_id: lease.expires_at for lease in s.leases()}
    assert got == {"a": 25.0, "b": 25.0, "c": 10.0}
    assert [lease.job_id for lease in s.leases("n2")] == ["c"]


def test_extend_leases_gives_every_lease_at_least_until_then(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c")
    s.lease_jobs("n1", ["a"], lease_id="L1", expires_at=10.0, now=1.0)  # lapses at 10
    s.lease_jobs("n2", ["b"], lease_id="L2", expires_at=30.0, now=1.0)
    s.lease_jobs("n2", ["c"], lease_id="L3", expires_at=80.0, now=1.0)
    assert s.extend_leases(50.0) == 2
    got = {lease.job_id: (lease.lease_id, lease.expires_at) for lease in s.leases()}
    assert got == {"a": ("L1", 50.0), "b": ("L2", 50.0), "c": ("L3", 80.0)}
    assert s.expired_leases(40.0) == []  # none swept for the time before
    assert s.renew_leases("n1", 60.0, now=40.0) == 1  # a lapsed one is live again


def test_a_lease_marked_for_preemption_is_not_renewed(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b")
    s.lease_jobs("n1", ["a", "b"], lease_id="L1", expires_at=10.0, now=1.0)
    # only a started job's live lease is marked, once, under its own lease id
    assert not s.mark_lease_preempt("a", lease_id="L1", for_job="hi", now=2.0)
    assert s.mark_lease_started("a", 1, lease_id="L1")
    assert not s.mark_lease_preempt("a", lease_id="other", for_job="hi", now=2.0)
    assert not s.mark_lease_preempt("a", lease_id="L1", for_job="hi", now=11.0)  # expired
    assert s.mark_lease_preempt("a", lease_id="L1", for_job="hi", now=2.0)
    assert not s.mark_lease_preempt("a", lease_id="L1", for_job="other", now=2.0)
    lease = s.lease_of("a")
    assert lease is not None and lease.preempt_for == "hi"
    assert s.renew_leases("n1", 20.0, now=5.0) == 1  # b only
    assert s.renew_leases("n1", 20.0, now=5.0, job_ids=["a", "b"]) == 1
    got = {lease.job_id: (lease.expires_at, lease.preempt_for) for lease in s.leases("n1")}
    assert got == {"a": (10.0, "hi"), "b": (20.0, None)}
    # its end reported (back in the node's own queue): renewed again
    assert s.mark_lease_started("a", None, lease_id="L1")
    lease = s.lease_of("a")
    assert lease is not None and lease.preempt_for is None
    assert s.renew_leases("n1", 30.0, now=6.0, job_ids=["a"]) == 1
    # marked with a time: the lease lasts at least that long (the victim's grace),
    # never shorter than it was
    assert s.mark_lease_started("a", 2, lease_id="L1")
    assert s.mark_lease_preempt("a", lease_id="L1", for_job="hi", now=7.0, expires_at=45.0)
    assert s.renew_leases("n1", 50.0, now=8.0, job_ids=["a"]) == 0
    lease = s.lease_of("a")
    assert lease is not None and (lease.expires_at, lease.preempt_for) == (45.0, "hi")
    assert s.mark_lease_started("a", None, lease_id="L1")
    assert s.mark_lease_started("a", 3, lease_id="L1")
    assert s.mark_lease_preempt("a", lease_id="L1", for_job="hi", now=9.0, expires_at=12.0)
    lease = s.lease_of("a")
    assert lease is not None and lease.expires_at == 45.0


def test_drop_and_start_are_fenced_by_lease_id(store: Store) -> None:
    s = cs(store)
    submit(s, "a")
    s.lease_jobs("n1", ["a"], lease_id="L1", expires_at=10.0, now=1.0)
    assert not s.mark_lease_started("a", 1, lease_id="other")
    assert s.mark_lease_started("a", 1, lease_id="L1")
    lease = s.lease_of("a")
    assert lease is not None and lease.started and lease.attempt == 1
    assert s.mark_lease_started("a", None)
    lease = s.lease_of("a")
    assert lease is not None and not lease.started and lease.attempt is None
    assert not s.drop_lease("a", lease_id="other")
    assert s.drop_lease("a", lease_id="L1")
    assert s.lease_of("a") is None
    assert not s.drop_lease("a")


def test_lost_nodes_once_each_in_order(store: Store) -> None:
    s = cs(store)
    submit(s, "a")
    s.add_lost("a", "n2", now=1.0)
    s.add_lost("a", "n1", now=2.0)
    s.add_lost("a", "n2", now=3.0)
    assert s.lost_nodes("a") == ["n2", "n1"]
    assert s.lost_nodes("b") == []


def test_maintenance_lock_can_be_taken_and_released(store: Store) -> None:
    s = cs(store)
    assert s.try_maintenance_lock()
    assert s.try_maintenance_lock()  # held already
    s.release_maintenance_lock()
    s.release_maintenance_lock()  # twice is harmless


def test_concurrent_claims_never_lease_a_job_twice(store: Store) -> None:
    s = cs(store)
    ids = [f"j{i:03d}" for i in range(60)]
    submit(s, *ids)
    got: dict[str, list[str]] = {}
    barrier = threading.Barrier(4)

    def claim(node: str) -> None:
        barrier.wait()
        mine: list[str] = []
        for start in range(0, 60, 5):
            mine += s.lease_jobs(
                node, ids[start : start + 10], lease_id=node, expires_at=100.0, now=2.0
            )
        got[node] = mine

    threads = [threading.Thread(target=claim, args=(f"n{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [j for mine in got.values() for j in mine]
    assert sorted(every) == ids  # each leased exactly once
    assert {lease.job_id: lease.node for lease in s.leases()} == {
        j: node for node, mine in got.items() for j in mine
    }


def test_postgres_maintenance_lock_is_held_by_one_store(pg_url: str, pg_schema: str) -> None:
    from gpuwarden.store.postgres import PostgresStore

    a = PostgresStore(pg_url, schema=pg_schema)
    b = PostgresStore(pg_url, schema=pg_schema)
    try:
        assert a.try_maintenance_lock()
        assert not b.try_maintenance_lock()
        a.release_maintenance_lock()
        assert b.try_maintenance_lock()
        assert not a.try_maintenance_lock()
    finally:
        a.release_maintenance_lock()
        b.release_maintenance_lock()
        a.close()
        b.close()


def test_claimable_jobs_skip_leased_cancelled_and_input_jobs(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c", "d")
    s.submit([JobSpec(id="hi", type="echo.echo", params={"text": "x"}, priority=5)], now=2.0)
    s.submit([JobSpec(id="in", type="testmods.cat", params={}, inputs=("f.txt",))], now=2.0)
    s.lease_jobs("n", ["b"], lease_id="L", expires_at=10.0, now=1.0)
    s.lease_jobs("n", ["c"], lease_id="L", expires_at=3.0, now=1.0)  # expired at 5.0
    s.start_attempt("d", node="x", gpu_uuid=None, now=2.0)
    s.request_cancel("d", now=3.0)
    s.finish_attempt("d", 1, target=JobState.QUEUED, now=4.0, outcome="interrupted", reason="r")
    got = s.claimable_jobs(now=5.0)
    assert [j.id for j in got] == ["hi", "a", "c"]
    assert got[0].priority == 5 and got[1].attempts == 0 and got[1].type == "echo.echo"
    assert [j.id for j in s.claimable_jobs(now=5.0, limit=1)] == ["hi"]
    assert all(j.input_dir is None for j in got)


def test_claimable_jobs_take_input_jobs_whose_inputs_were_staged(store: Store) -> None:
    s = cs(store)
    staged = JobSpec(id="st", type="testmods.cat", params={}, inputs=("f.txt",))
    s.submit([staged], now=1.0, origin=Submission(input_dir="/staging/b"))
    s.submit(
        [JobSpec(id="plain", type="echo.echo", params={"text": "x"})],
        now=2.0,
        origin=Submission(input_dir="/staging/c"),
    )
    got = {j.id: j.input_dir for j in s.claimable_jobs(now=5.0)}
    assert got == {"st": "/staging/b", "plain": None}  # no inputs: nothing to fetch


def test_claimable_jobs_page_after_a_job_in_their_order(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c")
    s.submit([JobSpec(id="hi", type="echo.echo", params={"text": "x"}, priority=5)], now=2.0)
    s.lease_jobs("n", ["b"], lease_id="L", expires_at=10.0, now=1.0)
    first = s.claimable_jobs(now=5.0, limit=2)
    assert [j.id for j in first] == ["hi", "a"]
    rest = s.claimable_jobs(now=5.0, limit=10, after=(first[-1].priority, first[-1].seq))
    assert [j.id for j in rest] == ["c"]  # b is leased
    after_hi = s.claimable_jobs(now=5.0, limit=10, after=(first[0].priority, first[0].seq))
    assert [j.id for j in after_hi] == ["a", "c"]
    assert s.claimable_jobs(now=5.0, after=(rest[-1].priority, rest[-1].seq)) == []


def test_live_lease_counts_and_expired_leases(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c", "d")
    s.lease_jobs("n1", ["a", "b"], lease_id="L1", expires_at=10.0, now=1.0)
    s.lease_jobs("n2", ["c"], lease_id="L2", expires_at=5.0, now=1.0)
    assert s.live_lease_counts(4.0) == {"n1": 2, "n2": 1}
    assert s.live_lease_counts(5.0) == {"n1": 2}
    assert s.live_lease_counts(10.0) == {}
    assert [lease.job_id for lease in s.expired_leases(4.0)] == []
    assert [lease.job_id for lease in s.expired_leases(5.0)] == ["c"]
    assert sorted(lease.job_id for lease in s.expired_leases(10.0)) == ["a", "b", "c"]


def test_queued_cancel_requests_without_a_live_lease(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c")
    for job_id in ("a", "b"):  # back in the queue with a cancel request
        s.start_attempt(job_id, node="x", gpu_uuid=None, now=2.0)
        s.request_cancel(job_id, now=3.0)
        s.finish_attempt(
            job_id, 1, target=JobState.QUEUED, now=4.0, outcome="interrupted", reason="r"
        )
    s.lease_jobs("n", ["c"], lease_id="L", expires_at=50.0, now=4.0)
    with s._write() as conn:  # b's node still holds a live lease on it
        s._run(conn, "put_lease", {"job_id": "b", "node": "n", "lease_id": "L2",
                                   "expires_at": 50.0, "now": 4.0})  # fmt: skip
    assert s.queued_cancel_requests(10.0) == ["a"]
    assert s.queued_cancel_requests(50.0) == ["a", "b"]


def test_jobs_by_ids_in_submission_order(store: Store) -> None:
    s = cs(store)
    submit(s, "a", "b", "c")
    assert [j.id for j in s.jobs_by_ids(["c", "zz", "a", "c"])] == ["a", "c"]
    assert s.jobs_by_ids([]) == []


def _route(name: str, job: str, *, state: str = "healthy", cred: str = "c1") -> ServiceRoute:
    return ServiceRoute(
        name=name,
        job_id=job,
        owner="tok1",
        share=("operator",),
        state=state,
        upstream="http://10.0.0.5:4000",
        credential=cred,
        since=3.0,
        last_ok=4.5,
    )


def test_service_routes_are_written_by_heartbeat_replaced_and_dropped(store: Store) -> None:
    s = cs(store)
    assert s.service_routes() == []
    assert s.put_service_routes("n1", [_route("web", "j1"), _route("api", "j2")], 10.0) == 2
    got = {r.route.name: r for r in s.service_routes()}
    assert sorted(got) == ["api", "web"]
    assert got["web"].route == _route("web", "j1") and got["web"].node == "n1"
    assert got["web"].updated_at == 10.0
    # the next heartbeat: a new credential for web; api is no longer reported
    s.put_service_routes("n1", [_route("web", "j1", cred="c2", state="unhealthy")], 11.0)
    (web,) = s.service_routes()
    assert web.route.credential == "c2" and web.route.state == "unhealthy"
    assert web.updated_at == 11.0
    # another node may not take a name another job's route has
    assert s.put_service_routes("n2", [_route("web", "j9", cred="evil")], 12.0) == 0
    (web,) = s.service_routes()
    assert web.route.job_id == "j1" and web.node == "n1" and web.route.credential == "c2"
    # the same job, moved to another node (its lease went there): it follows
    assert s.put_service_routes("n2", [_route("web", "j1", cred="c3")], 13.0) == 1
    (web,) = s.service_routes()
    assert web.node == "n2" and web.route.credential == "c3"
    # its job ended: the route goes
    assert s.drop_service_route("j1") and not s.drop_service_route("j1")
    assert s.service_routes() == []
    # an empty report drops every route of that node alone
    s.put_service_routes("n1", [_route("a", "ja")], 14.0)
    s.put_service_routes("n2", [_route("b", "jb")], 14.0)
    s.put_service_routes("n1", [], 15.0)
    assert [r.route.name for r in s.service_routes()] == ["b"]
