"""Release on demand (issue 15): a waiting job that needs room a managed runtime
holds gets it by asking the runtime through its own API, only once the runtime is
past its grace and not busy; the memory is watched on the device, and the runtime
process lives on. Against the ComfyUI stand-in (tests/standins/comfyui.py, whose
/free acts after the running prompt) on the broker's simulated GPU."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Lane
from gpuwarden.core.policy import QueuedJob
from gpuwarden.core.states import JobState
from gpuwarden.gpu.select import SIM_STATE_FILE
from gpuwarden.node import explain
from gpuwarden.node.status import BrokerStatus
from tests.brokerkit import submit
from tests.integration.test_broker import make_config
from tests.integration.test_sim_gpu import child_env

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Setup:
    node: Node
    comfy: subprocess.Popen[str]
    url: str

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e.detail | {"job": e.job_id} for e in self.node.store.events() if e.kind == kind]

    def prompt(self, gib: float, work_s: float) -> None:
        r = httpx.post(
            f"{self.url}/prompt",
            json={"prompt": {"1": {}}, "extra_data": {"model_gib": gib, "work_s": work_s}},
            timeout=10,
        )
        r.raise_for_status()


def start(tmp_path: Path, grace_s: float) -> Iterator[Setup]:
    raw = make_config(tmp_path).model_dump()
    raw["sim_gpu"]["count"] = 1
    base = Config.model_validate(raw)
    with open_node(base, mock_gpu=True) as first:
        gpu = first.probe.read()[0].uuid
    comfy = subprocess.Popen(
        [sys.executable, "-m", "tests.standins.comfyui", "--port", "0"],
        cwd=REPO,
        env=child_env(base.state_dir / SIM_STATE_FILE, gpu),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert comfy.stdout is not None
        url = comfy.stdout.readline().strip().removeprefix("listening on ")
        raw["runtimes"] = [
            {
                "name": "comfy",
                "kind": "comfyui",
                "url": url,
                "idle_grace_s": grace_s,
                "release_timeout_s": 20,
            }
        ]
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            node.broker.runtimes.start()
            try:
                yield Setup(node, comfy, url)
            finally:
                node.broker.runtimes.stop()
        # the runtime process was never killed, whatever happened
        assert comfy.poll() is None, "the ComfyUI stand-in died"
    finally:
        comfy.terminate()
        comfy.wait(30)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    yield from start(tmp_path, grace_s=2.0)


@pytest.fixture
def no_grace(tmp_path: Path) -> Iterator[Setup]:
    yield from start(tmp_path, grace_s=0.0)


def state(s: Setup) -> str:
    return str(s.node.broker.status().runtimes[0]["state"])


def published_state(s: Setup) -> str:
    status = explain.latest_status(s.node.store, time.time())
    rows = BrokerStatus.from_json(status.payload).runtimes if status else ()
    return str(rows[0]["state"]) if rows else ""


def until(s: Setup, check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        s.node.broker.tick()
        time.sleep(0.05)


def held(s: Setup) -> int:
    views = s.node.broker.vram.views()
    return sum(b for v in views for n, b in v.runtimes if n == "comfy")


def test_a_runtime_past_its_grace_is_asked_and_the_waiting_job_gets_the_room(
    setup: Setup,
) -> None:
    s = setup
    s.prompt(gib=16, work_s=0.1)  # ComfyUI loads a 16 GiB model and stays idle
    until(s, lambda: held(s) == 16 * GIB and state(s) == "idle", "the model, idle")
    # preview reads the published status: it names the runtime and why it is not asked
    until(s, lambda: published_state(s) == "idle", "the status to show it idle")
    status = explain.latest_status(s.node.store, time.time())
    assert status is not None
    me = QueuedJob("me", "testmods.gpu", Lane.VRAM, 12 * GIB, 0, 10**9)
    said = explain.describe(explain.decide(explain.view_from_status(status, 4), [me], "me"))
    assert said.startswith("would wait:") and "The runtime comfy holds 16.0 GiB" in said, said
    assert "not asked: in its grace" in said, said
    submit(s.node, JobSpec("j", "testmods.gpu", {"gib": 12, "seconds": 0.2}, vram_bytes=12 * GIB))
    s.node.broker.tick()
    # in its grace: named in the reason, not asked
    reason = s.node.broker.wait_reason("j") or ""
    assert "The runtime comfy holds 16.0 GiB" in reason and "in its grace" in reason, reason
    assert not s.events("runtime_release_requested")
    until(s, lambda: bool(s.events("runtime_release_requested")), "the ask", limit=20)
    [asked] = s.events("runtime_release_requested")
    assert (asked["runtime"], asked["bytes"], asked["job"]) == ("comfy", 16 * GIB, "j")
    until(s, lambda: bool(s.events("runtime_released")), "the memory back")
    [released] = s.events("runtime_released")
    assert released["bytes"] == 16 * GIB and float(str(released["after_s"])) >= 0
    until(
        s,
        lambda: s.node.store.get_job("j").state is JobState.DONE,  # type: ignore[union-attr]
        "the job to run in the room",
    )
    assert held(s) == 0


def test_a_busy_runtime_is_never_asked(no_grace: Setup) -> None:
    s = no_grace
    s.prompt(gib=16, work_s=6.0)  # busy for 6 s
    until(s, lambda: held(s) == 16 * GIB and state(s) == "busy", "the model, busy")
    submit(s.node, JobSpec("j", "testmods.gpu", {"gib": 12, "seconds": 0.2}, vram_bytes=12 * GIB))
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # busy the whole time: never asked
        s.node.broker.tick()
        assert state(s) == "busy"
        time.sleep(0.05)
    assert not s.events("runtime_release_requested")
    assert "busy (queue_running has 1 prompt)" in (s.node.broker.wait_reason("j") or "")
    # once its prompt ends (grace 0) it is asked, and the job runs
    until(
        s,
        lambda: s.node.store.get_job("j").state is JobState.DONE,  # type: ignore[union-attr]
        "the job after the prompt",
        limit=40,
    )
    assert s.events("runtime_released")


# a runtime whose release answers 200 and frees nothing (a model outside its own
# management, as ComfyUI's custom nodes keep theirs: SPEC's release-ineffective)
STUBBORN = r"""
import http.server, json, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def answer(self, body):
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_GET(self): self.answer(json.dumps({"running": 0}).encode())
    def do_POST(self): self.answer(b"OK")  # "released", and nothing happens
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
HOLDER = """
import sys
from gpuwarden.gpu import simclient
simclient.attach().allocate(16 * 1024**3, label="model")
sys.stdin.read()
"""


