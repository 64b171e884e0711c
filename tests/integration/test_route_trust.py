"""Where a node's service route may point the coordinator (issue 30, item 3; SPEC.md
section 16, "Services across hosts"): a route is bound to the address its
heartbeat came from, and one that points at the coordinator's own host must prove
that it is the node's forwarder. Every store backend; real sockets, no HTTP mocked.

The attack is planted first: another HTTP API listens on the coordinator's
loopback and answers anyone who connects, and a node credential reports a route
to it for a service job it holds; the heartbeat is taken (200). Then the route is
refused with its reason, ``/run/NAME/`` never reaches that API, and a real
forwarder reported the same way is served."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.cluster.routes import RouteBook, prove, route_refusal
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.node.services import Forwarder
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission
from gpuwarden.store.cluster import ClusterStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
CRED = "route-credential-0123456789abcdef"

pytestmark = pytest.mark.timeout(120)


class Plain(http.server.ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 that answers every GET with ``body`` and counts
    the requests it got (another API of the coordinator's host, or a service)."""

    daemon_threads = True

    def __init__(self, body: bytes) -> None:
        self.body = body
        #: the headers of each request, and (``ports``) the client port it came from
        self.hits: list[dict[str, str]] = []
        self.ports: list[int] = []
        #: the bodies of the requests that had one
        self.bodies: list[bytes] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.hits.append(dict(self.headers.items()))
                outer.ports.append(self.client_address[1])
                self.send_response(200)
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def do_POST(self) -> None:
                outer.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.do_GET()

            def log_message(self, *_: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def internal() -> Iterator[Plain]:
    server = Plain(b"internal-secret")
    yield server
    server.shutdown()
    server.server_close()


class Coord:
    def __init__(self, tmp: Path, store: Store) -> None:
        assert isinstance(store, ClusterStore)
        self.store: ClusterStore = store
        config = Config.model_validate(
            {
                "state_dir": tmp,
                "module_paths": [
                    REPO / "src" / "gpuwarden" / "modules",
                    REPO / "tests" / "modules",
                ],
                "allow_unsandboxed_containers": True,
                "api": {"rate_per_s": 10_000, "burst": 10_000},
                "cluster": {"lease_s": 30, "offline_after_s": 60},
            }
        )
        registry = Registry.load(config.module_paths, config.launch_rules)
        self.app = create_app(store, registry, config, service_routes=RouteBook(store, cache_s=0.0))
        self.tokens: dict[str, str] = {}
        self.ids: dict[str, str] = {}
        for role in (Role.OWNER, Role.SUBMITTER):
            record, self.tokens[role.value] = issue_token(
                store, name=role.value, role=role, by=ADMIN, now=time.time()
            )
            self.ids[role.value] = record.id
        self.clients: dict[str, TestClient] = {}

    def client(self, peer: str = "testclient") -> TestClient:
        """A client whose requests come from ``peer`` (the request's client host)."""
        if peer not in self.clients:
            self.clients[peer] = TestClient(self.app, client=(peer, 40000))
        return self.clients[peer]

    def post(self, path: str, who: str, body: Any, *, peer: str = "testclient", **h: str) -> Any:
        headers = {"Authorization": f"Bearer {self.tokens[who]}", **h}
        return self.client(peer).post(path, json=body, headers=headers)

    def running_service(self) -> None:
        """Node ``n`` enrolled, holding the submitter's service job ``w1`` (``hello``)."""
        r = self.post("/v1/nodes/invite", "owner", {"name": "n"})
        self.tokens["invite"] = r.json()["token"]
        r = self.post("/v1/nodes/enroll", "invite", {"capabilities": {}})
        assert r.status_code == 201, r.text
        self.tokens["node"] = r.json()["token"]
        spec = JobSpec(
            id="w1",
            type="testmods.gpu",
            params={"gib": 1, "seconds": 60, "leak": False},
            vram_bytes=GIB,
            service="hello",
        )
        self.store.submit([spec], now=time.time(), origin=Submission(owner=self.ids["submitter"]))
        r = self.post("/v1/node/claim", "node", {"report": report(), "want": 1})
        [job] = r.json()["jobs"]
        r = self.post("/v1/node/jobs/w1/start", "node", {"lease_id": job["lease_id"]})
        assert r.status_code == 200, r.text

    def beat(self, upstream: str, *, peer: str, **headers: str) -> dict[str, Any]:
        """A heartbeat of node ``n`` from ``peer`` reporting ``hello`` at ``upstream``."""
        address = upstream.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")
        route = {
            "name": "hello",
            "job": "w1",
            "state": "healthy",
            "since": time.time(),
            "last_ok": time.time(),
            "upstream": upstream,
            "credential": CRED,
        }
        rep = {
            **report(),
            "services": {"address": address, "clock": time.time(), "routes": [route]},
        }
        r = self.post(
            "/v1/node/heartbeat", "node", {"report": rep, "jobs": ["w1"]}, peer=peer, **headers
        )
        assert r.status_code == 200, r.text  # the forged report was taken
        got: dict[str, Any] = r.json()
        return got

    def run(self, path: str = "/run/hello/") -> Any:
        headers = {"Authorization": f"Bearer {self.tokens['submitter']}"}
        return self.client().get(path, headers=headers, follow_redirects=False)


def report() -> dict[str, Any]:
    total = 24 * GIB
    return {
        "gpus": [{"uuid": "GPU-0", "name": "sim", "total_bytes": total, "free_bytes": total}],
        "warm": [],
        "busy": 0,
        "max_jobs": 4,
    }


@pytest.fixture
def coord(tmp_path: Path, store: Store) -> Iterator[Coord]:
    c = Coord(tmp_path, store)
    yield c
    for client in c.clients.values():
        client.close()


def test_a_forged_route_reaches_no_api_on_the_coordinators_host(
    coord: Coord, internal: Plain
) -> None:
    # planted: an API on the coordinator's loopback that answers whoever connects
    target = f"http://127.0.0.1:{internal.port}"
    assert httpx.get(target + "/").text == "internal-secret"
    assert len(internal.hits) == 1
    coord.running_service()
    # the node credential reports a route to it, from another host, from this host,
    # through a proxy, and from an unknown address: each heartbeat is taken, the
    # route is not, and the answer says why
    cases = [
        ({"peer": "10.0.0.5"}, "not on the address this heartbeat came from (10.0.0.5)"),
        ({"peer": "127.0.0.1"}, "did not prove it is the node's service forwarder"),
        ({"peer": "::ffff:127.0.0.1"}, "did not prove it is the node's service forwarder"),
        (
            {"peer": "127.0.0.1", "X-Forwarded-For": "203.0.113.9"},
            "is a loopback address (this coordinator's own), and the address this "
            "heartbeat came from is not known",
        ),
        ({"peer": "testclient"}, "is a loopback address"),
    ]
    for how, why in cases:
        answer = coord.beat(target, **how)
        [refused] = answer["routes_refused"]
        assert refused["name"] == "hello" and why in refused["why"], (how, refused)
        assert coord.store.service_routes() == []
        r = coord.run()
        assert r.status_code == 404 and "internal-secret" not in r.text
    # what the other API answered the proof is named, and nothing else reached it
    answer = coord.beat(target, peer="127.0.0.1")
    assert "501" in answer["routes_refused"][0]["why"]
    assert len(internal.hits) == 1
    # the refusals are audited with the heartbeat
    audited = [a for a in coord.store.audit_rows() if a.action == "node.heartbeat"]
    assert audited and audited[-1].detail["routes_refused"][0]["name"] == "hello"
    # the next legitimate report works: a real forwarder of this host, which proves it
    service = Plain(b"service-ok")
    forwarder = Forwarder(
        "hello", CRED, lambda: socket.create_connection(("127.0.0.1", service.port))
    )
    try:
        answer = coord.beat(forwarder.upstream, peer="127.0.0.1")
        assert "routes_refused" not in answer
        [kept] = coord.store.service_routes()
        assert kept.route.upstream == forwarder.upstream
        r = coord.run()
        assert r.status_code == 200 and r.text == "service-ok"
        assert all("X-Gpuwarden-Route" not in h for h in service.hits)
    finally:
        forwarder.close()
        service.shutdown()
        service.server_close()
    assert len(internal.hits) == 1


def _route(upstream: str) -> ServiceRoute:
    return ServiceRoute(
        name="hello",
        job_id="w1",
        owner=None,
        share=(),
        state="healthy",
        upstream=upstream,
        credential=CRED,
        since=0.0,
        last_ok=None,
    )


def never(*_: str) -> str | None:
    raise AssertionError("no proof is asked of a route that is not on this host")


def test_the_rules_of_a_routes_address() -> None:
    # bound to the heartbeat's address: a node names only itself
    assert route_refusal(_route("http://10.0.0.5:4000"), "10.0.0.5", never) is None
    assert route_refusal(_route("http://10.0.0.5:4000"), "::ffff:10.0.0.5", never) is None
    assert "not on the address" in str(
        route_refusal(_route("http://10.0.0.6:4000"), "10.0.0.5", never)
    )
    # with no known address (a proxy): never loopback, link-local, unspecified, multicast
    for host in ("127.0.0.1", "127.8.0.1", "[::1]", "169.254.169.254", "[fe80::1]", "0.0.0.0"):
        why = route_refusal(_route(f"http://{host}:4000"), None, never)
        assert why is not None and "not known" in why, host
    assert "multicast" in str(route_refusal(_route("http://224.0.0.1:4000"), None, never))
    assert route_refusal(_route("http://10.0.0.5:4000"), None, never) is None
    # from this host: only what proves it is the forwarder
    assert route_refusal(_route("http://127.0.0.1:4000"), "127.0.0.1", lambda *_: None) is None
    assert "did not prove" in str(
        route_refusal(_route("http://127.0.0.1:4000"), "127.0.0.1", lambda *_: "no")
    )


def test_a_proof_is_the_forwarders_own_answer(internal: Plain) -> None:
    service = Plain(b"service-ok")
    forwarder = Forwarder(
        "hello", CRED, lambda: socket.create_connection(("127.0.0.1", service.port))
    )
    try:
        assert prove(forwarder.upstream, CRED) is None
        # another credential: refused, and the service never sees the request
        assert "403" in str(prove(forwarder.upstream, "another-credential-0123456789"))
        forwarder.rotate("route-credential-new-0123456789")
        assert prove(forwarder.upstream, CRED) is None  # the one before still holds
        assert service.hits == []
    finally:
        forwarder.close()
        service.shutdown()
        service.server_close()
    assert "501" in str(prove(f"http://127.0.0.1:{internal.port}", CRED))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert "did not answer" in str(prove(f"http://127.0.0.1:{closed}", CRED))
