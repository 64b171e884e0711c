"""Acceptance (issue 15): release on demand with the real ``gpuwarden serve``.

Each case runs the broker as a subprocess on one simulated GPU with a SQLite
store, beside runtime stand-ins (tests/standins: ComfyUI, Ollama, vLLM) started
as subprocesses on free ports, each holding its model memory in a child process
on that simulated GPU. Everything is checked through the command line
(``status --json``, ``preview``, ``explain``, ``show --json``, ``runtimes
--json``, ``submit``) and the event log (``serve --log``), and every case ends
with the runtime still alive and answering: gpuwarden asks, it never kills.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden.core.model import GIB
from gpuwarden.gpu.select import SIM_STATE_FILE
from tests.acceptance.test_cli import REPO, Broker, env, run, write_config

#: what a runtime's model takes on the 24 GiB simulated GPU, and what the waiting
#: job needs: together they overfill its budget (24 GiB less 512 MiB reserve)
MODEL_GIB = 16
JOB_GIB = 12
Event = dict[str, Any]


def until(check: Callable[[], Any], what: str, limit: float = 20.0) -> Any:
    """Poll ``check`` until it returns something true; return that. Fail past
    ``limit`` seconds (a deadline against a hang, not a speed test)."""
    deadline = time.monotonic() + limit
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {limit} s waiting for {what}"
        time.sleep(0.05)
    return got


class Stack:
    """One simulated GPU, the runtime stand-ins on it, and ``gpuwarden serve``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.config = write_config(tmp, grace=2)
        self.log = tmp / "events.jsonl"
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.broker: Broker | None = None
        # with no broker running, preview reads the probe now: that creates the
        # simulated GPU (in the state directory) the stand-ins allocate on, and
        # names it; the broker re-opens the same device, allocations kept
        r = self.cli("preview", "testmods.gpu", "--vram-gib", str(JOB_GIB))
        m = re.search(r"would start now on (GPU-\S+)", r.stdout)
        assert r.returncode == 0 and m, r.stdout + r.stderr
        self.gpu = m.group(1)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run("--config", self.config, *args, timeout=30)

    # -- the runtimes ---------------------------------------------------------------

    def standin(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> str:
        """Start ``tests.standins.NAME`` on a free port; return its URL."""
        proc = subprocess.Popen(
            [sys.executable, "-m", f"tests.standins.{name}", "--port", "0", *args],
            cwd=REPO,
            env={
                **env(),
                "GPUWARDEN_SIM_GPU": str(self.tmp / "state" / SIM_STATE_FILE),
                "CUDA_VISIBLE_DEVICES": self.gpu,
                **(extra_env or {}),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs[name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on http://"), f"{name} stand-in said {line!r}"
        return line.removeprefix("listening on ")

    def assert_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"the {name} stand-in died (exit {proc.returncode})"

    # -- the broker -----------------------------------------------------------------

    def serve(self, runtime: str) -> Broker:
        """Register ``runtime`` (a [[runtimes]] table's body) and start the broker."""
        with self.config.open("a") as f:
            f.write(f"\n[[runtimes]]\n{runtime}\n")
        self.broker = Broker(self.config, self.log)
        return self.broker

    def events(self, kind: str) -> list[Event]:
        assert self.broker is not None
        return self.broker.events(kind)

    def node(self) -> dict[str, Any]:
        r = self.cli("status", "--json")
        assert r.stdout, r.stderr
        [node] = json.loads(r.stdout)["nodes"]
        return dict(node)

    def submit(self, job: str, *, seconds: float = 0.2) -> None:
        r = self.cli(
            *("submit", "testmods.gpu", "--id", job, "--vram-gib", str(JOB_GIB)),
            *("--gib", str(JOB_GIB), "--seconds", str(seconds)),
        )
        assert r.returncode == 0, r.stderr

    def job(self, job: str) -> dict[str, Any]:
        r = self.cli("show", job, "--json")
        assert r.returncode == 0, r.stderr
        return dict(json.loads(r.stdout))

    def close(self) -> None:
        if self.broker is not None and self.broker.proc.poll() is None:
            self.broker.proc.kill()
            self.broker.proc.wait(10)
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def named(node: dict[str, Any], runtime: str) -> int:
    """What ``status --json`` shows ``runtime`` holding on the node's one GPU."""
    [gpu] = node["gpus"]
    return sum(int(r["bytes"]) for r in gpu["runtimes"] if r["name"] == runtime)


def row(node: dict[str, Any], runtime: str) -> dict[str, Any]:
    [found] = [r for r in node["runtimes"] if r["name"] == runtime]
    return dict(found)


def holds_idle(
    s: Stack, runtime: str, nbytes: int, state: str = "idle", **more: Any
) -> Callable[[], Any]:
    """A check: the status shows ``runtime`` in ``state`` (not busy) and holding
    ``nbytes`` on the GPU, by name and not as foreign memory, with ``more`` of its
    row as given."""

    def check() -> dict[str, Any] | None:
        node = s.node()
        r = row(node, runtime)
        ok = named(node, runtime) == nbytes and r["state"] == state
        ok = ok and node["gpus"][0]["foreign_bytes"] == 0
        return node if ok and all(r[k] == v for k, v in more.items()) else None

    return check


def status_where(s: Stack, check: Callable[[dict[str, Any]], Any]) -> Callable[[], Any]:
    """A check for :func:`until`: the node's status once ``check`` holds of it."""

    def look() -> dict[str, Any] | None:
        node = s.node()
        return node if check(node) else None

    return look


def stop_and_check_alive(s: Stack) -> None:
    """The broker ends cleanly, and the runtime lives on after it."""
    s.assert_alive()
    assert s.broker is not None and s.broker.stop() == 0
    s.assert_alive()


def comfy_prompt(url: str, gib: float, work_s: float) -> None:
    r = httpx.post(
        f"{url}/prompt",
        json={"prompt": {"1": {}}, "extra_data": {"model_gib": gib, "work_s": work_s}},
        timeout=10,
    )
    r.raise_for_status()


def comfy_holds(url: str) -> int:
    """What the ComfyUI stand-in says its worker holds (torch's reserved bytes)."""
    stats = httpx.get(f"{url}/system_stats", timeout=10).json()
    return int(stats["devices"][0]["torch_vram_total"])


def comfy_runtime(url: str, grace_s: float) -> str:
    return (
        f'name = "comfy"\nkind = "comfyui"\nurl = "{url}"\n'
        f"idle_grace_s = {grace_s}\nrelease_timeout_s = 10"
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def comfy(stack: Stack) -> str:
    """The ComfyUI stand-in with a 16 GiB model loaded (a prompt that ended), idle."""
    url = stack.standin("comfyui")
    comfy_prompt(url, MODEL_GIB, 0)
    until(lambda: comfy_holds(url) == MODEL_GIB * GIB, "the ComfyUI model loaded")
    return url


def test_a_runtime_in_its_grace_is_not_asked_and_its_memory_is_named(
    stack: Stack, comfy: str
) -> None:
    s = stack
    s.serve(comfy_runtime(comfy, grace_s=120))
    node = until(holds_idle(s, "comfy", MODEL_GIB * GIB), "comfy's 16 GiB named in status")
    # its memory is the worker child's, on the device, counted by the runtime's name
    [gpu] = node["gpus"]
    comfy_row = row(node, "comfy")
    server = s.procs["comfyui"].pid
    holders = {p["pid"] for p in gpu["processes"]}
    assert server in comfy_row["pids"] and server not in holders
    assert holders and holders <= set(comfy_row["pids"])
    assert gpu["used_bytes"] == MODEL_GIB * GIB and gpu["foreign_bytes"] == 0
    assert comfy_row["may_be_asked"] is False and "in its grace" in comfy_row["why"]
    assert comfy_row["busy_signal"] == "exact" and comfy_row["release"] == "waits-for-inflight"

    said = s.cli("preview", "testmods.gpu", "--vram-gib", str(JOB_GIB)).stdout
    assert "would wait:" in said and "16.0 GiB by the runtime comfy" in said, said
    assert "The runtime comfy holds 16.0 GiB" in said and "not asked: in its grace" in said, said

    s.submit("grace-1")

    def waits_in_grace() -> str:
        said = s.cli("explain", "grace-1").stdout
        return said if "it waits:" in said and "in its grace" in said else ""

    said = until(waits_in_grace, "explain to say it waits on the runtime's grace")
    assert "grace-1 (testmods.gpu) is queued" in said
    assert "The runtime comfy holds 16.0 GiB" in said and "not asked: in its grace" in said, said
    node = until(status_where(s, lambda n: "grace-1" in n["waiting"]), "the wait in status")
    assert "in its grace" in node["waiting"]["grace-1"]
    # the job goes on waiting, the runtime is not asked, and its memory stays put
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert not s.events("runtime_release_requested")
        time.sleep(0.2)
    node = s.node()
    assert named(node, "comfy") == MODEL_GIB * GIB and not node["running"]
    assert s.job("grace-1")["state"] == "queued"
    assert comfy_holds(comfy) == MODEL_GIB * GIB
    stop_and_check_alive(s)


def test_a_runtime_past_its_grace_is_asked_and_the_waiting_job_gets_the_room(
    stack: Stack, comfy: str
) -> None:
    s = stack
    s.serve(comfy_runtime(comfy, grace_s=1))
    until(
        holds_idle(s, "comfy", MODEL_GIB * GIB, may_be_asked=True),
        "comfy's 16 GiB named, past its grace",
    )
    listed = json.loads(s.cli("runtimes", "--json").stdout)["runtimes"]
    [mine] = [r for r in listed if r["name"] == "comfy"]
    assert mine["memory"] == {s.gpu: MODEL_GIB * GIB} and mine["state"] == "idle"
    # preview says whom the broker would ask, and asks nothing
    said = s.cli("preview", "testmods.gpu", "--vram-gib", str(JOB_GIB)).stdout
    assert f"Asking the runtime(s) comfy to release 16.0 GiB on {s.gpu}" in said, said
    assert not s.events("runtime_release_requested")

    s.submit("past-1")
    asked = until(lambda: s.events("runtime_release_requested"), "the ask")
    assert [(a["runtime"], a["gpu"], a["bytes"], a["job"]) for a in asked] == [
        ("comfy", s.gpu, MODEL_GIB * GIB, "past-1")
    ]
    [sent] = until(lambda: s.events("runtime_release_sent"), "the release call")
    assert (sent["runtime"], sent["calls"]) == ("comfy", "POST /free")
    [released] = until(lambda: s.events("runtime_released"), "the memory back")
    assert (released["runtime"], released["job"], released["gpu"]) == ("comfy", "past-1", s.gpu)
    assert released["bytes"] == MODEL_GIB * GIB
    assert 0 <= float(released["after_s"]) < 10

    job = until(lambda: (j := s.job("past-1"))["state"] == "done" and j, "past-1 done")
    assert job["attempts_detail"][-1]["gpu"] == s.gpu
    [started] = [e for e in s.events("transition") if e["job"] == "past-1" and e["to"] == "running"]
    assert int(started["id"]) > int(released["id"])  # it started in the room given back
    node = until(holds_idle(s, "comfy", 0), "status without comfy's memory")
    assert row(node, "comfy")["releasing"] is False
    assert comfy_holds(comfy) == 0  # the stand-in itself unloaded: nothing was killed
    stop_and_check_alive(s)


def test_a_busy_runtime_is_never_asked(stack: Stack) -> None:
    s = stack
    url = s.standin("comfyui")
    # it works until the test interrupts it (ComfyUI's POST /interrupt), however long a
    # loaded machine takes to start the broker, submit and explain
    comfy_prompt(url, MODEL_GIB, work_s=600)
    s.serve(comfy_runtime(url, grace_s=0))  # no grace: only its work keeps it

    def busy() -> dict[str, Any] | None:
        node = s.node()
        ok = named(node, "comfy") == MODEL_GIB * GIB and row(node, "comfy")["state"] == "busy"
        return node if ok else None

    node = until(busy, "comfy busy with its 16 GiB")
    assert row(node, "comfy")["detail"] == "queue_running has 1 prompt"
    s.submit("busy-1")

    def waits() -> str:
        said = s.cli("explain", "busy-1").stdout
        return said if "it waits:" in said else ""

    said = until(waits, "busy-1 to wait")
    assert "busy (queue_running has 1 prompt)" in said, said
    # all the while it works: busy at every look (three of them, over three seconds at
    # least), never asked
    looks, watched = 0, time.time() + 3.0
    while looks < 3 or time.time() < watched:
        assert row(s.node(), "comfy")["state"] == "busy"
        assert not s.events("runtime_release_requested")
        looks += 1
    assert s.job("busy-1")["state"] == "queued"
    ended = time.time()
    httpx.post(f"{url}/interrupt", timeout=10).raise_for_status()
    # once its prompt has ended it may be asked (grace 0), and the job runs
    until(lambda: s.job("busy-1")["state"] == "done", "busy-1 done after the prompt", limit=30)
    [asked] = s.events("runtime_release_requested")
    assert float(asked["ts"]) >= ended  # not before the prompt ended
    assert s.events("runtime_released")
    stop_and_check_alive(s)


def release_frees_nothing(s: Stack) -> str:
    """A vLLM stand-in whose release frees nothing, asked for a waiting job, until
    the broker's verdict; returns its URL. vLLM's sleep frees only its sleep-mode
    pool (weights, KV cache) and what lies outside it stays (the stand-in's
    --residual-mib): here everything does."""
    url = s.standin(
        "vllm",
        *("--enable-sleep-mode", "--weights-gib", "0", "--kv-gib", "0"),
        *("--residual-mib", str(MODEL_GIB * 1024)),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    s.serve(
        f'name = "llm"\nkind = "vllm"\nurl = "{url}"\nidle_grace_s = 0\nrelease_timeout_s = 1.5'
    )
    until(holds_idle(s, "llm", MODEL_GIB * GIB, may_be_asked=True), "vLLM's 16 GiB named")
    assert httpx.get(f"{url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    s.submit("stuck-1")
    [sent] = until(lambda: s.events("runtime_release_sent"), "the release call")
    assert sent["calls"] == "POST /sleep?level=1"
    # the call went through: the engine sleeps, and the device shows nothing freed
    assert httpx.get(f"{url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    [verdict] = until(lambda: s.events("runtime_release_ineffective"), "the verdict")
    assert (verdict["runtime"], verdict["job"], verdict["gpu"]) == ("llm", "stuck-1", s.gpu)
    assert verdict["residual_bytes"] == MODEL_GIB * GIB and float(verdict["after_s"]) >= 1.5
    assert not s.events("runtime_released")
    return url


def test_a_release_that_frees_nothing_is_marked_and_its_memory_stays_counted(
    stack: Stack,
) -> None:
    s = stack
    release_frees_nothing(s)

    def marked() -> dict[str, Any] | None:
        node = s.node()
        r = row(node, "llm")
        ok = r["release_ineffective_bytes"] == MODEL_GIB * GIB and not r["releasing"]
        return node if ok and "release-ineffective" in node["waiting"].get("stuck-1", "") else None

    node = until(marked, "status to mark it release-ineffective")
    assert named(node, "llm") == MODEL_GIB * GIB  # still counted: the job still waits
    assert node["gpus"][0]["foreign_bytes"] == 0
    assert not node["running"] and s.job("stuck-1")["state"] == "queued"
    said = s.cli("explain", "stuck-1").stdout
    assert "it waits:" in said and "16.0 GiB by the runtime llm" in said, said
    assert "not asked: release-ineffective: 16.0 GiB stayed" in said, said
    time.sleep(1.0)  # well past another release_timeout_s: it is not asked again
    assert len(s.events("runtime_release_requested")) == 1
    assert s.job("stuck-1")["state"] == "queued"
    stop_and_check_alive(s)


def test_preview_and_status_say_a_release_ineffective_runtime_is_not_asked(
    stack: Stack,
) -> None:
    s = stack
    release_frees_nothing(s)
    node = until(
        status_where(s, lambda n: row(n, "llm")["release_ineffective_bytes"]),
        "status to mark it release-ineffective",
    )
    # a would-be job ahead of stuck-1: preview plans on the published status
    said = s.cli("preview", "testmods.gpu", "--vram-gib", str(JOB_GIB), "--priority", "5").stdout
    assert len(s.events("runtime_release_requested")) == 1  # the broker asks no more
    assert "would wait:" in said and "release-ineffective" in said, said
    assert "Asking the runtime" not in said, said
    r = row(node, "llm")
    assert r["may_be_asked"] is False and "release-ineffective" in r["why"], r
    stop_and_check_alive(s)


def ollama_generate(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/api/generate", json={"stream": False, **body}, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def test_a_runtime_that_reloads_during_handoff_is_seen(stack: Stack) -> None:
    s = stack
    # 12 GiB, so that the model and the job together still fit on the device once
    # the model comes back (they overfill the budget only by its reserve)
    model = JOB_GIB * GIB
    url = s.standin("ollama", "--model", f"big={model}")
    # a client of Ollama's own pins the model (keep_alive -1: never unloaded by itself)
    assert ollama_generate(url, model="big", keep_alive=-1)["done_reason"] == "load"
    s.serve(f'name = "ollama"\nkind = "ollama"\nurl = "{url}"\nidle_grace_s = 1')
    # Ollama has no in-flight counter: "unknown" (no sign of work), never "idle"
    until(
        holds_idle(s, "ollama", model, state="unknown", may_be_asked=True, busy_signal="heuristic"),
        "Ollama's 12 GiB named, past its grace",
    )
    s.submit("hand-1", seconds=1.0)
    [released] = until(lambda: s.events("runtime_released"), "the model unloaded")
    assert (released["runtime"], released["bytes"]) == ("ollama", model)
    [sent] = s.events("runtime_release_sent")
    assert sent["calls"] == "POST /api/generate big:latest keep_alive=0"
    # right after the release, the client asks for its model again, pinned
    assert ollama_generate(url, model="big", keep_alive=-1)["done_reason"] == "load"
    [reload] = until(lambda: s.events("runtime_reloaded_during_handoff"), "the reload seen")
    assert (reload["runtime"], reload["gpu"], reload["bytes"]) == ("ollama", s.gpu, model)
    assert reload["reloads"] == 1 and 0 <= float(reload["after_s"]) < 30
    node = until(
        status_where(s, lambda n: row(n, "ollama")["reloads_during_handoff"] == 1),
        "the reload in status",
    )
    assert named(node, "ollama") == model
    assert s.job("hand-1")["state"] in ("running", "done")
    until(lambda: s.job("hand-1")["state"] == "done", "hand-1 done")
    models = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
    assert [m["name"] for m in models] == ["big:latest"]
    stop_and_check_alive(s)
