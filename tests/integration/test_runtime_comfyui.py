"""ComfyUIClient against the ComfyUI stand-in (tests/standins/comfyui.py) on the
simulated GPU: what the client says is checked against the device's own
per-process readings, never against what the stand-in says of itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gpuwarden.core.model import GIB
from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety
from gpuwarden.gpu.sim import SimGpuConfig, SimProbe
from gpuwarden.runtimes.base import RuntimeApiError
from gpuwarden.runtimes.comfyui import ComfyUIClient

ROOT = Path(__file__).resolve().parents[2]
#: how long a condition may take to come true on a loaded machine (not a speed check)
PATIENCE_S = 60.0


def wait_until(what: str, check: Callable[[], bool]) -> None:
    end = time.monotonic() + PATIENCE_S
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@dataclass
class Standin:
    proc: subprocess.Popen[str]
    url: str
    probe: SimProbe
    gpu: str
    client: ComfyUIClient

    def held(self) -> dict[int, int]:
        """The device's own per-process reading of the stand-in's GPU."""
        reading = next(r for r in self.probe.read() if r.uuid == self.gpu)
        return {p.pid: p.used_bytes for p in reading.processes}

    def tree(self) -> set[int]:
        return {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}

    def tree_held(self) -> dict[int, int]:
        tree = self.tree()
        return {pid: n for pid, n in self.held().items() if pid in tree}

    def prompt(self, model_gib: float, work_s: float) -> dict[str, Any]:
        body = {"prompt": {"9": {"class_type": "SaveImage", "inputs": {}}}}
        body["extra_data"] = {"model_gib": model_gib, "work_s": work_s}
        answer = httpx.post(self.url + "/prompt", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        out: dict[str, Any] = answer.json()
        return out


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Standin]:
    probe = SimProbe(tmp_path / "simgpu.json", SimGpuConfig(vram_bytes=24 * GIB))
    gpu = probe.device.uuids()[0]
    env = dict(os.environ, **probe.job_env(gpu))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.standins.comfyui", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), line
    url = line.split()[-1]
    client = ComfyUIClient(url, timeout_s=10)
    try:
        yield Standin(proc, url, probe, gpu, client)
        # the stand-in (and its worker child) lived through the case
        assert proc.poll() is None, "the stand-in exited"
        assert client.read().activity in (Activity.IDLE, Activity.BUSY)
        assert len(psutil.Process(proc.pid).children()) == 1, "the worker child is gone"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_probe_says_exact_busy_signal_and_release_that_waits(standin: Standin) -> None:
    caps = standin.client.probe()
    assert caps.busy_signal is BusySignal.EXACT
    assert caps.release is ReleaseSafety.WAITS
    assert caps.releasable
    assert any("/queue" in n for n in caps.notes) and any("/free" in n for n in caps.notes)


def test_a_prompt_loads_the_model_in_a_child_busy_then_idle(standin: Standin) -> None:
    assert standin.held() == {}
    assert standin.client.read().activity is Activity.IDLE
    standin.prompt(model_gib=2, work_s=3)
    wait_until("the model is on the GPU", lambda: bool(standin.held()))
    busy = standin.client.read()
    held = standin.held()
    # the memory is the worker child's, a descendant of the stand-in, not its own
    [(pid, nbytes)] = held.items()
    assert nbytes == 2 * GIB
    assert pid != standin.proc.pid and pid in standin.tree()
    assert busy.activity is Activity.BUSY, busy
    assert busy.detail == "queue_running has 1 prompt"
    wait_until("the prompt ended", lambda: standin.client.read().activity is Activity.IDLE)
    idle = standin.client.read()
    assert idle.detail == "queue empty"
    # ComfyUI keeps its models loaded between prompts: the memory stays
    assert standin.tree_held() == {pid: 2 * GIB}


def test_pending_prompts_are_busy_too(standin: Standin) -> None:
    standin.prompt(model_gib=1, work_s=3)
    standin.prompt(model_gib=1, work_s=0)
    standin.prompt(model_gib=1, work_s=0)
    wait_until("the first prompt runs", lambda: bool(standin.held()))
    reading = standin.client.read()
    assert reading.activity is Activity.BUSY
    assert reading.detail == "queue_running has 1 prompt, queue_pending has 2 prompts"
    wait_until("all ended", lambda: standin.client.read().activity is Activity.IDLE)


def test_release_during_a_prompt_acts_after_it_ends(standin: Standin) -> None:
    standin.prompt(model_gib=3, work_s=4)
    wait_until("the model is on the GPU", lambda: bool(standin.tree_held()))
    asked = standin.client.release()
    # /free answered at once: the prompt still runs and the model is still held
    during = standin.client.read()
    held_during = standin.tree_held()
    assert asked.calls == ("POST /free",)
    assert during.activity is Activity.BUSY, "the prompt ended before the check"
    assert list(held_during.values()) == [3 * GIB]
    wait_until("the prompt ended", lambda: standin.client.read().activity is Activity.IDLE)
    wait_until("the model left the GPU", lambda: standin.held() == {})
    assert standin.tree(), "the worker child itself lives on"


def test_release_when_idle_unloads_and_the_next_prompt_reloads(standin: Standin) -> None:
    standin.prompt(model_gib=1, work_s=0)
    wait_until("idle with the model", lambda: bool(standin.tree_held()))
    wait_until("idle", lambda: standin.client.read().activity is Activity.IDLE)
    assert standin.tree_held()
    standin.client.release()
    wait_until("the model left the GPU", lambda: standin.held() == {})
    standin.prompt(model_gib=1, work_s=0)
    wait_until("reloaded", lambda: list(standin.tree_held().values()) == [GIB])


def test_system_stats_is_the_whole_device_not_the_runtime(standin: Standin) -> None:
    standin.prompt(model_gib=2, work_s=0)
    wait_until("the model is on the GPU", lambda: bool(standin.tree_held()))
    # a second process's memory on the same GPU (the test's own)
    other = standin.probe.device.allocate(standin.gpu, 3 * GIB, os.getpid(), label="other")
    held = standin.held()
    assert held[os.getpid()] == 3 * GIB and sum(standin.tree_held().values()) == 2 * GIB
    [hint] = standin.client.vram_hint()
    assert hint.vram_total == 24 * GIB
    # vram_free counts the other process's memory too: total - free is not ComfyUI's
    assert hint.vram_total - hint.vram_free == 5 * GIB
    standin.probe.device.free(other)
    [hint] = standin.client.vram_hint()
    assert hint.vram_total - hint.vram_free == 2 * GIB


def test_interrupt_exists_and_is_not_a_release(standin: Standin) -> None:
    standin.prompt(model_gib=1, work_s=30)
    wait_until("running", lambda: bool(standin.tree_held()))
    assert httpx.post(standin.url + "/interrupt", timeout=10).status_code == 200
    wait_until("the prompt was cut", lambda: standin.client.read().activity is Activity.IDLE)
    assert list(standin.tree_held().values()) == [GIB]


def test_a_prompt_without_prompt_is_refused_as_comfyui_does(standin: Standin) -> None:
    answer = httpx.post(standin.url + "/prompt", json={"extra_data": {}}, timeout=10)
    assert answer.status_code == 400
    assert answer.json() == {"error": "no prompt", "node_errors": []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_unreachable_url_is_a_runtime_api_error_naming_it() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass  # the fault: nothing listens there
    client = ComfyUIClient(url, timeout_s=2)
    for call in (client.read, client.probe, client.release):
        with pytest.raises(RuntimeApiError, match=f"comfyui at {url}"):
            call()
    client.close()


def mocked(handler: Callable[[httpx.Request], httpx.Response]) -> tuple[ComfyUIClient, list[str]]:
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return handler(request)

    client = ComfyUIClient("http://comfy.test", transport=httpx.MockTransport(record))
    return client, seen


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"queue_running": None, "queue_pending": []}, "no queue_running list"),
        ({"queue_running": [], "queue_pending": "x"}, "no queue_pending list"),
        ([], "no JSON object"),
    ],
)
def test_a_queue_that_is_not_comfyuis_is_a_clear_error(body: Any, error: str) -> None:
    client, seen = mocked(lambda r: httpx.Response(200, json=body))
    with pytest.raises(RuntimeApiError, match=error):
        client.read()
    assert seen == ["GET /queue"]


@pytest.mark.parametrize(
    "device",
    [{"vram_total": "24G", "vram_free": 1}, {"vram_total": -1, "vram_free": 0}, "gpu"],
)
def test_system_stats_without_byte_counts_is_a_clear_error(device: Any) -> None:
    client, seen = mocked(lambda r: httpx.Response(200, json={"devices": [device]}))
    with pytest.raises(RuntimeApiError, match="without vram_total/vram_free"):
        client.vram_hint()
    assert seen == ["GET /system_stats"]


def test_free_refused_is_a_clear_error() -> None:
    client, seen = mocked(lambda r: httpx.Response(403, text="forbidden"))
    with pytest.raises(RuntimeApiError, match="POST /free answered 403: forbidden"):
        client.release()
    assert seen == ["POST /free"]


def test_release_sends_both_flags() -> None:
    bodies: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(200)

    client, seen = mocked(answer)
    client.release()
    assert seen == ["POST /free"]
    assert [json.loads(b) for b in bodies] == [{"unload_models": True, "free_memory": True}]
