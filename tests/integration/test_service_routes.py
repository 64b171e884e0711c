"""Services across hosts on the coordinator (SPEC.md section 16, "Services across
hosts"): the routes a heartbeat reports, checked as hostile input, kept in the
store, dropped with the job's end, and answered unavailable once the node is
silent; every store backend, with injected time."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster.routes import RouteBook, record_routes
from gpuwarden.core.model import JobSpec
from gpuwarden.core.serviceroute import STOPPED_KEEP_S, UNAVAILABLE, availability
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import ClusterStore, NodeState
from tests.integration.test_coordinator import claim, enrol, registry, report, s

__all__ = ["registry", "s"]

CRED = "A" * 43


def entry(**over: Any) -> dict[str, Any]:
    e = {
        "name": "hello",
        "job": "w1",
        "state": "healthy",
        "since": 100.0,
        "last_ok": 101.0,
        "upstream": "http://10.0.0.5:4000",
        "credential": CRED,
    }
    return {**e, **over}


def beat(*routes: dict[str, Any], address: str = "10.0.0.5", clock: float = 102.0) -> dict:
    return {
        **report(24),
        "heartbeat_every_s": 1.0,
        "services": {"address": address, "clock": clock, "routes": list(routes)},
    }


def running_service(s: ClusterStore, reg: Registry) -> str:
    enrol(s, "n", 24)
    s.submit([JobSpec(id="w1", type="testmods.web", service="hello", share=("operator",))], now=1.0)
    assert claim(s, reg, "n", 2.0) == ["w1"]
    lease = s.lease_of("w1")
    assert lease is not None
    co.start(s, "n", "w1", lease_id=lease.lease_id, gpu_uuid=None, now=3.0)
    return lease.lease_id


def test_reported_routes_take_only_well_formed_entries() -> None:
    now = 10.0
    good = nv.reported_routes(beat(entry()), now)
    (r,) = good
    # times moved from the node's clock (102) onto this one (10)
    assert r.since == 8.0 and r.last_ok == 9.0 and r.owner is None and r.share == ()
    bad = [
        entry(upstream="http://10.0.0.6:4000"),  # not the declared address
        entry(upstream="http://localhost:4000"),
        entry(upstream="https://10.0.0.5:4000"),
        entry(upstream="http://10.0.0.5:99999"),
        entry(upstream="http://10.0.0.5:4000/x"),
        entry(credential="short"),
        entry(credential="A" * 300),
        entry(credential=5),
        entry(name="../x"),
        entry(name="a" * 200),
        entry(job=["w1"]),
        entry(state="great"),
        entry(since="soon"),
        entry(since=float("nan")),
        entry(last_ok=True),
        "not a mapping",
    ]
    for b in bad:
        assert nv.reported_routes(beat(b), now) == [], b
    assert nv.reported_routes(beat(entry(), entry(job="w2")), now) == []  # a name twice
    assert (
        nv.reported_routes({"services": {"address": "nope", "clock": 1, "routes": [entry()]}}, 1)
        == []
    )
    assert nv.reported_routes({"services": "x"}, now) == []
    assert (
        nv.reported_routes(beat(*[entry(name=f"s{i}") for i in range(300)]), now)[-1].name == "s255"
    )


def test_heartbeat_keeps_the_routes_of_running_leased_services_only(
    s: ClusterStore, registry: Registry
) -> None:
    running_service(s, registry)
    co.heartbeat(s, "n", beat(entry(), entry(name="other", job="zz")), 4.0, 10.0, held=["w1"])
    (rec,) = s.service_routes()
    assert (
        rec.route.name == "hello" and rec.route.owner is None and rec.route.share == ("operator",)
    )
    assert rec.node == "n" and rec.updated_at == 4.0
    # the stored node report never holds a credential
    node = s.get_node("n")
    assert node is not None and "services" not in node.report and CRED not in str(node.report)
    # a node never makes a route "stopped" (only the job's end here does)
    co.heartbeat(s, "n", beat(entry(state="stopped")), 4.5, 10.0, held=["w1"])
    assert s.service_routes() == []
    co.heartbeat(s, "n", beat(entry()), 4.6, 10.0, held=["w1"])
    assert [r.route.state for r in s.service_routes()] == ["healthy"]
    # a name that is not the job's service name is not taken
    co.heartbeat(s, "n", beat(entry(name="hijack")), 5.0, 10.0, held=["w1"])
    assert s.service_routes() == []
    # a loopback address from a heartbeat that came from elsewhere is not taken
    loop = beat(entry(upstream="http://127.0.0.1:4000"), address="127.0.0.1")
    leases = {x.job_id: x for x in s.leases()}
    got = record_routes(s, "n", loop, 5.0, leases=leases, peer="10.0.0.5")
    assert got.kept == 0 and "not on the address this heartbeat came from" in got.refused[0]["why"]
    # from this host, only a forwarder that proves it holds the credential
    proven = record_routes(
        s, "n", loop, 5.0, leases=leases, peer="127.0.0.1", prove_at=lambda *_: None
    )
    assert proven.kept == 1 and proven.refused == []


def test_a_route_goes_with_its_job_and_is_unavailable_once_its_node_is_silent(
    s: ClusterStore, registry: Registry
) -> None:
    lease_id = running_service(s, registry)
    co.heartbeat(s, "n", beat(entry()), 4.0, 10.0, held=["w1"])
    clock = [4.0]
    book = RouteBook(s, clock=lambda: clock[0], cache_s=0.0)
    assert availability(book()["hello"], 4.0) is None  # healthy: forwarded
    # a coordinator restarted: a new book reads the same route
    assert RouteBook(s, clock=lambda: 4.5)()["hello"].credential == CRED
    clock[0] = 4.0 + 3.5  # past its heartbeat window (2 beats of 1 s, and 1 s)
    gone = book()["hello"]
    assert gone.state == UNAVAILABLE
    why = availability(gone, clock[0])
    assert why is not None and "hello is unavailable, last seen" in why.message
    # an offline node's routes are unavailable at once
    co.heartbeat(s, "n", beat(entry()), 8.0, 10.0, held=["w1"])
    clock[0] = 8.0
    assert book()["hello"].state == "healthy"
    s.set_node_state("n", NodeState.OFFLINE, now=8.0)
    assert book()["hello"].state == UNAVAILABLE
    # the cache: read at most once per cache_s
    cached = RouteBook(s, clock=lambda: clock[0])
    first = cached()
    s.drop_service_route("w1")
    assert cached() is first
    co.heartbeat(s, "n", beat(entry()), 9.0, 10.0, held=["w1"])
    assert s.service_routes()
    co.finish(
        s,
        registry,
        "n",
        "w1",
        lease_id=lease_id,
        state=JobState.CANCELLED,
        outcome="stopped",
        reason="stopped",
        now=9.5,
    )
    # its route is kept as stopped: no upstream, no credential, never forwarded
    (rec,) = s.service_routes()
    assert rec.route.state == "stopped" and rec.route.upstream == "" and rec.route.credential == ""
    assert rec.route.since == 9.5 and rec.route.last_ok is not None
    # a heartbeat that no longer reports it leaves the stopped route alone
    co.heartbeat(s, "n", beat(), 10.0, 10.0, held=[])
    clock[0] = 10.0 + 60.0  # long past the heartbeat window: still "stopped"
    stopped = RouteBook(s, clock=lambda: clock[0], cache_s=0.0)()["hello"]
    assert stopped.state == "stopped"
    why = availability(stopped, clock[0])
    assert why is not None and why.message.startswith("hello is unavailable, last seen ")
    assert why.message.endswith("(it is stopped)")


def test_a_stopped_route_is_kept_for_a_while_then_dropped_and_a_new_service_replaces_it(
    s: ClusterStore, registry: Registry
) -> None:
    running_service(s, registry)
    co.heartbeat(s, "n", beat(entry()), 4.0, 10.0, held=["w1"])
    # the node goes silent and its lease expires: the sweep keeps the route stopped
    lease = s.lease_of("w1")
    assert lease is not None
    late = lease.expires_at + 1.0
    co.sweep(s, late, registry=registry)
    (rec,) = s.service_routes()
    assert rec.route.state == "stopped" and rec.route.since == late
    book = RouteBook(s, clock=lambda: late + STOPPED_KEEP_S - 1, cache_s=0.0)
    assert book()["hello"].state == "stopped"
    # past STOPPED_KEEP_S: a name nobody has (the book skips it, the sweep drops it)
    assert "hello" not in RouteBook(s, clock=lambda: late + STOPPED_KEEP_S + 1)()
    assert s.drop_stopped_routes(late - 1) == 0 and s.service_routes()
    # a new service of the same name, on another node, replaces the stopped route
    assert (
        s.put_service_routes(
            "other",
            [
                dataclasses.replace(
                    rec.route,
                    job_id="w9",
                    state="healthy",
                    upstream="http://10.0.0.9:1",
                    credential=CRED,
                )
            ],
            late + 2,
        )
        == 1
    )
    (again,) = s.service_routes()
    assert again.node == "other" and again.route.job_id == "w9" and again.route.state == "healthy"
    s.stop_service_route("w9", late + 3)
    co.sweep(s, late + 3 + STOPPED_KEEP_S + 1, registry=registry)
    assert s.service_routes() == []
