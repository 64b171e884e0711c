"""The agent's sync step in one process: a real broker on a simulated GPU, the
coordinator's app on SQLite through an in-process transport. The lease watchdog,
what a stopping agent gives back, and a refused credential."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from gpuwarden.api import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster.agent import Agent, Coordinator, CredentialRefused, enroll
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
MODULES = [REPO / "modules", REPO / "tests" / "modules"]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)


class Switch(httpx.BaseTransport):
    """The coordinator, or (``down``) no answer at all."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.down = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("the coordinator is down (test)")
        got = self.inner.handle_request(request)
        return httpx.Response(got.status_code, headers=got.headers, content=got.read())


class Mono:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@dataclass
class Rig:
    store: SqliteStore  # the coordinator's
    node: Node  # the agent's broker
    agent: Agent
    switch: Switch
    mono: Mono

    def step(self) -> None:
        self.node.broker.tick()
        self.agent.sync()

    def until(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()
            time.sleep(0.02)

    def job(self, job_id: str) -> Any:
        return self.store.get_job(job_id)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path)


def make_rig(tmp_path: Path, **api: Any) -> Iterator[Rig]:
    coord_config = Config.model_validate(
        {
            "state_dir": tmp_path / "coord",
            "module_paths": MODULES,
            "allow_unsandboxed_containers": True,
            "api": {"rate_per_s": 10_000, "burst": 10_000, **api},
            "cluster": {"lease_s": 6, "offline_after_s": 8},
        }
    )
    store = SqliteStore(tmp_path / "coord.db")
    registry = Registry.load(MODULES, coord_config.launch_rules)
    client = TestClient(create_app(store, registry, coord_config))
    switch = Switch(client._transport)
    _, invite = issue_token(
        store,
        name="enroll a",
        role=Role.ENROLL,
        by=ADMIN,
        now=time.time(),
        expires_at=time.time() + 900,
        node="a",
    )
    agent_config = Config.model_validate(
        {
            "state_dir": tmp_path / "agent",
            "node_name": "a",
            "module_paths": MODULES,
            "allow_unsandboxed_containers": True,
            "sim_gpu": {"vram_gib": 24, "release_delay_s": 0.05},
            "broker": {"poll_interval_s": 0.02, "shutdown_grace_s": 1},
        }
    )
    with open_node(agent_config, mock_gpu=True) as node:
        got = enroll("http://testserver", invite, {"gpus": []}, transport=switch)
        mono = Mono()
        agent = Agent(
            node.broker,
            Coordinator("http://testserver", got["token"], transport=switch),
            node="a",
            lease_s=float(got["lease_s"]),
            max_jobs=4,
            labels={},
            claim_every_s=0.05,
            monotonic=mono,
        )
        node.broker.tick()  # the first status: the GPU is observed
        try:
            yield Rig(store=store, node=node, agent=agent, switch=switch, mono=mono)
        finally:
            node.broker.shutdown(0.0)
            agent.coordinator.close()
            client.close()
            store.close()


def gpu_job(job_id: str, seconds: float) -> JobSpec:
    return JobSpec(
        id=job_id,
        type="testmods.gpu",
        params={"gib": 2, "seconds": seconds, "leak": False},
        vram_bytes=2 * GIB,
    )


def test_a_leased_job_runs_here_and_its_result_goes_up(rig: Rig) -> None:
    registry = Registry.load(MODULES)
    spec = prepare(registry, JobSpec(id="e1", type="echo.echo", params={"text": "hi"}))
    rig.store.submit([spec], now=time.time())
    rig.until("e1 done", lambda: rig.job("e1").state is JobState.DONE)
    job = rig.job("e1")
    assert job.result["node"] == "a" and job.result["message"]
    [attempt] = rig.store.attempts("e1")
    assert attempt.node == "a" and attempt.outcome == "succeeded"
    assert rig.store.lease_of("e1") is None
    local = rig.node.store.get_job("e1")
    assert local is not None and local.state is JobState.DONE
    rig.until("e1 forgotten", lambda: not rig.agent.held)
    # its outputs went up first: the result points at the coordinator's copy
    here = Path(job.result["output_dir"])
    assert here.is_relative_to(Path(rig.store.path).parent / "coord" / "outputs" / "e1")
    assert job.result["outputs"] == ["echo.txt"]
    mine = Path(job.result["node_output_dir"]) / "echo.txt"
    assert (here / "echo.txt").read_bytes() == mine.read_bytes()


