"""A job's host RAM keys (``ram_gib``, ``ram_floor_gib``, ``ram_start_min_gib``)
through every way in (the manifest read and written back, ``submit`` into the
local store, the client and the API, a coordinator's payload to its agent), and
RAM admission in a real broker loop with real job processes: a job waits for
MemAvailable with the reason, a pass never admits two caps against the same free
memory, and a launch whose fresh sample no longer allows it is refused with a
launch error before its process runs (SPEC.md section 11, "Host RAM")."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.core.model import GIB, JobSpec, LaunchMode, Role
from gpuwarden.core.ramadmit import RamNeed
from gpuwarden.core.states import JobState
from gpuwarden.errors import BundleError, ValidationError
from gpuwarden.eventlog import EventLog
from gpuwarden.intake.manifest import manifest_doc, parse_manifest
from gpuwarden.launch.host import HostLauncher
from gpuwarden.node import explain
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore
from tests.brokerkit import run_until, submit
from tests.integration.test_broker import make_config
from tests.integration.test_est_s import MODULES, _run, api
from tests.integration.test_job_gpus import _node

__all__ = ["api"]  # the fixture, shared with test_est_s


def _manifest(**job: Any) -> bytes:
    body = {"id": "j1", "type": "testmods.sleep", **job}
    return json.dumps({"version": 1, "jobs": [body]}).encode()


def test_the_manifest_takes_the_ram_keys_and_writes_them_back() -> None:
    [job] = parse_manifest(_manifest(ram_gib=2, ram_floor_gib=0.5, ram_start_min_gib=3.25))
    assert job.ram == RamNeed(2 * GIB, GIB // 2, 3 * GIB + GIB // 4)
    [plain] = parse_manifest(_manifest())
    assert not plain.ram.asks
    assert (
        not {"ram_gib", "ram_floor_gib", "ram_start_min_gib"}
        & manifest_doc([plain])["jobs"][0].keys()
    )
    [back] = parse_manifest(json.dumps(manifest_doc([job])).encode())
    assert back.ram == job.ram


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("ram_gib", "2", "ram_gib must be a number of GiB, got '2'"),
        ("ram_gib", True, "ram_gib must be a number of GiB, got True"),
        ("ram_floor_gib", 0, "ram_floor_gib must be greater than 0 GiB, got 0"),
        ("ram_start_min_gib", -1, "ram_start_min_gib must be greater than 0 GiB, got -1"),
        ("ram_gib", 1e9, "ram_gib must be at most 65536 GiB"),
    ],
)
def test_the_manifest_refuses_a_bad_ram_key(key: str, value: Any, says: str) -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_manifest(**{key: value}))
    assert f"jobs[0].{says}" in str(info.value)


def test_submit_ram_keys_into_the_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    config = tmp_path / "gpuwarden.toml"
    paths = ", ".join(f'"{m}"' for m in MODULES)
    config.write_text(
        f'state_dir = "{state}"\nmodule_paths = [{paths}]\nallow_unsandboxed_containers = true\n'
    )
    SqliteStore(state / "gpuwarden.db").close()
    base = ["--config", str(config), "submit", "testmods.sleep"]
    code, _, err = _run(
        capsys, *base, "--id", "r1", "--ram-gib", "1.5", "--ram-floor-gib", "2",
        "--ram-start-min-gib", "4",
    )  # fmt: skip
    assert code == 0, err
    code, _, err = _run(capsys, *base, "--id", "r0", "--ram-gib", "0")
    assert code == 2 and "--ram-gib must be greater than 0 GiB, got 0.0" in err
    warm = ["--config", str(config), "submit", "testmods.warm", "--id", "w", "--ram-gib", "1"]
    code, _, err = _run(capsys, *warm)
    assert code == 2 and "runs in a warm server" in err and "ram_floor_gib" in err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        job = store.get_job("r1")
        assert job is not None and job.ram == RamNeed(3 * GIB // 2, 2 * GIB, 4 * GIB)
        assert store.get_job("r0") is None and store.get_job("w") is None
        [entry] = store.queue_entries()
        assert entry.ram == job.ram
    finally:
        store.close()


def test_the_client_and_the_api_take_the_ram_keys(api: tuple[SqliteStore, TestClient, str]) -> None:
    store, tc, token = api
    with c.Client("http://testserver", token, http=TestClient(tc.app)) as client:
        job = client.submit("testmods.sleep", {}, ram_gib=1, ram_start_min_gib=2)
        assert (job["ram_cap_bytes"], job["ram_floor_bytes"], job["ram_start_min_bytes"]) == (
            GIB,
            None,
            2 * GIB,
        )
        assert client.get(job["id"])["ram_cap_bytes"] == GIB
        stored = store.get_job(job["id"])
        assert stored is not None and stored.ram == RamNeed(GIB, 0, 2 * GIB)
        assert client.submit("testmods.sleep", {})["ram_cap_bytes"] is None
        with pytest.raises(c.RequestRefused, match="ram_floor_gib"):
            client.submit("testmods.sleep", {}, ram_floor_gib=-1)
        with pytest.raises(c.RequestRefused, match="warm server"):
            client.submit("testmods.warm", {}, ram_gib=1)


def test_a_coordinator_sends_the_ram_keys_to_its_agent(store: Store) -> None:
    """On both stores: the keys are stored with the job and go in the payload a
    node is sent when it claims it."""
    assert isinstance(store, ClusterStore)
    registry = Registry.load(MODULES)
    _node(store, "one", 1)
    store.submit([JobSpec("r", "testmods.sleep", {}, ram=RamNeed(GIB, 2 * GIB, 3 * GIB))], now=1.0)
    job = store.get_job("r")
    assert job is not None and job.ram == RamNeed(GIB, 2 * GIB, 3 * GIB)
    record = store.get_node("one")
    assert record is not None
    [payload] = co.claim(store, registry, "one", nv.node_view(record), 2.0, lease_s=5.0)
    assert RamNeed.from_json(payload) == job.ram


# -- admission in a real broker loop --------------------------------------------------


class FakeMeminfo:
    """MemAvailable as the test sets it (the plan's samples and the launch's fresh
    read both go through it); ``reads`` counts them."""

    def __init__(self, available: int) -> None:
        self.available = available
        self.reads = 0
        self.then: int | None = None  # after the next read: this

    def __call__(self) -> int:
        self.reads += 1
        value = self.available
        if self.then is not None:
            self.available, self.then = self.then, None
        return value


@pytest.fixture
def ram_node(tmp_path: Path) -> Iterator[tuple[Node, FakeMeminfo]]:
    with open_node(
        make_config(tmp_path), mock_gpu=True, events=EventLog(tmp_path / "events.jsonl")
    ) as n:
        meminfo = FakeMeminfo(8 * GIB)
        n.broker.attempts.host_ram.read = meminfo
        n.broker.attempts.host_ram.every_s = 0.0
        n.broker.attempts.host_ram.total_bytes = 64 * GIB  # whatever this host has
        yield n, meminfo


def _state(node: Node, job_id: str) -> JobState | None:
    job = node.store.get_job(job_id)
    return None if job is None else job.state


def _sleep(job_id: str, seconds: float = 0.2, **ram: int) -> JobSpec:
    return JobSpec(job_id, "testmods.sleep", {"seconds": seconds}, ram=RamNeed(**ram))


def test_a_job_waits_for_memavailable_with_the_reason_then_runs(
    ram_node: tuple[Node, FakeMeminfo],
) -> None:
    node, meminfo = ram_node
    submit(node, _sleep("big", start_min_bytes=12 * GIB))
    for _ in range(5):
        node.broker.tick()
    assert _state(node, "big") is JobState.QUEUED and meminfo.reads > 0
    reason = node.broker.wait_reason("big")
    assert reason == (
        "host RAM: 8.00 GiB available, the job needs 12.00 GiB to start (ram_start_min_gib)"
    )
    meminfo.available = 16 * GIB
    run_until(node, lambda: _state(node, "big") is JobState.DONE)


def test_one_pass_never_admits_two_caps_against_the_same_memory(
    ram_node: tuple[Node, FakeMeminfo],
) -> None:
    """10 GiB available, two jobs capped at 6 GiB: the first starts, the second
    waits, the first's cap counted as promised; it starts once the first ended."""
    node, meminfo = ram_node
    meminfo.available = 10 * GIB
    submit(node, _sleep("a", 1.0, cap_bytes=6 * GIB), _sleep("b", 0.2, cap_bytes=6 * GIB))
    run_until(node, lambda: _state(node, "a") is JobState.RUNNING)
    node.broker.tick()
    assert _state(node, "b") is JobState.QUEUED
    reason = node.broker.wait_reason("b") or ""
    assert reason.startswith("host RAM: 10.00 GiB available (")
    assert "promised to running jobs' caps" in reason and "cap of 6.00 GiB" in reason
    run_until(node, lambda: _state(node, "b") is JobState.DONE)
    a, b = node.store.attempts("a")[0], node.store.attempts("b")[0]
    assert a.ended_at is not None and b.started_at >= a.ended_at


