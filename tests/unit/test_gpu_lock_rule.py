"""The GPU lock file's rules (``gpu_lock``): a GPU an outsider keeps takes no new
job, with the holder's reason; the others still do; which lock an attempt holds."""

from __future__ import annotations

from gpuwarden.core.gpulock import LockMode, lock_mode
from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import GIB, Lane
from gpuwarden.core.policy import (
    GpuView,
    QueuedJob,
    Snapshot,
    Start,
    Wait,
    WarmView,
    plan,
)

NOW = 1000.0
LOCKED = "GPU locked by PID 4242"


def job(id_: str, gib: int, seq: int = 0, **kw: object) -> QueuedJob:
    return QueuedJob(id_, "m.t", Lane.VRAM, gib * GIB, 0, seq, **kw)  # type: ignore[arg-type]


def test_a_locked_gpu_takes_no_job_and_says_who_holds_it() -> None:
    gpus = (GpuView("G0", 24 * GIB, locked=LOCKED),)
    [d] = plan(Snapshot(queued=(job("a", 4),), gpus=gpus), NOW)
    assert isinstance(d, Wait)
    assert f"G0: {LOCKED}" in d.reason
    assert d.reserved_gpu is None  # nothing is held back on a GPU an outsider keeps


def test_the_other_gpus_still_take_jobs() -> None:
    gpus = (GpuView("G0", 80 * GIB, locked=LOCKED), GpuView("G1", 24 * GIB))
    decisions = plan(Snapshot(queued=(job("a", 4), job("b", 30, seq=1)), gpus=gpus), NOW)
    assert decisions[0] == Start("a", "G1")
    assert isinstance(decisions[1], Wait) and LOCKED in decisions[1].reason


def test_a_waiter_keeps_the_gpu_too_and_cpu_jobs_go_on() -> None:
    wants = "GPU wanted by PID 77, which waits for its lock"
    running = Holding("x/1", "m.t", 2 * GIB, coresident=True, job_id="x")
    gpus = (GpuView("G0", 24 * GIB, holdings=(running,), locked=wants),)
    cpu = QueuedJob("c", "m.c", Lane.CPU, 0, 0, 1)
    decisions = plan(Snapshot(queued=(job("a", 1, coresident=True), cpu), gpus=gpus), NOW)
    assert isinstance(decisions[0], Wait) and wants in decisions[0].reason
    assert decisions[1] == Start("c", None)


def test_no_job_goes_to_a_warm_server_on_a_locked_gpu() -> None:
    server = Holding("warm:m:1", "m.m", 6 * GIB, state=HoldState.WARM)
    g = GpuView("G", 24 * GIB, holdings=(server,), locked=LOCKED)
    served = QueuedJob("j", "m.m", Lane.VRAM, 6 * GIB, 0, 1, serve=True, warm=True)
    warm = (WarmView("m.m", "G", "warm:m:1", busy=False, idle_since=NOW - 1),)
    [d] = plan(Snapshot(queued=(served,), gpus=(g,), warm=warm), NOW)
    assert isinstance(d, Wait) and LOCKED in d.reason


def test_locked_survives_the_json_round_trip() -> None:
    g = GpuView("G", 24 * GIB, locked=LOCKED)
    assert GpuView.from_json(g.to_json()) == g
    assert GpuView.from_json({"uuid": "G", "total_bytes": 1}).locked == ""


def test_lock_mode() -> None:
    assert lock_mode(gpus=1, coresident=False, runtime=False) is LockMode.EXCLUSIVE
    assert lock_mode(gpus=1, coresident=True, runtime=False) is LockMode.SHARED
    assert lock_mode(gpus=2, coresident=True, runtime=False) is LockMode.EXCLUSIVE
    assert lock_mode(gpus=1, coresident=True, runtime=True) is None
    assert lock_mode(gpus=0, coresident=False, runtime=False) is None
