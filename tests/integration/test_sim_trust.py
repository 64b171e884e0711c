"""The simulated GPU is no isolation boundary, but a job on it can neither stall
the broker's loop nor forge a fault for everyone (issue 30, item 9).

The attacks, as a job on the simulated GPU can make them: every job may write
the device's folder (``simgpu/``, mode 0777) and its lock file (0666). Before the
fix, one that kept the lock froze the broker's loop (CPU jobs waited 26 s, the
status went stale), and one that appended Xid 79 to the state got the GPU
latched faulty for everyone. Each test first checks that its attack is in place
(the lock is held; the forged Xid is in the state file), then that the loop
still ticks in bounded time, that nothing is latched, and that the legitimate
path (a job, a fault injected through the faults file) still works.

Where the test runs as root (CI), the job-like processes run as ``nobody``, as a
sandboxed job runs as a uid of its own, and reach the device's folder as a
sandbox gives it to them: that folder alone (here an open descriptor of it,
``/proc/self/fd/N``; the state directory above it is root's, 0700).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.gpu import sim as sim_module
from gpuwarden.gpu.select import SIM_STATE_FILE, open_probe
from gpuwarden.gpu.sim import (
    CREATE_LOCK_WAIT_S,
    PROBE_STALE_S,
    SimDevice,
    SimGpuConfig,
    faults_path_for,
)
from tests.brokerkit import submit

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"
MODULES = Path(sim_module.__file__).resolve().parents[1] / "modules"
T0 = 1_000_000.0
#: a tick longer than this was held up by the lock (the holder keeps it 120 s);
#: a tick on its own takes milliseconds
SLOW_TICK_S = 15.0

NOBODY = 65534
ROOT = os.geteuid() == 0
#: how a job-like process runs: as nobody where the test is root, with a Python
#: nobody may run (the stdlib is all these processes need)
AS_JOB: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if ROOT else {}
JOB_PYTHON = "/usr/bin/python3" if ROOT and Path("/usr/bin/python3").exists() else sys.executable

#: keeps the device's lock until its stdin closes (at most 120 s: it never outlives a test)
HOLD_LOCK = """
import fcntl, os, signal, sys
signal.alarm(120)
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""

#: what a job may do to the state: an Xid 79 and a hang on every GPU, memory that
#: never comes back; a faults file in the folder it may write; and the real one
FORGE = """
import fcntl, json, os, sys, tempfile
state, faults = sys.argv[1], sys.argv[2]
folder = os.path.dirname(state)
lock = os.open(state + ".lock", os.O_RDWR)
fcntl.flock(lock, fcntl.LOCK_EX)
with open(state) as f:
    s = json.load(f)
forged = {}
for d in s["devices"]:
    d["xids"], d["hang"] = [79], False
    forged[d["uuid"]] = {"xids": [79], "hang": False}
s["release_delay_s"] = 1e9
fd, tmp = tempfile.mkstemp(dir=folder)
os.write(fd, json.dumps(s).encode())
os.close(fd)
os.chmod(tmp, 0o666)
os.replace(tmp, state)
with open(os.path.join(folder, "simgpu-faults.json"), "w") as f:
    json.dump({"version": 1, "release_delay_s": 1e9, "devices": forged}, f)
try:
    with open(faults, "w") as f:
        json.dump({"version": 1, "release_delay_s": 1e9, "devices": forged}, f)
    print("wrote the faults file")
except OSError as exc:
    print("refused", exc.errno)
os.close(lock)
print("forged", flush=True)
"""


