"""llama-server as a managed runtime, against the llama-server stand-in
(tests/standins/llamaserver.py) on the simulated GPU: the client's readings
checked against the device's per-process usage (a router's models are held by its
children), and a broker that asks a router past its grace to unload, never while
a completion runs, and never a single-model server (it has no unload route)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety
from gpuwarden.core.states import JobState
from gpuwarden.gpu.select import SIM_STATE_FILE
from gpuwarden.gpu.sim import SimGpuConfig, SimProbe
from gpuwarden.runtimes.base import RuntimeApiError
from gpuwarden.runtimes.llama import LlamaServerClient
from tests.brokerkit import submit
from tests.integration.test_broker import make_config
from tests.integration.test_sim_gpu import child_env

REPO = Path(__file__).resolve().parents[2]
#: the most any wait below lasts (a bound on waiting, not an assertion on speed)
WAIT_S = 60.0


@dataclass
class Standin:
    proc: subprocess.Popen[str]
    url: str
    probe: SimProbe
    client: LlamaServerClient

    def held(self) -> dict[int, int]:
        """Bytes per pid on the device, as the broker's probe reads them (a sweep
        first: a killed owner's memory goes back)."""
        (reading,) = self.probe.read()
        return {p.pid: p.used_bytes for p in reading.processes}

    def children(self) -> set[int]:
        return {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}

    def child_bytes(self) -> int:
        """What the router's children hold (the router itself holds nothing)."""
        held = self.held()
        assert self.proc.pid not in held
        kids = self.children()
        return sum(b for pid, b in held.items() if pid in kids)


@dataclass
class Completion:
    """One completion request run in a thread, and what it got."""

    url: str
    model: str
    delay_s: float
    response: httpx.Response | None = None
    error: Exception | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        body = {"model": self.model, "prompt": "hi", "delay_s": self.delay_s}
        try:
            self.response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=WAIT_S)
        except httpx.HTTPError as exc:
            self.error = exc

    def result(self) -> httpx.Response:
        self.thread.join(WAIT_S)
        assert self.response is not None, self.error
        return self.response


def launch(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.standins.llamaserver", "--port", "0", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait(WAIT_S)
        pytest.fail(f"the stand-in did not start: {line!r}")
    return proc, line.split()[-1]


def sim_env(tmp_path: Path) -> tuple[SimProbe, dict[str, str]]:
    config = SimGpuConfig(count=1, vram_bytes=24 * GIB, release_delay_s=0)
    probe = SimProbe(tmp_path / "simgpu.json", config)
    return probe, child_env(tmp_path / "simgpu.json", probe.device.uuids()[0])


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Standin]]:
    started: list[Standin] = []

    def run(*args: str, token: str | None = None) -> Standin:
        probe, env = sim_env(tmp_path)
        proc, url = launch(env, *args)
        standin = Standin(proc, url, probe, LlamaServerClient(url, token=token, timeout_s=WAIT_S))
        started.append(standin)
        return standin

    yield run
    for standin in started:
        standin.client.close()
        alive = standin.proc.poll() is None
        standin.proc.terminate()
        standin.proc.wait(WAIT_S)
        assert alive, "the stand-in died during the test"
        # its children went with it (the router stops them before it exits)
        assert not standin.held(), standin.held()


def until(check: Callable[[], bool], what: str, limit: float = WAIT_S) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


ROUTER = ("--preset", "tiny=1", "--preset", "big=2")


# -- the client against the stand-in ----------------------------------------------------


def test_router_load_read_and_unload_frees_the_childs_memory(
    start: Callable[..., Standin],
) -> None:
    s = start(*ROUTER, "--metrics")
    caps = s.client.probe()
    assert (caps.busy_signal, caps.release) == (BusySignal.EXACT, ReleaseSafety.ABORTS)
    assert s.held() == {}  # nothing loaded: a router holds nothing of its own
    prepared = s.client.prepare("big", keep_alive_s=60, timeout_s=WAIT_S)
    assert prepared.detail.startswith("POST /models/load; loaded after")
    assert s.child_bytes() == 2 * GIB
    [child] = s.children()
    assert s.held() == {child: 2 * GIB}  # held by the model's child, not the router
    reading = s.client.read()
    assert (reading.activity, reading.detail) == (Activity.IDLE, "big: 0 processing, 0 deferred")
    assert [m.name for m in reading.loaded] == ["big"]
    asked = s.client.release()
    assert asked.calls == ("POST /models/unload big",)
    until(lambda: s.held() == {}, "the child's memory to come back")
    until(lambda: not psutil.pid_exists(child) or child not in s.children(), "the child to exit")
    assert s.client.read().detail == "no model loaded"
    assert s.proc.poll() is None  # the router lives on


