"""Adoption, for real (SPEC.md, "Service jobs", "Adoption"): a ``gpuwarden serve``
with a running service is killed with SIGKILL and started again; the new broker
takes the service back: the same process (same PID) keeps serving, the job keeps
its one attempt, no second process of it runs, and its route is back (healthy,
with a forwarder of the new broker). Stopped afterwards, it ends once."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.app import open_store
from gpuwarden.config import load_config
from tests.acceptance.test_chaos import Rig
from tests.acceptance.test_cli import GW, env, wait_for

pytestmark = pytest.mark.timeout(60)

PORT = 18431  # testmods.web's port (unsandboxed: on the host)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.cleanup()
    for p in marked("/w1/"):  # never leave the service behind
        with contextlib.suppress(psutil.Error):
            p.kill()


def marked(part: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if part in p.environ().get("GPUWARDEN_ATTEMPT", "") and p.status() != "zombie":
                out.append(p)
    return out


def echo_pid() -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=2)
    try:
        conn.request("GET", "/echo")
        resp = conn.getresponse()
        return int(json.loads(resp.read())["pid"]) if resp.status == 200 else None
    except OSError:
        return None
    finally:
        conn.close()


def published(rig: Rig) -> dict[str, Any]:
    store = open_store(load_config(rig.config))
    try:
        statuses = store.node_statuses()
        services = statuses[0].payload.get("services", []) if statuses else []
        job = store.get_job("w1")
        attempts = store.attempts("w1")
        return {
            "service": next((s for s in services if s["name"] == "hello"), None),
            "state": job.state.value if job else None,
            "attempts": len(attempts),
        }
    finally:
        store.close()


def test_a_restarted_broker_adopts_its_running_service(rig: Rig) -> None:
    first = rig.serve()
    first.wait_started()
    made = subprocess.run(
        [*GW, "--config", str(rig.config), "submit", "testmods.web", "--service=hello", "--id=w1"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert made.returncode == 0, made.stderr

    def healthy(upstream_not: str = "") -> dict[str, Any] | None:
        got = published(rig)
        s = got["service"]
        ok = s and s["state"] == "healthy" and s["upstream"] and s["upstream"] != upstream_not
        return got if ok else None

    wait_for(lambda: healthy() is not None, "the service healthy")
    before = healthy()
    assert before is not None
    pid = echo_pid()
    assert pid is not None and [p.pid for p in marked("/w1/")] == [pid]
    assert first.kill() == -9  # the broker is dead; its service is not
    assert echo_pid() == pid
    second = rig.serve()
    second.wait_started()
    old = before["service"]["upstream"]
    wait_for(lambda: healthy(old) is not None, "the service adopted")
    after = healthy(old)
    assert after is not None
    assert after["state"] == "running" and after["attempts"] == 1
    assert echo_pid() == pid and [p.pid for p in marked("/w1/")] == [pid]  # the same, alone
    assert second.events("service_adopted")
    # the new broker owns it: stopped, it ends, once
    stop = subprocess.run(
        [*GW, "--config", str(rig.config), "stop", "w1"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert stop.returncode == 0, stop.stderr
    wait_for(lambda: published(rig)["state"] not in ("running", None), "the service stopped")
    wait_for(lambda: not marked("/w1/"), "its process gone")
    assert published(rig)["attempts"] == 1
