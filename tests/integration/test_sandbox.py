"""Sandboxed attempts for real, through the broker: the probe job reports from
inside each runtime what it can see and do, and the echo types exercise both
container launch paths (one process per attempt, and a warm server).

The broker runs as root here (as in CI). The attacks of "Trust at the edges"
are tried for real: the host uid of the sandbox's processes and of what they
write, a fork bomb against the pids limit, a nested user namespace, a syscall
the seccomp filter refuses, /tmp and the output folder past their sizes, and
mount sources that a job could have swapped for a link.

bubblewrap and podman run here (CI installs them: GPUWARDEN_REQUIRE_CONTAINERS=1
makes these tests fail instead of skipping). Docker has no engine on this kind
of machine: its command line is covered in tests/unit/test_sandbox_argv.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import platform
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden import safefs
from gpuwarden.app import Node, open_node, sandbox_launcher
from gpuwarden.config import Config
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.launch.base import INSIDE, LaunchRequest, Mount, attempt_marker
from gpuwarden.launch.host import find_attempt_processes
from gpuwarden.launch.sandbox import (
    LABEL_INSTANCE,
    SandboxLauncher,
    container_name,
    mounts_for,
)
from gpuwarden.launch.warmproc import ServeError, WarmProcess
from gpuwarden.store.base import Submission
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES, need_tool

RUNTIMES = ["bubblewrap", "podman"]
#: the sandbox's /tmp and output limits in these tests (small: the tests pass them)
TMP_MIB = 16
OUTPUT_MIB = 8
#: the sandbox's user on the host
NOBODY = 65534

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
            "sandbox": {"scratch_mib": 64, "tmp_mib": TMP_MIB, "output_mib": OUTPUT_MIB},
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
    return node.config.state_dir / "jobs" / job_id / f"attempt-{attempt}" / "out"


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
    assert job.result.get("sandbox") == node.config.container_runtime.value


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


@pytest.mark.parametrize(
    "runtime_config",
    ["bubblewrap", "podman"],
    indirect=True,
)
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
    exchange = node.config.state_dir / "warm"
    assert not any(p.is_file() for p in exchange.glob("*/exchange/**/*"))  # moved out


@both
def test_cancel_stops_the_sandbox_and_confirms_it_gone(node: Node) -> None:
    submit(node, JobSpec(id="c1", type="echo.container", params={"text": "x", "sleep_s": 60}))
    run_until(node, lambda: bool(node.broker.running), timeout=30)
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


# -- trust at the edges: the attacks of issue 11, for real --------------------------


def sandboxed(node: Node, job_id: str, attempt: int = 1) -> list[psutil.Process]:
    """The attempt's processes that run inside its sandbox: they carry its marker
    and live in a PID namespace other than the broker's (bubblewrap's outer
    process, podman's client and conmon are on this side of it)."""
    ours = os.stat("/proc/self/ns/pid").st_ino
    found = []
    for proc in find_attempt_processes(attempt_marker(node.broker.instance, job_id, attempt)):
        try:
            if os.stat(f"/proc/{proc.pid}/ns/pid").st_ino != ours:
                found.append(proc)
        except OSError:
            continue
    return found


def attempt_processes(node: Node, job_id: str, attempt: int = 1) -> list[psutil.Process]:
    return find_attempt_processes(attempt_marker(node.broker.instance, job_id, attempt))


def go(node: Node, job_id: str) -> None:
    """Let a probe that waits for ``go`` carry on (its output folder is mounted)."""
    (job_out(node, job_id) / "go").write_text("go")


def wait_sandboxed(node: Node, job_id: str) -> list[psutil.Process]:
    found: list[psutil.Process] = []

    def running() -> bool:
        found[:] = sandboxed(node, job_id)
        return bool(found)

    run_until(node, running, timeout=60)
    return found


