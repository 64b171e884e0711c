"""RAM caps enforced by the kernel, for real: a memory cgroup per attempt (this
host: cgroup v1 memory, the broker as root), a host job and a bubblewrap job
killed at their cap, one under its cap that finishes, the cgroup removed after.
Every test that runs a job asserts first that the limit was in place while it
ran. Without root or a memory controller they skip with the reason; with
GPUWARDEN_REQUIRE_MEMCAPS=1 or GPUWARDEN_REQUIRE_CONTAINERS=1 (CI) they fail."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from gpuwarden.core.launchrules import Runtime
from gpuwarden.launch.base import LaunchRequest, LaunchResult
from gpuwarden.launch.host import HostLauncher, starter_argv
from gpuwarden.launch.memcaps import (
    MemoryCgroups,
    find_memory_cgroups,
    why_no_memory_cgroups,
)
from gpuwarden.launch.sandbox import SandboxLauncher, SandboxLimits, mounts_for
from tests.conftest import need_tool

MIB = 2**20
CAP = 64 * MIB
REQUIRE = (
    os.environ.get("GPUWARDEN_REQUIRE_MEMCAPS") == "1"
    or os.environ.get("GPUWARDEN_REQUIRE_CONTAINERS") == "1"
)

V1_MOUNTS = """\
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup MEM cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""

# the job: says which cgroups it is in, waits for the test's go, then takes
# argv[2] MiB (written: pages the kernel must give it)
JOB = """
import os, sys, time
folder, mib = sys.argv[1], int(sys.argv[2])
with open(os.path.join(folder, "cgroup.tmp"), "w") as f:
    f.write(f"{os.getpid()}\\n" + open("/proc/self/cgroup").read())
os.rename(os.path.join(folder, "cgroup.tmp"), os.path.join(folder, "cgroup"))
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.01)
data = b"\\x01" * (mib * 2**20)
print("took", len(data) // 2**20, "MiB", flush=True)
"""


@pytest.fixture
def memory() -> MemoryCgroups:
    found = find_memory_cgroups()
    if found is None:
        why = why_no_memory_cgroups()
        if REQUIRE:
            pytest.fail(f"memory caps are required here but cannot be enforced: {why}")
        pytest.skip(f"no memory cgroup can be made here ({why}); CI has one (root, cgroup v1)")
    return found


# -- finding the hierarchy (no root needed) --------------------------------------


