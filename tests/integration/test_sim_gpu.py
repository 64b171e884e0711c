"""The simulated GPU: memory, release after exit, faults, sharing between processes,
and processes in PID namespaces of their own (sandboxed jobs, issue 12): listed
under their host pids, as NVML lists them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpuwarden
from gpuwarden.core.model import GIB, MIB
from gpuwarden.errors import GpuProbeError, GpuwardenError, SimOutOfMemoryError
from gpuwarden.gpu import sim as sim_module
from gpuwarden.gpu import simclient
from gpuwarden.gpu.base import GpuReading, ProcessUsage
from gpuwarden.gpu.select import SIM_STATE_FILE, open_probe
from gpuwarden.gpu.sim import SimDevice, SimGpuConfig, SimProbe, find_host_pids, own_pidns
from tests.conftest import need_tool

SRC_DIR = str(Path(gpuwarden.__file__).resolve().parent.parent)
T0 = 1_000_000.0  # an injected clock, far from the real one

CHILD_ALLOC = """
import sys
from gpuwarden.gpu import simclient
gpu = simclient.attach()
print(gpu.allocate(int(sys.argv[1]), leak=sys.argv[2] == "1", label="child"), flush=True)
if len(sys.argv) > 3:
    sys.stdin.read()  # hold the memory until the parent closes stdin
"""

CHILD_GREEDY = """
from gpuwarden.errors import SimOutOfMemoryError
from gpuwarden.gpu import simclient
gpu = simclient.attach()
n = 0
while True:
    try:
        gpu.allocate(512 * 1024**2)
    except SimOutOfMemoryError:
        break
    n += 1
print(n)
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "simgpu.json"


@pytest.fixture
def dev(path: Path) -> SimDevice:
    return SimDevice.create(path, SimGpuConfig(count=2, vram_bytes=8 * GIB))


def by_uuid(readings: list[GpuReading]) -> dict[str, GpuReading]:
    return {r.uuid: r for r in readings}