def test_router_busy_while_a_completion_runs_and_unload_cuts_it(
    start: Callable[..., Standin],
) -> None:
    """Why the broker reads again before it asks: an unload aborts what runs."""
    s = start(*ROUTER)  # no --metrics: /slots is read
    request = Completion(s.url, "tiny", delay_s=WAIT_S)  # autoload: it loads tiny first
    until(lambda: s.client.read().detail == "tiny: slot 0 processing", "the completion to run")
    caps = s.client.probe()
    assert any("GET /slots is read instead" in n for n in caps.notes)
    assert s.client.read().detail == "tiny: slot 0 processing"
    assert s.child_bytes() == GIB
    s.client.release()  # the fault: asked while busy
    response = request.result()
    assert response.status_code == 500  # the request in flight was cut
    until(lambda: s.held() == {}, "the memory back")
    assert s.client.read().activity is Activity.IDLE


def test_a_child_that_ignores_the_exit_is_killed_after_stop_timeout(
    start: Callable[..., Standin],
) -> None:
    s = start(*ROUTER, "--ignore-exit", "--stop-timeout", "1", "--load-on-startup", "tiny")
    until(lambda: s.child_bytes() == GIB, "tiny loaded at startup")
    s.client.probe()
    s.client.release()
    time.sleep(0.3)
    assert s.child_bytes() == GIB  # it ignored the command: still there
    until(lambda: s.held() == {}, "the force-kill after stop-timeout", limit=10)


def test_single_model_server_is_not_releasable(start: Callable[..., Standin]) -> None:
    s = start("--model", "solo=2")
    assert s.held() == {s.proc.pid: 2 * GIB}  # in its own process
    caps = s.client.probe()
    assert caps.release is ReleaseSafety.NOT_RELEASABLE and not caps.releasable
    assert caps.busy_signal is BusySignal.EXACT  # /slots, on by default
    with pytest.raises(RuntimeApiError, match="cannot be asked to release"):
        s.client.release()
    assert s.client.prepare("solo", keep_alive_s=0, timeout_s=5).model == "solo"
    with pytest.raises(RuntimeApiError, match="serves solo, not 'other'"):
        s.client.prepare("other", keep_alive_s=0, timeout_s=5)
    request = Completion(s.url, "solo", delay_s=1.0)
    until(lambda: s.client.read().detail == "slot 0 processing", "the slot to work")
    assert request.result().status_code == 200
    assert s.held() == {s.proc.pid: 2 * GIB}  # nothing was freed


def test_api_key_guards_every_route_but_health(start: Callable[..., Standin]) -> None:
    s = start(*ROUTER, "--api-key", "sekrit", token="sekrit")
    bare = LlamaServerClient(s.url)
    assert bare.call("GET", "/health").status_code == 200
    with pytest.raises(RuntimeApiError, match="GET /models answered 401"):
        bare.probe()  # the fault: no key
    bare.close()
    assert s.client.probe().release is ReleaseSafety.ABORTS
    assert s.client.prepare("tiny", keep_alive_s=0, timeout_s=WAIT_S).model == "tiny"


def test_a_model_that_fails_to_load(start: Callable[..., Standin]) -> None:
    s = start(*ROUTER, "--fail-load", "big")
    s.client.probe()
    with pytest.raises(RuntimeApiError, match=r"big failed to load \(exit code 1\)"):
        s.client.prepare("big", keep_alive_s=0, timeout_s=WAIT_S)
    assert s.held() == {}


# -- under a broker -------------------------------------------------------------------------


