"""A service across hosts, for real (SPEC.md section 16, "Services across hosts"):
a coordinator on a fresh PostgreSQL database and one agent, each a process of its
own. The coordinator serves the agent's running service at ``/run/<name>/`` with
the route credential the agent's heartbeat reported; a token that may not use it
gets the same 404 as an unknown name; the agent killed with SIGKILL turns the URL
into the unavailable page within the heartbeat window, never a stale answer, and
closes a client's WebSocket with a reason; once its lease expired the route is
kept as stopped: still the unavailable page (not a 404) to those who may reach
it, the same 404 to everyone else."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.acceptance.test_cluster import Cluster, wait_for
from tests.acceptance.test_cluster_preemption import running_cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(pg_url, tmp_path_factory.mktemp("xsvc"), {"s1": {"vram_gib": 24}}) as c:
        yield c


def _token(c: Cluster, name: str, role: str) -> str:
    made = c.gw(
        "token", "create", name, "--role", role, "--json", config=c.tmp / "coordinator.toml"
    )
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["token"])


def _get(c: Cluster, token: str, path: str) -> httpx.Response:
    return httpx.get(
        c.urls[0] + path,
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
        timeout=10,
    )


def _service_processes(job_id: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            marker = p.environ().get("GPUWARDEN_ATTEMPT", "")
        except (psutil.Error, OSError):
            continue
        if f"/{job_id}/" in marker:
            out.append(p)
    return out


def test_the_coordinator_serves_an_agents_service_until_the_agent_dies(cluster: Cluster) -> None:
    c = cluster
    bob = _token(c, "bob", "submitter")
    with c.client() as client:
        client.submit("testmods.web", {}, id="svc1", service="hello")
        client.submit("testmods.wsweb", {}, id="svc2", service="wsecho")
    loop = asyncio.new_event_loop()
    try:
        seen: list[httpx.Response] = []

        def served() -> httpx.Response | None:
            got = _get(c, c.owner, "/run/hello/echo?x=1")
            seen.append(got)
            return got if got.status_code == 200 else None

        try:
            answer = wait_for("the service at /run/hello/", served, timeout=40)
        except AssertionError:
            raise AssertionError(
                (seen[-1].status_code, seen[-1].text, c.gw("status").stdout)
            ) from None
        assert answer.json()["path"] == "/echo?x=1", answer.text  # the service itself
        # another token that may not use it: the same 404 as a name no service has
        assert _get(c, bob, "/run/hello/echo").status_code == 404
        assert _get(c, c.owner, "/run/nosuch/").status_code == 404
        # a WebSocket through the coordinator, open when the agent dies
        wait_for("the WebSocket service", lambda: _get(c, c.owner, "/run/wsecho/echo").is_success)
        ws = loop.run_until_complete(_ws_open(c, c.owner, "/run/wsecho/ws"))
        # the agent dies (SIGKILL): confirmed dead first
        agent = c.agents["s1"].proc
        assert agent is not None
        agent.send_signal(signal.SIGKILL)
        assert agent.wait(10) == -signal.SIGKILL
        killed_at = time.monotonic()

        def unavailable() -> httpx.Response | None:
            # at once: its forwarder does not answer (never a stale answer); within
            # the heartbeat window: the coordinator says its node stopped reporting it
            got = _get(c, c.owner, "/run/hello/echo")
            assert got.status_code == 503, (got.status_code, got.text)
            return got if got.json()["state"] == "unavailable" else None

        page = wait_for("the unavailable page", unavailable, timeout=20)
        took = time.monotonic() - killed_at
        body = page.json()
        assert body["state"] == "unavailable" and "hello is unavailable, last seen" in body["error"]
        # within the heartbeat window (10 s leases: a beat each 1.7 s; two beats and
        # a second), the cache's second and this poll's
        assert took < 8, took
        # the client's WebSocket was closed, with a reason (its agent's connection broke)
        code, reason = loop.run_until_complete(_ws_closed(ws))
        assert (code, reason) == (1011, "the service went away")

        # the lease expires (10 s): the sweep ends the attempt and keeps the route as
        # stopped: still the unavailable page, never a 404 or a stale answer
        def stopped() -> httpx.Response | None:
            got = _get(c, c.owner, "/run/hello/echo")
            assert got.status_code == 503, (got.status_code, got.text)
            return got if got.json()["state"] == "stopped" else None

        page = wait_for("the stopped page", stopped, timeout=40)
        assert page.json()["error"].startswith("hello is unavailable, last seen ")
        assert page.json()["error"].endswith("(it is stopped)")
        assert page.headers["cache-control"] == "no-store"
        # an outsider: the same 404 as a name no service has
        assert _get(c, bob, "/run/hello/echo").status_code == 404
        assert _get(c, bob, "/run/hello/echo").json() == _get(c, bob, "/run/nosuch/").json()
    finally:
        loop.close()
        for job_id in ("svc1", "svc2"):
            for p in _service_processes(job_id):  # the orphans the killed agent left
                if p.pid != os.getpid():
                    p.kill()


async def _ws_open(c: Cluster, token: str, path: str) -> ClientConnection:
    ws = await connect(
        "ws" + c.urls[0].removeprefix("http") + path,
        additional_headers={"Authorization": f"Bearer {token}"},
    )
    await ws.send("before")
    assert await ws.recv() == "before"
    return ws


async def _ws_closed(ws: ClientConnection) -> tuple[int | None, str | None]:
    with pytest.raises(ConnectionClosed) as caught:
        await asyncio.wait_for(ws.recv(), 20)
    got = caught.value.rcvd
    return (got.code, got.reason) if got is not None else (None, None)


@pytest.fixture(scope="module")
def podman_cluster(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, podman_base_image: str
) -> Iterator[Cluster]:
    inspect = ["podman", "image", "inspect", "--format", "{{.Id}}", podman_base_image]
    image = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.strip()
    sandboxed = {"container_runtime": "podman", "sandbox_image": image}
    tmp = tmp_path_factory.mktemp("xsvcpod")
    with running_cluster(pg_url, tmp, {"p1": {"vram_gib": 24}}, agent_config=sandboxed) as c:
        yield c


def test_the_coordinator_serves_an_agents_podman_service_over_http_and_websocket(
    podman_cluster: Cluster,
) -> None:
    c = podman_cluster
    eve = _token(c, "eve", "submitter")
    with c.client() as client:
        client.submit("testmods.wsplain", {}, id="pod1", service="podweb")
    try:
        seen: list[httpx.Response] = []

        def served() -> httpx.Response | None:
            got = _get(c, c.owner, "/run/podweb/echo?x=1")
            seen.append(got)
            return got if got.status_code == 200 else None

        try:
            answer = wait_for("the podman service at /run/podweb/", served, timeout=120)
        except AssertionError:
            raise AssertionError((seen[-1].status_code, seen[-1].text)) from None
        assert answer.json()["path"] == "/echo?x=1"
        assert _get(c, eve, "/run/podweb/echo").status_code == 404

        async def echo() -> None:
            ws = await _ws_open(c, c.owner, "/run/podweb/ws")
            try:
                await ws.send(b"\x00\x01binary")
                assert await ws.recv() == b"\x00\x01binary"
            finally:
                await ws.close()

        asyncio.run(asyncio.wait_for(echo(), 30))
        # it runs in a container of the agent's podman, labelled with its attempt
        ids = subprocess.run(
            ["podman", "ps", "--filter", "label=gpuwarden.job=pod1", "--format", "{{.ID}}"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert len(ids) == 1, ids
    finally:
        with c.client() as client:
            client.stop("pod1")
