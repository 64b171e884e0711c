"""OllamaClient against the Ollama stand-in (tests/standins/ollama.py) on a simulated
GPU: what the client says is checked against the device's own per-process readings,
never against the stand-in's account of itself."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gpuwarden.core.model import GIB
from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety
from gpuwarden.gpu.base import GpuReading
from gpuwarden.gpu.sim import SimGpuConfig, SimProbe
from gpuwarden.runtimes.base import RuntimeApiError
from gpuwarden.runtimes.ollama import OllamaClient

REPO = Path(__file__).resolve().parents[2]
TINY = 2 * GIB
#: the seconds of "work" of a request that must still run while the test looks
LONG_REQUEST_S = 8.0
#: how long the memory must stay put after a release asked during that request
#: (an unload that did not wait frees it in well under this on the simulated GPU)
HOLD_S = 2.0
#: the stand-in's catalogue: one model all on the GPU, one half on the CPU
MODELS = ("--model", f"tiny={TINY}", "--model", f"half={TINY}@0.5")


@dataclass
class Standin:
    proc: subprocess.Popen[str]
    url: str
    probe: SimProbe

    def device(self) -> GpuReading:
        return self.probe.read()[0]

    def usage(self) -> dict[int, int]:
        return {p.pid: p.used_bytes for p in self.device().processes}

    def children(self) -> set[int]:
        return {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}


def wait_for(what: str, check: Callable[[], bool], limit_s: float = 30.0) -> None:
    """Poll ``check`` until it holds (a deadline against a hang, not a speed test)."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened within {limit_s} s: {what}")
        time.sleep(0.05)