@dataclass
class Setup:
    node: Node
    proc: subprocess.Popen[str]
    url: str

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e.detail | {"job": e.job_id} for e in self.node.store.events() if e.kind == kind]

    def held(self) -> int:
        views = self.node.broker.vram.views()
        return sum(b for v in views for n, b in v.runtimes if n == "llama")

    def row(self) -> dict[str, object]:
        [row] = self.node.broker.status().runtimes
        return row

    def until(self, check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
        deadline = time.monotonic() + limit
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.node.broker.tick()
            time.sleep(0.05)

    def job_done(self, job: str) -> bool:
        record = self.node.store.get_job(job)
        return record is not None and record.state is JobState.DONE


@contextmanager
def brokered(tmp_path: Path, grace_s: float, *args: str) -> Iterator[Setup]:
    raw = make_config(tmp_path).model_dump()
    raw["sim_gpu"]["count"] = 1
    base = Config.model_validate(raw)
    with open_node(base, mock_gpu=True) as first:
        gpu = first.probe.read()[0].uuid
    proc, url = launch(child_env(base.state_dir / SIM_STATE_FILE, gpu), *args)
    try:
        raw["runtimes"] = [
            {
                "name": "llama",
                "kind": "llama-server",
                "url": url,
                "idle_grace_s": grace_s,
                "release_timeout_s": 20,
            }
        ]
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            node.broker.runtimes.start()
            try:
                yield Setup(node, proc, url)
            finally:
                node.broker.runtimes.stop()
        # the runtime process was never killed, whatever happened
        assert proc.poll() is None, "the llama-server stand-in died"
    finally:
        proc.terminate()
        proc.wait(30)


def big_job(s: Setup) -> None:
    submit(s.node, JobSpec("j", "testmods.gpu", {"gib": 12, "seconds": 0.2}, vram_bytes=12 * GIB))


def test_a_router_past_its_grace_is_asked_to_unload_and_the_job_gets_the_room(
    tmp_path: Path,
) -> None:
    with brokered(tmp_path, 2.0, "--preset", "m=16", "--load-on-startup", "m", "--metrics") as s:
        s.until(lambda: s.held() == 16 * GIB and s.row()["state"] == "idle", "the model, idle")
        row = s.row()
        assert (row["busy_signal"], row["release"]) == ("exact", "aborts")
        assert s.node.broker.vram.views()[0].foreign_bytes == 0  # named, not foreign
        big_job(s)
        s.node.broker.tick()
        reason = s.node.broker.wait_reason("j") or ""
        assert "The runtime llama holds 16.0 GiB" in reason and "in its grace" in reason, reason
        s.until(lambda: bool(s.events("runtime_release_requested")), "the ask", limit=20)
        [asked] = s.events("runtime_release_requested")
        assert (asked["runtime"], asked["bytes"], asked["job"]) == ("llama", 16 * GIB, "j")
        s.until(lambda: bool(s.events("runtime_released")), "the memory back")
        s.until(lambda: s.job_done("j"), "the job to run in the room")
        assert s.held() == 0
        sent = s.events("runtime_release_sent")
        assert sent and "POST /models/unload m" in str(sent[0]), sent


def test_a_router_with_a_completion_running_is_never_asked(tmp_path: Path) -> None:
    with brokered(tmp_path, 0.0, "--preset", "m=16", "--load-on-startup", "m") as s:
        s.until(lambda: s.held() == 16 * GIB, "the model loaded")
        request = Completion(s.url, "m", delay_s=5.0)
        s.until(lambda: s.row()["state"] == "busy", "the completion seen")
        big_job(s)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # busy the whole time: never asked
            s.node.broker.tick()
            assert s.row()["state"] == "busy"
            time.sleep(0.05)
        assert not s.events("runtime_release_requested")
        assert "busy (m: slot 0 processing)" in (s.node.broker.wait_reason("j") or "")
        # it ends (grace 0): asked, the memory comes back, the job runs
        s.until(lambda: s.job_done("j"), "the job after the completion", limit=40)
        assert request.result().status_code == 200  # never cut
        assert s.events("runtime_released")


def test_a_single_model_server_is_named_and_never_asked(tmp_path: Path) -> None:
    with brokered(tmp_path, 0.0, "--model", "solo=16") as s:
        s.until(lambda: s.held() == 16 * GIB and s.row()["state"] == "idle", "its memory, named")
        assert s.row()["release"] == "not-releasable"
        assert s.proc.pid in s.row()["pids"]  # type: ignore[operator]
        big_job(s)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            s.node.broker.tick()
            time.sleep(0.05)
        reason = s.node.broker.wait_reason("j") or ""
        assert "The runtime llama holds 16.0 GiB" in reason, reason
        assert "cannot be asked to release" in reason, reason
        assert not s.events("runtime_release_requested")
        record = s.node.store.get_job("j")
        assert record is not None and record.state is JobState.QUEUED
