"""The node status (node/status.py): typed, and the same JSON document as before;
a stored document read back, also a partial one; an agent's GPU report."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from typing import Any

from gpuwarden.core.ledger import Holding, HoldState
from gpuwarden.core.model import GIB
from gpuwarden.core.policy import GpuView, WarmView
from gpuwarden.core.ramadmit import UNSAMPLED, RamView
from gpuwarden.node.status import (
    BrokerStatus,
    FootprintStatus,
    GpuStatus,
    LoopError,
    ProcessUse,
    RunningStatus,
    WarmStatus,
    gpu_reports,
)

WARM = Holding("warm:m.llm:7", "m.llm", 6 * GIB, False, HoldState.WARM, None, 1.0)
RUN = Holding("j/1", "m.gpu", 8 * GIB, False, HoldState.RUNNING, "j", 2.0)
VIEW = GpuView("G0", 24 * GIB, reserve_bytes=GIB, holdings=(WARM, RUN), name="sim")


def status() -> BrokerStatus:
    return BrokerStatus(
        probe="sim",
        gpus=(GpuStatus("G0", "sim", 24 * GIB, 14 * GIB, (ProcessUse(11, 8 * GIB),), VIEW),),
        footprints={"m.gpu": FootprintStatus(8 * GIB, 0, 8 * GIB)},
        queues={"/q": {"inbox": 1, "processing": 0, "outbox": 0, "failed": 0}},
        running=(RunningStatus("j", "m.gpu", 1, "G0", 2.0),),
        warm=(WarmStatus("m.llm", "G0", 7, "idle", 6 * GIB, 3, 1.5, 4.0, 12, False),),
        warm_views=(WarmView("m.llm", "G0", "warm:m.llm:7", False, 1.0),),
        waiting={"k": "needs 8.0 GiB on one GPU"},
        last_error=LoopError(3.0, "schedule", "boom"),
    )


def test_the_document_has_the_keys_clients_read_in_their_order() -> None:
    doc = status().to_json()
    assert list(doc) == [
        "stopped",
        "accepting",
        "probe",
        "probe_error",
        "gpus",
        "degraded",
        "footprints",
        "queues",
        "running",
        "warm",
        "warm_views",
        "waiting",
        "last_error",
        "queued_indexed",
        "runtimes",
        "stats",
        "faults",
        "ram",
        "services",
    ]
    [gpu] = doc["gpus"]
    assert list(gpu) == [
        "uuid",
        "name",
        "total_bytes",
        "used_bytes",
        "processes",
        "reserve_bytes",
        "foreign_bytes",
        "holdings",
        "degraded",
        "runtimes",
        "locked",
        "free_bytes",
        "sensors",
    ]
    assert gpu["free_bytes"] == 24 * GIB - GIB - 14 * GIB
    assert list(doc["warm"][0]) == [
        "type",
        "gpu",
        "epoch",
        "state",
        "footprint_bytes",
        "jobs_served",
        "load_s",
        "idle_s",
        "pid",
        "keep_warm",
    ]
    assert doc["last_error"] == {"ts": 3.0, "where": "schedule", "message": "boom"}


def test_a_stored_document_reads_back_the_same() -> None:
    doc = status().to_json()
    assert BrokerStatus.from_json(doc).to_json() == doc
    assert BrokerStatus.from_json(doc).gpu_views() == (VIEW,)


def test_a_locked_gpu_reads_back_locked() -> None:
    """``gpu_lock``: a GPU a process outside the queue keeps says so in the status."""
    locked = dataclasses.replace(VIEW, locked="GPU locked by PID 7")
    st = dataclasses.replace(status(), gpus=(GpuStatus("G0", "sim", 24 * GIB, view=locked),))
    back = BrokerStatus.from_json(json.loads(json.dumps(st.to_json())))
    assert back.gpu_views()[0].locked == "GPU locked by PID 7"


def test_a_gpu_without_the_books_view_has_no_room() -> None:
    doc = GpuStatus("G1", "sim", 24 * GIB).to_json()
    assert doc["free_bytes"] == 0 and "holdings" not in doc
    assert GpuStatus.from_json(doc).view is None


def test_a_partial_document_reads_as_empty() -> None:
    partial: dict[str, Any] = {"gpus": [VIEW.to_json()], "running": [{"job": "j"}]}
    read = BrokerStatus.from_json(partial)
    assert read.gpu_views() == (VIEW,) and not read.stopped and read.accepting
    assert read.running == (RunningStatus("j", "", 0),)
    assert read.waiting == {} and read.warm_views == () and read.last_error is None


def test_the_report_counts_idle_warm_servers_as_room_and_takes_what_is_leased() -> None:
    other = GpuView("G1", 24 * GIB, reserve_bytes=GIB, name="sim")
    views = (VIEW, other)
    free = 24 * GIB - GIB - 14 * GIB
    [g0, g1] = gpu_reports(views, used={"G0": 14 * GIB}, evictable=set(), waiting=0)
    assert (g0.free_bytes, g1.free_bytes) == (free, 23 * GIB)
    assert g0.used_bytes == 14 * GIB and g0.ledger_bytes == 14 * GIB and g1.used_bytes == 0
    [g0, _] = gpu_reports(views, used={}, evictable={WARM.holder}, waiting=0)
    assert g0.free_bytes == free + 6 * GIB
    # a leased job not started yet takes from the GPU with the most room first
    [g0, g1] = gpu_reports(views, used={}, evictable=set(), waiting=25 * GIB)
    assert (g1.free_bytes, g0.free_bytes) == (0, free - 2 * GIB)
    assert g0.waiting_bytes + g1.waiting_bytes == 25 * GIB  # what it takes, per GPU
    degraded = GpuView("G2", 24 * GIB, degraded="Xid 79")
    [g2] = gpu_reports((degraded,), used={}, evictable=set(), waiting=0)
    assert g2.free_bytes == 0 and g2.usable_bytes == 24 * GIB
    assert list(g2.to_json()) == [
        "uuid",
        "name",
        "total_bytes",
        "free_bytes",
        "usable_bytes",
        "used_bytes",
        "ledger_bytes",
        "foreign_bytes",
        "reserve_bytes",
        "degraded",
        "sensors",
        "waiting_bytes",
    ]


def test_the_host_ram_view_goes_both_ways() -> None:
    view = RamView(9 * GIB, GIB, (2 * GIB,), 3 * GIB)
    back = BrokerStatus.from_json(replace(status(), ram=view).to_json())
    assert back.ram == view
    assert BrokerStatus.from_json({}).ram == UNSAMPLED
    assert BrokerStatus.from_json({"ram": {"available_bytes": "x"}}).ram == UNSAMPLED
