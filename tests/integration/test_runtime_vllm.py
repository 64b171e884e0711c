"""The vLLM client against the vLLM stand-in (tests/standins/vllm.py) on the
simulated GPU: what it says is checked against the device's own per-process
readings, as the broker reads them (the engine core, a child of the server, holds
the memory; after a sleep a residual stays)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

import gpuwarden
from gpuwarden.core.model import GIB, MIB
from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety
from gpuwarden.gpu.sim import SimGpuConfig, SimProbe
from gpuwarden.runtimes.base import RuntimeApiError
from gpuwarden.runtimes.vllm import (
    NO_SLEEP_NOTE,
    RUNNING,
    WAITING,
    VllmClient,
    parse_prometheus,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC_DIR = str(Path(gpuwarden.__file__).resolve().parent.parent)
WEIGHTS = GIB // 2
KV = GIB
RESIDUAL = 64 * MIB
FULL = WEIGHTS + KV + RESIDUAL
#: the most any wait below lasts (a bound on waiting, not an assertion on speed)
WAIT_S = 60.0


@dataclass
class Standin:
    proc: subprocess.Popen[str]
    url: str
    probe: SimProbe
    client: VllmClient

    def held(self) -> dict[int, int]:
        """Bytes per pid on the device, as the broker's probe reads them."""
        (reading,) = self.probe.read()
        return {p.pid: p.used_bytes for p in reading.processes}

    def engine_pid(self) -> int:
        """The one descendant of the server that holds memory: its engine core."""
        kids = {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        holders = [pid for pid in self.held() if pid in kids]
        assert len(holders) == 1, (self.held(), kids)
        return holders[0]

    def engine_bytes(self) -> int:
        held = self.held()
        assert self.proc.pid not in held  # the HTTP server itself holds nothing
        return held.get(self.engine_pid(), 0) if held else 0


@dataclass
class Completion:
    """One completion request run in a thread, and what it got."""

    url: str
    delay_s: float
    response: httpx.Response | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        self.response = httpx.post(
            f"{self.url}/v1/completions",
            json={"model": "standin/tiny-llm", "prompt": "hi", "delay_s": self.delay_s},
            timeout=WAIT_S,
        )

    def result(self) -> httpx.Response:
        self.thread.join(WAIT_S)
        assert self.response is not None
        return self.response


def start(
    tmp_path: Path, *, sleep_mode: bool, dev_mode: bool, api_key: str | None = None
) -> Standin:
    probe = SimProbe(tmp_path / "simgpu.json", SimGpuConfig(count=1, vram_bytes=8 * GIB))
    env = dict(os.environ)
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    env.update(probe.job_env(probe.device.uuids()[0]))
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    command = [sys.executable, "-m", "tests.standins.vllm", "--port", "0"]
    command += ["--weights-gib", str(WEIGHTS / GIB), "--kv-gib", str(KV / GIB)]
    command += ["--residual-mib", str(RESIDUAL / MIB)]
    if sleep_mode:
        command.append("--enable-sleep-mode")
    if api_key:
        command += ["--api-key", api_key]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait(timeout=WAIT_S)
        pytest.fail(f"the stand-in did not start: {line!r}")
    url = line.split()[-1]
    return Standin(proc, url, probe, VllmClient(url, token=api_key, timeout_s=WAIT_S))


def stop(standin: Standin) -> None:
    standin.client.close()
    alive = standin.proc.poll() is None
    standin.proc.terminate()
    standin.proc.wait(timeout=WAIT_S)
    assert alive, "the stand-in died during the test"


@pytest.fixture
def vllm(tmp_path: Path) -> Iterator[Standin]:
    standin = start(tmp_path, sleep_mode=True, dev_mode=True)
    yield standin
    stop(standin)


def wait_busy(standin: Standin) -> None:
    deadline = time.monotonic() + WAIT_S
    while standin.client.read().activity is not Activity.BUSY:
        assert time.monotonic() < deadline, "the request never showed as running"
        time.sleep(0.02)


# -- probing ---------------------------------------------------------------------


def test_without_dev_mode_it_is_not_releasable(tmp_path: Path) -> None:
    standin = start(tmp_path, sleep_mode=True, dev_mode=False)
    try:
        assert standin.engine_bytes() == FULL
        caps = standin.client.probe()
        assert caps.busy_signal is BusySignal.EXACT
        assert caps.release is ReleaseSafety.NOT_RELEASABLE
        assert not caps.releasable
        assert any(
            "started without --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1" in n
            for n in caps.notes
        )
        with pytest.raises(RuntimeApiError) as raised:
            standin.client.release()
        assert NO_SLEEP_NOTE in str(raised.value)
        # idle, so the re-read lets it through to release, which refuses the same way
        assert standin.client.read().activity is Activity.IDLE
        with pytest.raises(RuntimeApiError, match="cannot be asked to release"):
            standin.client.release_if_idle()
        assert standin.client.call("POST", "/sleep").status_code == 404  # no route at all
        assert standin.engine_bytes() == FULL  # nothing was freed
    finally:
        stop(standin)


def test_dev_mode_without_sleep_mode_fails_at_the_sleep(tmp_path: Path) -> None:
    standin = start(tmp_path, sleep_mode=False, dev_mode=True)
    try:
        caps = standin.client.probe()
        # the routes answer, so the probe cannot tell; the sleep itself says it
        assert caps.release is ReleaseSafety.ABORTS
        assert standin.client.is_sleeping() is False
        with pytest.raises(RuntimeApiError, match=r"answered 500.*--enable-sleep-mode"):
            standin.client.release()
        assert standin.engine_bytes() == FULL
    finally:
        stop(standin)


def test_probe_with_sleep_mode(vllm: Standin) -> None:
    caps = vllm.client.probe()
    assert caps.busy_signal is BusySignal.EXACT
    assert caps.release is ReleaseSafety.ABORTS
    assert any("aborts requests in flight" in n for n in caps.notes)
    reading = vllm.client.read()
    assert reading.activity is Activity.IDLE
    assert reading.detail == "0 running, 0 waiting"
    assert [m.name for m in reading.loaded] == ["standin/tiny-llm"]
    assert vllm.engine_bytes() == FULL


# -- busy, idle, sleep, wake -----------------------------------------------------------


def test_release_if_idle_refuses_while_busy_and_the_request_completes(vllm: Standin) -> None:
    vllm.client.probe()
    request = Completion(vllm.url, delay_s=1.0)
    wait_busy(vllm)
    reading = vllm.client.read()
    assert reading.activity is Activity.BUSY
    assert reading.detail == "1 running, 0 waiting"
    assert vllm.client.release_if_idle() is None
    response = request.result()
    assert response.status_code == 200, response.text  # not aborted
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert vllm.client.is_sleeping() is False
    assert vllm.engine_bytes() == FULL


def test_release_when_idle_leaves_the_residual_and_wake_brings_it_back(vllm: Standin) -> None:
    vllm.client.probe()
    engine = vllm.engine_pid()
    asked = vllm.client.release_if_idle()
    assert asked is not None
    assert asked.calls == ("POST /sleep?level=1",)
    assert vllm.client.is_sleeping() is True
    # the memory went, but not all of it: the broker must count what stays
    assert vllm.held() == {engine: RESIDUAL}
    assert vllm.client.read().activity is Activity.IDLE
    vllm.client.wake()
    assert vllm.client.is_sleeping() is False
    assert vllm.held() == {engine: FULL}
    response = Completion(vllm.url, delay_s=0.0).result()
    assert response.status_code == 200, response.text


def test_sleep_with_work_in_flight_aborts_it(vllm: Standin) -> None:
    """Why the broker re-reads the metrics: vLLM's /sleep aborts by default."""
    vllm.client.probe()
    request = Completion(vllm.url, delay_s=WAIT_S)
    wait_busy(vllm)
    vllm.client.release()  # not release_if_idle: the fault itself
    response = request.result()
    assert response.status_code == 500
    assert "aborted" in response.json()["error"]["message"]
    assert vllm.client.is_sleeping() is True
    assert vllm.engine_bytes() == RESIDUAL
    assert vllm.client.read().detail == "0 running, 0 waiting"


def test_a_request_while_asleep_waits_for_the_wake(vllm: Standin) -> None:
    vllm.client.probe()
    assert vllm.client.release() is not None
    request = Completion(vllm.url, delay_s=0.0)
    deadline = time.monotonic() + WAIT_S
    while (reading := vllm.client.read()).detail != "0 running, 1 waiting":
        assert time.monotonic() < deadline, reading
        time.sleep(0.02)
    assert reading.activity is Activity.BUSY
    assert vllm.client.release_if_idle() is None  # a waiting request counts
    vllm.client.wake()
    assert request.result().status_code == 200
    assert vllm.engine_bytes() == FULL


def test_api_key_guards_only_the_v1_routes(tmp_path: Path) -> None:
    """vLLM's --api-key covers /v1 only: the sleep routes answer anyone."""
    standin = start(tmp_path, sleep_mode=True, dev_mode=True, api_key="sekrit")
    try:
        bare = VllmClient(standin.url)
        refused = bare.call("POST", "/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 401  # the fault: no key
        assert bare.probe().release is ReleaseSafety.ABORTS  # /metrics, /is_sleeping: open
        bare.close()
        keyed = standin.client.call("POST", "/v1/completions", json={"delay_s": 0})
        assert keyed.status_code == 200, keyed.text
        assert standin.client.release_if_idle() is not None
        assert standin.engine_bytes() == RESIDUAL
    finally:
        stop(standin)


# -- faults at the edge -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_unreachable_url_is_a_runtime_api_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with socket.socket() as sock:  # the fault: nothing listens there
        assert sock.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0
    client = VllmClient(url, timeout_s=2.0)
    with pytest.raises(RuntimeApiError, match=r"vllm at .*GET /metrics failed"):
        client.probe()
    with pytest.raises(RuntimeApiError, match=r"GET /metrics failed"):
        client.read()
    client.close()


def mock(routes: dict[str, httpx.Response]) -> VllmClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return routes.get(request.url.path, httpx.Response(404, json={"detail": "Not Found"}))

    return VllmClient("http://vllm.test", transport=httpx.MockTransport(answer))


def test_metrics_that_are_not_prometheus_text() -> None:
    client = mock({"/metrics": httpx.Response(200, text="<html>hello</html>\n")})
    with pytest.raises(RuntimeApiError, match="not Prometheus text: line 1"):
        client.read()


def test_metrics_without_the_gauges_are_unknown_and_not_releasable() -> None:
    client = mock({"/metrics": httpx.Response(200, text="other_metric 1\n")})
    caps = client.probe()
    assert caps.busy_signal is BusySignal.NONE
    assert caps.release is ReleaseSafety.NOT_RELEASABLE
    reading = client.read()
    assert reading.activity is Activity.UNKNOWN
    assert client.release_if_idle() is None


def test_sleep_route_gone_since_the_probe() -> None:
    routes = {
        "/metrics": httpx.Response(200, text=f"{RUNNING} 0\n{WAITING} 0\n"),
        "/is_sleeping": httpx.Response(200, json={"is_sleeping": False}),
    }
    client = mock(routes)
    assert client.probe().releasable
    del routes["/is_sleeping"]  # the fault: restarted without VLLM_SERVER_DEV_MODE
    with pytest.raises(RuntimeApiError, match=r"POST /sleep\?level=1 answered 404"):
        client.release_if_idle()
    assert client.capabilities is None  # probed afresh next time
    with pytest.raises(RuntimeApiError, match="cannot be asked to release"):
        client.release()


def test_is_sleeping_that_is_not_a_bool() -> None:
    client = mock(
        {
            "/metrics": httpx.Response(200, text="vllm:num_requests_running 0\n"),
            "/is_sleeping": httpx.Response(200, json={"is_sleeping": "no"}),
        }
    )
    with pytest.raises(RuntimeApiError, match="is_sleeping"):
        client.probe()


def test_parse_prometheus() -> None:
    text = (
        "# HELP x y\n# TYPE vllm:num_requests_running gauge\n\n"
        'vllm:num_requests_running{model_name="a \\"b\\"",engine="0"} 2.0\n'
        'vllm:num_requests_waiting{model_name="c,}"} 1 1700000000000\n'
        "plain 3e2\n"
    )
    assert parse_prometheus(text) == [
        ("vllm:num_requests_running", {"model_name": 'a "b"', "engine": "0"}, 2.0),
        ("vllm:num_requests_waiting", {"model_name": "c,}"}, 1.0),
        ("plain", {}, 300.0),
    ]
    for bad in ("name{a=b} 1", "name one", 'name{a="b" 1', "1name 2"):
        with pytest.raises(ValueError, match="line 1"):
            parse_prometheus(bad)
