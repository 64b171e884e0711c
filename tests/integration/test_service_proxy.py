"""The service proxy at ``/run/<name>/`` on real servers: the API served by uvicorn
(``cli/httpserver.py: ApiThread``) in front of a stand-in service
(``tests/standins/serviceapp.py``) in a process of its own; httpx for HTTP, the
``websockets`` client for WebSockets. No HTTP is mocked."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gpuwarden.api.auth import Principal, issue_token, parse_token
from gpuwarden.cli.httpserver import ApiThread
from gpuwarden.config import Config
from gpuwarden.core.model import Role
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
CREDENTIAL = "route-secret-0123456789"

pytestmark = pytest.mark.timeout(60)


class Service:
    """The stand-in service, a process of its own (so that it can be killed)."""

    def __init__(self, credential: str = CREDENTIAL) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.standins.serviceapp", credential],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while True:  # listening from the start; wait until uvicorn answers
            try:
                httpx.post(f"{self.url}/release-never", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the stand-in service never answered"
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@dataclass
class Env:
    api: ApiThread
    store: SqliteStore
    service: Service
    tokens: dict[str, str] = field(default_factory=dict)
    routes: dict[str, ServiceRoute] = field(default_factory=dict)

    def h(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def id_of(self, who: str) -> str:
        parts = parse_token(self.tokens[who])
        assert parts is not None
        return parts[0]

    def url(self, path: str) -> str:
        return self.api.url + path

    def ws_url(self, path: str) -> str:
        return "ws" + self.api.url.removeprefix("http") + path

    def serve(self, name: str, **kw: object) -> ServiceRoute:
        base = ServiceRoute(
            name=name,
            job_id=f"job-{name}",
            owner=self.id_of("alice"),
            share=(),
            state="healthy",
            upstream=self.service.url,
            credential=CREDENTIAL,
            since=time.time() - 60,
            last_ok=time.time(),
        )
        route = replace(base, **kw)  # type: ignore[arg-type]
        self.routes[name] = route
        return route


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    s = Service()
    yield s
    s.kill()


@pytest.fixture
def env(tmp_path: Path, service: Service) -> Iterator[Env]:
    config = Config.model_validate(
        {
            "state_dir": tmp_path,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )
    store = SqliteStore(tmp_path / "gpuwarden.db")
    registry = Registry.load(config.module_paths, config.launch_rules)
    routes: dict[str, ServiceRoute] = {}
    api = ApiThread(
        store, registry, config, "127.0.0.1", 0, name="api", service_routes=lambda: dict(routes)
    )
    assert api.start()
    e = Env(api=api, store=store, service=service, routes=routes)
    for who, role in [
        ("owner", Role.OWNER),
        ("operator", Role.OPERATOR),
        ("alice", Role.SUBMITTER),
        ("bob", Role.SUBMITTER),
        ("carol", Role.SUBMITTER),
        ("node", Role.NODE),
    ]:
        _, e.tokens[who] = issue_token(store, name=who, role=role, by=ADMIN, now=time.time())
    e.serve("svc")
    yield e
    api.stop()
    store.close()


def headers_of(answer: httpx.Response, name: str) -> list[str]:
    return [v for k, v in answer.json()["headers"] if k == name]


# -- HTTP -----------------------------------------------------------------------------


def test_the_owner_reaches_the_service_and_its_credential_arrives(env: Env) -> None:
    r = httpx.post(
        env.url("/run/svc/echo/a%2Fb/c?x=1&y=two"),
        content=b"the body",
        headers={**env.h("alice"), "Cookie": "gw_session=stolen; gw_csrf=c; theirs=1"},
    )
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["method"] == "POST"
    assert got["raw_path"] == "/echo/a%2Fb/c"  # the client's escapes kept
    assert got["query"] == "x=1&y=two"
    assert got["body"] == "the body"
    assert headers_of(r, "x-gpuwarden-route") == [CREDENTIAL]
    assert headers_of(r, "authorization") == []
    assert headers_of(r, "cookie") == ["theirs=1"]
    assert headers_of(r, "x-forwarded-prefix") == ["/run/svc"]
    assert headers_of(r, "x-forwarded-for") == ["127.0.0.1"]
    assert headers_of(r, "x-forwarded-proto") == ["http"]
    assert headers_of(r, "x-forwarded-host") == [f"127.0.0.1:{env.api.bound[1]}"]
    # every method goes through
    for method in ["GET", "PUT", "PATCH", "DELETE", "OPTIONS"]:
        r = httpx.request(method, env.url("/run/svc/echo/m"), headers=env.h("alice"))
        assert r.status_code == 200 and r.json()["method"] == method


def test_headers_a_client_smuggles_are_dropped(env: Env) -> None:
    r = httpx.get(
        env.url("/run/svc/echo/x"),
        headers={
            **env.h("alice"),
            "X-Gpuwarden-Route": "forged",
            "X-Gpuwarden-Anything": "forged",
            "X-Forwarded-For": "6.6.6.6",
            "X-Forwarded-Prefix": "/elsewhere",
            "Proxy-Authorization": "Basic Zm9v",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "only this connection",
        },
    )
    assert r.status_code == 200, r.text
    names = [k for k, _ in r.json()["headers"]]
    assert headers_of(r, "x-gpuwarden-route") == [CREDENTIAL]
    assert "x-gpuwarden-anything" not in names
    # one X-Forwarded-For, the proxy's: the client's address as uvicorn gave it (uvicorn
    # trusts X-Forwarded-For from a loopback peer, as this test client is, by default)
    assert len(headers_of(r, "x-forwarded-for")) == 1
    assert headers_of(r, "x-forwarded-prefix") == ["/run/svc"]
    assert "proxy-authorization" not in names and "x-hop" not in names


def test_a_streamed_answer_arrives_in_pieces(env: Env) -> None:
    with httpx.stream("GET", env.url("/run/svc/stream"), headers=env.h("alice")) as r:
        assert r.status_code == 200
        pieces = r.iter_raw()
        # the service sends part 2 only after it was released: part 1 came on its own
        assert next(pieces) == b"part-1;"
        assert httpx.post(f"{env.service.url}/release").status_code == 200
        assert b"".join(pieces) == b"part-2;"


def test_a_redirect_to_the_service_root_is_rewritten_under_the_prefix(env: Env) -> None:
    r = httpx.get(env.url("/run/svc/redirect"), headers=env.h("alice"))
    assert r.status_code == 302 and r.headers["location"] == "/run/svc/echo/here?x=1"
    r = httpx.get(env.url("/run/svc/redirect-abs"), headers=env.h("alice"))
    assert r.status_code == 302 and r.headers["location"] == "/run/svc/echo/abs"
    r = httpx.get(env.url("/run/svc?a=1"), headers=env.h("alice"))
    assert r.status_code == 308 and r.headers["location"] == "/run/svc/?a=1"


def test_no_access_is_the_same_404_as_an_unknown_name(env: Env) -> None:
    env.serve("other", owner=env.id_of("bob"))
    refused = httpx.get(env.url("/run/svc/echo/x"), headers=env.h("bob"))
    unknown = httpx.get(env.url("/run/nothing/echo/x"), headers=env.h("bob"))
    assert refused.status_code == unknown.status_code == 404
    assert refused.content == unknown.content
    drop = {"date"}
    assert {k: v for k, v in refused.headers.items() if k not in drop} == {
        k: v for k, v in unknown.headers.items() if k not in drop
    }
    # an operator is not let in by its role alone; without a token, 401 for every name
    assert httpx.get(env.url("/run/svc/echo/x"), headers=env.h("operator")).status_code == 404
    assert httpx.get(env.url("/run/svc/echo/x")).status_code == 401
    assert httpx.get(env.url("/run/nothing/echo/x")).status_code == 401
    # a node token passes no gate of a client's route
    assert httpx.get(env.url("/run/svc/echo/x"), headers=env.h("node")).status_code == 403


def test_the_share_list_and_the_owner_role_let_others_in(env: Env) -> None:
    env.serve("svc", share=(env.id_of("carol"), "operator"))
    for who in ["alice", "carol", "operator", "owner"]:
        r = httpx.get(env.url("/run/svc/echo/x"), headers=env.h(who))
        assert r.status_code == 200, (who, r.text)
    assert httpx.get(env.url("/run/svc/echo/x"), headers=env.h("bob")).status_code == 404
    # a job of the host's owner (no owning token): owners and operators
    env.serve("svc", owner=None, share=())
    assert httpx.get(env.url("/run/svc/echo/x"), headers=env.h("operator")).status_code == 200
    assert httpx.get(env.url("/run/svc/echo/x"), headers=env.h("alice")).status_code == 404


def _signed_in(env: Env, browser: httpx.Client, who: str = "alice") -> None:
    r = browser.post(
        env.url("/v1/session"), json={"token": env.tokens[who]}, headers={"Origin": env.api.url}
    )
    assert r.status_code == 200, r.text
    assert browser.cookies.get("gw_session")


def test_without_a_services_host_a_browser_session_is_not_served_a_service(env: Env) -> None:
    """A service's pages on the API's origin could act as the viewer: the
    dashboard's cookie never reaches a service there; a token still does."""
    with httpx.Client() as browser:
        _signed_in(env, browser)
        r = browser.get(env.url("/run/svc/echo/page"))
    assert r.status_code == 403 and "[api] services_host" in r.text, r.text
    assert "echo" not in r.text  # the service was not asked
    assert httpx.get(env.url("/run/svc/echo/page"), headers=env.h("alice")).status_code == 200