def child_env(path: Path, gpu_uuid: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    env["GPUWARDEN_SIM_GPU"] = str(path)
    env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
    return env


def run_child(code: str, env: Mapping[str, str], *args: str) -> tuple[int, str]:
    """Run a child to completion; return its pid and what it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return proc.pid, out


# -- identity and opening -----------------------------------------------------


def test_uuids_are_stable_and_distinct(path: Path, tmp_path: Path) -> None:
    first = SimDevice.create(path, SimGpuConfig(count=2)).uuids()
    assert len(set(first)) == 2
    assert all(u.startswith("GPU-sim-") for u in first)
    assert SimDevice.create(path, SimGpuConfig(count=2)).uuids() == first
    other = SimDevice.create(tmp_path / "other.json", SimGpuConfig(count=2)).uuids()
    assert set(other).isdisjoint(first)


def test_reopen_keeps_allocations_and_config_change_resets(path: Path, dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    dev.allocate(gpu0, GIB, os.getpid())
    # another instance, as another process would open it
    assert by_uuid(SimDevice.open(path).readings(T0))[gpu0].used_bytes == GIB
    again = SimDevice.create(path, SimGpuConfig(count=2, vram_bytes=8 * GIB, release_delay_s=5))
    assert by_uuid(again.readings(T0))[gpu0].used_bytes == GIB
    resized = SimDevice.create(path, SimGpuConfig(count=3, vram_bytes=8 * GIB))
    readings = resized.readings(T0)
    assert len(readings) == 3
    assert all(r.used_bytes == 0 for r in readings)
    assert resized.allocations() == []


def test_create_replaces_unreadable_state(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(GpuProbeError, match="not valid JSON"):
        SimDevice.open(path)
    SimDevice.create(path, SimGpuConfig())
    assert len(SimDevice.open(path).readings(T0)) == 1


def test_open_missing_state(tmp_path: Path) -> None:
    with pytest.raises(GpuProbeError, match=r"no simulated GPU at .*--mock-gpu"):
        SimDevice.open(tmp_path / "nowhere.json")


def test_state_file_is_json_beside_its_lock(path: Path, dev: SimDevice) -> None:
    dev.allocate(dev.uuids()[0], MIB, os.getpid())
    state = json.loads(path.read_text())
    assert len(state["devices"]) == 2
    assert path.with_name("simgpu.json.lock").exists()
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []


# -- memory ----------------------------------------------------------------------


def test_allocate_and_free(dev: SimDevice) -> None:
    gpu0, gpu1 = dev.uuids()
    me = os.getpid()
    a = dev.allocate(gpu0, 2 * GIB, me, label="weights")
    b = dev.allocate(gpu0, 512 * MIB, me)
    c = dev.allocate(gpu1, GIB, me)
    assert len({a, b, c}) == 3
    readings = dev.readings(T0)
    assert [r.index for r in readings] == [0, 1]
    r0, r1 = readings
    assert r0.used_bytes == 2 * GIB + 512 * MIB
    assert r0.processes == (ProcessUsage(me, 2 * GIB + 512 * MIB),)
    assert r0.free_bytes == 8 * GIB - r0.used_bytes
    assert r0.name == "gpuwarden simulated GPU"
    assert r1.used_bytes == GIB
    dev.free(a)
    assert dev.readings(T0)[0].used_bytes == 512 * MIB
    assert dev.free_pid(me) == 2
    assert all(r.used_bytes == 0 and r.processes == () for r in dev.readings(T0))
    with pytest.raises(GpuProbeError, match=f"no allocation {a}"):
        dev.free(a)


def test_unknown_gpu(dev: SimDevice) -> None:
    with pytest.raises(GpuProbeError, match="no simulated GPU with UUID 'GPU-nope'"):
        dev.allocate("GPU-nope", 1, os.getpid())


def test_out_of_memory_reads_like_pytorch(path: Path) -> None:
    dev = SimDevice.create(path, SimGpuConfig())  # one 24 GiB GPU
    gpu = dev.uuids()[0]
    dev.allocate(gpu, 20 * GIB + 512 * MIB, os.getpid())
    with pytest.raises(SimOutOfMemoryError) as err:
        dev.allocate(gpu, 8 * GIB, os.getpid())
    assert isinstance(err.value, GpuwardenError)
    assert err.value.message.startswith(
        "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of "
        "24.00 GiB of which 3.50 GiB is free."
    )
    assert f"Process {os.getpid()} has 20.50 GiB memory in use." in err.value.message
    assert gpu in err.value.message
    # a failed allocation holds nothing; exactly the remainder still fits
    dev.allocate(gpu, 3 * GIB + 512 * MIB, os.getpid())
    assert dev.readings(T0)[0].free_bytes == 0


def test_capacity_is_per_gpu(dev: SimDevice) -> None:
    gpu0, gpu1 = dev.uuids()
    dev.allocate(gpu0, 6 * GIB, os.getpid())
    # 10 GiB is free on the node, but not 4 GiB on any one GPU... except gpu1
    with pytest.raises(SimOutOfMemoryError, match=r"of which 2\.00 GiB is free"):
        dev.allocate(gpu0, 4 * GIB, os.getpid())
    dev.allocate(gpu1, 4 * GIB, os.getpid())
    with pytest.raises(SimOutOfMemoryError):
        dev.allocate(gpu1, 5 * GIB, os.getpid())
    assert [r.used_bytes for r in dev.readings(T0)] == [6 * GIB, 4 * GIB]


# -- release after exit ------------------------------------------------------------


def test_memory_returns_after_child_exits(path: Path, dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    pid, out = run_child(CHILD_ALLOC, child_env(path, gpu0), str(2 * GIB), "0")
    (alloc,) = dev.allocations()
    assert (alloc.id, alloc.pid, alloc.label, alloc.release_at) == (int(out), pid, "child", None)

    first = by_uuid(dev.readings(T0))[gpu0]  # the sweep notices the exit
    assert first.processes == (ProcessUsage(pid, 2 * GIB),)
    assert dev.allocations()[0].release_at == pytest.approx(T0 + 0.2)
    # still held while the release is pending, and it still counts against capacity
    assert by_uuid(dev.readings(T0 + 0.1))[gpu0].used_bytes == 2 * GIB
    with pytest.raises(SimOutOfMemoryError):
        dev.allocate(gpu0, 7 * GIB, os.getpid())
    assert by_uuid(dev.readings(T0 + 0.25))[gpu0].used_bytes == 0
    assert dev.allocations() == []


def test_zombie_child_counts_as_gone(path: Path, dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_ALLOC, str(GIB), "0", "hold"],
        env=child_env(path, gpu0),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        int(proc.stdout.readline())
        dev.sweep(T0)
        assert dev.allocations()[0].release_at is None  # alive: kept
        proc.stdin.close()
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        dev.sweep(T0 + 1)  # exited but not reaped yet
        assert dev.allocations()[0].release_at == pytest.approx(T0 + 1.2)
    finally:
        proc.wait(timeout=10)


def test_zero_delay_releases_on_first_sweep(path: Path) -> None:
    dev = SimDevice.create(path, SimGpuConfig(release_delay_s=0))
    gpu = dev.uuids()[0]
    run_child(CHILD_ALLOC, child_env(path, gpu), str(GIB), "0")
    assert dev.readings(T0)[0].used_bytes == 0


def test_slow_release_can_be_injected(path: Path, dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    dev.set_release_delay(30)
    run_child(CHILD_ALLOC, child_env(path, gpu0), str(GIB), "0")
    assert dev.readings(T0)[0].used_bytes == GIB
    assert dev.readings(T0 + 29)[0].used_bytes == GIB
    assert dev.readings(T0 + 30)[0].used_bytes == 0


def test_reused_pid_is_not_the_owner(dev: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu0 = dev.uuids()[0]
    me = os.getpid()
    real = psutil.Process(me).create_time()
    dev.allocate(gpu0, GIB, me, label="mine")
    # an allocation made by an earlier process that had this same pid
    monkeypatch.setattr(sim_module, "_process_create_time", lambda pid: real - 1000.0)
    dev.allocate(gpu0, 2 * GIB, me, label="previous owner")
    monkeypatch.undo()

    dev.sweep(T0)
    pending = {a.label: a.release_at for a in dev.allocations()}
    assert pending == {"mine": None, "previous owner": pytest.approx(T0 + 0.2)}
    dev.sweep(T0 + 1)
    assert [a.label for a in dev.allocations()] == ["mine"]
    assert dev.readings(T0 + 1000)[0].processes == (ProcessUsage(me, GIB),)


def test_leak_is_never_released(path: Path, dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    pid, _ = run_child(CHILD_ALLOC, child_env(path, gpu0), str(3 * GIB), "1")
    for now in (T0, T0 + 1, T0 + 86_400):
        assert by_uuid(dev.readings(now))[gpu0].processes == (ProcessUsage(pid, 3 * GIB),)
    (leak,) = dev.allocations()
    assert leak.leak
    assert leak.release_at == pytest.approx(T0 + 0.2)  # its owner was noticed gone
    assert dev.free_pid(pid) == 1
    assert dev.readings(T0)[0].used_bytes == 0


# -- faults ----------------------------------------------------------------------


def test_foreign_memory(dev: SimDevice) -> None:
    gpu0, gpu1 = dev.uuids()
    dev.add_foreign(gpu1, 7 * GIB, label="someone's notebook")
    for now in (T0, T0 + 86_400):
        r1 = by_uuid(dev.readings(now))[gpu1]
        assert r1.used_bytes == 7 * GIB
        assert r1.processes == (ProcessUsage(0, 7 * GIB),)
    with pytest.raises(SimOutOfMemoryError, match=r"of which 1\.00 GiB is free"):
        dev.allocate(gpu1, 2 * GIB, os.getpid())
    assert by_uuid(dev.readings(T0))[gpu0].used_bytes == 0
    assert dev.clear_foreign() == 1
    assert by_uuid(dev.readings(T0))[gpu1].used_bytes == 0


def test_hang(path: Path, dev: SimDevice) -> None:
    gpu1 = dev.uuids()[1]
    probe = SimProbe(path, SimGpuConfig(count=2, vram_bytes=8 * GIB), clock=lambda: T0)
    probe.device.set_hang(gpu1, True)
    with pytest.raises(GpuProbeError, match=f"GPU {gpu1} .*stopped answering"):
        probe.read()
    with pytest.raises(GpuProbeError):
        dev.readings(T0)
    dev.set_hang(gpu1, False)
    assert len(probe.read()) == 2


def test_xid(dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    dev.inject_xid(gpu0, 43)
    dev.inject_xid(gpu0, 79)
    assert dev.xids(gpu0) == [43, 79]
    r0, r1 = dev.readings(T0)
    assert r0.extra == {"xid": "79"}
    assert r1.extra == {}
    dev.clear_xids(gpu0)
    assert dev.readings(T0)[0].extra == {}


# -- the probe and the client -------------------------------------------------------------


def test_sim_probe(tmp_path: Path) -> None:
    now = [T0]
    probe = open_probe("sim", state_dir=tmp_path / "state", sim=SimGpuConfig(count=2))
    assert isinstance(probe, SimProbe)
    probe.clock = lambda: now[0]
    path = tmp_path / "state" / SIM_STATE_FILE
    assert probe.kind == "sim"
    readings = probe.read()
    assert [r.total_bytes for r in readings] == [24 * GIB, 24 * GIB]
    uuid = readings[1].uuid
    assert probe.job_env(uuid) == {
        "CUDA_VISIBLE_DEVICES": uuid,
        "GPUWARDEN_SIM_GPU": str(path),
    }
    assert probe.job_env(None)["CUDA_VISIBLE_DEVICES"] == ""
    # a job started with that environment allocates on that GPU
    env = {**child_env(path, uuid), **probe.job_env(uuid)}
    pid, _ = run_child(CHILD_ALLOC, env, str(GIB), "0")
    assert by_uuid(probe.read())[uuid].processes == (ProcessUsage(pid, GIB),)
    now[0] += 1
    assert by_uuid(probe.read())[uuid].used_bytes == 0
    probe.close()


def test_client_in_process(path: Path, dev: SimDevice) -> None:
    gpu0, gpu1 = dev.uuids()
    client = simclient.attach({"GPUWARDEN_SIM_GPU": str(path), "CUDA_VISIBLE_DEVICES": gpu1})
    assert client.gpu_uuid == gpu1
    a = client.allocate(GIB)
    client.allocate(GIB, leak=True)
    assert by_uuid(dev.readings(T0))[gpu1].processes == (ProcessUsage(os.getpid(), 2 * GIB),)
    client.free(a)
    assert client.free_all() == 1
    assert dev.allocations() == []
    by_index = simclient.attach({"GPUWARDEN_SIM_GPU": str(path), "CUDA_VISIBLE_DEVICES": "0"})
    assert by_index.gpu_uuid == gpu0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "not running under gpuwarden's simulated GPU"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-x"}, "not running under gpuwarden's simulated GPU"),
        ({"GPUWARDEN_SIM_GPU": "@"}, "not running under gpuwarden's simulated GPU"),
        ({"GPUWARDEN_SIM_GPU": "@", "CUDA_VISIBLE_DEVICES": ""}, "given no GPU"),
        ({"GPUWARDEN_SIM_GPU": "@", "CUDA_VISIBLE_DEVICES": "GPU-x"}, "names no simulated GPU"),
        ({"GPUWARDEN_SIM_GPU": "@", "CUDA_VISIBLE_DEVICES": "7"}, "the simulated node has 2"),
        ({"GPUWARDEN_SIM_GPU": "/nonexistent/simgpu.json"}, "no simulated GPU at"),
    ],
)
def test_client_attach_errors(
    path: Path, dev: SimDevice, env: dict[str, str], message: str
) -> None:
    env = {k: str(path) if v == "@" else v for k, v in env.items()}
    with pytest.raises(GpuProbeError, match=message):
        simclient.attach(env)


def test_concurrent_processes_never_exceed_capacity(path: Path) -> None:
    dev = SimDevice.create(path, SimGpuConfig(count=1, vram_bytes=4 * GIB))
    env = child_env(path, dev.uuids()[0])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD_GREEDY], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    counts = []
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        counts.append(int(out))
    assert sum(counts) == 8  # 4 GiB in 512 MiB blocks, no more, no fewer
    assert len(dev.allocations()) == 8
    (reading,) = dev.readings(T0)
    assert reading.used_bytes == 4 * GIB
    assert sum(p.used_bytes for p in reading.processes) == 4 * GIB


# -- processes in a PID namespace of their own (sandboxed jobs, issue 12) -----------------

CHILD_NS = """
import json, os, sys
from gpuwarden.gpu import simclient
gpu = simclient.attach()
for _ in range(int(sys.argv[3])):
    gpu.allocate(int(sys.argv[1]), leak=sys.argv[2] == "1", label="namespaced")
seen = {"pid": os.getpid(), "pidns": os.stat("/proc/self/ns/pid").st_ino}
print(json.dumps(seen), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "free_all":
        print(gpu.free_all(), flush=True)
    elif cmd == "sweep":
        gpu.device.sweep(float(args[0]))
        print("swept", flush=True)
"""


class NsChild:
    """A job-like process in a PID namespace of its own (``unshare --pid``, as
    bubblewrap and podman give one), attached to the simulated GPU. It allocates
    ``blocks`` times ``nbytes`` on start, then runs commands sent to it, and
    exits when its stdin closes."""

    def __init__(self, path: Path, gpu: str, nbytes: int, leak: bool = False, blocks: int = 1):
        need_tool("unshare")
        userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        self.proc = subprocess.Popen(
            [
                *("unshare", *userns, "--pid", "--fork", "--mount-proc"),
                *(sys.executable, "-c", CHILD_NS, str(nbytes), "1" if leak else "0", str(blocks)),
            ],
            env=child_env(path, gpu),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert line, f"the namespaced child failed (exit {self.proc.wait(10)})"
        self.seen: dict[str, int] = json.loads(line)
        (python,) = psutil.Process(self.proc.pid).children(recursive=True)
        self.host_pid = python.pid

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def ns_child(path: Path, dev: SimDevice) -> Iterator[list[NsChild]]:
    started: list[NsChild] = []
    yield started
    for child in started:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait(10)


def assert_own_namespace(child: NsChild) -> None:
    """The child really is in a PID namespace of its own: it sees another pid."""
    assert child.seen["pidns"] != own_pidns()
    assert child.seen["pid"] != child.host_pid


def test_a_process_in_its_own_pid_namespace_is_listed_under_its_host_pid(
    path: Path, dev: SimDevice, ns_child: list[NsChild]
) -> None:
    gpu0 = dev.uuids()[0]
    child = NsChild(path, gpu0, 2 * GIB)
    ns_child.append(child)
    assert_own_namespace(child)
    (alloc,) = dev.allocations()
    # recorded as it saw itself; nothing has looked for it on the host yet
    assert (alloc.pid, alloc.pidns, alloc.host_pid) == (
        child.seen["pid"],
        child.seen["pidns"],
        None,
    )

    reading = by_uuid(dev.readings(T0))[gpu0]
    assert reading.processes == (ProcessUsage(child.host_pid, 2 * GIB),)
    assert dev.allocations()[0].host_pid == child.host_pid  # kept: not looked for again
    assert by_uuid(dev.readings(T0 + 5))[gpu0].processes == reading.processes  # alive: kept
    # another process in the host's namespace sees the same
    assert by_uuid(SimDevice.open(path).readings(T0 + 5))[gpu0].processes == reading.processes

    child.exit()
    gone = by_uuid(dev.readings(T0 + 6))[gpu0]  # noticed gone, listed until released
    assert gone.processes == (ProcessUsage(child.host_pid, 2 * GIB),)
    assert by_uuid(dev.readings(T0 + 6.25))[gpu0].used_bytes == 0
    assert dev.allocations() == []


def test_a_namespaced_owner_gone_before_any_reading_is_used_memory_of_no_process(
    path: Path, dev: SimDevice, ns_child: list[NsChild]
) -> None:
    gpu0 = dev.uuids()[0]
    child = NsChild(path, gpu0, GIB)
    ns_child.append(child)
    assert_own_namespace(child)
    child.exit()  # before the host ever found it
    first = by_uuid(dev.readings(T0))[gpu0]
    # as NVML shows a process that exited: its memory used, no process listed
    assert (first.used_bytes, first.processes) == (GIB, ())
    (alloc,) = dev.allocations()
    assert alloc.host_pid is None and alloc.release_at == pytest.approx(T0 + 0.2)
    assert by_uuid(dev.readings(T0 + 0.25))[gpu0].used_bytes == 0


def test_a_namespaced_leak_stays_under_its_host_pid_and_is_freed_by_it(
    path: Path, dev: SimDevice, ns_child: list[NsChild]
) -> None:
    gpu0 = dev.uuids()[0]
    child = NsChild(path, gpu0, 3 * GIB, leak=True)
    ns_child.append(child)
    assert_own_namespace(child)
    dev.readings(T0)  # found while it runs
    child.exit()
    for now in (T0 + 1, T0 + 86_400):
        assert by_uuid(dev.readings(now))[gpu0].processes == (
            ProcessUsage(child.host_pid, 3 * GIB),
        )
    # the pid the job saw means another process here: it frees nothing
    assert psutil.pid_exists(child.seen["pid"])
    assert dev.free_pid(child.seen["pid"]) == 0
    assert dev.free_pid(child.host_pid) == 1  # the pid status and the degraded reason show
    assert dev.readings(T0)[0].used_bytes == 0


def test_a_namespaced_client_frees_its_own_and_not_a_host_process_of_its_pid(
    path: Path, dev: SimDevice, ns_child: list[NsChild]
) -> None:
    gpu0 = dev.uuids()[0]
    child = NsChild(path, gpu0, GIB, blocks=2)
    ns_child.append(child)
    assert_own_namespace(child)
    # a host process with the very pid the child sees (its namespace's init is 1,
    # and so is the host's)
    same = child.seen["pid"]
    assert psutil.pid_exists(same)
    dev.allocate(gpu0, 4 * GIB, same, label="host process")
    assert child.ask("free_all") == "2"
    assert [(a.pid, a.label) for a in dev.allocations()] == [(same, "host process")]
    assert by_uuid(dev.readings(T0))[gpu0].processes == (ProcessUsage(same, 4 * GIB),)
    child.exit()


def test_a_sweep_inside_a_namespace_judges_only_its_own(
    path: Path, dev: SimDevice, ns_child: list[NsChild]
) -> None:
    gpu0 = dev.uuids()[0]
    # a host process the namespaced one cannot see (a pid that names nothing
    # there, or another process)
    dev.allocate(gpu0, GIB, os.getpid(), label="host")
    child = NsChild(path, gpu0, GIB)
    ns_child.append(child)
    assert_own_namespace(child)
    assert child.ask(f"sweep {T0}") == "swept"
    assert {a.label: a.release_at for a in dev.allocations()} == {"host": None, "namespaced": None}
    child.exit()


def test_a_host_pid_written_by_someone_else_is_not_believed(path: Path, dev: SimDevice) -> None:
    gpu0 = dev.uuids()[0]
    me = os.getpid()
    forged = {
        "id": 99,
        "gpu": gpu0,
        "nbytes": GIB,
        "pid": 7,
        "create_time": psutil.Process(me).create_time(),
        "label": "forged",
        "leak": False,
        "release_at": None,
        "pidns": 4242,  # a namespace this process is not in
        "host_pid": me,  # alive, but not in that namespace
    }
    state = json.loads(path.read_text())
    state["allocations"].append(forged)
    path.write_text(json.dumps(state))
    first = by_uuid(dev.readings(T0))[gpu0]
    assert dev.allocations()[0].release_at == pytest.approx(T0 + 0.2)  # taken for gone
    assert first.processes == (ProcessUsage(me, GIB),)  # until released, as any exited owner
    assert by_uuid(dev.readings(T0 + 1))[gpu0].used_bytes == 0


def test_a_namespaced_pid_given_to_another_process_is_not_the_owner(
    path: Path, dev: SimDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu0 = dev.uuids()[0]
    me = os.getpid()
    monkeypatch.setattr(sim_module, "own_pidns", lambda: 4242)  # allocate as if in a sandbox
    monkeypatch.setattr(sim_module, "_process_create_time", lambda pid: 1.0)  # long ago
    dev.allocate(gpu0, GIB, 7, label="previous owner")
    monkeypatch.undo()
    # the namespace's pid 7 is now another process (this one, started later)
    monkeypatch.setattr(sim_module, "find_host_pids", lambda wanted: {(4242, 7): me})
    reading = dev.readings(T0)[0]
    (alloc,) = dev.allocations()
    assert alloc.host_pid is None and alloc.release_at == pytest.approx(T0 + 0.2)
    assert (reading.used_bytes, reading.processes) == (GIB, ())


def test_a_malformed_state_is_a_clear_probe_error_and_create_resets_it(
    path: Path, dev: SimDevice
) -> None:
    gpu0 = dev.uuids()[0]
    dev.allocate(gpu0, GIB, os.getpid())
    state = json.loads(path.read_text())
    state["allocations"][0]["pid"] = "1/../../etc"  # what a job could write there
    path.write_text(json.dumps(state))
    assert json.loads(path.read_text())["allocations"][0]["pid"] == "1/../../etc"
    with pytest.raises(GpuProbeError, match=r"is malformed \(allocation 0: 'pid' is '1/"):
        dev.readings(T0)
    with pytest.raises(GpuProbeError, match="restart the broker with --mock-gpu"):
        SimDevice.open(path)
    again = SimDevice.create(path, SimGpuConfig(count=2, vram_bytes=8 * GIB))
    assert again.allocations() == [] and len(again.readings(T0)) == 2


def test_a_state_written_before_pid_namespaces_is_read_as_host_pids(
    path: Path, dev: SimDevice
) -> None:
    gpu0 = dev.uuids()[0]
    me = os.getpid()
    dev.allocate(gpu0, GIB, me)
    state = json.loads(path.read_text())
    del state["host_pidns"]
    for a in state["allocations"]:
        del a["pidns"], a["host_pid"]
    path.write_text(json.dumps(state))
    assert dev.readings(T0)[0].processes == (ProcessUsage(me, GIB),)
    reopened = SimDevice.create(path, SimGpuConfig(count=2, vram_bytes=8 * GIB))
    assert reopened.readings(T0)[0].processes == (ProcessUsage(me, GIB),)
    (alloc,) = reopened.allocations()
    assert (alloc.pidns, alloc.host_pid) == (own_pidns(), me)


READER = """
import json, sys
from pathlib import Path
from gpuwarden.gpu.sim import SimDevice
(reading,) = SimDevice.open(Path(sys.argv[1])).readings(float(sys.argv[2]))
print(json.dumps([[p.pid, p.used_bytes] for p in reading.processes]))
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every uid can reach (pytest's are root's alone)."""
    made = Path(tempfile.mkdtemp(prefix="gw-simns-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made)


NOBODY = 65534
AS_NOBODY: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def bwrap_as_nobody(state: Path) -> list[str]:
    """bubblewrap as a broker that is not root runs it (as its own user; here
    nobody), with the simulated GPU's folder, as much of the host as a job needs."""
    return [
        *("bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/"),
        *("--proc", "/proc", "--dev", "/dev", "--bind", str(state), str(state)),
    ]


def readable_copies(folder: Path) -> str:
    """gpuwarden and psutil copied where every uid may read them (the checkout and
    the venv may be under a folder only root can search, as ``mktemp -d`` makes)."""
    lib = folder / "pylib"
    skip = shutil.ignore_patterns("__pycache__", "modules")
    shutil.copytree(Path(SRC_DIR) / "gpuwarden", lib / "gpuwarden", ignore=skip)
    shutil.copytree(Path(psutil.__file__).resolve().parent, lib / "psutil", ignore=skip)
    for path in [lib, *lib.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(lib)


def python_for_nobody(state: Path) -> tuple[str, str]:
    """An interpreter nobody can run inside such a sandbox, with psutil and
    gpuwarden importable, and its PYTHONPATH: this one where nobody may run it,
    else the system's with copies of both beside the simulated GPU's folder."""
    tried = []
    for python, pythonpath in (
        (sys.executable, SRC_DIR),
        ("/usr/bin/python3", lambda: readable_copies(state.parent)),
    ):
        path = pythonpath if isinstance(pythonpath, str) else pythonpath()
        done = subprocess.run(
            [*bwrap_as_nobody(state), python, "-c", "import psutil, gpuwarden.gpu.sim"],
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": path},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            **AS_NOBODY,
        )
        if done.returncode == 0:
            return python, path
        tried.append(f"{python}: {done.stderr.strip()}")
    pytest.fail("no Python that nobody can run in a sandbox imports psutil: " + "; ".join(tried))


def test_a_reader_that_is_not_root_finds_the_host_pid_of_its_own_sandbox(open_dir: Path) -> None:
    """A broker that is not root runs bubblewrap as its own user: the job's
    processes are that user's, and the broker, reading as that user, finds them."""
    need_tool("bwrap")
    path = open_dir / "simgpu" / "simgpu.json"
    dev = SimDevice.create(path, SimGpuConfig(count=1, vram_bytes=8 * GIB), shared_folder=True)
    gpu0 = dev.uuids()[0]
    python, pythonpath = python_for_nobody(path.parent)
    env = {**child_env(path, gpu0), "PYTHONPATH": pythonpath}
    sandbox = subprocess.Popen(
        [*bwrap_as_nobody(path.parent), python, "-c", CHILD_NS, str(2 * GIB), "0", "1"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **AS_NOBODY,
    )
    try:
        assert sandbox.stdout is not None and sandbox.stdin is not None
        line = sandbox.stdout.readline()
        assert line, f"the sandboxed child failed (exit {sandbox.wait(10)})"
        seen = json.loads(line)
        tree = psutil.Process(sandbox.pid).children(recursive=True)
        (inside,) = [p for p in tree if p.cmdline()[1:3] == ["-c", CHILD_NS]]
        assert inside.uids().real == NOBODY  # not root on the host
        assert seen["pidns"] != own_pidns() and seen["pid"] != inside.pid
        reader = subprocess.run(
            [python, "-c", READER, str(path), str(T0)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            **AS_NOBODY,
        )
        assert reader.returncode == 0, reader.stderr
        assert json.loads(reader.stdout) == [[inside.pid, 2 * GIB]]
    finally:
        if sandbox.stdin is not None:
            sandbox.stdin.close()
        sandbox.wait(30)
    assert dev.allocations()[0].host_pid == inside.pid


def test_find_host_pids_finds_this_process_and_nothing_for_what_is_not_there() -> None:
    me, ns = os.getpid(), own_pidns()
    assert ns is not None
    assert find_host_pids({(ns, me)}) == {(ns, me): me}
    assert find_host_pids({(4242, 1)}) == {}