def test_a_job_with_staged_inputs_is_fetched_and_runs_here(rig: Rig, tmp_path: Path) -> None:
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "data.txt").write_text("data\n")
    registry = Registry.load(MODULES)
    spec = prepare(
        registry,
        JobSpec(id="c1", type="testmods.cat", params={"file": "data.txt"}, inputs=("data.txt",)),
    )
    rig.store.submit([spec], now=time.time(), origin=Submission(input_dir=str(staged)))
    rig.until("c1 done", lambda: rig.job("c1").state is JobState.DONE)
    job = rig.job("c1")
    assert (Path(job.result["output_dir"]) / "copy").read_text() == "data\n"
    assert (staged / "data.txt").read_text() == "data\n"  # the agent ran on its own copy


def test_an_output_over_the_limit_is_skipped_and_the_end_still_reported(
    tmp_path: Path,
) -> None:
    rigs = make_rig(tmp_path, max_output_mib=1e-6)  # 1 byte
    rig = next(rigs)
    try:
        registry = Registry.load(MODULES)
        spec = prepare(registry, JobSpec(id="e2", type="echo.echo", params={"text": "hi"}))
        rig.store.submit([spec], now=time.time())
        rig.until("e2 done", lambda: rig.job("e2").state is JobState.DONE)
        here = Path(rig.job("e2").result["output_dir"])
        assert here.is_dir() and not list(here.iterdir())
    finally:
        rigs.close()


def test_the_agent_reports_its_gpu_room(rig: Rig) -> None:
    rig.step()
    node = rig.store.get_node("a")
    assert node is not None
    [gpu] = node.report["gpus"]
    assert gpu["total_bytes"] == 24 * GIB and gpu["usable_bytes"] == int(23.5 * GIB)
    assert "testmods.gpu" in node.report["types"] and node.report["accepting"]


def test_the_watchdog_stops_held_jobs_and_they_are_never_reported(rig: Rig) -> None:
    rig.store.submit([gpu_job("g1", 20)], now=time.time())
    rig.until("g1 running", lambda: rig.job("g1").state is JobState.RUNNING)
    rig.switch.down = True
    rig.mono.offset += rig.agent.stop_after_s + 1  # no answer for that long
    rig.until(
        "g1 stopped here",
        lambda: (j := rig.node.store.get_job("g1")) is not None and j.state.terminal,
        timeout=20,
    )
    assert rig.node.store.get_job("g1").state is JobState.CANCELLED  # type: ignore[union-attr]
    lost = [e for e in rig.node.store.events(job_id="g1") if e.kind == "lease_lost"]
    assert lost and "no answer from the coordinator" in lost[0].detail["reason"]
    rig.switch.down = False
    for _ in range(20):
        rig.step()
    # the coordinator heard nothing of its end: the attempt is still running there
    assert rig.job("g1").state is JobState.RUNNING
    assert not [a for a in rig.store.audit_rows() if a.action == "node.finish"]
    # the lease is not renewed (the agent no longer holds it): the sweep takes it back
    lease = rig.store.lease_of("g1")
    assert lease is not None
    co.sweep(rig.store, lease.expires_at + 0.1, 8.0)
    job = rig.job("g1")
    assert job.state is JobState.QUEUED and rig.store.lost_nodes("g1") == ["a"]


def test_a_stopping_agent_gives_its_running_jobs_back(rig: Rig) -> None:
    rig.store.submit([gpu_job("g2", 20)], now=time.time())
    rig.until("g2 running", lambda: rig.job("g2").state is JobState.RUNNING)
    rig.agent.stopping = True
    rig.node.broker.shutdown(0.0)
    rig.agent.final_reports()
    job = rig.job("g2")
    assert job.state is JobState.QUEUED
    [attempt] = rig.store.attempts("g2")
    assert attempt.outcome == "interrupted" and "shut down" in attempt.reason
    assert rig.store.lease_of("g2") is None  # offered again at once


def test_a_client_cancel_stops_the_job_here_and_its_end_is_reported(rig: Rig) -> None:
    rig.store.submit([gpu_job("g3", 20)], now=time.time())
    rig.until("g3 running", lambda: rig.job("g3").state is JobState.RUNNING)
    rig.store.request_cancel("g3", now=time.time())
    rig.agent._last_beat = -1e9  # the next sync heartbeats
    rig.until("g3 cancelled", lambda: rig.job("g3").state is JobState.CANCELLED)
    [attempt] = rig.store.attempts("g3")
    assert attempt.outcome == "cancelled" and attempt.node == "a"


def test_a_revoked_agent_is_told_so(rig: Rig) -> None:
    rig.step()
    co.revoke(rig.store, None, "a", now=time.time())
    rig.agent._last_beat = -1e9
    with pytest.raises(CredentialRefused, match="revoked"):
        rig.agent.sync()