@pytest.fixture
def split_env(tmp_path: Path, service: Service) -> Iterator[Env]:
    """The API at 127.0.0.1, its services at ``localhost``: another origin and
    another cookie jar on the same server."""
    config = Config.model_validate(
        {
            "state_dir": tmp_path,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "api": {"rate_per_s": 10_000, "burst": 10_000, "services_host": "localhost"},
        }
    )
    store = SqliteStore(tmp_path / "gpuwarden.db")
    registry = Registry.load(config.module_paths, config.launch_rules)
    routes: dict[str, ServiceRoute] = {}
    api = ApiThread(
        store, registry, config, "127.0.0.1", 0, name="api", service_routes=lambda: dict(routes)
    )
    assert api.start()
    e = Env(api=api, store=store, service=service, routes=routes)
    for who, role in [("alice", Role.SUBMITTER), ("bob", Role.SUBMITTER)]:
        _, e.tokens[who] = issue_token(store, name=who, role=role, by=ADMIN, now=time.time())
    e.serve("svc")
    e.serve("other")
    yield e
    api.stop()


def test_a_browser_is_handed_to_the_services_host_with_a_pass(split_env: Env) -> None:
    env = split_env
    port = env.api.url.rsplit(":", 1)[1]
    with httpx.Client() as browser:
        _signed_in(env, browser)
        r = browser.get(env.url("/run/svc/echo/page?x=1"))
        assert r.status_code == 303, r.text
        handoff = r.headers["location"]
        assert handoff.startswith(f"http://localhost:{port}/run/svc/echo/page?x=1&gw_handoff=")
        r = browser.get(handoff)
        assert r.status_code == 303 and r.headers["location"] == "/run/svc/echo/page?x=1"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("gw_run=") and "HttpOnly" in cookie and "Path=/run/svc/" in cookie
        r = browser.get(f"http://localhost:{port}/run/svc/echo/page?x=1")
        assert r.status_code == 200, r.text
        assert headers_of(r, "cookie") == []  # neither gw_session nor gw_run reach it
        assert headers_of(r, "x-gpuwarden-route") == [CREDENTIAL]
        # the handoff was used up
        assert browser.get(handoff).status_code == 401
        # the services host serves nothing else: the API and the dashboard are not there
        for path in ("/v1/jobs", "/", "/v1/status"):
            r = browser.get(f"http://localhost:{port}{path}")
            assert r.status_code == 404 and "only the services" in r.text, (path, r.text)
        # the pass is for that service alone (its cookie is not even sent elsewhere)
        r = browser.get(f"http://localhost:{port}/run/other/echo/x")
        assert r.status_code == 401 and "no pass for this service" in r.text


