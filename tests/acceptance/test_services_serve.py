"""Acceptance: a service job on one host behind a real `serve --api` (SPEC.md,
"Service jobs" and section 15, "Services at /run/"): submitted with a token and
a share, shown starting then healthy by `jobs`, `show` and `status`, reached
over HTTP and WebSocket at `/run/<name>/`, by a browser on the services host
with its pass, refused (404) to a token without access, and stopped with
`gpuwarden stop`: it ends done and its URL says when it was last seen."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.core.model import Role
from gpuwarden.store.sqlite import SqliteStore
from tests.acceptance.test_cli import run, write_config
from tests.acceptance.test_cli_api import ApiBroker, run_env

# a service that listens after 20 s, then HTTP, WebSocket and stop, beside other xdist workers
pytestmark = pytest.mark.timeout(150)

HOST = Principal(token_id="local", name="tester", role=Role.OWNER)

NAME = "echo1"


def poll(check: Callable[[], Any], what: str, timeout: float = 15) -> Any:
    """``check()`` once it is truthy (polled until ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return got


def token(state: Path, name: str) -> tuple[str, str]:
    """A submitter's token made in the host's store (as `token create` makes it,
    without a command's start for each): its id and its secret."""
    store = SqliteStore(state / "gpuwarden.db")
    try:
        record, secret = issue_token(
            store, name=name, role=Role.SUBMITTER, by=HOST, now=time.time()
        )
    finally:
        store.close()
    return record.id, secret


class Site:
    """A `serve --api` at 127.0.0.1 whose services host is ``localhost``."""

    def __init__(self, tmp_path: Path) -> None:
        # a short grace: the broker stops its service (which never ends by itself) at once
        self.config = write_config(tmp_path, grace=2, extra='[api]\nservices_host = "localhost"\n')
        self.broker = ApiBroker(self.config)
        self.url = self.broker.url
        self.port = self.url.rsplit(":", 1)[1]
        state = tmp_path / "state"
        self.alice = token(state, "alice")
        self.bob = token(state, "bob")  # shared with
        self.eve = token(state, "eve")  # not shared with

    @property
    def name(self) -> str:
        """The service's name in URLs: a submitter's service names are its own
        (``<token id>-NAME``), as its job ids are."""
        return f"{self.alice[0]}-{NAME}"

    def gw(self, *args: str, who: tuple[str, str]) -> str:
        r = run_env(*args, "--url", self.url, token=who[1])
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def job(self, job_id: str) -> dict[str, Any]:
        """The job as the API's JSON has it (``GET /v1/jobs/{id}``)."""
        r = self.get(f"/v1/jobs/{job_id}", self.alice)
        assert r.status_code == 200, r.text
        got: dict[str, Any] = r.json()
        return got

    def get(self, path: str, who: tuple[str, str] | None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {who[1]}"} if who else {}
        return httpx.get(self.url + path, headers=headers | kw.pop("headers", {}), **kw)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    yield s
    if s.broker.proc.poll() is None:  # a failed test: stop it (and its service) in order
        s.broker.stop()


def submit(site: Site, delay_s: float) -> str:
    out = site.gw(
        "submit", "testmods.wsweb", "--id", "svc", "--service", NAME,
        "--share", site.bob[0], "--param", f"start_delay_s={delay_s}", who=site.alice,
    )  # fmt: skip
    job_id = f"{site.alice[0]}-svc"
    assert f"submitted {job_id}" in out, out
    return job_id


def test_a_service_is_shown_starting_then_healthy_reached_over_http_and_websocket_and_stopped(
    site: Site,
) -> None:
    # it listens after 20 s: time for three CLI calls and a request on a loaded machine
    job_id = submit(site, delay_s=20)
    # starting: `show`, `jobs`, the API's JSON say so, with its URL path
    doc = poll(lambda: (d := site.job(job_id))["service_state"] == "starting" and d, "starting")
    assert doc["state"] == "running" and doc["service_url_path"] == f"/run/{site.name}/"
    shown = site.gw("show", job_id, who=site.alice)
    assert "service: starting since" in shown and f"URL path /run/{site.name}/" in shown, shown
    assert "last passed its health check never" in shown
    listed = site.gw("jobs", who=site.alice)
    assert "running (starting)" in listed, listed
    r = site.get(f"/run/{site.name}/echo", site.alice, headers={"Accept": "application/json"})
    assert r.status_code == 503 and r.json()["state"] == "starting", r.text
    # healthy
    poll(lambda: site.job(job_id)["service_state"] == "healthy", "healthy", timeout=60)
    shown = site.gw("show", job_id, who=site.alice)
    assert re.search(r"service: healthy since .*; last passed its health check \d+s ago", shown)
    [row] = site.get("/v1/jobs", site.alice).json()
    assert row["service_state"] == "healthy" and row["service_last_ok"] is not None
    status = run("--config", site.config, "status")
    assert re.search(rf"{site.name}\s.*healthy.*/run/{site.name}/", status.stdout), status.stdout
    [node] = site.get("/v1/status", site.alice).json()["nodes"]
    assert [s["state"] for s in node["services"]] == ["healthy"]
    # alice (its owner) and bob (shared with) reach it with their bearer tokens
    for who in (site.alice, site.bob):
        r = site.get(f"/run/{site.name}/echo?x=1", who)
        assert r.status_code == 200, r.text
        assert r.json()["path"] == "/echo?x=1"
        assert "Authorization" not in r.json()["headers"]
    # a WebSocket echo both ways, text and bytes
    ws_url = site.url.replace("http://", "ws://") + f"/run/{site.name}/ws"
    auth = {"Authorization": f"Bearer {site.alice[1]}"}
    with connect(ws_url, additional_headers=auth, proxy=None) as ws:
        ws.send("hello")
        assert ws.recv(timeout=5) == "hello"
        ws.send(b"\x00\xffbytes")
        assert ws.recv(timeout=5) == b"\x00\xffbytes"
    # stop: it ends done, stopped by alice
    out = site.gw("stop", "svc", who=site.alice)
    assert "the broker will stop it" in out
    done = poll(lambda: (d := site.job(job_id))["state"] == "done" and d, "done")
    assert done["reason"] == "stopped by alice" and done["service_state"] == "stopped"
    assert "done (stopped)" in site.gw("jobs", who=site.alice)
    # the URL answers the unavailable page, never a stale app, and says when it was seen
    r = site.get(f"/run/{site.name}/echo", site.alice)
    assert r.status_code == 503, r.text
    assert re.search(rf"{site.name} is unavailable, last seen \d+ s ago \(it is stopped\)", r.text)
    assert "echo" not in r.text.replace(f"{site.name} is", "")
    assert r.headers["cache-control"] == "no-store"
    [node] = site.get("/v1/status", site.alice).json()["nodes"]
    assert [s["state"] for s in node["services"]] == ["stopped"]
    assert site.broker.stop() == 0


def test_a_token_without_access_gets_the_unknown_names_404_and_a_browser_is_handed_over(
    site: Site,
) -> None:
    body = {"type": "testmods.wsweb", "id": "svc", "service": NAME, "share": [site.bob[0]]}
    r = httpx.post(
        site.url + "/v1/jobs", json=body, headers={"Authorization": f"Bearer {site.alice[1]}"}
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    poll(lambda: site.job(job_id)["service_state"] == "healthy", "healthy")
    assert site.get(f"/run/{site.name}/echo", site.alice).status_code == 200
    # eve: not the owner, not shared with; the same 404 as a name nobody has
    theirs = site.get(f"/run/{site.name}/echo", site.eve)
    unknown = site.get("/run/nothing-here/echo", site.eve)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.content == unknown.content and "no such service here" in theirs.text
    with pytest.raises(Exception, match="404"):
        ws_url = site.url.replace("http://", "ws://") + f"/run/{site.name}/ws"
        connect(ws_url, additional_headers={"Authorization": f"Bearer {site.eve[1]}"}, proxy=None)
    # eve's view of the status lists no service of alice's
    status = site.get("/v1/status", site.eve).json()
    assert [n["services"] for n in status["nodes"]] == [[]]
    # a browser signed in at 127.0.0.1 is handed to localhost and served there
    with httpx.Client() as browser:
        r = browser.post(
            site.url + "/v1/session", json={"token": site.alice[1]}, headers={"Origin": site.url}
        )
        assert r.status_code == 200, r.text
        r = browser.get(site.url + f"/run/{site.name}/echo?b=1")
        assert r.status_code == 303, r.text
        handoff = r.headers["location"]
        assert handoff.startswith(
            f"http://localhost:{site.port}/run/{site.name}/echo?b=1&gw_handoff="
        )
        r = browser.get(handoff)
        assert r.status_code == 303 and r.headers["set-cookie"].startswith("gw_run=")
        r = browser.get(f"http://localhost:{site.port}/run/{site.name}/echo?b=1")
        assert r.status_code == 200, r.text
        assert r.json()["path"] == "/echo?b=1"
        assert "Cookie" not in r.json()["headers"]  # neither gw_session nor gw_run reach it
    r = httpx.post(
        site.url + "/v1/jobs/svc/stop", headers={"Authorization": f"Bearer {site.alice[1]}"}
    )
    assert r.status_code == 200, r.text
    poll(lambda: site.job(job_id)["state"] == "done", "done")
    assert site.broker.stop() == 0