@pytest.fixture
def site() -> Iterator[Path]:
    """A folder every uid can reach (pytest's are root's alone), for the state."""
    made = Path(tempfile.mkdtemp(prefix="gw-simtrust-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def make_config(site: Path) -> Config:
    return Config.model_validate(
        {
            "state_dir": site / "state",
            "node_name": "simtrust",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "queue_roots": [site / "queue"],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
        }
    )


@pytest.fixture
def node(site: Path) -> Iterator[Node]:
    with open_node(make_config(site), mock_gpu=True) as n:
        yield n
        n.broker.shutdown(0)


def state_of(node: Node, job_id: str) -> JobState:
    j = node.store.get_job(job_id)
    assert j is not None
    return j.state


def kinds(node: Node) -> list[str]:
    return [e.kind for e in node.store.events()]


def tick_until(node: Node, done: Callable[[], bool], timeout: float) -> float:
    """Tick the broker until ``done()``; the longest tick, in seconds."""
    slowest = 0.0
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out (the slowest tick took {slowest:.2f} s)"
        t = time.monotonic()
        node.broker.tick()
        slowest = max(slowest, time.monotonic() - t)
        time.sleep(0.02)
    return slowest


def as_job(folder: Path, code: str, *names: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``code`` as a job on the simulated GPU would run: its user, given the
    device's ``folder`` alone (its arguments: the ``names`` in that folder)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return subprocess.Popen(
            [JOB_PYTHON, "-c", code, *(f"/proc/self/fd/{fd}/{n}" for n in names)],
            pass_fds=(fd,),
            text=True,
            **AS_JOB,
            **kwargs,
        )
    finally:
        os.close(fd)


def hold_lock(lock: Path) -> subprocess.Popen[str]:
    holder = as_job(
        lock.parent, HOLD_LOCK, lock.name, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    # the attack is in place: no one else may take the lock now
    fd = os.open(lock, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    return holder


def let_go(holder: subprocess.Popen[str]) -> None:
    if holder.stdin is not None:
        holder.stdin.close()
    holder.wait(30)


def test_a_job_that_keeps_the_lock_never_stalls_the_loop(node: Node, site: Path) -> None:
    lock = site / "state" / "simgpu" / "simgpu.json.lock"
    holder = hold_lock(lock)
    try:
        # a CPU job runs and ends at once, the loop's ticks stay short
        submit(node, JobSpec(id="cpu", type="testmods.sleep", params={"seconds": 0.1}))
        slowest = tick_until(node, lambda: state_of(node, "cpu").terminal, timeout=60)
        assert state_of(node, "cpu") is JobState.DONE
        # bounded: never the holder's 120 s (a loaded machine may stall a tick a while)
        assert slowest < SLOW_TICK_S
        (published,) = node.store.node_statuses()
        assert time.time() - published.updated_at < SLOW_TICK_S  # the status is not stale
        # once the last reading is old, VRAM admission fails closed, naming the lock
        submit(node, JobSpec(id="gpu", type="testmods.gpu", params={"gib": 1, "seconds": 0.2}))
        slowest = tick_until(
            node,
            lambda: "simgpu.json.lock" in node.broker.status().probe_error,
            timeout=PROBE_STALE_S + 20,
        )
        assert slowest < SLOW_TICK_S
        assert "held by another process" in node.broker.status().probe_error
        assert state_of(node, "gpu") is JobState.QUEUED
    finally:
        let_go(holder)
    # let go of: the device is read again, and the vram job runs
    tick_until(node, lambda: not node.broker.status().probe_error, timeout=20)
    tick_until(node, lambda: state_of(node, "gpu").terminal, timeout=30)
    assert state_of(node, "gpu") is JobState.DONE


def test_the_broker_takes_the_device_back_from_a_lock_kept_at_its_start(site: Path) -> None:
    state_dir = site / "state"
    first = open_probe("sim", state_dir=state_dir, sim=SimGpuConfig())
    lock = state_dir / SIM_STATE_FILE
    lock = lock.with_name(lock.name + ".lock")
    before = lock.stat().st_ino
    holder = hold_lock(lock)
    try:
        start = time.monotonic()
        again = open_probe("sim", state_dir=state_dir, sim=SimGpuConfig())
        assert time.monotonic() - start < CREATE_LOCK_WAIT_S + 5
        assert lock.stat().st_ino != before  # a fresh lock file, taken
        assert len(again.read()) == 1
        assert holder.poll() is None  # the job still keeps the old one: it stalls nothing
    finally:
        let_go(holder)
        first.close()


def test_a_job_cannot_forge_a_fault_or_slow_the_release(node: Node, site: Path) -> None:
    device: SimDevice = node.probe.device  # type: ignore[attr-defined]
    (gpu,) = device.uuids()
    state = site / "state" / SIM_STATE_FILE
    faults = device.faults_path
    # the faults file: beside the folder jobs may write, the broker's, others may not write it
    assert faults == site / "state" / "simgpu-faults.json" == faults_path_for(state)
    st = faults.stat()
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o644
    assert not (site / "state").stat().st_mode & 0o022
    tick_until(node, lambda: bool(node.broker.status().gpus), timeout=10)

    # the job names the real faults file as the folder it is given sees it: "../"
    proc = as_job(
        state.parent,
        FORGE,
        state.name,
        f"../{faults.name}",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "forged" in out, err
    # the forgery is in place: the state says Xid 79, a faults file is in the folder
    forged = json.loads(state.read_text())
    assert forged["devices"][0]["xids"] == [79] and forged["release_delay_s"] == 1e9
    assert (state.parent / faults.name).exists()
    if ROOT:  # as a uid of its own, the real faults file is out of its reach
        assert "refused 13" in out, out
        assert "79" not in faults.read_text()

    time.sleep(0.2)
    deadline = time.monotonic() + 1.5
    tick_until(node, lambda: time.monotonic() > deadline, timeout=10)
    assert "gpu_xid" not in kinds(node) and "gpu_fault" not in kinds(node)
    assert gpu not in node.broker.status().to_json()["degraded"]
    assert device.xids(gpu) == []

    # a job's memory still comes back at the config's delay (0 s), not the forged one
    submit(node, JobSpec(id="g", type="testmods.gpu", params={"gib": 2, "seconds": 0.2}))
    tick_until(node, lambda: state_of(node, "g").terminal, timeout=30)
    assert state_of(node, "g") is JobState.DONE
    tick_until(node, lambda: device.readings(time.time())[0].used_bytes == 0, timeout=10)

    # the legitimate way (the broker's user, through the faults file) still latches
    device.inject_xid(gpu, 79)
    tick_until(node, lambda: "gpu_fault" in kinds(node), timeout=10)
    assert "hardware fault" in node.broker.status().to_json()["degraded"][gpu]


@pytest.mark.skipif(not ROOT, reason="makes a file of another user's (chown)")
def test_a_faults_file_that_is_not_the_brokers_is_not_believed(tmp_path: Path) -> None:
    dev = SimDevice.create(tmp_path / "state" / "simgpu.json", SimGpuConfig())
    (gpu,) = dev.uuids()
    dev.inject_xid(gpu, 79)
    assert dev.readings(T0)[0].extra == {"xid": "79"}  # the legitimate injection is read
    os.chown(dev.faults_path, NOBODY, NOBODY)  # as if another user had written it
    assert dev.readings(T0)[0].extra == {}
    assert dev.readings(T0)[0].xids == ()
    os.chown(dev.faults_path, 0, 0)
    dev.faults_path.chmod(0o666)  # others may write it
    assert dev.readings(T0)[0].xids == ()
    dev.faults_path.chmod(0o644)
    assert dev.readings(T0)[0].extra == {"xid": "79"}
    link = tmp_path / "elsewhere.json"
    dev.faults_path.rename(link)
    dev.faults_path.symlink_to(link)  # a link is never followed
    assert dev.readings(T0)[0].xids == ()
