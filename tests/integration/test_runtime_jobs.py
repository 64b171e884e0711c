"""Runtime types (issue 15): a job type that names a managed runtime and a model.
The broker makes the model resident before the job's process starts, checks that
at least 99 % of it sits in GPU memory (Ollama's ``size_vram / size``), fails the
attempt as infrastructure (retried) when the runtime put it on the CPU, and
counts the model's memory once: held for the job while it runs, the runtime's
again afterwards. Against the Ollama stand-in (tests/standins/ollama.py) on the
broker's simulated GPU; what the device shows is the truth checked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Lane
from gpuwarden.core.placement import GpuRoom, NodeView, Offerable, offers_for
from gpuwarden.core.states import JobState
from gpuwarden.gpu.select import SIM_STATE_FILE
from tests.brokerkit import run_until, submit
from tests.integration.test_broker import make_config
from tests.integration.test_sim_gpu import child_env

REPO = Path(__file__).resolve().parents[2]
RTMODS = REPO / "tests" / "modules"
TINY = 2 * GIB
#: the stand-in's models: one all on the GPU, one it places half on the CPU
CATALOGUE = ("--model", f"tiny={TINY}", "--model", f"half={TINY}@0.5")


@dataclass
class Setup:
    node: Node
    ollama: subprocess.Popen[str]
    url: str
    gpu: str

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e.detail | {"job": e.job_id} for e in self.node.store.events() if e.kind == kind]

    def runtime_bytes(self) -> int:
        return sum(b for v in self.node.broker.vram.views() for n, b in v.runtimes if n == "llm")

    def device_used(self) -> int:
        return self.node.probe.read()[0].used_bytes

    def loaded(self) -> list[str]:
        answer = httpx.get(f"{self.url}/api/ps", timeout=10).json()
        return [m["name"] for m in answer["models"]]

    def tick(self) -> None:
        self.node.broker.tick()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    raw = make_config(tmp_path).model_dump()
    raw["sim_gpu"]["count"] = 1
    raw["module_paths"].append(RTMODS)
    base = Config.model_validate(raw)
    with open_node(base, mock_gpu=True) as first:
        gpu = first.probe.read()[0].uuid
    ollama = subprocess.Popen(
        [sys.executable, "-m", "tests.standins.ollama", "--port", "0", *CATALOGUE],
        cwd=REPO,
        env=child_env(base.state_dir / SIM_STATE_FILE, gpu),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert ollama.stdout is not None
        url = ollama.stdout.readline().strip().removeprefix("listening on ")
        # named "llm": the type's runtime = "ollama" finds it by its kind
        raw["runtimes"] = [{"name": "llm", "kind": "ollama", "url": url, "idle_grace_s": 600}]
        with open_node(Config.model_validate(raw), mock_gpu=True) as node:
            node.broker.runtimes.start()
            try:
                yield Setup(node, ollama, url, gpu)
            finally:
                node.broker.runtimes.stop()
        assert ollama.poll() is None, "the Ollama stand-in died"
    finally:
        ollama.terminate()
        ollama.wait(30)


def ended(s: Setup, job_id: str) -> JobState:
    def done() -> bool:
        job = s.node.store.get_job(job_id)
        return job is not None and job.state in (
            JobState.DONE,
            JobState.FAILED,
            JobState.QUARANTINED,
        )

    try:
        run_until(s.node, done, timeout=60)
    except AssertionError:
        job = s.node.store.get_job(job_id)
        attempts = [(a.outcome, a.reason) for a in s.node.store.attempts(job_id)]
        raise AssertionError(f"{job_id} did not end: {job}, {attempts}") from None
    job = s.node.store.get_job(job_id)
    assert job is not None
    return job.state


def found(s: Setup) -> None:
    run_until(s.node, lambda: bool(s.node.broker.status().runtimes[0]["pids"]))


def answer_of(s: Setup, job_id: str, attempt: int) -> dict[str, object]:
    folder = s.node.broker.launching.attempt_dir(job_id, attempt)
    said: dict[str, object] = json.loads((folder / "out" / "answer.json").read_text())
    return said


def test_the_model_is_made_resident_on_the_gpu_then_the_job_runs(setup: Setup) -> None:
    s = setup
    found(s)
    assert s.loaded() == [] and s.device_used() == 0, "nothing is loaded before the job"
    submit(s.node, JobSpec("a", "rtmods.ask"))
    assert ended(s, "a") is JobState.DONE, s.node.store.get_job("a")
    # the broker preloaded it: the stand-in lists it, the device holds it, by the runtime
    assert s.loaded() == ["tiny:latest"] and s.device_used() == TINY
    run_until(s.node, lambda: s.runtime_bytes() == TINY)
    assert answer_of(s, "a", 1) == {
        "runtime": "llm",
        "kind": "ollama",
        "model": "tiny",
        "done": True,
        "gpu_env": "",
    }, "the job is told the runtime and the model, and its own process gets no GPU"


def test_while_it_runs_its_footprint_covers_the_model_counted_once(setup: Setup) -> None:
    s = setup
    found(s)
    submit(s.node, JobSpec("a", "rtmods.ask", {"wait_s": 3.0}))
    run_until(s.node, lambda: s.device_used() == TINY)  # the preload reached the device
    # until the poller's next look finds the runner, its memory counts as foreign
    run_until(s.node, lambda: s.node.broker.vram.views()[0].foreign_bytes == 0)
    [view] = s.node.broker.vram.views()
    held = {h.job_id: h.bytes for h in view.holdings}
    assert held == {"a": TINY}
    assert view.runtime_bytes == 0, "the runtime's memory for the job is the job's holding"
    assert view.total_bytes - view.free_bytes == TINY, "counted once"
    row = s.node.broker.status().runtimes[0]
    assert row["in_use_by"] == ["a"] and row["may_be_asked"] is False
    assert "in use by gpuwarden job(s) a" in str(row["why"])
    assert ended(s, "a") is JobState.DONE
    run_until(
        s.node, lambda: s.runtime_bytes() == TINY and not s.node.broker.vram.views()[0].holdings
    )


def test_a_warm_model_adds_nothing_and_starts_at_once(setup: Setup) -> None:
    s = setup
    found(s)
    httpx.post(f"{s.url}/api/generate", json={"model": "tiny", "stream": False}, timeout=30)
    run_until(s.node, lambda: s.runtime_bytes() == TINY and "tiny" in _models(s))
    submit(s.node, JobSpec("w", "rtmods.ask", {"wait_s": 2.0}))
    run_until(s.node, lambda: _state(s, "w") is JobState.RUNNING)
    [view] = s.node.broker.vram.views()
    assert {h.job_id: h.bytes for h in view.holdings} == {"w": 0}
    assert view.runtime_bytes == TINY, "the runtime's model stays its own"
    assert ended(s, "w") is JobState.DONE
    assert s.device_used() == TINY, "no second copy was loaded"


def test_a_model_placed_on_the_cpu_fails_the_attempt_as_infrastructure(setup: Setup) -> None:
    s = setup
    found(s)
    submit(s.node, JobSpec("h", "rtmods.half"))
    # an infrastructure failure each time: retried, then quarantined (section 2)
    assert ended(s, "h") is JobState.QUARANTINED
    attempts = s.node.store.attempts("h")
    assert [a.outcome for a in attempts] == ["launch_error", "launch_error"], "retried once"
    assert "placed only 50.0 % of the model half in GPU memory" in attempts[0].reason
    assert "size_vram / size = 0.500" in attempts[0].reason
    for a in attempts:  # its own process never ran
        folder = s.node.broker.launching.attempt_dir("h", a.number)
        assert not (folder / "out" / "answer.json").exists()
    # the runtime really did put half of it on the device, and keeps it: not killed
    assert s.loaded() == ["half:latest"] and s.device_used() == TINY // 2


def test_a_type_whose_runtime_this_node_lacks_is_refused(tmp_path: Path) -> None:
    raw = make_config(tmp_path).model_dump()
    raw["module_paths"].append(RTMODS)
    with open_node(Config.model_validate(raw), mock_gpu=True) as node:
        submit(node, JobSpec("x", "rtmods.ask"))
        run_until(node, lambda: _state_of(node, "x") is JobState.FAILED)
        job = node.store.get_job("x")
        assert job is not None
        assert "uses the managed runtime 'ollama', and this node has no runtime" in job.reason


def _state_of(node: Node, job_id: str) -> JobState | None:
    job = node.store.get_job(job_id)
    return job.state if job is not None else None


def _state(s: Setup, job_id: str) -> JobState | None:
    return _state_of(s.node, job_id)


def _models(s: Setup) -> list[str]:
    return [str(m) for m in s.node.broker.status().runtimes[0]["models"]]


def test_across_hosts_a_runtime_job_goes_where_its_model_is_warm(setup: Setup) -> None:
    s = setup
    found(s)
    b = s.node.broker
    ask = b.registry.types["rtmods.ask"]
    assert b.runs(ask) and b.runtime_warm_types() == []
    httpx.post(f"{s.url}/api/generate", json={"model": "tiny", "stream": False}, timeout=30)
    run_until(s.node, lambda: b.runtime_warm_types() == ["rtmods.ask"])
    # what this node reports (warm: the runtime has the model) steers placement
    room = (GpuRoom("G", "sim", 24 * GIB, 24 * GIB, 24 * GIB),)
    here = NodeView("here", room, warm=frozenset(b.runtime_warm_types()))
    cold = NodeView("cold", room)
    job = Offerable("j", "rtmods.ask", Lane.VRAM, TINY, 0, 1, time.time(), runtime=True)
    assert offers_for(cold, [job], [here], now=time.time()) == [], "left for the warm node"
    assert offers_for(here, [job], [cold], now=time.time()) == ["j"]
    assert offers_for(cold, [job], [here], now=time.time() + 60) == ["j"], "but not forever"


def test_a_node_without_the_runtime_does_not_run_its_types(tmp_path: Path) -> None:
    raw = make_config(tmp_path).model_dump()
    raw["module_paths"].append(RTMODS)
    with open_node(Config.model_validate(raw), mock_gpu=True) as node:
        ask = node.broker.registry.types["rtmods.ask"]
        assert not node.broker.runs(ask)
        assert node.broker.rules.refusal(ask) is None, "its launch rules would allow it"
