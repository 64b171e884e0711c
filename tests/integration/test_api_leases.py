"""VRAM leases over HTTP (SPEC.md section 11, "VRAM leases"): against a broker
running in this process on two simulated 24 GiB GPUs. A grant with ``wait``,
renewal, an unrenewed lease's expiry, ``DELETE``, registered PIDs, who may touch
whose lease, and ``gpu`` pinning (placed only there, a wait that says so, an
unknown UUID refused with the node's GPUs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fastapi.testclient import TestClient

from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token, parse_token
from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, Role
from gpuwarden.store.sqlite import SqliteStore
from tests.acceptance.test_cli import GW, env

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
T = TypeVar("T")


def until(fn: Callable[[], T], what: str, timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Served:
    node: Node
    config: Config
    api: SqliteStore
    http: TestClient
    tokens: dict[str, str]

    def h(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def ask(self, who: str, wait: str | None = "20", **body: Any) -> Any:
        params = {"wait": wait} if wait is not None else {}
        return self.http.post("/v1/leases", json=body, params=params, headers=self.h(who))

    def get(self, who: str, lease_id: str) -> Any:
        return self.http.get(f"/v1/leases/{lease_id}", headers=self.h(who))

    def gpus(self) -> list[str]:
        def look() -> list[str]:
            st = self.http.get("/v1/status", headers=self.h("op")).json()
            return sorted(g["uuid"] for n in st["nodes"] for g in n.get("gpus", []))

        return until(look, "the broker's GPUs in its status")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    config = Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "leasenode",
            "gpu": "sim",
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "sim_gpu": {"count": 2, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.05, "kill_grace_s": 0.3},
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )
    with open_node(config, mock_gpu=True) as node:
        broker = node.broker
        broker.recover()
        stop = threading.Event()
        loop = threading.Thread(target=broker.run, args=(stop,), daemon=True)
        loop.start()
        api = SqliteStore(config.state_dir / "gpuwarden.db")
        tokens = {
            name: issue_token(api, name=name, role=role, by=ADMIN, now=time.time())[1]
            for name, role in (
                ("alice", Role.SUBMITTER),
                ("bob", Role.SUBMITTER),
                ("op", Role.OPERATOR),
            )
        }
        app = create_app(api, broker.registry, config, wake=broker.wake, ends=broker.ends)
        try:
            yield Served(node, config, api, TestClient(app), tokens)
        finally:
            stop.set()
            broker.wake()
            loop.join(60)
            api.close()


def test_a_lease_is_granted_within_the_wait_renewed_and_ended(served: Served) -> None:
    s = served
    before = time.time()
    r = s.ask("alice", vram_bytes=2 * GIB, ttl_s=30)
    assert r.status_code == 201, r.text
    lease = r.json()
    assert lease["granted"] is True and lease["state"] == "running", lease
    assert lease["gpu"] in s.gpus()
    token_id = (parse_token(s.tokens["alice"]) or ("?",))[0]
    assert lease["id"].startswith(f"{token_id}-lease-"), lease
    assert before + 25 < lease["until"] <= time.time() + 30
    time.sleep(1.1)
    r = s.http.post(f"/v1/leases/{lease['id']}/renew", headers=s.h("alice"))
    assert r.status_code == 200, r.text
    assert r.json()["until"] > lease["until"] + 1
    # its own process is named as the lease's (a process of this host)
    r = s.http.post(
        f"/v1/leases/{lease['id']}/pids", json={"pids": [os.getpid()]}, headers=s.h("alice")
    )
    assert r.status_code == 200, r.text
    assert r.json()["pids"] == [os.getpid()]
    r = s.http.post(
        f"/v1/leases/{lease['id']}/pids", json={"pids": [4_000_000]}, headers=s.h("alice")
    )
    assert r.status_code == 422 and "no such process" in r.json()["error"], r.text
    r = s.http.delete(f"/v1/leases/{lease['id']}", headers=s.h("alice"))
    assert r.status_code == 200, r.text
    ended = until(lambda: (j := s.get("alice", lease["id"]).json())["state"] == "done" and j, "end")
    assert ended["reason"].startswith("ended by its holder"), ended
    # an ended lease: nothing to renew or end
    r = s.http.post(f"/v1/leases/{lease['id']}/renew", headers=s.h("alice"))
    assert r.status_code == 409 and "has ended" in r.json()["error"], r.text
    assert s.http.delete(f"/v1/leases/{lease['id']}", headers=s.h("alice")).status_code == 409
    rows = s.http.get("/v1/audit", params={"limit": 500}, headers=s.h("op")).json()
    audited = [a["action"] for a in rows if a["target"] == lease["id"]]
    assert "lease.create" in audited and "lease.end" in audited and "lease.pids" in audited
    assert "lease.renew" not in audited


def test_a_lease_not_renewed_within_its_ttl_ends_expired(served: Served) -> None:
    s = served
    lease = s.ask("alice", vram_bytes=GIB, ttl_s=5).json()
    assert lease["granted"], lease
    time.sleep(2)
    assert s.get("alice", lease["id"]).json()["state"] == "running"
    job = until(
        lambda: (j := s.get("alice", lease["id"]).json())["state"] != "running" and j, "expiry"
    )
    assert job["state"] == "failed", job
    assert job["reason"] == "lease expired: not renewed within its ttl of 5 s", job


def test_only_its_owner_or_an_operator_may_touch_a_lease(served: Served) -> None:
    s = served
    lease = s.ask("alice", vram_bytes=GIB, ttl_s=30).json()
    lid = lease["id"]
    for method, path in (
        ("GET", f"/v1/leases/{lid}"),
        ("POST", f"/v1/leases/{lid}/renew"),
        ("DELETE", f"/v1/leases/{lid}"),
    ):
        r = s.http.request(method, path, headers=s.h("bob"))
        assert r.status_code == 404, (method, r.text)
    assert s.http.get("/v1/leases", headers=s.h("bob")).json() == []
    assert [x["id"] for x in s.http.get("/v1/leases", headers=s.h("op")).json()] == [lid]
    assert s.get("alice", lid).json()["state"] == "running"  # bob's DELETE did nothing
    assert s.http.post(f"/v1/leases/{lid}/renew", headers=s.h("op")).status_code == 200
    assert s.http.delete(f"/v1/leases/{lid}", headers=s.h("op")).status_code == 200
    until(lambda: s.get("alice", lid).json()["state"] == "done", "the operator's end")


def test_a_queued_lease_cannot_be_renewed_and_delete_cancels_it(served: Served) -> None:
    s = served
    [gpu0, _] = s.gpus()
    big = s.ask("alice", vram_bytes=20 * GIB, gpu=gpu0, ttl_s=30).json()
    assert big["granted"] and big["gpu"] == gpu0
    r = s.ask("alice", wait="0.5", vram_bytes=20 * GIB, gpu=gpu0, ttl_s=30)
    queued = r.json()
    assert r.status_code == 201 and queued["state"] == "queued" and not queued["granted"], queued
    assert f"pinned to GPU {gpu0}" in (queued["waiting"] or ""), queued
    r = s.http.post(f"/v1/leases/{queued['id']}/renew", headers=s.h("alice"))
    assert r.status_code == 409 and "not granted yet" in r.json()["error"], r.text
    r = s.http.delete(f"/v1/leases/{queued['id']}", headers=s.h("alice"))
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
    s.http.delete(f"/v1/leases/{big['id']}", headers=s.h("alice"))


def test_a_pinned_lease_goes_only_to_its_gpu(served: Served) -> None:
    s = served
    gpu0, gpu1 = s.gpus()
    for gpu in (gpu1, gpu0, gpu1):
        lease = s.ask("alice", vram_bytes=GIB, gpu=gpu, ttl_s=30).json()
        assert lease["granted"] and lease["gpu"] == gpu and lease["pinned_gpu"] == gpu, lease
    r = s.ask("alice", vram_bytes=GIB, gpu="GPU-nope")
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "no such GPU" in error and gpu0 in error and gpu1 in error, error
    r = s.ask("alice", vram_bytes=30 * GIB)
    assert r.status_code == 422 and "30.0 GiB" in r.json()["error"], r.text


def test_the_client_asks_renews_and_ends_a_lease(served: Served) -> None:
    s = served
    with c.Client("http://testserver", s.tokens["alice"], http=s.http) as api:
        lease = api.lease(2 * GIB, ttl_s=30, wait=20)
        assert lease["granted"], lease
        assert api.renew_lease(lease["id"])["until"] >= lease["until"]
        assert [x["id"] for x in api.leases()] == [lease["id"]]
        assert api.get_lease(lease["id"])["state"] == "running"
        api.end_lease(lease["id"])
        until(lambda: api.get_lease(lease["id"])["state"] == "done", "the end")
        with pytest.raises(c.Conflict):
            api.renew_lease(lease["id"])


def test_metrics_and_status_show_a_granted_lease(served: Served, tmp_path: Path) -> None:
    s = served
    [gpu0, gpu1] = s.gpus()
    lease = s.ask("alice", vram_bytes=3 * GIB, gpu=gpu0, ttl_s=30).json()
    assert lease["granted"], lease

    def scraped() -> str:
        text: str = s.http.get("/metrics", headers=s.h("op")).text
        granted = re.search(
            r'^gpuwarden_vram_leases\{node="[^"]+",state="granted"\} 1.0$', text, re.M
        )
        return text if granted else ""

    text = until(scraped, "the granted lease counted in /metrics")
    held = {
        m["gpu"]: float(m["v"])
        for m in re.finditer(
            r'^gpuwarden_vram_lease_held_bytes\{gpu="(?P<gpu>[^"]+)",node="[^"]+"\} (?P<v>\S+)$',
            text,
            re.M,
        )
    }
    assert held == {gpu0: 3 * GIB, gpu1: 0.0}, text  # per GPU, no lease id in a label
    assert lease["id"] not in text
    # `status` (text and --json) lists it, read from the state directory
    cfg = tmp_path / "status.toml"
    cfg.write_text(f'state_dir = "{s.config.state_dir}"\ngpu = "sim"\nmodule_paths = []\n')
    r = subprocess.run(
        [*GW, "--config", str(cfg), "status", "--json"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    rows = json.loads(r.stdout)["leases"]
    assert [(x["id"], x["gpu"], x["vram_bytes"], x["state"]) for x in rows] == [
        (lease["id"], gpu0, 3 * GIB, "running")
    ], r.stdout
    assert rows[0]["until"] is not None
    r = subprocess.run(
        [*GW, "--config", str(cfg), "status"], capture_output=True, text=True, env=env(), timeout=60
    )
    line = next(ln for ln in r.stdout.splitlines() if lease["id"] in ln and "until" in ln)
    assert gpu0 in line and "3.0 GiB" in line and "running" in line and "until " in line, r.stdout
    assert f"leases: 1 (1 granted, 0 waiting); held: {gpu0} 3.0 GiB" in r.stdout, r.stdout