def test_a_handoff_is_for_one_client_and_one_service(split_env: Env) -> None:
    env = split_env
    with httpx.Client() as browser:
        _signed_in(env, browser)
        handoff = browser.get(env.url("/run/svc/x")).headers["location"]
    # the same code for another service's path is refused, and that try uses it up:
    # a handoff seen by someone else is spent, not kept for a second guess
    stolen = handoff.replace("/run/svc/", "/run/other/")
    r = httpx.get(stolen)
    assert r.status_code == 401 and "used up or expired" in r.text
    assert httpx.get(handoff).status_code == 401


# -- unavailable ----------------------------------------------------------------------


def seen_ago(text: str) -> int:
    m = re.search(r"svc is unavailable, last seen (\d+) s ago", text)
    assert m, text
    return int(m.group(1))


def test_a_stopped_service_answers_the_unavailable_page(env: Env) -> None:
    env.serve("svc", state="stopped", last_ok=time.time() - 42)
    r = httpx.get(env.url("/run/svc/echo/x"), headers=env.h("alice"))
    assert r.status_code == 503 and r.headers["content-type"].startswith("text/html")
    assert 42 <= seen_ago(r.text) <= 45
    assert "echo" not in r.text  # nothing of the service's
    r = httpx.get(
        env.url("/run/svc/echo/x"), headers={**env.h("alice"), "Accept": "application/json"}
    )
    assert r.status_code == 503
    body = r.json()
    assert 42 <= seen_ago(body["error"]) <= 45
    assert body["state"] == "stopped" and 42 <= body["last_seen_s"] <= 45
    env.serve("svc", state="unhealthy", last_ok=None)
    r = httpx.get(env.url("/run/svc/echo/x"), headers=env.h("alice"))
    assert r.status_code == 503 and "svc is unavailable, never seen healthy" in r.text


