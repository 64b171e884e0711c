"""The warm fast path (issue 14): a queued job goes to its type's idle warm server
without a planning pass, by plan()'s own rules, and a server's answer wakes the
loop (nothing waits for a poll interval). Real worker processes on the simulated
GPU, as in test_warm.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core import policy
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.node import loop
from tests.brokerkit import run_until, submit
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"


def make_config(tmp_path: Path, *, poll: float = 0.02) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "fastnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": poll, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
            "warm": {"idle_grace_s": 300, "stop_grace_s": 0.5},
        }
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(make_config(tmp_path), mock_gpu=True) as n:
        yield n
        n.broker.shutdown(0)


def state(node: Node, job_id: str) -> JobState:
    j = node.store.get_job(job_id)
    assert j is not None
    return j.state


def warm(i: str, sleep_s: float = 0.0, **kw: Any) -> JobSpec:
    return JobSpec(id=i, type="testmods.warm", params={"sleep_s": sleep_s}, **kw)


def loaded(node: Node) -> None:
    """One job has loaded the testmods.warm server; it is idle now."""
    submit(node, warm("first"))
    run_until(node, lambda: state(node, "first").terminal)
    assert state(node, "first") is JobState.DONE
    run_until(node, lambda: [s.state.value for s in node.broker.warm] == ["idle"])


def test_a_job_reaches_the_idle_server_without_a_planning_pass(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded(node)
    seen: list[str] = []  # the class heads a planning pass saw queued
    started: list[str] = []  # and the jobs it started
    real_pass = policy.plan_pass

    def spy(lineups: Iterable[policy.Lineup], snapshot: policy.Snapshot, now: float) -> Any:
        lineups = list(lineups)
        seen.extend(lu.job.id for lu in lineups)
        done = real_pass(lineups, snapshot, now)
        started.extend(d.job_id for d in done.starts)
        return done

    monkeypatch.setattr(loop.policy, "plan_pass", spy)
    submit(node, warm("next"), warm("after"))
    node.broker.tick()
    # "next" was handed over before the tick's plan ran: no pass ever saw it queued
    assert state(node, "next") is not JobState.QUEUED
    assert "next" not in seen
    run_until(node, lambda: state(node, "after").terminal)
    assert state(node, "next") is JobState.DONE and state(node, "after") is JobState.DONE
    # "after" waited for the busy server, and was handed to it as "next" ended, in
    # the step that drained that end, not by a plan
    assert started == []
    [server] = node.broker.status().to_json()["warm"]
    assert server["jobs_served"] == 3


def fast(node: Node, paused: str = "") -> list[str]:
    """What the fast path would hand over now (the loop's queue index brought up to
    date first, as the loop's hook does)."""
    b = node.broker
    b.queue.refresh(time.time())
    starts = b.warm.fast_starts(b.queue.index, node.store, b.registry.types, paused=paused)
    return [job.id for job, _, _ in starts]


def test_the_fast_path_leaves_to_the_plan_what_the_plan_might_decide_otherwise(
    node: Node,
) -> None:
    loaded(node)
    submit(node, warm("low"), warm("high", priority=5))
    assert fast(node) == ["high"]  # the type's first job in queue order
    # a higher priority waiting (another type): its memory may come from this idle
    # server, so the plan decides
    submit(node, JobSpec(id="big", type="testmods.gpu", params={"gib": 20}, priority=9))
    assert fast(node) == []
    node.store.transition("big", JobState.CANCELLED, now=time.time(), reason="test")
    assert fast(node) == ["high"]
    # VRAM admission paused (the probe failed): the plan decides
    assert fast(node, paused="the GPU probe failed: x") == []
    node.store.request_cancel("high", now=time.time())  # queued: cancelled at once
    assert fast(node) == ["low"]


def test_a_busy_server_takes_nothing_by_the_fast_path(node: Node) -> None:
    loaded(node)
    submit(node, warm("slow", sleep_s=1.0))
    node.broker.tick()
    run_until(node, lambda: state(node, "slow") is JobState.RUNNING)
    submit(node, warm("waiting"))
    assert fast(node) == []
    run_until(node, lambda: state(node, "waiting").terminal)
    assert state(node, "slow") is JobState.DONE and state(node, "waiting") is JobState.DONE


def test_only_wakes_move_a_loop_whose_poll_interval_is_a_minute(tmp_path: Path) -> None:
    """With a poll interval of 60 s (the most allowed) the loop ticks only when woken: a submitter's
    wake, then each server note and result posted to its mailbox. Every job ends,
    so none of them waited for a poll."""
    with open_node(make_config(tmp_path, poll=60), mock_gpu=True) as n:
        stop = threading.Event()
        runner = threading.Thread(target=n.broker.run, args=(stop,), daemon=True)
        n.broker.recover()
        runner.start()
        try:
            for batch in (["w0"], ["w1", "w2", "w3"]):
                submit(n, *(warm(i) for i in batch))
                n.broker.wake()
                deadline = time.monotonic() + 50  # under the poll: a guard, not a speed check
                while not all(state(n, i).terminal for i in batch):
                    assert time.monotonic() < deadline, "the loop waited for its poll"
                    time.sleep(0.01)
                assert all(state(n, i) is JobState.DONE for i in batch)
        finally:
            stop.set()
            n.broker.wake()
            runner.join(60)
