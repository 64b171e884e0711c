"""Acceptance: a critical Xid latches its GPU across a broker restart, and only
`gpuwarden gpu clear --reason` ends it, with who and why recorded (real broker,
real job processes, the real CLI, the simulated GPU)."""

from __future__ import annotations

import getpass
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.gpu.sim import SimDevice
from gpuwarden.store.sqlite import SqliteStore
from tests.acceptance.test_admission import sim_state, state_of, submit
from tests.acceptance.test_cli import Broker, run, wait_for, write_config

REASON = "reseated the card"


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return write_config(tmp_path, extra="[vram]\nreserve_gib = 0\n")


@pytest.fixture
def brokers() -> Iterator[list[Broker]]:
    started: list[Broker] = []
    yield started
    for b in started:
        if b.proc.poll() is None:
            b.stop(signal.SIGKILL)


def latched(cfg: Path, gpu: str) -> dict[str, object]:
    """The GPU's latched fault in the published status (empty when none)."""
    _, st = status_of(cfg)
    faults = st.get("faults") or {}
    assert isinstance(faults, dict)
    return dict(faults.get(gpu) or {})


def status_of(cfg: Path) -> tuple[int, dict[str, object]]:
    r = run("--config", cfg, "status", "--json")
    return r.returncode, json.loads(r.stdout)["nodes"][0]


def test_a_fault_is_still_latched_after_a_restart_and_gpu_clear_ends_it(
    cfg: Path, brokers: list[Broker], tmp_path: Path
) -> None:
    first = Broker(cfg, tmp_path / "events-1.jsonl")
    brokers.append(first)
    wait_for(sim_state(first).exists, "the simulated GPU")
    device = SimDevice.open(sim_state(first))
    (gpu,) = device.uuids()
    device.inject_xid(gpu, 79)
    assert 79 in device.xids(gpu)  # the fault really happened
    wait_for(lambda: bool(first.events("gpu_fault")), "the fault to be latched")
    wait_for(lambda: bool(latched(cfg, gpu)), "the status to show the latch")
    code, st = status_of(cfg)
    assert code == 1 and "hardware fault" in json.dumps(st["degraded"])
    submit(first, "testmods.gpu", "--gib", "1", "--seconds", "0.2", "--id", "waits")
    wait_for(lambda: "waits" in (status_of(cfg)[1].get("waiting") or {}), "the job to wait")
    assert state_of(first, "waits")["state"] == "queued"
    assert first.stop(signal.SIGTERM) == 0
    files = json.loads((tmp_path / "state" / "faults.json").read_text())
    assert [(x["gpu"], x["xid"]) for x in files["latches"]] == [(gpu, 79)]

    # a new broker on the same state directory: the fault is still there
    second = Broker(cfg, tmp_path / "events-2.jsonl")
    brokers.append(second)
    assert second.events("gpu_xid") == []  # not seen again: put back from the store
    (restored,) = second.events("gpu_fault_restored")
    assert restored["gpu"] == gpu and restored["xid"] == 79
    wait_for(lambda: bool(latched(cfg, gpu)), "the status to show the latch again")
    fault = latched(cfg, gpu)
    assert fault["xid"] == 79 and "latched since" in str(fault["reason"])
    text = run("--config", cfg, "status")
    assert text.returncode == 1 and "fault latched" in text.stdout and gpu in text.stdout
    wait_for(lambda: "waits" in (status_of(cfg)[1].get("waiting") or {}), "the job to wait")
    assert state_of(second, "waits")["state"] == "queued"
    assert "hardware fault" in run("--config", cfg, "explain", "waits").stdout

    # gpu clear without a reason is refused, and changes nothing
    bare = run("--config", cfg, "gpu", "clear", gpu)
    assert bare.returncode == 2 and "--reason" in bare.stderr
    blank = run("--config", cfg, "gpu", "clear", gpu, "--reason", "  ")
    assert blank.returncode == 2 and "needs a --reason" in blank.stderr
    cleared = run("--config", cfg, "gpu", "clear", gpu, "--reason", REASON)
    assert cleared.returncode == 0, cleared.stderr
    wait_for(lambda: bool(second.events("gpu_fault_cleared")), "the clear to be taken")
    (done,) = second.events("gpu_fault_cleared")
    by = f"local:{getpass.getuser()}"
    assert (done["gpu"], done["by"], done["reason"], done["xid"]) == (gpu, by, REASON, 79)
    store = SqliteStore(tmp_path / "state" / "gpuwarden.db")
    try:
        (row,) = store.gpu_faults(gpu_uuid=gpu)
    finally:
        store.close()
    assert (row.node, row.xid, row.cleared_by, row.clear_reason) == ("accept", 79, by, REASON)
    assert row.cleared_at is not None
    wait_for(lambda: state_of(second, "waits")["state"] == "done", "the job to run", timeout=30)
    wait_for(lambda: status_of(cfg)[0] == 0, "status to be healthy again")
    assert not latched(cfg, gpu)
    files = json.loads((tmp_path / "state" / "faults.json").read_text())
    assert files["latches"] == []