def pids_max_of(pid: int) -> int | None:
    """``pids.max`` of the pids cgroup ``pid`` is in, read on the host (cgroup v1
    or v2); None when it is ``max`` or the root cgroup (no limit)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "pids.max")
        elif controllers == "":
            for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                candidates.append(root / path.lstrip("/") / "pids.max")
    for f in candidates:
        if f.exists():
            text = f.read_text().strip()
            return None if text == "max" else int(text)
    return None


def finish_and_read(node: Node, job_id: str) -> dict[str, Any]:
    run_until(node, lambda: ended(node, job_id), timeout=90)
    job = node.store.get_job(job_id)
    assert job is not None and job.state is JobState.DONE, job.reason if job else None
    return json.loads((job_out(node, job_id) / "report.json").read_text())


def next_job_completes(node: Node, job_id: str) -> None:
    """After an attack: the broker still runs jobs, and nothing of the attack is left."""
    submit(node, JobSpec(id=job_id, type="echo.container", params={"text": "after"}))
    run_until(node, lambda: ended(node, job_id), timeout=60)
    job = node.store.get_job(job_id)
    assert job is not None and job.state is JobState.DONE, job.reason
    assert (job_out(node, job_id) / "echo.txt").read_text() == "after"


def nothing_left(node: Node, job_id: str) -> None:
    assert attempt_processes(node, job_id) == []
    sandbox = node.broker.sandbox
    assert sandbox is not None
    if sandbox.runtime.needs_image:
        assert sandbox.leftovers(node.broker.instance) == []
    gone = sandbox.pids_cgroups
    if gone is not None:
        assert not any(gone.parent.glob(f"*-{job_id}-*"))  # the pids cgroup was removed


@both
def test_the_sandboxs_processes_and_files_belong_to_an_unprivileged_host_uid(
    node: Node,
) -> None:
    assert os.geteuid() == 0  # the broker is root: the case the attack needed
    submit(node, JobSpec(id="u1", type="probe.sandbox", params={"wait_for": "go"}))
    inside = wait_sandboxed(node, "u1")
    # seen from the host, not from inside (where uid_map reads the same either way)
    for proc in inside:
        assert proc.uids() == (NOBODY, NOBODY, NOBODY), (proc.pid, proc.cmdline())
        assert proc.gids() == (NOBODY, NOBODY, NOBODY), (proc.pid, proc.cmdline())
    if node.config.container_runtime is Runtime.BUBBLEWRAP:
        # bubblewrap itself too: no process of the attempt is root, none has groups
        every = attempt_processes(node, "u1")
        assert len(every) > len(inside)  # bubblewrap's own outer process is among them
        for proc in every:
            assert proc.uids().real == NOBODY and proc.uids().effective == NOBODY
            groups = Path(f"/proc/{proc.pid}/status").read_text().split("Groups:")[1]
            assert groups.splitlines()[0].split() == [], (proc.pid, groups)
    go(node, "u1")
    report = finish_and_read(node, "u1")
    written = job_out(node, "u1") / "report.json"
    assert (written.stat().st_uid, written.stat().st_gid) == (NOBODY, NOBODY)
    assert report["uid"] == NOBODY and report["euid"] == NOBODY
    assert report["uid_map"], report.get("errors")  # what it reads inside, for the record
    nothing_left(node, "u1")
    next_job_completes(node, "u2")


@both
def test_a_fork_bomb_hits_the_per_sandbox_pids_limit_and_leaves_nothing(node: Node) -> None:
    sandbox = node.broker.sandbox
    assert sandbox is not None and sandbox.limits.pids == 512
    submit(
        node,
        JobSpec(id="f1", type="probe.sandbox", params={"wait_for": "go", "fork": 1500}),
    )
    inside = wait_sandboxed(node, "f1")
    # the limit is in place before the bomb goes off: each sandbox's own pids
    # cgroup (bubblewrap on this host; podman's --pids-limit), or the fallback
    limits = {pids_max_of(p.pid) for p in inside}
    if sandbox.runtime is Runtime.BUBBLEWRAP and sandbox.pids_cgroups is None:
        assert {p.rlimit(psutil.RLIMIT_NPROC) for p in inside} == {(512, 512)}
    else:
        assert limits == {512}, limits
    go(node, "f1")
    report = finish_and_read(node, "f1")
    fork = report["tried"]["fork"]
    assert fork["asked"] == 1500
    assert 0 < fork["made"] < 512, fork  # the probe and its runtime's processes count too
    assert fork["error"].startswith("EAGAIN"), fork
    nothing_left(node, "f1")
    next_job_completes(node, "f2")


def host_can(fn: Any) -> int:
    """Run ``fn`` in a forked child on the host; its exit status (0: allowed)."""
    pid = os.fork()
    if pid == 0:
        os._exit(fn())
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@both
def test_no_nested_user_namespace_and_the_filter_refuses_mount_and_keyctl(node: Node) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    # on this host, outside a sandbox, both are allowed: what refuses them inside
    # is the sandbox (a user namespace would give the job capabilities back)
    assert host_can(lambda: 0 if libc.unshare(0x10000000) == 0 else 1) == 0
    keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
    assert host_can(lambda: 0 if libc.syscall(keyctl, 0, -3, 0) >= 0 else 1) == 0
    submit(node, JobSpec(id="n1", type="probe.sandbox"))
    report = finish_and_read(node, "n1")
    assert report["seccomp"] == 2  # a filter is loaded (bwrap's, podman's profile)
    assert report["userns"]["ok"] is False, report["userns"]
    assert report["userns"]["error"].startswith("EPERM"), report["userns"]
    assert report["keyctl"]["ok"] is False and report["keyctl"]["error"].startswith("EPERM")
    assert report["mount"]["ok"] is False and report["mount"]["error"].startswith("EPERM")
    nothing_left(node, "n1")
    next_job_completes(node, "n2")


@both
def test_tmp_is_a_tmpfs_of_tmp_mib_and_filling_it_fails_inside(node: Node) -> None:
    submit(node, JobSpec(id="t1", type="probe.sandbox", params={"tmp_fill_mib": 4 * TMP_MIB}))
    report = finish_and_read(node, "t1")
    assert report["tmp"]["size_bytes"] == TMP_MIB * 2**20  # the limit was in place
    filled = report["tried"]["tmp_fill"]
    assert filled["error"].startswith("ENOSPC"), filled
    assert filled["written_bytes"] <= TMP_MIB * 2**20
    nothing_left(node, "t1")
    next_job_completes(node, "t2")


@both
def test_output_past_output_mib_stops_the_job_which_fails_for_it(node: Node) -> None:
    params = {"output_fill_mib": 4 * OUTPUT_MIB, "hold_s": 50}
    submit(node, JobSpec(id="o1", type="probe.sandbox", params=params))
    run_until(node, lambda: ended(node, "o1"), timeout=90)
    job = node.store.get_job("o1")
    assert job is not None
    written = job_out(node, "o1") / "fill.bin"
    assert written.stat().st_size > OUTPUT_MIB * 2**20  # the attack really wrote past it
    # the job's own failure (probe.sandbox has no retries: an infrastructure
    # failure would have quarantined it), stopped long before its 60 s timeout
    assert job.state is JobState.FAILED, job.reason
    assert f"output past {OUTPUT_MIB} MiB" in job.reason, job.reason
    assert "timed out" not in job.reason
    assert len(node.store.attempts("o1")) == 1
    nothing_left(node, "o1")
    next_job_completes(node, "o2")


@both
def test_a_served_job_past_output_mib_fails_for_it_and_is_not_retried(node: Node) -> None:
    """A warm server's job that writes past the limit faster than the watch looks
    (once a second) is caught at its end, before its outputs leave the exchange."""
    text = "0123456789abcdef" * 4096  # 64 KiB, written 256 times: 16 MiB
    params = {"text": text, "output": "big.txt", "repeat": 256}
    submit(node, JobSpec(id="s1", type="echo.serve", params=params))
    run_until(node, lambda: ended(node, "s1"), timeout=90)
    job = node.store.get_job("s1")
    assert job is not None
    written = job_out(node, "s1") / "big.txt"
    assert written.stat().st_size == 16 * 2**20 > OUTPUT_MIB * 2**20  # it really wrote past
    assert job.state is JobState.FAILED, job.reason
    assert f"output past {OUTPUT_MIB} MiB" in job.reason, job.reason
    assert len(node.store.attempts("s1")) == 1  # its own failure: not retried
    submit(node, JobSpec(id="s2", type="echo.serve", params={"text": "after"}))
    run_until(node, lambda: ended(node, "s2"), timeout=90)
    after = node.store.get_job("s2")
    assert after is not None and after.state is JobState.DONE, after and after.reason
    assert (job_out(node, "s2") / "echo.txt").read_text() == "after"


# -- the launcher on its own: mount sources a job could have swapped -----------------


@pytest.fixture
def launcher(runtime_config: tuple[str, Config]) -> SandboxLauncher:
    _, config = runtime_config
    made = sandbox_launcher(config)
    assert made is not None
    return made


def probe_request(tmp_path: Path, launcher: SandboxLauncher) -> LaunchRequest:
    attempt = tmp_path / "attempt"
    attempt.mkdir(mode=0o700)
    module = MODULES / "probe"
    mounts = mounts_for(
        module_dir=str(module),
        input_dir=None,
        output_dir=str(attempt / "out"),
        scratch_dir=str(attempt / "scratch"),
        report_dir=str(attempt / "report"),
        params_file=None,
        weights_dir=None,
        scratch_bytes=2**20,
    )
    return LaunchRequest(
        job_id="edge",
        attempt=1,
        argv=(launcher.python, "src/probe.py"),
        cwd=str(module),
        env={
            "GPUWARDEN_OUTPUT_DIR": str(attempt / "out"),
            "GPUWARDEN_SCRATCH_DIR": str(attempt / "scratch"),
        },
        attempt_dir=str(attempt),
        timeout_s=60,
        kill_grace_s=1,
        instance="edge-test",
        mounts=mounts,
    )


@both
def test_a_writable_folder_that_is_a_link_is_refused_and_its_target_keeps_its_owner(
    launcher: SandboxLauncher, tmp_path: Path
) -> None:
    req = probe_request(tmp_path, launcher)
    victim = tmp_path / "etc-like"
    victim.mkdir()
    (victim / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    out = Path(req.attempt_dir) / "out"
    out.symlink_to(victim)
    assert out.is_symlink()  # the attack is in place: the output folder points elsewhere
    result = launcher.run(req, threading.Event())
    assert result.launch_error is not None and "symlink" in result.launch_error
    assert result.exit_code is None  # nothing ran
    for path in (victim, victim / "passwd"):
        assert (path.stat().st_uid, path.stat().st_gid) == (0, 0)  # never chowned


@both
def test_a_writable_folder_with_content_is_never_handed_over(
    launcher: SandboxLauncher, tmp_path: Path
) -> None:
    req = probe_request(tmp_path, launcher)
    out = Path(req.attempt_dir) / "out"
    out.mkdir()
    (out / "brokers-own").write_text("not the job's")
    assert out.stat().st_uid == 0 and any(out.iterdir())
    result = launcher.run(req, threading.Event())
    assert result.launch_error is not None and "not a fresh folder" in result.launch_error
    assert out.stat().st_uid == 0 and (out / "brokers-own").stat().st_uid == 0
    # a fresh attempt folder works
    again = tmp_path / "again"
    again.mkdir()
    fresh = probe_request(again, launcher)
    done = launcher.run(fresh, threading.Event())
    assert done.launch_error is None and done.exit_code == 0, done.stderr
    made = Path(fresh.attempt_dir) / "out"
    assert (made.stat().st_uid, made.stat().st_mode & 0o777) == (NOBODY, 0o700)
    assert safefs.walk(made).files  # report.json, written by the sandbox's user


FILL_SERVER = """
import time
from gpuwarden.server.worker import serve

