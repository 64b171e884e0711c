"""The route credential never reaches the service (issue 30, item 5; SPEC.md
section 14, "Reaching a service"): a forwarder removes ``X-Gpuwarden-Route`` from
every request of a connection, not only the first. Real keep-alive clients, a real
forwarder and a real service; no HTTP mocked.

The attack is planted first: the client sends the header on each of several
requests over one connection (as the coordinator's pooled proxy does), and the
test shows the connection was reused; then no request the service got has it,
every request was answered, and the next one works."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpuwarden.node.services import ROUTE_HEADER, Forwarder
from gpuwarden.store.base import Store
from tests.integration.test_route_trust import CRED, Coord, Plain

pytestmark = pytest.mark.timeout(120)


def saw_route(service: Plain) -> int:
    """How many of the requests the service got carried the route header."""
    return sum(any(k.lower() == ROUTE_HEADER.lower() for k in h) for h in service.hits)


@pytest.fixture
def service() -> Iterator[Plain]:
    s = Plain(b"service-ok")
    yield s
    s.shutdown()
    s.server_close()


@pytest.fixture
def forwarder(service: Plain) -> Iterator[Forwarder]:
    f = Forwarder("hello", CRED, lambda: socket.create_connection(("127.0.0.1", service.port)))
    yield f
    f.close()


def test_a_keep_alive_client_never_hands_the_credential_to_the_service(
    service: Plain, forwarder: Forwarder
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", forwarder.port, timeout=10)
    try:
        conn.connect()
        first = conn.sock
        for i in range(3):
            conn.request("GET", f"/r{i}", headers={ROUTE_HEADER: CRED})
            r = conn.getresponse()
            assert r.status == 200 and r.read() == b"service-ok"
        conn.request("POST", "/body", body=b"ROUTE " + CRED.encode(), headers={ROUTE_HEADER: CRED})
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"service-ok"
        # planted: four requests with the header, on one client connection, relayed
        # over one connection to the service
        assert conn.sock is first and len(service.hits) == 4
        assert len(set(service.ports)) == 1
    finally:
        conn.close()
    assert saw_route(service) == 0
    assert service.bodies == [b"ROUTE " + CRED.encode()]  # a body passes as it is


def test_pipelined_requests_lose_the_header_each(service: Plain, forwarder: Forwarder) -> None:
    one = f"GET /p HTTP/1.1\r\nHost: x\r\n{ROUTE_HEADER}: {CRED}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", forwarder.port), timeout=10) as s:
        s.sendall(one * 3)
        data = b""
        deadline = time.monotonic() + 10
        while data.count(b"service-ok") < 3 and time.monotonic() < deadline:
            data += s.recv(65536)
    assert data.count(b"HTTP/1.1 200") == 3 and len(service.hits) == 3
    assert saw_route(service) == 0


def test_a_request_that_cannot_be_framed_closes_the_connection(
    service: Plain, forwarder: Forwarder
) -> None:
    good = f"GET /p HTTP/1.1\r\nHost: x\r\n{ROUTE_HEADER}: {CRED}\r\n\r\n".encode()
    smuggle = f"GET /q HTTP/1.1\r\nHost: x\r\n{ROUTE_HEADER} : {CRED}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", forwarder.port), timeout=10) as s:
        s.sendall(good)
        data = b""
        while b"service-ok" not in data:
            data += s.recv(65536)
        # on the same connection, a head whose route header hides behind a space
        s.sendall(smuggle)
        while chunk := s.recv(65536):  # closed, not answered
            data += chunk
    assert data.count(b"HTTP/1.1 200") == 1 and len(service.hits) == 1
    assert saw_route(service) == 0
    # the next connection is served
    conn = http.client.HTTPConnection("127.0.0.1", forwarder.port, timeout=10)
    try:
        conn.request("GET", "/again", headers={ROUTE_HEADER: CRED})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert saw_route(service) == 0


def test_through_the_coordinators_pooled_proxy(
    tmp_path: Path, store: Store, service: Plain, forwarder: Forwarder
) -> None:
    coord = Coord(tmp_path, store)
    coord.running_service()
    assert "routes_refused" not in coord.beat(forwarder.upstream, peer="127.0.0.1")
    headers = {"Authorization": f"Bearer {coord.tokens['submitter']}"}
    with TestClient(coord.app) as client:  # one event loop: its pooled connections
        for i in range(3):
            r = client.get(f"/run/hello/r{i}", headers=headers)
            assert r.status_code == 200 and r.text == "service-ok"
    # planted: the proxy sent the header on each request, over one connection
    assert len(service.hits) == 3 and len(set(service.ports)) == 1
    assert saw_route(service) == 0
