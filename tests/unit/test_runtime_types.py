"""Runtime types (issue 15): their module.toml keys, how the plan places their jobs,
how the VRAM book counts the model once, and the 99 %-in-VRAM check."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from gpuwarden.core.launchrules import LaunchRules, Runtime
from gpuwarden.core.ledger import HoldState
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    GpuView,
    QueuedJob,
    Refuse,
    RuntimeView,
    Snapshot,
    Start,
    Wait,
    plan,
)
from gpuwarden.core.runtime import RuntimeKind, resolve_runtime
from gpuwarden.gpu.base import GpuReading, ProcessUsage
from gpuwarden.launch.base import LaunchRequest, LaunchResult
from gpuwarden.node.runtimejobs import RUNTIME_URL_ENV, RuntimeLaunch, placement_trouble
from gpuwarden.node.settings import RuntimeSpec, VramSettings
from gpuwarden.node.vram import VramBook
from gpuwarden.registry import parse_module
from gpuwarden.runtimes.base import Prepared, RuntimeApiError, RuntimeClient
from tests.unit.test_registry import head, make_module, module_error

TYPE = """
[types.ask]
lane = "{lane}"
launch = "{launch}"
vram_gib = {gib}
command = ["{{python}}", "src/run.py"]
{extra}
"""


def runtime_type(
    tmp_path: Path, extra: str, *, lane: str = "vram", launch: str = "host", gib: float = 4
) -> Path:
    body = TYPE.format(lane=lane, launch=launch, gib=gib, extra=extra)
    return make_module(tmp_path, "mine", head() + body)


# --- module.toml --------------------------------------------------------------------


def test_a_runtime_type_parses(tmp_path: Path) -> None:
    [t] = parse_module(runtime_type(tmp_path, 'runtime = "ollama"\nmodel = "llama3:8b"')).types
    assert (t.runtime, t.model, t.lane) == ("ollama", "llama3:8b", Lane.VRAM)


@pytest.mark.parametrize(
    ("extra", "lane", "launch", "gib", "said"),
    [
        ('runtime = "ollama"', "vram", "host", 4, "key 'runtime' needs key 'model' too"),
        ('model = "x"', "vram", "host", 4, "key 'model' needs key 'runtime' too"),
        ('runtime = "ollama"\nmodel = "x"', "cpu", "host", 0, 'use lane = "vram"'),
        ('runtime = "ollama"\nmodel = "x"', "vram", "container", 4, 'use launch = "host"'),
        ('runtime = "ollama"\nmodel = "x"', "vram", "serve", 4, 'use launch = "host"'),
        ('runtime = "../etc"\nmodel = "x"', "vram", "host", 4, "key 'types.ask.runtime'"),
        ('runtime = "ollama"\nmodel = "a b"', "vram", "host", 4, "key 'types.ask.model'"),
        ('runtime = "ollama"\nmodel = ""', "vram", "host", 4, "key 'types.ask.model'"),
    ],
)
def test_a_wrong_runtime_type_is_refused_naming_the_key(
    tmp_path: Path, extra: str, lane: str, launch: str, gib: float, said: str
) -> None:
    assert said in module_error(runtime_type(tmp_path, extra, lane=lane, launch=launch, gib=gib))


def test_the_launch_rules_judge_a_runtime_types_process_as_a_cpu_one(tmp_path: Path) -> None:
    [t] = parse_module(runtime_type(tmp_path, 'runtime = "ollama"\nmodel = "x"')).types
    local = LaunchRules(Runtime.LOCAL)
    assert local.refusal(t) is None, "a runtime's client runs no model code on a GPU"
    sandboxed = LaunchRules(Runtime.BUBBLEWRAP)
    assert "allow_host_jobs" in (sandboxed.refusal(t) or "")


def test_resolve_by_name_then_by_the_only_one_of_the_kind() -> None:
    pairs = [("llm", "ollama"), ("comfy", "comfyui"), ("a", "vllm"), ("b", "vllm")]
    assert resolve_runtime("llm", pairs) == "llm"
    assert resolve_runtime("ollama", pairs) == "llm"
    assert resolve_runtime("vllm", pairs) is None, "two of that kind: which one is not said"
    assert resolve_runtime("a", pairs) == "a"
    assert resolve_runtime("llama-server", pairs) is None


# --- the plan -------------------------------------------------------------------------

G1, G2 = "GPU-1", "GPU-2"


def job(model: str = "m", gib: float = 4, runtime: str = "llm") -> QueuedJob:
    return QueuedJob(
        "j", "mine.ask", Lane.VRAM, int(gib * GIB), 0, 1, True, runtime=runtime, model=model
    )


def runtime(**kw: object) -> RuntimeView:
    fields: dict[str, object] = {"name": "llm", "may_ask": False, "why": "in its grace"}
    return RuntimeView(**(fields | kw))  # type: ignore[arg-type]


def snapshot(*gpus: GpuView, rt: RuntimeView | None = None, paused: str = "") -> Snapshot:
    return Snapshot((job(),), gpus, 0, 4, True, paused, runtimes=(rt or runtime(),))


def decide(s: Snapshot, j: QueuedJob | None = None) -> object:
    [decision] = plan(dataclasses.replace(s, queued=((j or job()),)), 0.0)
    return decision


def test_a_warm_model_starts_at_once_where_the_runtime_holds_it() -> None:
    full = GpuView(G1, 24 * GIB, foreign_bytes=21 * GIB, runtimes=(("llm", 3 * GIB),))
    other = GpuView(G2, 24 * GIB)
    d = decide(snapshot(other, full, rt=runtime(models=("m",))))
    assert d == Start("j", G1, warm=True), "no room is needed: the model is there"


def test_a_cold_model_is_placed_on_the_runtimes_gpus_only() -> None:
    a, b = GpuView(G1, 24 * GIB), GpuView(G2, 24 * GIB)
    d = decide(snapshot(a, b, rt=runtime(gpus=(G2,))))
    assert isinstance(d, Start) and d.gpu_uuid == G2 and not d.warm
    full = GpuView(G2, 24 * GIB, foreign_bytes=22 * GIB)
    waits = decide(snapshot(a, full, rt=runtime(gpus=(G2,))))
    assert isinstance(waits, Wait) and G1 not in waits.reason.split("; ", 1)[1], waits.reason


def test_a_job_of_a_runtime_this_node_lacks_is_refused() -> None:
    d = decide(snapshot(GpuView(G1, 24 * GIB)), job(runtime="ollama"))
    assert isinstance(d, Refuse) and "managed runtime 'ollama'" in d.reason


def test_an_unreachable_runtime_holds_its_jobs() -> None:
    rt = runtime(reachable=False, why="unreachable (connection refused)")
    d = decide(snapshot(GpuView(G1, 24 * GIB), rt=rt))
    assert isinstance(d, Wait) and "waits for the runtime llm: unreachable" in d.reason


def test_a_runtime_whose_gpus_are_not_here_says_so() -> None:
    d = decide(snapshot(GpuView(G1, 24 * GIB), rt=runtime(gpus=("GPU-elsewhere",))))
    assert isinstance(d, Wait) and "GPU-elsewhere" in d.reason


# --- the VRAM book ----------------------------------------------------------------------

RUNNER = 4242
SETTINGS = VramSettings(
    reserve_bytes=0, reclaim_timeout_s=30, tolerance_bytes=64 << 20, step_bytes=256 << 20
)


def reading(runtime_gib: float) -> list[GpuReading]:
    used = int(runtime_gib * GIB)
    procs = (ProcessUsage(RUNNER, used),) if used else ()
    return [GpuReading(G1, "sim", 24 * GIB, used, procs)]


def test_the_model_loaded_for_a_job_is_counted_once() -> None:
    book = VramBook(SETTINGS)
    book.runtime_pids["llm"] = {RUNNER}
    book.observe(reading(3), 0.0)  # another model, 3 GiB, loaded before
    assert book.views()[0].runtimes == (("llm", 3 * GIB),)
    book.start(
        "j/1",
        G1,
        type_name="mine.ask",
        job_id="j",
        nbytes=4 * GIB,
        coresident=True,
        now=0.0,
        runtime="llm",
    )
    book.observe(reading(3), 1.0)  # not loaded yet: the runtime's 3 GiB stay its own
    [view] = book.views()
    assert view.runtimes == (("llm", 3 * GIB),) and view.held_bytes == 4 * GIB
    book.observe(reading(7), 2.0)  # the model is in: its 4 GiB are the job's holding
    [view] = book.views()
    assert view.runtimes == (("llm", 3 * GIB),) and view.held_bytes == 4 * GIB
    assert book.runtime_jobs() == {"llm": ["j"]}
    book.end("j/1", 3.0)
    book.observe(reading(7), 4.0)  # ended: the warm model is the runtime's again
    [view] = book.views()
    assert view.runtimes == (("llm", 7 * GIB),) and view.held_bytes == 0
    assert book.runtime_jobs() == {}


def test_two_jobs_loading_at_once_cover_no_more_than_the_runtime_took_on() -> None:
    book = VramBook(SETTINGS)
    book.runtime_pids["llm"] = {RUNNER}
    book.observe(reading(2), 0.0)
    for j in ("a", "b"):
        book.start(
            f"{j}/1",
            G1,
            type_name="mine.ask",
            job_id=j,
            nbytes=4 * GIB,
            coresident=True,
            now=0.0,
            runtime="llm",
        )
    book.observe(reading(6), 1.0)  # only a's model is in so far
    [view] = book.views()
    assert view.runtimes == (("llm", 2 * GIB),), "b's model is still to come: nothing of it"
    assert view.held_bytes == 8 * GIB
    book.observe(reading(1), 2.0)  # it let go of its first model meanwhile
    [view] = book.views()
    # which model went is not known: its 1 GiB is counted as its own, beside both
    # jobs' footprints (more than the device shows, never less)
    assert view.runtimes == (("llm", 1 * GIB),) and view.held_bytes == 8 * GIB
    assert book.views()[0].holdings[0].state is HoldState.RUNNING


# --- the 99 % check and the launch ------------------------------------------------------


def test_placement_trouble_below_99_percent() -> None:
    assert placement_trouble("llm", Prepared("m", 0.995)) is None
    assert placement_trouble("llm", Prepared("m", None)) is None, "a runtime that cannot say"
    said = placement_trouble("llm", Prepared("m", 0.42, "size_vram / size = 0.420"))
    assert said is not None and "only 42.0 % of the model m" in said and "0.420" in said


class FakeClient(RuntimeClient):
    kind = RuntimeKind.OLLAMA

    def __init__(self, prepared: Prepared | Exception) -> None:
        super().__init__("http://127.0.0.1:1")
        self.prepared = prepared
        self.asked: list[tuple[str, float]] = []

    def probe(self):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def read(self):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def release(self):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def prepare(self, model: str, *, keep_alive_s: float, timeout_s: float) -> Prepared:
        self.asked.append((model, keep_alive_s))
        if isinstance(self.prepared, Exception):
            raise self.prepared
        return self.prepared


class Inner:
    def __init__(self) -> None:
        self.env: dict[str, str] | None = None

    def run(self, req: LaunchRequest, stop: threading.Event, on_start=None) -> LaunchResult:  # type: ignore[no-untyped-def]
        self.env = req.env
        return LaunchResult(req.job_id, req.attempt, 0, 0.0, 1.0)


SPEC = RuntimeSpec("llm", RuntimeKind.OLLAMA, "http://127.0.0.1:11434", idle_grace_s=120)
REQ = LaunchRequest("j", 1, ("x",), "/", {"A": "1"}, "/tmp", 60.0)


@pytest.mark.parametrize(
    ("prepared", "error"),
    [
        (Prepared("m", 1.0), None),
        (Prepared("m", 0.5), "placed only 50.0 %"),
        (RuntimeApiError("ollama at x: POST /api/generate failed"), "could not make the model m"),
    ],
)
def test_the_launch_prepares_first_and_runs_the_job_only_when_it_is_on_the_gpu(
    prepared: Prepared | Exception, error: str | None
) -> None:
    client, inner = FakeClient(prepared), Inner()
    launch = RuntimeLaunch(inner, SPEC, "m", client=lambda spec: client, clock=lambda: 0.0)
    result = launch.run(REQ, threading.Event())
    assert client.asked == [("m", 120)], "asked to keep it at least the runtime's grace"
    if error is None:
        assert result.launch_error is None and inner.env is not None
        assert inner.env[RUNTIME_URL_ENV] == SPEC.url and inner.env["A"] == "1"
    else:
        assert result.launch_error is not None and error in result.launch_error
        assert inner.env is None, "the job's process never started"