def test_a_starting_service_says_so_with_retry_after(env: Env) -> None:
    env.serve("svc", state="starting", last_ok=None)
    r = httpx.get(env.url("/run/svc/echo/x"), headers=env.h("alice"))
    assert r.status_code == 503 and "svc is starting" in r.text
    assert r.headers["retry-after"] == "2"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_an_unreachable_forwarder_answers_the_unavailable_page(env: Env) -> None:
    port = closed_port()
    with pytest.raises(ConnectionRefusedError):  # the fault is real: nothing listens there
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    env.serve("svc", upstream=f"http://127.0.0.1:{port}", last_ok=time.time() - 7)
    r = httpx.get(env.url("/run/svc/echo/x"), headers=env.h("alice"))
    assert r.status_code == 503, r.text
    assert 7 <= seen_ago(r.text) <= 10


# -- WebSocket ------------------------------------------------------------------------


def test_websocket_frames_pass_both_ways(env: Env) -> None:
    async def go() -> None:
        async with connect(env.ws_url("/run/svc/ws"), additional_headers=env.h("alice")) as ws:
            assert await ws.recv() == f"route:{CREDENTIAL}"
            await ws.send("hello")
            assert await ws.recv() == "hello"
            await ws.send(b"\x00\x01binary")
            assert await ws.recv() == b"\x00\x01binary"

    asyncio.run(asyncio.wait_for(go(), 20))


def test_a_websocket_without_access_gets_the_same_404(env: Env) -> None:
    async def status(path: str, who: str | None) -> int:
        headers = env.h(who) if who else {}
        with pytest.raises(InvalidStatus) as caught:
            async with connect(env.ws_url(path), additional_headers=headers):
                pass
        return caught.value.response.status_code

    async def go() -> None:
        assert await status("/run/svc/ws", "bob") == 404
        assert await status("/run/nothing/ws", "bob") == 404
        assert await status("/run/svc/ws", None) == 401

    asyncio.run(asyncio.wait_for(go(), 20))


def test_a_killed_service_closes_the_clients_websocket_with_a_reason(env: Env) -> None:
    doomed = Service()
    try:
        env.serve("svc", upstream=doomed.url)

        async def go() -> None:
            async with connect(env.ws_url("/run/svc/ws"), additional_headers=env.h("alice")) as ws:
                assert await ws.recv() == f"route:{CREDENTIAL}"
                await ws.send("before")
                assert await ws.recv() == "before"
                doomed.kill()
                assert doomed.proc.returncode is not None  # the fault is real
                with pytest.raises(ConnectionClosed) as caught:
                    await ws.recv()
                assert caught.value.rcvd is not None
                assert caught.value.rcvd.code == 1011
                assert caught.value.rcvd.reason == "the service went away"

        asyncio.run(asyncio.wait_for(go(), 20))
    finally:
        doomed.kill()


def test_the_unavailable_page_in_json_for_a_stopped_websocket_service(env: Env) -> None:
    env.serve("svc", state="stopped", last_ok=time.time() - 5)

    async def go() -> None:
        with pytest.raises(InvalidStatus) as caught:
            async with connect(env.ws_url("/run/svc/ws"), additional_headers=env.h("alice")):
                pass
        answer = caught.value.response
        assert answer.status_code == 503
        assert "svc is unavailable, last seen" in json.loads(answer.body or b"{}")["error"]

    asyncio.run(asyncio.wait_for(go(), 20))


def test_the_client_going_closes_the_services_websocket(env: Env) -> None:
    def open_at_service() -> int:
        return int(httpx.get(f"{env.service.url}/ws-open").text)

    async def none_open() -> None:
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(open_at_service) != 0:
            assert time.monotonic() < deadline, "the service's WebSocket stayed open"
            await asyncio.sleep(0.05)

    async def go() -> None:
        await none_open()  # an earlier test's sockets are gone
        async with connect(env.ws_url("/run/svc/ws"), additional_headers=env.h("alice")) as ws:
            assert await ws.recv() == f"route:{CREDENTIAL}"
            assert await asyncio.to_thread(open_at_service) == 1
        await none_open()

    asyncio.run(asyncio.wait_for(go(), 20))
