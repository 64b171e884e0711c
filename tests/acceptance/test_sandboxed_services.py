"""Acceptance: a sandboxed service job (bubblewrap, podman) behind a real
`serve --api` (SPEC.md section 15, "Services at /run/", and section 19, "Service
jobs", "Adoption"): a stdlib HTTP + WebSocket app (``testmods.wsplain``) is
started in the sandbox, health-checked inside its network namespace, reached at
``/run/<name>/`` over HTTP and WebSocket (an echo both ways), refused (404) to a
token without access; then the broker is killed with SIGKILL (confirmed dead
first) and started again: it adopts the service, the same process (bubblewrap:
the same PIDs; podman: the same container) serves again through the new
broker's forwarder, the job keeps its one attempt, nothing runs twice; stopped,
it ends once and its processes (its container) are gone.

podman needs the test base image (``images/base-rootfs.sh``, see
``tests/conftest.py``); without podman or debootstrap the podman case is skipped
with the reason, unless GPUWARDEN_REQUIRE_CONTAINERS=1 (then it fails)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.core.model import Role
from gpuwarden.store.sqlite import SqliteStore
from tests.acceptance.test_cli import write_config
from tests.acceptance.test_cli_api import ApiBroker, run_env
from tests.conftest import need_tool

pytestmark = pytest.mark.timeout(240)

HOST = Principal(token_id="local", name="tester", role=Role.OWNER)
NAME = "boxed"


def poll(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return got


def token(state: Path, name: str) -> tuple[str, str]:
    store = SqliteStore(state / "gpuwarden.db")
    try:
        record, secret = issue_token(
            store, name=name, role=Role.SUBMITTER, by=HOST, now=time.time()
        )
    finally:
        store.close()
    return record.id, secret


def marked(job_id: str) -> list[psutil.Process]:
    """The live processes that carry an attempt marker of ``job_id``."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            mark = p.environ().get("GPUWARDEN_ATTEMPT", "")
            if f"/{job_id}/" in mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def alive(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    return False


def containers(job_id: str) -> list[str]:
    """The ids of the podman containers (any state) of ``job_id``."""
    done = subprocess.run(
        ["podman", "ps", "--all", "--no-trunc", "--filter", f"label=gpuwarden.job={job_id}",
         "--format", "{{.ID}}"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@dataclass
class Site:
    tmp: Path
    config: Path
    runtime: str
    broker: ApiBroker
    alice: tuple[str, str]
    eve: tuple[str, str]

    @property
    def job_id(self) -> str:
        return f"{self.alice[0]}-svc"

    @property
    def name(self) -> str:
        """The service's name in URLs: a submitter's service names are its own."""
        return f"{self.alice[0]}-{NAME}"

    def get(self, path: str, who: tuple[str, str]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {who[1]}", "Accept": "application/json"}
        return httpx.get(self.broker.url + path, headers=headers, timeout=10)

    def ws_url(self) -> str:
        return "ws" + self.broker.url.removeprefix("http") + f"/run/{self.name}/ws"

    def store(self) -> SqliteStore:
        return SqliteStore(self.tmp / "state" / "gpuwarden.db")

    def attempts(self) -> list[Any]:
        s = self.store()
        try:
            return s.attempts(self.job_id)
        finally:
            s.close()

    def identity(self) -> tuple[object, ...]:
        """What must not change across the restart: the service's processes
        (bubblewrap) or its container (podman), and the attempt's PID."""
        (attempt,) = self.attempts()
        pids = tuple(sorted((p.pid, p.create_time()) for p in marked(self.job_id)))
        if self.runtime == "podman":
            return attempt.pid, tuple(containers(self.job_id))
        return attempt.pid, pids


@pytest.fixture(params=["bubblewrap", "podman"])
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    runtime: str = request.param
    if runtime == "bubblewrap":
        need_tool("bwrap")
        extra = 'container_runtime = "bubblewrap"\n'
    else:
        base = request.getfixturevalue("podman_base_image")
        inspect = ["podman", "image", "inspect", "--format", "{{.Id}}", base]
        image = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.strip()
        extra = f'container_runtime = "podman"\nsandbox_image = "{image}"\n'  # pinned: its id
    config = write_config(tmp_path, grace=5, extra=extra)
    broker = ApiBroker(config)
    state = tmp_path / "state"
    s = Site(tmp_path, config, runtime, broker, token(state, "alice"), token(state, "eve"))
    yield s
    if s.broker.proc.poll() is None:
        s.broker.stop()
    for p in marked(s.job_id):  # never leave the service behind
        with contextlib.suppress(psutil.Error):
            p.kill()
    if runtime == "podman":
        for c in containers(s.job_id):
            subprocess.run(["podman", "rm", "--force", c], capture_output=True, check=False)


def served(site: Site) -> dict[str, Any] | None:
    """The service's answer at ``/run/<name>/echo`` once it is healthy."""
    r = site.get(f"/run/{site.name}/echo?x=1", site.alice)
    return r.json() if r.status_code == 200 else None


def ws_echo(site: Site) -> None:
    headers = {"Authorization": f"Bearer {site.alice[1]}"}
    with connect(site.ws_url(), additional_headers=headers, open_timeout=10) as ws:
        ws.send("hello")
        assert ws.recv(10) == "hello"
        ws.send(b"\x00\x01binary")
        assert ws.recv(10) == b"\x00\x01binary"


def outsider_gets_404(site: Site) -> None:
    assert site.get(f"/run/{site.name}/echo", site.eve).status_code == 404
    headers = {"Authorization": f"Bearer {site.eve[1]}"}
    with pytest.raises(InvalidStatus) as caught, connect(site.ws_url(), additional_headers=headers):
        pass
    assert caught.value.response.status_code == 404


def events(site: Site, kind: str) -> list[dict[str, Any]]:
    log = site.tmp / "events.jsonl"
    rows = []
    for line in log.read_text().splitlines() if log.exists() else []:
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return [r for r in rows if r.get("event") == kind]


def test_a_sandboxed_service_is_served_at_run_and_adopted_after_its_broker_is_killed(
    site: Site,
) -> None:
    made = run_env(
        "submit", "testmods.wsplain", "--id", "svc", "--service", NAME, "--url",
        site.broker.url, token=site.alice[1],
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    first = poll(lambda: served(site), "the service served at /run/", timeout=120)
    assert first["path"] == "/echo?x=1"
    ws_echo(site)
    outsider_gets_404(site)
    before = site.identity()
    assert before[1], "no process or container of the service"
    # the broker dies (SIGKILL, confirmed); its sandboxed service does not
    site.broker.proc.send_signal(signal.SIGKILL)
    assert site.broker.proc.wait(10) == -signal.SIGKILL
    assert site.identity() == before
    # a new broker adopts it: the same process or container serves again
    site.broker = ApiBroker(site.config)
    again = poll(lambda: served(site), "the adopted service served at /run/", timeout=60)
    assert again["pid"] == first["pid"]  # the same process (its PID inside the sandbox)
    assert site.identity() == before  # the same PIDs / container: nothing started twice
    assert len(site.attempts()) == 1
    assert [e["job"] for e in events(site, "service_adopted")] == [site.job_id]
    ws_echo(site)
    outsider_gets_404(site)
    # the new broker owns it: stopped, it ends once; its processes and container go
    stop = run_env("stop", site.job_id, "--url", site.broker.url, token=site.alice[1])
    assert stop.returncode == 0, stop.stdout + stop.stderr
    poll(lambda: site.attempts()[0].ended_at is not None, "the service's end", timeout=60)
    (attempt,) = site.attempts()
    assert attempt.outcome is not None
    poll(lambda: not marked(site.job_id), "its processes gone", timeout=30)
    if site.runtime == "podman":
        poll(lambda: not containers(site.job_id), "its container removed", timeout=30)
    r = site.get(f"/run/{site.name}/echo", site.alice)
    assert r.status_code == 503 and r.json()["state"] == "stopped", r.text


@pytest.fixture
def bwrap_site(tmp_path: Path) -> Iterator[Site]:
    need_tool("bwrap")
    config = write_config(tmp_path, grace=5, extra='container_runtime = "bubblewrap"\n')
    broker = ApiBroker(config)
    state = tmp_path / "state"
    s = Site(tmp_path, config, "bubblewrap", broker, token(state, "alice"), token(state, "eve"))
    yield s
    if s.broker.proc.poll() is None:
        s.broker.stop()
    for p in marked(s.job_id):
        with contextlib.suppress(psutil.Error):
            p.kill()


def test_a_sandboxed_service_that_does_not_answer_at_the_restart_is_stopped_not_adopted(
    bwrap_site: Site,
) -> None:
    site = bwrap_site
    made = run_env(
        "submit", "testmods.wsplain", "--id", "svc", "--service", NAME, "--url",
        site.broker.url, token=site.alice[1],
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    poll(lambda: served(site), "the service served at /run/", timeout=120)
    site.broker.proc.send_signal(signal.SIGKILL)
    assert site.broker.proc.wait(10) == -signal.SIGKILL
    # the service hangs (SIGSTOP): its port still takes a connection, nothing answers
    old = marked(site.job_id)
    app = [p for p in old if any("wsplain.py" in a for a in p.cmdline())]
    assert app
    for p in app:
        p.send_signal(signal.SIGSTOP)
    site.broker = ApiBroker(site.config)
    poll(lambda: events(site, "service_not_adopted"), "service_not_adopted", timeout=60)
    assert not events(site, "service_adopted")
    # stopped as before: every process of that attempt gone, the attempt interrupted
    poll(lambda: not any(alive(p) for p in old), "its processes gone", 30)
    first = site.attempts()[0]
    assert first.ended_at is not None and first.outcome == "interrupted", first