def test_v1_memory_is_found_from_the_mount_table(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    mem.mkdir()
    text = V1_MOUNTS.replace("MEM", str(mem))
    assert find_memory_cgroups(text, euid=0) == MemoryCgroups(mem, 1)
    # this host's layout: the v2 mount beside v1 has no memory controller
    assert find_memory_cgroups(text.replace(",memory", ""), euid=0) is None
    said = why_no_memory_cgroups(text.replace(",memory", ""), euid=0)
    assert "no memory controller" in said or "no cgroup v1 memory mount" in said


def test_v2_is_used_only_with_the_memory_controller(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    text = f"cgroup2 {root} cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
    (root / "cgroup.controllers").write_text("cpuset cpu io pids\n")
    assert find_memory_cgroups(text, euid=0) is None
    assert "has no memory controller" in why_no_memory_cgroups(text, euid=0)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert find_memory_cgroups(text, euid=0) == MemoryCgroups(root, 2)


def test_v2_sets_memory_max_and_no_swap_and_enables_memory_on_the_way(tmp_path: Path) -> None:
    # a stand-in for cgroupfs: its control files exist already
    root = tmp_path / "cgroup"
    made = root / "gpuwarden" / "a1"
    made.mkdir(parents=True)
    for f in (root / "cgroup.subtree_control", root / "gpuwarden" / "cgroup.subtree_control"):
        f.write_text("pids\n")
    for name in ("memory.max", "memory.swap.max", "memory.events"):
        (made / name).write_text("")  # written in place, as cgroupfs is
    cg = MemoryCgroups(root, 2)
    assert cg.create("a1", CAP) == made
    assert (root / "cgroup.subtree_control").read_text() == "+memory"
    assert (root / "gpuwarden" / "cgroup.subtree_control").read_text() == "+memory"
    assert cg.limit(made) == CAP and cg.swap_limit(made) == 0
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cg.oom_kills(made) == 1


def test_a_limit_that_does_not_read_back_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    made = root / "gpuwarden" / "a1"
    made.mkdir(parents=True)
    (made / "memory.limit_in_bytes").mkdir()  # cannot be written: not a control file
    with pytest.raises(OSError):
        MemoryCgroups(root, 1).create("a1", CAP)


def test_a_cap_where_none_can_be_enforced_is_a_launch_error(tmp_path: Path) -> None:
    launcher = HostLauncher(None)
    assert not launcher.memory_caps().enforced
    assert "no memory cgroup can be made here" in launcher.memory_caps().how
    result = launcher.run(request(tmp_path, 8), threading.Event())
    assert result.launch_error is not None and "cannot enforce memory caps" in result.launch_error
    assert result.exit_code is None and result.pid is None
    # and one whose cgroup cannot be made: a launch error too, nothing started
    broken = HostLauncher(MemoryCgroups(tmp_path / "not-a-cgroupfs" / "x", 1))
    result = broken.run(request(tmp_path, 8, attempt=2), threading.Event())
    assert result.launch_error is not None and "memory cgroup" in result.launch_error
    assert result.pid is None


# -- host jobs for real ----------------------------------------------------------


def request(tmp_path: Path, mib: int, *, attempt: int = 1, cap: int = CAP) -> LaunchRequest:
    folder = tmp_path / f"job-{attempt}"
    folder.mkdir(exist_ok=True)
    return LaunchRequest(
        job_id="capped",
        attempt=attempt,
        argv=(sys.executable, "-c", JOB, str(folder), str(mib)),
        cwd=str(tmp_path),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        attempt_dir=str(tmp_path / f"attempt-{attempt}"),
        timeout_s=60,
        kill_grace_s=1,
        instance=f"memcap-test-{os.getpid()}",
        ram_cap_bytes=cap,
    )


def run_host(
    launcher: HostLauncher, req: LaunchRequest, how: str
) -> tuple[Callable[[], LaunchResult], list[int]]:
    """Start ``req`` (by ``run`` on a thread, or ``start`` through the reaper);
    the result when it ends, and the pids ``on_start`` got."""
    pids: list[int] = []
    box: list[LaunchResult] = []
    if how == "start":
        ended = launcher.start(req, threading.Event(), pids.append, box.append)
    else:
        ended = threading.Thread(
            target=lambda: box.append(launcher.run(req, threading.Event(), pids.append))
        )
        ended.start()

    def result() -> LaunchResult:
        ended.join(60)
        assert box, "the attempt did not end"
        return box[0]

    return result, pids


def wait_for(path: Path, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)
    return path.read_text()


def cgroup_of(memory: MemoryCgroups, said: str) -> Path:
    """The memory cgroup the job said it was in (``/proc/self/cgroup``)."""
    for line in said.splitlines()[1:]:
        _, controllers, rel = line.split(":", 2)
        if memory.version == 1 and "memory" in controllers.split(","):
            return memory.root / rel.lstrip("/")
        if memory.version == 2 and controllers == "":
            return memory.root / rel.lstrip("/")
    raise AssertionError(f"no memory cgroup in {said!r}")


@pytest.mark.parametrize("how", ["run", "start"])
def test_a_host_job_past_its_cap_is_killed_by_the_kernel(
    memory: MemoryCgroups, tmp_path: Path, how: str
) -> None:
    launcher = HostLauncher(memory)
    assert launcher.memory_caps().enforced
    req = request(tmp_path, 512)
    result, pids = run_host(launcher, req, how)
    folder = tmp_path / "job-1"
    said = wait_for(folder / "cgroup")
    job_pid = int(said.splitlines()[0])
    path = cgroup_of(memory, said)
    # the limit is in place, swap off, and the job (the pid the broker got) is in it
    assert path.parent == memory.parent and path.name.endswith("-capped-1")
    assert memory.limit(path) == CAP
    assert memory.swap_limit(path) in (None, 0, CAP)  # v1: memory+swap equal; v2: swap 0
    assert job_pid in memory.processes(path)
    # the pid the broker got is the attempt's supervisor, outside the cap; the
    # starter it ran executed the job: its child's pid stayed the job's
    assert pids[0] not in memory.processes(path)
    assert psutil.Process(job_pid).ppid() == pids[0]
    (folder / "go").write_text("")
    ended = result()
    assert ended.launch_error is None
    assert ended.exit_code in (-9, 137), ended
    assert ended.oom_killed is True and ended.ram_cap_bytes == CAP
    assert "took" not in ended.stdout
    assert not path.exists()  # the cgroup is removed


def test_a_host_job_under_its_cap_finishes_normally(memory: MemoryCgroups, tmp_path: Path) -> None:
    req = request(tmp_path, 8)
    result, _ = run_host(HostLauncher(memory), req, "start")
    folder = tmp_path / "job-1"
    path = cgroup_of(memory, wait_for(folder / "cgroup"))
    assert memory.limit(path) == CAP
    (folder / "go").write_text("")
    ended = result()
    assert ended.exit_code == 0 and ended.launch_error is None, ended
    assert ended.oom_killed is False and ended.ram_cap_bytes == CAP
    assert ended.stdout.strip() == "took 8 MiB"
    assert not path.exists()


def test_without_a_cap_a_host_job_starts_as_before(memory: MemoryCgroups, tmp_path: Path) -> None:
    req = request(tmp_path, 1, cap=0)
    result, _ = run_host(HostLauncher(memory), req, "run")
    folder = tmp_path / "job-1"
    said = wait_for(folder / "cgroup")
    assert "gpuwarden" not in said  # no cgroup of ours
    (folder / "go").write_text("")
    ended = result()
    assert ended.exit_code == 0 and ended.oom_killed is None and ended.ram_cap_bytes == 0


def test_a_starter_failure_is_a_launch_error_not_the_jobs(
    memory: MemoryCgroups, tmp_path: Path
) -> None:
    req = request(tmp_path, 1)
    missing = LaunchRequest(**{**_fields(req), "argv": ("no-such-command-here",)})
    ended = HostLauncher(memory).run(missing, threading.Event())
    assert ended.launch_error is not None
    assert "gpuwarden-sandbox:" in ended.launch_error and "not on PATH" in ended.launch_error
    assert not any(memory.parent.glob("*-capped-1"))  # removed


def test_the_starter_joins_every_cgroup_it_is_given(memory: MemoryCgroups) -> None:
    argv = starter_argv([Path("/a"), Path("/b")], ["job", "--x"])
    assert argv[1:3] == ["-I", "-S"] and argv[argv.index("--") + 1 :] == ["job", "--x"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--cgroup"] == ["/a", "/b"]


def _fields(req: LaunchRequest) -> dict[str, object]:
    return {f: getattr(req, f) for f in req.__dataclass_fields__}


# -- bubblewrap ----------------------------------------------------------------

BWRAP_JOB = """
import os, time
out = "/gpuwarden/output"
open(out + "/ready", "w").close()
while not os.path.exists(out + "/go"):
    time.sleep(0.01)
data = b"\\x01" * (MIB * 2**20)
print("took", len(data) // 2**20, "MiB", flush=True)
"""


def bwrap_request(tmp_path: Path, launcher: SandboxLauncher, mib: int) -> LaunchRequest:
    attempt = tmp_path / "attempt"
    attempt.mkdir(mode=0o700)
    module = tmp_path / "module"
    module.mkdir(mode=0o755)
    mounts = mounts_for(
        module_dir=str(module),
        input_dir=None,
        output_dir=str(attempt / "out"),
        scratch_dir=str(attempt / "scratch"),
        report_dir=None,
        params_file=None,
        weights_dir=None,
        scratch_bytes=2**20,
    )
    return LaunchRequest(
        job_id="capped",
        attempt=1,
        argv=(launcher.python, "-c", BWRAP_JOB.replace("MIB", str(mib))),
        cwd=str(module),
        env={},
        attempt_dir=str(attempt),
        timeout_s=60,
        kill_grace_s=1,
        instance=f"memcap-bwrap-{os.getpid()}",
        mounts=mounts,
        ram_cap_bytes=CAP,
    )


@pytest.mark.parametrize(("mib", "killed"), [(512, True), (8, False)])
def test_a_bubblewrap_job_is_capped_in_its_own_memory_cgroup(
    memory: MemoryCgroups, tmp_path: Path, mib: int, killed: bool
) -> None:
    need_tool("bwrap")
    launcher = SandboxLauncher(Runtime.BUBBLEWRAP, SandboxLimits(), memory_cgroups=memory)
    assert launcher.memory_caps().enforced
    req = bwrap_request(tmp_path, launcher, mib)
    path = launcher.memory_cgroup_path(req)
    assert path is not None
    box: list[LaunchResult] = []
    worker = threading.Thread(target=lambda: box.append(launcher.run(req, threading.Event())))
    worker.start()
    out = Path(req.attempt_dir) / "out"
    wait_for(out / "ready")
    # the limit is in place and the sandbox's processes are in the cgroup
    assert memory.limit(path) == CAP
    assert memory.swap_limit(path) in (None, 0, CAP)
    assert memory.processes(path)
    (out / "go").write_text("")
    worker.join(60)
    ended = box[0]
    assert ended.launch_error is None, ended
    assert ended.ram_cap_bytes == CAP and ended.oom_killed is killed, ended
    if killed:
        assert ended.exit_code in (-9, 137) and "took" not in ended.stdout
    else:
        assert ended.exit_code == 0 and ended.stdout.strip() == f"took {mib} MiB"
    assert not path.exists()