def load(ctx):
    return None

def handle(model, job):
    with open(job.output_dir / "fill.bin", "wb") as f:
        for _ in range(int(job.params["mib"])):
            f.write(bytes(2**20))
            f.flush()
    time.sleep(50)
    return "never"

serve(load, handle)
"""


@both
def test_a_serve_worker_past_output_mib_in_its_exchange_folder_is_stopped_for_it(
    launcher: SandboxLauncher, tmp_path: Path
) -> None:
    module = tmp_path / "fillmod"
    (module / "src").mkdir(parents=True)
    (module / "src" / "fill.py").write_text(FILL_SERVER)
    log_dir = tmp_path / "warm" / "fill-1"
    exchange = log_dir / "exchange"
    exchange.mkdir(parents=True)  # as serving.py makes it: the broker's, empty
    sockets = Path(tempfile.mkdtemp(prefix="gw-sbx-"))
    socket_path = sockets / "1.sock"
    mounts = mounts_for(
        module_dir=str(module),
        input_dir=None,
        output_dir=str(exchange),
        scratch_dir=str(log_dir / "scratch"),
        report_dir=None,
        params_file=None,
        weights_dir=None,
        scratch_bytes=2**20,
        extra=(Mount(str(socket_path), str(INSIDE / "serve.sock"), writable=True),),
    )
    req = LaunchRequest(
        job_id="warm-fill",
        attempt=1,
        argv=(launcher.python, "src/fill.py"),
        cwd=str(module),
        env={"CUDA_VISIBLE_DEVICES": ""},
        attempt_dir=str(log_dir),
        timeout_s=math.inf,
        kill_grace_s=1,
        instance="serve-limit-test",
        mounts=mounts,
    )
    worker = WarmProcess(launcher, req, socket_path, epoch=1, stop_wait_s=1)
    try:
        worker.start(load_timeout_s=60)
        assert exchange.stat().st_uid == NOBODY  # handed to the sandbox's user, while empty
        slot = exchange / "j1-1"
        owner = launcher.job_owner
        for sub in ("", "in", "out", "scratch"):  # what serving.py makes for each job
            safefs.make_dir(slot / sub if sub else slot, mode=0o700, owner=owner)
        inside = INSIDE / "output" / slot.name
        with pytest.raises(ServeError) as caught:
            worker.run_job(
                "j1",
                1,
                {"mib": 4 * OUTPUT_MIB},
                inside / "in",
                inside / "out",
                inside / "scratch",
                timeout_s=55,
            )
        written = slot / "out" / "fill.bin"
        assert written.stat().st_size > OUTPUT_MIB * 2**20  # it really wrote past the limit
    finally:
        result = worker.stop("test over")
    err = caught.value
    assert err.kind == "output_limit" and err.infrastructure is False, err
    assert f"output past {OUTPUT_MIB} MiB" in str(err)
    assert result.limit_exceeded == f"output past {OUTPUT_MIB} MiB"
    assert not worker.alive()
    assert find_attempt_processes(req.marker) == []
    if launcher.runtime.needs_image:
        assert launcher.leftovers(req.instance) == []
    safefs.remove_tree(sockets)


@pytest.mark.parametrize("runtime_config", ["bubblewrap"], indirect=True)
def test_pids_cgroups_a_crashed_run_left_are_removed_at_start_and_only_those(
    runtime_config: tuple[str, Config],
) -> None:
    _, config = runtime_config
    with open_node(config, mock_gpu=True) as n:
        instance = n.broker.instance
        cgroups = n.broker.sandbox.pids_cgroups if n.broker.sandbox else None
    if cgroups is None:
        pytest.skip("no pids cgroup can be made here (CI has one)")

    def left_by(inst: str, job: str) -> Path:
        req = LaunchRequest("x", 1, (), "/", {}, "/", 1.0, instance=inst)
        return cgroups.create(container_name(dataclasses.replace(req, job_id=job)), 8)

    ours, theirs = left_by(instance, "crashed"), left_by("someone-else", "theirs")
    try:
        assert ours.is_dir() and theirs.is_dir()  # what a crash leaves
        with open_node(config, mock_gpu=True) as n:
            n.broker.recover()
        assert not ours.exists()
        assert theirs.is_dir()
    finally:
        for path in (ours, theirs):
            cgroups.remove(path)


@pytest.mark.parametrize("runtime_config", ["podman"], indirect=True)
def test_podmans_own_default_profile_would_let_a_job_make_a_user_namespace(
    launcher: SandboxLauncher, tmp_path: Path
) -> None:
    """Why podman gets a profile of gpuwarden's: with podman's default one, the
    same container (every other flag as the launcher's) can ``unshare -U``."""
    attempt = tmp_path / "a"
    req = LaunchRequest(
        job_id="ns",
        attempt=1,
        argv=("unshare", "-U", "true"),
        cwd="/",
        env={},
        attempt_dir=str(attempt),
        timeout_s=60,
        kill_grace_s=1,
        instance="userns-test",
    )
    argv = launcher.argv(req)
    ours = argv.index(f"seccomp={attempt}/seccomp.json")
    plain = argv[: ours - 1] + argv[ours + 1 :]
    plain[plain.index(container_name(req))] = f"{container_name(req)}-default"
    plain.insert(plain.index("run") + 1, "--rm")
    done = subprocess.run(plain, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # the attack works under podman's default
    result = launcher.run(req, threading.Event())
    assert result.launch_error is None, result.launch_error
    assert result.exit_code == 1 and "Operation not permitted" in result.stderr, result.stderr
    assert launcher.leftovers(req.instance) == []


def test_why_bubblewrap_sources_are_staged_and_not_passed_by_descriptor(tmp_path: Path) -> None:
    """bubblewrap 0.8.0's --ro-bind-fd looks the descriptor's path up again
    (realpath of /proc/self/fd/N): run as the sandbox's user it cannot reach a
    source under a folder only root may search, so the starter stages sources."""
    need_tool("bwrap")
    private = tmp_path / "state"
    private.mkdir(mode=0o700)
    source = private / "module"
    source.mkdir(mode=0o755)
    assert private.stat().st_mode & 0o777 == 0o700 and private.stat().st_uid == 0
    fd = os.open(source, os.O_PATH | os.O_DIRECTORY)
    try:
        done = subprocess.run(
            [
                *("bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr"),
                *("--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib"),
                *("--symlink", "usr/lib64", "/lib64"),
                *("--ro-bind-fd", str(fd), "/module", "true"),
            ],
            pass_fds=(fd,),
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(fd)
    assert done.returncode == 1 and "Permission denied" in done.stderr, done.stderr
