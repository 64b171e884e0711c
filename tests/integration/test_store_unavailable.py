"""PostgreSQL unreachable: the API answers 503 with ``Retry-After`` and a clear
message, never 500, and serves again once the server is back; the Python client
waits out a 503 for a bounded time, saying what it waits for.

The server is never stopped (other work shares it): the store reaches it through a
TCP forwarder the test cuts (``tests/pgproxy.py``), and each test first asserts
that the cut is felt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.client import Client, Unavailable
from gpuwarden.config import Config
from gpuwarden.core.model import Role
from gpuwarden.errors import StoreUnavailable
from gpuwarden.registry import Registry
from gpuwarden.store.postgres import PostgresStore
from tests.pgproxy import Proxy, proxy_to

REPO = Path(__file__).resolve().parents[2]
MODULES = [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
MESSAGE = "the store is unreachable (PostgreSQL): retry in 2 s"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def proxy(pg_url: str) -> Iterator[Proxy]:
    with proxy_to(pg_url) as p:
        yield p


@pytest.fixture
def store(pg_url: str, pg_schema: str, proxy: Proxy) -> Iterator[PostgresStore]:
    s = PostgresStore(proxy.url(pg_url), schema=pg_schema, max_size=4)
    try:
        yield s
    finally:
        proxy.restore()
        s.close()


def cut_felt(proxy: Proxy, pg_url: str) -> None:
    """The cut is real: a fresh connection through the proxy fails."""
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(proxy.url(pg_url), connect_timeout=5).close()
    assert proxy.refused >= 1


def test_the_store_raises_store_unavailable_and_recovers(
    store: PostgresStore, proxy: Proxy, pg_url: str
) -> None:
    assert store.list_jobs(limit=1) == []
    proxy.cut()
    cut_felt(proxy, pg_url)
    with pytest.raises(StoreUnavailable) as got:
        store.list_jobs(limit=1)
    assert got.value.message == MESSAGE and got.value.retry_after_s == 2.0
    assert store.unavailable(got.value)
    assert "127.0.0.1" in got.value.detail  # where, for the log only
    proxy.restore()
    deadline = time.monotonic() + 60
    while True:
        try:
            assert store.list_jobs(limit=1) == []
            break
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the store did not come back"
            time.sleep(0.2)


def test_the_api_answers_503_with_retry_after_then_serves_again(
    store: PostgresStore, proxy: Proxy, pg_url: str, tmp_path: Path
) -> None:
    config = Config.model_validate(
        {"state_dir": tmp_path / "state", "module_paths": MODULES, "api": {"rate_per_s": 1000}}
    )
    registry = Registry.load(MODULES, config.launch_rules)
    _, token = issue_token(store, name="t", role=Role.OWNER, by=ADMIN, now=time.time())
    h = {"Authorization": f"Bearer {token}"}
    job = {"type": "echo.echo", "params": {"text": "hi"}}
    with TestClient(create_app(store, registry, config)) as client:
        assert client.post("/v1/jobs", json=job, headers=h).status_code == 201
        proxy.cut()
        cut_felt(proxy, pg_url)
        answers: list[httpx.Response] = [
            client.get("/v1/jobs", headers=h),
            client.post("/v1/jobs", json=job, headers=h),
            client.get("/v1/status", headers=h),
        ]
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "2"
            assert r.json() == {"error": MESSAGE}
        proxy.restore()
        statuses: list[int] = []
        deadline = time.monotonic() + 60
        while not statuses or statuses[-1] != 200:
            assert time.monotonic() < deadline, f"the API did not come back: {statuses}"
            statuses.append(client.get("/v1/jobs", headers=h).status_code)
            time.sleep(0.1)
        assert set(statuses) <= {200, 503}, statuses  # never a 500
        jobs = client.get("/v1/jobs", headers=h).json()
        assert len(jobs) == 1  # the submit answered 503 did nothing


def _answers(*responses: httpx.Response) -> tuple[httpx.MockTransport, list[str]]:
    asked: list[str] = []
    queue = list(responses)

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return httpx.MockTransport(handle), asked


def _unavailable(retry_after: str = "1") -> httpx.Response:
    return httpx.Response(503, json={"error": MESSAGE}, headers={"Retry-After": retry_after})


def test_the_client_waits_out_a_503_as_retry_after_says() -> None:
    transport, asked = _answers(
        _unavailable("2"), _unavailable("1"), httpx.Response(200, json={"ok": True})
    )
    said: list[str] = []
    slept: list[float] = []
    with Client(
        "http://gw", "t", transport=transport, on_wait=said.append, sleep=slept.append
    ) as c:
        got: Any = c.request_json("GET", "/v1/health")
    assert got == {"ok": True}
    assert len(asked) == 3 and slept == [2.0, 1.0]
    assert len(said) == 2 and MESSAGE in said[0] and "trying again in 2 s" in said[0]


def test_the_client_gives_up_after_its_bound() -> None:
    transport, asked = _answers(_unavailable("1"))
    c = Client("http://gw", "t", transport=transport, retry_unavailable_s=0)
    with c, pytest.raises(Unavailable) as got:
        c.request_json("GET", "/v1/health")
    assert got.value.status == 503 and got.value.retry_after == 1.0 and len(asked) == 1
    transport, asked = _answers(_unavailable("1"))
    started = time.monotonic()
    c = Client("http://gw", "t", transport=transport, retry_unavailable_s=0.3)
    with c, pytest.raises(Unavailable):
        c.request_json("GET", "/v1/health")
    assert len(asked) >= 2 and time.monotonic() - started < 10
