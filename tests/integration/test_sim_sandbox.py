"""The simulated GPU sees sandboxed jobs as NVML would (issue 12): by their host
pids, so admission, measurement and CUDA out-of-memory behave the same in a
sandbox as outside one.

A job under bubblewrap or podman runs in a PID namespace of its own, and the
pid it records on the simulated GPU is that namespace's. Each test here first
checks that the job really is in its own namespace (the pid it saw differs
from its host pid), then what the broker made of its memory. The broker runs
in-process, as root (as in CI); the unsandboxed runs (``local``) are the
baseline the sandboxed ones must match. The same through the real CLI is in
tests/acceptance/test_sandbox_gpu.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.gpu.select import SIM_STATE_FILE
from gpuwarden.gpu.sim import find_host_pids
from gpuwarden.launch.base import attempt_marker
from gpuwarden.launch.host import find_attempt_processes
from tests.brokerkit import run_until, submit
from tests.conftest import REPO, need_tool
from tests.integration.test_sandbox import (
    ended,
    job_out,
    make_config,
    next_job_completes,
    nothing_left,
)

TEST_MODULES = REPO / "tests" / "modules"
SANDBOXES = ["bubblewrap", "podman"]
HOLD = "testmods.vramhold"

pytestmark = pytest.mark.timeout(900)


def config_for(tmp_path: Path, runtime: str, request: pytest.FixtureRequest) -> Config:
    modules = [REPO / "src" / "gpuwarden" / "modules", TEST_MODULES]
    if runtime == "local":  # the baseline: the same job types, unsandboxed
        return make_config(
            tmp_path, runtime, module_paths=modules, allow_unsandboxed_containers=True
        )
    if runtime == "bubblewrap":
        need_tool("bwrap")
        return make_config(tmp_path, runtime, module_paths=modules)
    image = request.getfixturevalue("podman_image")
    return make_config(tmp_path, runtime, image, module_paths=modules)


@pytest.fixture
def config(request: pytest.FixtureRequest, tmp_path: Path) -> Config:
    return config_for(tmp_path, request.param, request)


@pytest.fixture
def node(config: Config) -> Iterator[Node]:
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        yield n
        n.broker.shutdown(2)


sandboxes = pytest.mark.parametrize("config", SANDBOXES, indirect=True)
every_runtime = pytest.mark.parametrize("config", ["local", *SANDBOXES], indirect=True)


def sandboxed_runtime(node: Node) -> bool:
    return node.broker.sandbox is not None


def hold(node: Node, job_id: str, gib: float) -> None:
    """Submit a job that allocates ``gib`` GiB and holds it until :func:`release`."""
    submit(node, JobSpec(id=job_id, type=HOLD, params={"gib": gib, "wait_for": "go"}))


def release(node: Node, job_id: str) -> None:
    (job_out(node, job_id) / "go").write_text("go")


def holder(node: Node, job_id: str) -> tuple[int, dict[str, Any]]:
    """Once the job holds its memory: its host pid, and what it said of itself
    (``pid`` and ``pidns`` as it saw them). The host pid is found here, by the
    test, among the attempt's processes: the one in the job's namespace whose
    pid there is the one the job saw."""
    held_file = job_out(node, job_id) / "held.json"
    run_until(node, held_file.exists, timeout=90)
    held: dict[str, Any] = json.loads(held_file.read_text())
    found = find_host_pids({(held["pidns"], held["pid"])})
    host_pid = found[(held["pidns"], held["pid"])]
    marker = attempt_marker(node.broker.instance, job_id, 1)
    assert host_pid in {p.pid for p in find_attempt_processes(marker)}
    return host_pid, held


def assert_own_namespace(node: Node, host_pid: int, held: dict[str, Any]) -> None:
    """The attack surface of issue 12 is in place: the job sees another pid than
    the host's, in a PID namespace that is not the broker's."""
    ours = Path("/proc/self/ns/pid").stat().st_ino
    if sandboxed_runtime(node):
        assert held["pidns"] != ours, held
        assert held["pid"] != host_pid, (held, host_pid)
    else:
        assert (held["pidns"], held["pid"]) == (ours, host_pid)


def gpu_status(node: Node) -> dict[str, Any]:
    (gpu,) = node.broker.status().to_json()["gpus"]
    return dict(gpu)


def holding_of(node: Node, job_id: str) -> int | None:
    for h in gpu_status(node)["holdings"]:
        if h["job_id"] == job_id:
            return int(h["bytes"])
    return None


def until_held(node: Node, job_id: str, nbytes: int) -> None:
    """Tick until the broker counts ``nbytes`` as the job's (its holding grew to
    what the probe lists under its pids); say what the GPU read if it never does."""
    try:
        run_until(node, lambda: holding_of(node, job_id) == nbytes)
    except AssertionError:
        raise AssertionError(
            f"the broker never counted {nbytes} bytes as {job_id}'s; the GPU reads "
            f"{gpu_status(node)}, the device holds {node.broker.probe.device.allocations()}"  # type: ignore[attr-defined]
        ) from None


@sandboxes
def test_a_sandboxed_jobs_memory_shows_under_its_host_pid_while_it_runs(node: Node) -> None:
    hold(node, "h1", 5)
    host_pid, held = holder(node, "h1")
    assert_own_namespace(node, host_pid, held)

    # what NVML would list: the host pid, and the broker counts it as the job's
    until_held(node, "h1", 5 * GIB)
    gpu = gpu_status(node)
    assert gpu["used_bytes"] == 5 * GIB
    assert gpu["processes"] == [{"pid": host_pid, "used_bytes": 5 * GIB}]
    assert gpu["foreign_bytes"] == 0
    (alloc,) = node.broker.probe.device.allocations()  # type: ignore[attr-defined]
    assert (alloc.pid, alloc.pidns, alloc.host_pid) == (held["pid"], held["pidns"], host_pid)

    release(node, "h1")
    run_until(node, lambda: ended(node, "h1"), timeout=60)
    job = node.store.get_job("h1")
    assert job is not None and job.state is JobState.DONE, job and job.reason
    # the process is gone: its memory is released and the holding reclaimed
    run_until(node, lambda: gpu_status(node)["holdings"] == [])
    assert gpu_status(node)["used_bytes"] == 0
    nothing_left(node, "h1")


@every_runtime
def test_a_job_alone_that_used_more_than_declared_raises_the_footprint(node: Node) -> None:
    declared = node.broker.registry.get(HOLD).vram_bytes
    assert declared == GIB  # the job below uses 5 times that
    hold(node, "m1", 5)
    host_pid, held = holder(node, "m1")
    assert_own_namespace(node, host_pid, held)
    until_held(node, "m1", 5 * GIB)  # the broker saw it
    release(node, "m1")
    run_until(node, lambda: ended(node, "m1"), timeout=60)
    job = node.store.get_job("m1")
    assert job is not None and job.state is JobState.DONE, job and job.reason

    raised = [e for e in node.store.events(limit=100_000) if e.kind == "footprint_raised"]
    assert [(e.detail["type"], e.detail["bytes"]) for e in raised] == [(HOLD, 5 * GIB)]
    footprint = node.broker.status().to_json()["footprints"][HOLD]
    assert footprint["measured_bytes"] == footprint["effective_bytes"] == 5 * GIB


@every_runtime
def test_cuda_oom_beside_another_job_is_shared_and_retried(node: Node) -> None:
    hold(node, "big", 20)  # 20 of the GPU's 24 GiB
    host_pid, held = holder(node, "big")
    assert_own_namespace(node, host_pid, held)
    # the broker counts those 20 GiB as the job's: 4 GiB of budget are left
    until_held(node, "big", 20 * GIB)
    assert gpu_status(node)["foreign_bytes"] == 0

    # declared 1 GiB, so it is admitted beside; it asks for 10 and runs out
    submit(node, JobSpec(id="beside", type=HOLD, params={"gib": 10}))
    run_until(node, lambda: ended(node, "beside"), timeout=120)
    job = node.store.get_job("beside")
    assert job is not None
    attempts = node.store.attempts("beside")
    assert [a.outcome for a in attempts] == ["cuda_oom_shared"] * 3, [
        (a.outcome, a.reason) for a in attempts
    ]
    assert job.state is JobState.QUARANTINED, job.reason
    assert "CUDA out of memory beside another job" in job.reason
    # its message names the other job's process as NVML would: by its host pid
    first = attempts[0].stderr
    assert f"Process {host_pid} has 20.00 GiB memory in use." in first, first

    release(node, "big")
    run_until(node, lambda: ended(node, "big"), timeout=60)
    big = node.store.get_job("big")
    assert big is not None and big.state is JobState.DONE, big and big.reason
    if sandboxed_runtime(node):
        nothing_left(node, "big")


@sandboxes
def test_a_job_that_corrupts_the_state_file_pauses_vram_admission_and_nothing_else(
    config: Config,
) -> None:
    """The simulated GPU's folder is writable by every job (issue 11): a job that
    writes a path where a pid belongs stops the probe with a clear reason, never
    reaches a /proc path with it, and the broker goes on; a restart resets it."""
    with open_node(config, mock_gpu=True) as node:
        node.broker.recover()
        submit(node, JobSpec(id="x1", type=HOLD, params={"gib": 1, "clobber": True}))
        run_until(node, (job_out(node, "x1") / "held.json").exists, timeout=90)
        state_file = config.state_dir / SIM_STATE_FILE
        written = json.loads(state_file.read_text())
        assert [a["pid"] for a in written["allocations"]] == ["../1"]  # the attack is in place

        def probe_error() -> str:
            return str(node.broker.status().to_json()["probe_error"])

        run_until(node, lambda: "malformed" in probe_error(), timeout=60)
        assert "'pid' is '../1'" in probe_error()
        assert "restart the broker with --mock-gpu" in probe_error()
        assert [e.kind for e in node.store.events(limit=100_000)].count("probe_failed") == 1
        # VRAM admission waits, with the reason; everything else goes on
        submit(node, JobSpec(id="x2", type=HOLD, params={"gib": 1}))
        next_job_completes(node, "x3")
        waiting = node.broker.status().to_json()["waiting"]
        assert "the GPU probe failed" in waiting.get("x2", ""), waiting
        queued = node.store.get_job("x2")
        assert queued is not None and queued.state is JobState.QUEUED
        node.broker.shutdown(2)

    # a broker that starts on the file resets the simulated GPU; the job runs
    with open_node(config, mock_gpu=True) as again:
        again.broker.recover()
        run_until(again, lambda: ended(again, "x2"), timeout=90)
        job = again.store.get_job("x2")
        assert job is not None and job.state is JobState.DONE, job and job.reason
        assert again.broker.status().to_json()["probe_error"] == ""
        assert json.loads(state_file.read_text())["allocations"] == []
        # nothing of the attack is left in the device's folder
        assert sorted(p.name for p in state_file.parent.iterdir()) == [
            "simgpu.json",
            "simgpu.json.lock",
        ]
        again.broker.shutdown(2)
