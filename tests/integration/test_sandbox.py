"""Sandboxed attempts for real, through the broker: the probe job reports from
inside each runtime what it can see and do, and the echo types exercise both
container launch paths (one process per attempt, and a warm server).

bubblewrap and podman run here (CI installs them: GPUWARDEN_REQUIRE_CONTAINERS=1
makes these tests fail instead of skipping). Docker has no engine on this kind
of machine: its command line is covered in tests/unit/test_sandbox_argv.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.launch.base import attempt_marker
from gpuwarden.launch.host import find_attempt_processes
from gpuwarden.launch.sandbox import LABEL_INSTANCE
from gpuwarden.store.base import Submission
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES, need_tool

RUNTIMES = ["bubblewrap", "podman"]

#: the first podman test may build the base image (debootstrap, about 100 s cold)
pytestmark = pytest.mark.timeout(900)


def make_config(tmp_path: Path, runtime: str, image: str = "", **top: Any) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "sandboxnode",
            "gpu": "sim",
            "module_paths": [MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 1},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            "warm": {"idle_grace_s": 60, "stop_grace_s": 1},
            "container_runtime": runtime,
            "sandbox_image": image,
            "sandbox": {"scratch_mib": 64},
            **top,
        }
    )


@pytest.fixture
def runtime_config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Config]]:
    runtime = request.param
    if runtime == "bubblewrap":
        need_tool("bwrap")
        yield runtime, make_config(tmp_path, runtime)
    else:
        image = request.getfixturevalue("podman_image")
        yield runtime, make_config(tmp_path, runtime, image)


@pytest.fixture
def node(runtime_config: tuple[str, Config]) -> Iterator[Node]:
    _, config = runtime_config
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        yield n
        n.broker.shutdown(2)


def ended(node: Node, *ids: str) -> bool:
    return all((j := node.store.get_job(i)) is not None and j.state.terminal for i in ids)


def job_out(node: Node, job_id: str, attempt: int = 1) -> Path:
    return node.broker.config.state_dir / "jobs" / job_id / f"attempt-{attempt}" / "out"


#: every test runs in each runtime, but for the podman-only ones below
both = pytest.mark.parametrize("runtime_config", RUNTIMES, indirect=True)


@both
def test_the_probe_sees_no_network_no_capabilities_and_nothing_else_of_the_host(
    node: Node, tmp_path: Path
) -> None:
    marker = tmp_path / "elsewhere" / "marker.txt"
    marker.parent.mkdir()
    marker.write_text("the sandbox must not see this")
    assert marker.exists()  # the probe reports visibility; the file is really there
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "scan.txt").write_text("input data")
    # a listener on the host's loopback: a job on the host's network reaches it,
    # a sandbox with a network of its own cannot (and no traffic leaves the host)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    spec = JobSpec(
        id="probe1",
        type="probe.sandbox",
        params={"marker": str(marker), "input": "scan.txt", "connect": f"127.0.0.1:{port}"},
        inputs=("scan.txt",),
    )
    # the job's input folder, as intake records it for a bundle
    node.store.submit(
        [prepare(node.broker.registry, spec)],
        now=time.time(),
        origin=Submission(input_dir=str(inputs)),
    )
    with listener:
        run_until(node, lambda: ended(node, "probe1"), timeout=90)
    job = node.store.get_job("probe1")
    assert job is not None and job.state is JobState.DONE, job.reason
    report = json.loads((job_out(node, "probe1") / "report.json").read_text())

    assert report["uid"] != 0 and report["euid"] != 0
    assert int(report["cap_eff"], 16) == 0, report["cap_eff"]
    assert int(report["cap_prm"], 16) == 0
    assert report["no_new_privs"] == 1
    assert report["interfaces"] == ["lo"]
    assert report["connect"]["ok"] is False, report["connect"]
    assert all(not r["ok"] for r in report["root_writable"].values()), report["root_writable"]
    assert report["input_readable"]["ok"] is True
    assert report["input_writable"]["ok"] is False
    assert report["input_dir_writable"]["ok"] is False
    assert report["output_writable"]["ok"] is True
    assert report["scratch_writable"]["ok"] is True
    assert report["marker_visible"]["visible"] is False
    assert not report["devices"]  # no GPU on the cpu lane
    assert "LD_PRELOAD" not in report["env_keys"]
    assert job.result.get("sandbox") == node.broker.config.container_runtime.value


@both
def test_echo_container_runs_and_its_processes_are_gone(node: Node) -> None:
    submit(node, JobSpec(id="e1", type="echo.container", params={"text": "from a sandbox"}))
    run_until(node, lambda: ended(node, "e1"), timeout=60)
    job = node.store.get_job("e1")
    assert job is not None and job.state is JobState.DONE, job.reason
    assert (job_out(node, "e1") / "echo.txt").read_text() == "from a sandbox"
    assert find_attempt_processes(attempt_marker(node.broker.instance, "e1", 1)) == []
    if node.broker.sandbox is not None and node.broker.sandbox.runtime.needs_image:
        assert node.broker.sandbox.leftovers(node.broker.instance) == []


@both
def test_echo_serve_loads_once_in_the_sandbox_and_serves_two_jobs(node: Node) -> None:
    submit(
        node,
        JobSpec(id="s1", type="echo.serve", params={"text": "one"}),
        JobSpec(id="s2", type="echo.serve", params={"text": "two", "output": "sub/two.txt"}),
    )
    run_until(node, lambda: ended(node, "s1", "s2"), timeout=90)
    for job_id, path, text in (("s1", "echo.txt", "one"), ("s2", "sub/two.txt", "two")):
        job = node.store.get_job(job_id)
        assert job is not None and job.state is JobState.DONE, job.reason
        assert (job_out(node, job_id) / path).read_text() == text
    loads = [e for e in node.store.events(limit=100_000) if e.kind == "warm_server_starting"]
    assert len(loads) == 1
    exchange = node.broker.config.state_dir / "warm"
    assert not any(p.is_file() for p in exchange.glob("*/exchange/**/*"))  # moved out


@both
def test_cancel_stops_the_sandbox_and_confirms_it_gone(node: Node) -> None:
    submit(node, JobSpec(id="c1", type="echo.container", params={"text": "x", "sleep_s": 60}))
    run_until(node, lambda: bool(node.broker._running), timeout=30)
    time.sleep(1.0)  # let it really start inside the sandbox
    node.store.request_cancel("c1", now=time.time())
    run_until(node, lambda: ended(node, "c1"), timeout=60)
    job = node.store.get_job("c1")
    assert job is not None and job.state is JobState.CANCELLED, job.reason
    assert find_attempt_processes(attempt_marker(node.broker.instance, "c1", 1)) == []
    sandbox = node.broker.sandbox
    assert sandbox is not None
    if sandbox.runtime.needs_image:
        assert sandbox.leftovers(node.broker.instance) == []


@both
def test_a_missing_runtime_is_a_launch_error_retried_then_quarantined(node: Node) -> None:
    sandbox = node.broker.sandbox
    assert sandbox is not None
    sandbox.executable = "gpuwarden-no-such-runtime"
    submit(node, JobSpec(id="m1", type="echo.container", params={"text": "x"}))
    run_until(node, lambda: ended(node, "m1"), timeout=30)
    job = node.store.get_job("m1")
    assert job is not None and job.state is JobState.QUARANTINED
    assert "is not installed" in job.reason and "quarantined after 2 attempts" in job.reason


# -- podman only: containers by label, and the runtime's own failures ------------------


@pytest.mark.parametrize("runtime_config", ["podman"], indirect=True)
def test_leftover_containers_of_this_instance_and_only_those_are_removed_at_start(
    runtime_config: tuple[str, Config], podman_image: str
) -> None:
    _, config = runtime_config
    with open_node(config, mock_gpu=True) as n:
        instance = n.broker.instance
    ours = _create_container(podman_image, instance, "leftover-ours")
    theirs = _create_container(podman_image, "someone-else", "leftover-theirs")
    try:
        with open_node(config, mock_gpu=True) as n:
            n.broker.recover()
            sandbox = n.broker.sandbox
            assert sandbox is not None
            assert not sandbox.exists(ours)
            assert sandbox.exists(theirs)
            kinds = [e.kind for e in n.store.events(limit=100_000)]
            assert "leftover_containers_removed" in kinds
    finally:
        subprocess.run(["podman", "rm", "--force", ours, theirs], capture_output=True, check=False)


@pytest.mark.parametrize("runtime_config", ["podman"], indirect=True)
def test_runtime_exit_125_is_a_launch_error_retried_then_quarantined(
    runtime_config: tuple[str, Config], tmp_path: Path
) -> None:
    _, good = runtime_config
    config = good.model_copy(update={"sandbox_image": "0" * 64})  # pinned, not there
    with open_node(config, mock_gpu=True) as n:
        submit(n, JobSpec(id="r1", type="echo.container", params={"text": "x"}))
        run_until(n, lambda: ended(n, "r1"), timeout=60)
        job = n.store.get_job("r1")
        assert job is not None and job.state is JobState.QUARANTINED
        assert "exit 125" in job.reason and "launch error" in job.reason
        sandbox = n.broker.sandbox
        assert sandbox is not None and sandbox.leftovers(n.broker.instance) == []


def _create_container(image: str, instance: str, name: str) -> str:
    subprocess.run(["podman", "rm", "--force", name], capture_output=True, check=False)
    subprocess.run(
        [
            *("podman", "create", "--name", name, "--label", f"{LABEL_INSTANCE}={instance}"),
            *("--network", "none", image, "python3", "-c", "pass"),
        ],
        check=True,
        capture_output=True,
    )
    return name


@both
def test_a_vram_container_job_reaches_only_its_gpu_from_the_sandbox(node: Node) -> None:
    # on the simulated GPU the sandbox is given the simulated device's folder and
    # nothing else: the job allocates there, and the broker sees and measures it
    submit(node, JobSpec(id="b1", type="burn.embed", params={"gib": 1, "seconds": 0.5}))
    run_until(node, lambda: ended(node, "b1"), timeout=60)
    job = node.store.get_job("b1")
    assert job is not None and job.state is JobState.DONE, job.reason
    held = json.loads((job_out(node, "b1") / "burn.json").read_text())
    assert held["allocated_bytes"] == 2**30
    assert held["gpu"] == job.result["gpu"]


@pytest.mark.parametrize("runtime_config", ["podman"], indirect=True)
def test_a_job_past_its_memory_limit_is_killed_and_the_result_says_what_the_runtime_saw(
    runtime_config: tuple[str, Config],
) -> None:
    _, base = runtime_config
    if not base.sandbox.cgroups:
        pytest.skip("memory limits need cgroups, which podman cannot use on this host")
    sandbox = base.sandbox.model_copy(update={"memory_gib": 0.125})  # 128 MiB
    config = base.model_copy(update={"sandbox": sandbox})
    with open_node(config, mock_gpu=True) as n:
        submit(n, JobSpec(id="h1", type="probe.sandbox", params={"hog_mib": 512}))
        run_until(n, lambda: ended(n, "h1"), timeout=90)
        job = n.store.get_job("h1")
        assert job is not None and job.exit_code == 137, (job.exit_code if job else None, job)
        # killed for memory is an infrastructure failure: probe.sandbox has no retries
        assert job.state is JobState.QUARANTINED
        assert job.result.get("oom_killed") is True
        assert job.reason.startswith("killed for memory: the container runtime recorded an OOM")