def test_a_release_that_frees_nothing_is_marked_and_its_memory_stays_counted(
    tmp_path: Path,
) -> None:
    raw = make_config(tmp_path).model_dump()
    raw["sim_gpu"]["count"] = 1
    base = Config.model_validate(raw)
    with open_node(base, mock_gpu=True) as first:
        gpu = first.probe.read()[0].uuid
    server = subprocess.Popen(
        [sys.executable, "-c", STUBBORN, HOLDER],
        env=child_env(base.state_dir / SIM_STATE_FILE, gpu),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        raw["runtimes"] = [
            {
                "name": "stubborn",
                "kind": "generic",
                "url": f"http://127.0.0.1:{port}",
                "idle_grace_s": 0,
                "release_timeout_s": 1.0,
                "busy": {"path": "/status", "busy_key": "running"},
                "release": {"method": "POST", "path": "/unload"},
            }
        ]
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            node.broker.runtimes.start()
            s = Setup(node, server, f"http://127.0.0.1:{port}")
            try:

                def stubborn() -> int:
                    views = node.broker.vram.views()
                    return sum(b for v in views for n, b in v.runtimes if n == "stubborn")

                until(s, lambda: stubborn() == 16 * GIB, "its memory on the device")
                submit(
                    node,
                    JobSpec("j", "testmods.gpu", {"gib": 12, "seconds": 0.2}, vram_bytes=12 * GIB),
                )
                until(s, lambda: bool(s.events("runtime_release_sent")), "the release sent")
                until(s, lambda: bool(s.events("runtime_release_ineffective")), "the verdict")
                [verdict] = s.events("runtime_release_ineffective")
                assert verdict["residual_bytes"] == 16 * GIB
                assert stubborn() == 16 * GIB  # still counted: the job still waits
                node.broker.tick()
                reason = node.broker.wait_reason("j") or ""
                assert "release-ineffective: 16.0 GiB stayed" in reason, reason
                job = node.store.get_job("j")
                assert job is not None and job.state is JobState.QUEUED
                assert len(s.events("runtime_release_requested")) == 1  # not asked again
            finally:
                node.broker.runtimes.stop()
        assert server.poll() is None  # never killed
    finally:
        server.kill()
        server.wait(10)
