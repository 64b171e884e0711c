"""The node's counts (node/stats.py): histograms in fixed buckets, the hooks, the
events counted and those ignored, and the published document read back, also a
malformed one."""

from __future__ import annotations

import math
from typing import Any

from gpuwarden.core.model import GIB
from gpuwarden.node.stats import (
    RECLAIM_BUCKETS,
    WAIT_BUCKETS,
    Histogram,
    NodeStats,
    StatsSnapshot,
)
from gpuwarden.node.status import BrokerStatus


def test_a_histogram_counts_each_value_in_its_bucket_and_is_cumulative() -> None:
    h = Histogram((1.0, 5.0))
    for v in (0.5, 1.0, 3.0, 7.0, -2.0, math.nan):  # -2 (a clock step) is 0; NaN is dropped
        h.observe(v)
    assert h.counts == [3, 1, 1] and h.count == 5
    assert h.sum == 0.5 + 1.0 + 3.0 + 7.0
    assert h.cumulative() == [(1.0, 3), (5.0, 4), (math.inf, 5)]


def test_attempts_count_by_type_and_outcome_with_their_wait_and_run_times() -> None:
    s = NodeStats(since=10.0)
    s.attempt_started("m.gpu", 0.3)
    s.attempt_started("m.gpu", 42.0)
    s.attempt_ended("m.gpu", "succeeded", 2.0)
    s.attempt_ended("m.gpu", "succeeded", 3.0)
    s.attempt_ended("m.gpu", "gpu_fault", 1.0)
    snap = s.snapshot(queued={"m.gpu": 4}, faults={"G1"})
    assert snap.since == 10.0
    assert snap.attempts == {"m.gpu": {"succeeded": 2, "gpu_fault": 1}}
    assert snap.wait["m.gpu"].bounds == WAIT_BUCKETS and snap.wait["m.gpu"].count == 2
    assert snap.wait["m.gpu"].sum == 42.3
    assert snap.run["m.gpu"].count == 3 and snap.run["m.gpu"].sum == 6.0
    assert snap.queued == {"m.gpu": 4} and snap.faults == ("G1",)


def test_the_events_the_loop_emits_are_counted() -> None:
    s = NodeStats()
    s.on_event("memory_reclaimed", {"gpu": "G0", "after_s": 0.4})
    s.on_event("gpu_xid", {"gpu": "G0", "xid": 79, "severity": "critical"})
    s.on_event("gpu_xid", {"gpu": "G0", "xid": 79, "severity": "critical"})
    s.on_event("gpu_xid", {"gpu": "G0", "xid": 13, "severity": "application"})
    s.on_event("warm_server_loaded", {"type": "m.llm", "gpu": "G0", "load_s": 12.5})
    s.on_event("runtime_released", {"runtime": "ollama", "bytes": 3 * GIB, "after_s": 1.0})
    s.on_event("runtime_release_ineffective", {"runtime": "ollama", "residual_bytes": GIB})
    s.on_event("runtime_reloaded_during_handoff", {"runtime": "ollama", "bytes": GIB})
    s.evicted("m.llm")
    snap = s.snapshot()
    assert snap.reclaim["G0"].bounds == RECLAIM_BUCKETS and snap.reclaim["G0"].count == 1
    assert snap.xids == {"G0": {"79": 2, "13": 1}}
    assert snap.warm_loads["m.llm"].count == 1 and snap.warm_loads["m.llm"].sum == 12.5
    assert snap.releases == {"ollama": {"released": 1, "ineffective": 1, "reloaded": 1}}
    assert snap.released_bytes == {"ollama": 3 * GIB}  # only a release gives bytes back
    assert snap.evictions == {"m.llm": 1}


def test_events_it_does_not_know_or_malformed_details_count_nothing() -> None:
    s = NodeStats()
    s.on_event("transition", {"gpu": "G0", "after_s": 1.0})
    s.on_event("memory_reclaimed", {"gpu": "G0", "after_s": "soon"})
    s.on_event("memory_reclaimed", {"after_s": 1.0})
    s.on_event("gpu_xid", {"gpu": "G0", "xid": True})
    s.on_event("gpu_xid", {"gpu": "G0", "xid": 10**9})  # an absurd code: one label, -1
    s.on_event("warm_server_loaded", {"type": "m.llm", "load_s": math.inf})
    s.on_event("runtime_released", {"bytes": GIB})
    snap = s.snapshot()
    assert snap.reclaim == {} and snap.warm_loads == {} and snap.releases == {}
    assert snap.xids == {"G0": {"-1": 1}}


def test_a_snapshot_does_not_move_with_later_counts() -> None:
    s = NodeStats()
    s.attempt_ended("t", "succeeded", 1.0)
    snap = s.snapshot()
    s.attempt_ended("t", "succeeded", 1.0)
    assert snap.attempts == {"t": {"succeeded": 1}} and snap.run["t"].count == 1


def test_the_published_document_reads_back_the_same_in_a_broker_status() -> None:
    s = NodeStats(since=5.0)
    s.attempt_started("t", 1.0)
    s.attempt_ended("t", "job_failed", 9.0)
    s.on_event("memory_reclaimed", {"gpu": "G0", "after_s": 0.2})
    s.on_event("gpu_xid", {"gpu": "G0", "xid": 48})
    doc = BrokerStatus(stats=s.snapshot(queued={"t": 2}, faults=["G0"])).to_json()
    assert StatsSnapshot.from_json(doc["stats"]) == BrokerStatus.from_json(doc).stats
    assert BrokerStatus.from_json(doc).to_json() == doc


def test_a_missing_or_malformed_document_reads_as_empty() -> None:
    assert BrokerStatus.from_json({}).stats == StatsSnapshot()
    bad: dict[str, Any] = {
        "since": "yesterday",
        "attempts": {"t": {"succeeded": "many", "job_failed": 2}, "u": 3},
        "wait": {"t": {"le": [1, 2], "counts": [1]}, "u": {"le": [2, 1], "counts": [0, 0, 0]}},
        "run": {"t": {"le": [1], "counts": [1, 2], "sum": 4}},
        "faults": "G0",
        "queued": {"t": -3, "u": True},
    }
    read = StatsSnapshot.from_json(bad)
    assert read.since == 0.0 and read.faults == ()
    assert read.attempts == {"t": {"job_failed": 2}}
    assert read.wait == {}  # a count per bucket missing; bounds out of order
    assert read.run["t"].cumulative() == [(1.0, 1), (math.inf, 3)] and read.run["t"].sum == 4
    assert read.queued == {"t": 0}
    assert StatsSnapshot.from_json(["not", "a", "dict"]) == StatsSnapshot()