def test_the_node_floor_holds_for_every_job(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config = config.model_copy(
        update={"broker": config.broker.model_copy(update={"ram_floor_gib": 6.0})}
    )
    with open_node(config, mock_gpu=True) as node:
        meminfo = FakeMeminfo(4 * GIB)
        node.broker.attempts.host_ram.read = meminfo
        node.broker.attempts.host_ram.every_s = 0.0
        submit(node, _sleep("plain"))  # asks nothing itself
        for _ in range(5):
            node.broker.tick()
        assert _state(node, "plain") is JobState.QUEUED
        assert node.broker.wait_reason("plain") == (
            "host RAM: 4.00 GiB available, a floor of 6.00 GiB must stay free"
        )
        meminfo.available = 7 * GIB
        run_until(node, lambda: _state(node, "plain") is JobState.DONE)


def test_a_launch_refused_by_a_fresh_sample_never_runs(
    ram_node: tuple[Node, FakeMeminfo],
) -> None:
    """The plan's sample allows the start; MemAvailable falls before the launch;
    the fresh read right before it refuses it: a launch error, the process never
    ran (it would write its pid into out/), retried once it allows again."""
    node, meminfo = ram_node
    meminfo.available, meminfo.then = 16 * GIB, 1 * GIB  # the plan sees 16, the launch 1
    submit(node, _sleep("late", start_min_bytes=8 * GIB))
    run_until(node, lambda: len(node.store.attempts("late")) >= 1 and meminfo.then is None)
    run_until(node, lambda: node.store.attempts("late")[0].ended_at is not None)
    first = node.store.attempts("late")[0]
    assert first.outcome == "launch_error", first
    assert first.reason.startswith(
        "launch error: host RAM: 1.00 GiB available, the job needs 8.00 GiB to start "
        "(ram_start_min_gib); checked again right before the launch, so it was not started"
    ), first.reason
    first_dir = node.broker.launching.attempt_dir("late", 1)
    assert not (first_dir / "out" / "pid").exists()
    meminfo.available = 16 * GIB
    run_until(node, lambda: _state(node, "late") is JobState.DONE)
    assert [a.outcome for a in node.store.attempts("late")] == ["launch_error", "succeeded"]
    # the same path names the second attempt's pid: the first one's absence is real
    assert (node.broker.launching.attempt_dir("late", 2) / "out" / "pid").is_file()


def test_a_node_that_cannot_enforce_caps_refuses_a_job_that_asks_for_one(
    ram_node: tuple[Node, FakeMeminfo],
) -> None:
    """A host launcher without memory cgroups: a bundle's job with ``ram_gib`` is
    refused at submission (``check_fits``), and one already queued (accepted by
    another configuration) fails at its start with the reason, never run; a job
    without a cap of its own still runs."""
    node, _ = ram_node
    node.broker.launchers[LaunchMode.HOST] = HostLauncher(None)
    assert not node.broker.launchers[LaunchMode.HOST].memory_caps().enforced
    with pytest.raises(ValidationError, match="cannot enforce one: no memory cgroup"):
        node.broker.check_fits([_sleep("checked", cap_bytes=GIB)])
    submit(node, _sleep("capped", cap_bytes=GIB), _sleep("plain"))
    run_until(node, lambda: _state(node, "capped") is JobState.FAILED)
    job = node.store.get_job("capped")
    assert job is not None and job.reason.startswith(
        "refused: ram_gib asks for a RAM cap of 1.00 GiB, but this node cannot enforce one: "
    )
    assert node.store.attempts("capped") == []  # never started
    run_until(node, lambda: _state(node, "plain") is JobState.DONE)


ADMIN = Principal(token_id="local", name="t", role=Role.OWNER)


def test_a_ram_request_no_host_can_meet_is_refused_at_submission(
    ram_node: tuple[Node, FakeMeminfo],
) -> None:
    """Issue 31: 30 GiB on a 23.5 GiB host waited for ever; it is refused as a
    footprint no GPU holds is, on the broker and against its published status."""
    node, _ = ram_node
    too_big = _sleep("huge", start_min_bytes=65 * GIB)
    with pytest.raises(ValidationError) as refused:
        node.broker.check_fits([too_big])
    assert str(refused.value) == (
        "job huge (testmods.sleep) needs 65.00 GiB of RAM available to start "
        "(ram_start_min_gib), and this host has 64.00 GiB of RAM in all: ask for less"
    )
    capped = _sleep("capped", cap_bytes=60 * GIB, floor_bytes=8 * GIB)
    with pytest.raises(ValidationError, match=r"a RAM cap of 60\.00 GiB .* floor of 8\.00 GiB"):
        node.broker.check_fits([capped])
    node.broker.check_fits([_sleep("fits", cap_bytes=56 * GIB, floor_bytes=8 * GIB)])
    # the published status says the same to a submit from another process
    node.broker.tick()
    status = explain.latest_status(node.store, time.time())
    assert status is not None
    view = explain.view_from_status(status, 1)
    assert view.ram.total_bytes == 64 * GIB
    jobtype = node.broker.registry.get("testmods.sleep")
    assert explain.never_admitted(view.ram, jobtype, too_big.ram) is not None
    assert explain.never_admitted(view.ram, jobtype, RamNeed(GIB)) is None
    _, token = issue_token(node.store, name="s", role=Role.SUBMITTER, by=ADMIN, now=time.time())
    http = TestClient(create_app(node.store, node.broker.registry, node.config))
    body = {"type": "testmods.sleep", "ram_start_min_gib": 65}
    r = http.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 422 and "this host has 64.00 GiB of RAM in all" in r.json()["error"]
    body["ram_start_min_gib"] = 2
    r = http.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