def stays_for(seconds: float, check: Callable[[], bool]) -> None:
    """``check`` holds at every poll for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check()
        time.sleep(0.05)


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Standin]:
    probe = SimProbe(tmp_path / "simgpu.json", SimGpuConfig(vram_bytes=24 * GIB))
    env = {**os.environ, **probe.job_env(probe.read()[0].uuid)}
    env.pop("OLLAMA_KEEP_ALIVE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.standins.ollama", "--port", "0", *MODELS],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("listening on http://127.0.0.1:"), line
    try:
        yield Standin(proc, line.removeprefix("listening on "), probe)
        # every case leaves the runtime alive: nothing here ever kills it
        assert proc.poll() is None, "the Ollama stand-in died"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def client(standin: Standin) -> Iterator[OllamaClient]:
    c = OllamaClient(standin.url, timeout_s=30.0)
    yield c
    c.close()


def generate(url: str, **body: Any) -> dict[str, Any]:
    answer = httpx.post(f"{url}/api/generate", json={"stream": False, **body}, timeout=60)
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


def test_probe_says_heuristic_busy_and_waiting_release(client: OllamaClient) -> None:
    caps = client.probe()
    assert caps.busy_signal is BusySignal.HEURISTIC
    assert caps.release is ReleaseSafety.WAITS
    assert caps.releasable
    assert any("GET /api/ps answered" in note for note in caps.notes)
    assert any("/api/version answered" in note for note in caps.notes)


def test_preload_puts_the_memory_on_a_runner_child(standin: Standin, client: OllamaClient) -> None:
    assert standin.usage() == {}
    client.preload("tiny")
    usage = standin.usage()
    assert list(usage.values()) == [TINY]
    [runner] = usage
    assert runner != standin.proc.pid
    assert runner in standin.children()
    reading = client.read()
    assert reading.activity is Activity.UNKNOWN
    [loaded] = reading.loaded
    assert (loaded.name, loaded.size_bytes, loaded.vram_bytes) == ("tiny:latest", TINY, TINY)
    assert client.placement("tiny") == 1.0
    # Ollama's default keep-alive: 5 min from the end of the (pre)load
    assert 250 < seconds_left(loaded.expires_at) <= 300


def seconds_left(expires_at: str | None) -> float:
    assert expires_at is not None
    return (datetime.fromisoformat(expires_at) - datetime.now(UTC)).total_seconds()


def test_placement_reads_a_model_partly_on_the_cpu(standin: Standin, client: OllamaClient) -> None:
    client.preload("half:latest", "10m")
    assert list(standin.usage().values()) == [TINY // 2]
    assert client.placement("half") == 0.5
    assert 550 < seconds_left(client.read().loaded[0].expires_at) <= 600  # "10m"
    with pytest.raises(RuntimeApiError, match="does not list tiny as loaded"):
        client.placement("tiny")


def test_release_waits_for_the_request_in_flight(standin: Standin, client: OllamaClient) -> None:
    # the request loads the model itself: once the model is listed, it is in flight
    request, answers = in_flight(standin.url, model="tiny", prompt="hi", delay_s=LONG_REQUEST_S)
    wait_for("the request's model on the device", lambda: TINY in standin.usage().values())
    [runner] = standin.usage()
    client.read()
    asked = client.release()
    assert asked.models == ("tiny:latest",)
    assert asked.calls == ("POST /api/generate tiny:latest keep_alive=0",)
    # the moment in flight: the memory and the model stay
    after_ask = client.read()
    stays_for(HOLD_S, lambda: standin.usage() == {runner: TINY} and psutil.pid_exists(runner))
    assert [m.name for m in after_ask.loaded] == ["tiny:latest"]
    assert "past expires_at" in after_ask.detail
    assert not after_ask.worked, "the release moving expires_at back is not work"
    assert request.is_alive(), f"the request ended before the checks: raise {LONG_REQUEST_S=}"
    # the moment after: the request ends whole, then the memory goes
    request.join(timeout=60)
    assert [a["done_reason"] for a in answers] == ["stop"]
    wait_for("the runner's memory freed", lambda: standin.device().used_bytes == 0)
    assert client.read().loaded == ()
    assert not psutil.pid_exists(runner) or psutil.Process(runner).status() == "zombie"


def in_flight(url: str, **body: Any) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """A generate request running in a thread of its own, and where its answer goes."""
    answers: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: answers.append(generate(url, **body)))
    thread.start()
    return thread, answers


def test_expires_at_moves_while_a_first_request_runs(
    standin: Standin, client: OllamaClient
) -> None:
    # sched.go loadedModels: no expiresAt yet, so it is listed as now + keep_alive
    request, _ = in_flight(standin.url, model="tiny", prompt="hi", delay_s=LONG_REQUEST_S)
    wait_for("the request's model on the device", lambda: TINY in standin.usage().values())
    first = client.read()
    time.sleep(0.01)
    second = client.read()
    assert request.is_alive(), f"the request ended before the reads: raise {LONG_REQUEST_S=}"
    assert first.loaded[0].expires_at != second.loaded[0].expires_at
    assert second.worked
    request.join(timeout=60)


def test_a_pin_during_a_pending_release_cancels_it(standin: Standin, client: OllamaClient) -> None:
    request, answers = in_flight(standin.url, model="tiny", prompt="hi", delay_s=LONG_REQUEST_S)
    wait_for("the request's model on the device", lambda: TINY in standin.usage().values())
    [runner] = standin.usage()
    client.read()
    client.release()
    assert "past expires_at" in client.read().detail  # the release is pending
    # sched.go useLoadedRunner: a request's keep_alive replaces the pending zero
    assert generate(standin.url, model="tiny", keep_alive=-1)["done_reason"] == "load"
    assert request.is_alive(), f"the request ended before the pin: raise {LONG_REQUEST_S=}"
    request.join(timeout=60)
    assert [a["done_reason"] for a in answers] == ["stop"]
    reading = client.read()
    assert reading.worked
    assert seconds_left(reading.loaded[0].expires_at) > 100 * 365 * 86400  # forever
    stays_for(HOLD_S, lambda: standin.usage() == {runner: TINY})


def test_an_idle_release_unloads(standin: Standin, client: OllamaClient) -> None:
    client.preload("tiny")
    assert standin.device().used_bytes == TINY
    client.release()
    wait_for("the runner's memory freed", lambda: standin.device().used_bytes == 0)
    assert client.read().loaded == ()
    assert client.release().calls == ()


def test_worked_is_seen_after_a_request(standin: Standin, client: OllamaClient) -> None:
    client.preload("tiny")
    assert not client.read().worked  # the first read is the baseline
    assert not client.read().worked  # nothing happened
    before = client.read().loaded[0].expires_at
    time.sleep(0.01)  # expires_at has microseconds: let the clock move past it
    assert generate(standin.url, model="tiny", prompt="hi")["done_reason"] == "stop"
    seen = client.read()
    assert seen.loaded[0].expires_at != before
    assert seen.worked
    assert not client.read().worked


def test_a_model_repinned_after_release_reloads(standin: Standin, client: OllamaClient) -> None:
    client.preload("tiny")
    [first] = standin.usage()
    client.read()
    client.release()
    wait_for("the runner's memory freed", lambda: standin.device().used_bytes == 0)
    assert not client.read().worked
    # a client of the runtime's own pins it again (the "reloaded during handoff" case)
    assert generate(standin.url, model="tiny", keep_alive=-1)["done_reason"] == "load"
    usage = standin.usage()
    assert list(usage.values()) == [TINY]
    [second] = usage
    assert second != first
    assert second in standin.children()
    reading = client.read()
    assert reading.worked, "a model that appeared is a sign of work"
    expires = reading.loaded[0].expires_at
    assert expires is not None and datetime.fromisoformat(expires).year > 2200  # forever


def test_unreachable_url_names_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))  # the fault is real: nothing listens there
    url = f"http://127.0.0.1:{port}"
    client = OllamaClient(url, timeout_s=2.0)
    with pytest.raises(RuntimeApiError, match=re.escape(f"ollama at {url}: GET /api/ps failed")):
        client.probe()
    with pytest.raises(RuntimeApiError, match=re.escape(url)):
        client.release()
    client.close()


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (500, b'{"error":"boom"}', "answered 500"),
        (200, b"<html>", "not JSON"),
        (200, b'{"models": 3}', "no 'models' list"),
        (200, b'{"models": [{"size": 1}]}', "without a name"),
        (200, b'{"models": [{"name": "m", "size": -1}]}', "negative"),
        (200, b'{"models": [{"name": "m", "size_vram": "lots"}]}', "not a number"),
        (200, b'{"models": [{"name": "m", "expires_at": 5}]}', "not a time"),
    ],
)
def test_bad_answers_are_clear_errors(status: int, body: bytes, said: str) -> None:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(status, content=body)

    client = OllamaClient("http://ollama.test", transport=httpx.MockTransport(answer))
    with pytest.raises(RuntimeApiError, match=said):
        client.read()
    assert asked == ["/api/ps"]  # the bad answer was really given


def test_a_release_not_acknowledged_is_an_error() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/ps":
            return httpx.Response(200, json={"models": [{"name": "m:latest", "size": 1}]})
        return httpx.Response(200, json={"model": "m", "done": True, "done_reason": "stop"})

    client = OllamaClient("http://ollama.test", transport=httpx.MockTransport(answer))
    with pytest.raises(RuntimeApiError, match="not done_reason 'unload'"):
        client.release()


def test_unknown_model_is_the_runtimes_404(standin: Standin, client: OllamaClient) -> None:
    with pytest.raises(RuntimeApiError, match=r"answered 404.*model 'nope' not found"):
        client.preload("nope")
    assert standin.usage() == {}
