"""The broker loop keeps its queue between ticks (gpuwarden.node.queue): it follows
the store's events instead of reading every queued job each tick, and a count
that disagrees with the store reloads it."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.app import Node, open_node, open_store
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import prepare
from gpuwarden.node.explain import explain_job, latest_status, view_from_status
from tests.brokerkit import run_until, submit
from tests.integration.test_broker import make_config


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Node, Config]]:
    config = make_config(tmp_path, cpu_slots=1)
    with open_node(config, mock_gpu=True) as node:
        yield node, config


def test_the_queue_follows_other_writers_and_reloads_when_its_count_disagrees(
    setup: tuple[Node, Config], tmp_path: Path
) -> None:
    node, config = setup
    release = tmp_path / "release"
    submit(node, JobSpec("h", "testmods.hold", {"until": str(release)}))
    run_until(node, lambda: node.store.get_job("h").state is JobState.RUNNING)  # type: ignore[union-attr]
    assert len(node.broker.queue) == 0

    # another process (a CLI submit, the API) writes to the same store
    other = open_store(config)
    try:
        specs = [JobSpec(f"w{i}", "echo.echo", {"text": "x"}) for i in range(1, 5)]
        other.submit([prepare(node.broker.registry, s) for s in specs], now=time.time())
        node.broker.tick()
        assert len(node.broker.queue) == 4
        head = node.broker.wait_reason("w1")
        assert head == node.broker.wait_reason("w3") == "all 1 cpu slots are in use"
        assert list(node.broker.status().waiting) == ["w1", "w2", "w3", "w4"]
        assert node.broker.status().queued_indexed == 4

        other.request_cancel("w2", now=time.time())
        node.broker.tick()
        assert "w2" not in node.broker.queue.index
        assert node.broker.wait_reason("w2") is None
    finally:
        other.close()

    # a change no event tells of (written behind the store's back): the index keeps
    # the job until its count is checked against the store's
    with sqlite3.connect(config.db_path) as db:
        db.execute("UPDATE jobs SET state = 'failed' WHERE id = 'w3'")
    node.broker.tick()
    assert "w3" in node.broker.queue.index  # the fault happened: the index missed it
    real = node.broker.clock
    node.broker.clock = lambda: real() + 10.0  # past the count check's interval
    node.broker.tick()
    assert "w3" not in node.broker.queue.index
    assert len(node.broker.queue) == 2

    release.touch()
    run_until(
        node,
        lambda: all(
            node.store.get_job(j).state is JobState.DONE  # type: ignore[union-attr]
            for j in ("h", "w1", "w4")
        ),
    )
    assert len(node.broker.queue) == 0


def test_a_queued_job_of_an_unknown_type_fails_once_with_its_reason(
    setup: tuple[Node, Config],
) -> None:
    node, config = setup
    other = open_store(config)
    try:  # stored by a broker with another module set
        other.submit([JobSpec("ghost", "gone.type", {})], now=time.time())
    finally:
        other.close()
    node.broker.tick()
    job = node.store.get_job("ghost")
    assert job is not None and job.state is JobState.FAILED
    assert "job type gone.type is not known to this broker" in job.reason
    assert "ghost" not in node.broker.queue.index


def test_explain_says_why_a_job_far_down_a_long_queue_waits(
    setup: tuple[Node, Config], tmp_path: Path
) -> None:
    """explain once read only the first 1,000 queued jobs and had no decision for
    a job behind them; it now plans over the whole queue, by class."""
    node, _ = setup
    release = tmp_path / "release"
    submit(node, JobSpec("h", "testmods.hold", {"until": str(release)}))
    run_until(node, lambda: node.store.get_job("h").state is JobState.RUNNING)  # type: ignore[union-attr]
    specs = [JobSpec(f"w{i:04d}", "echo.echo", {"text": "x"}) for i in range(1200)]
    submit(node, *specs)
    node.broker.tick()
    node.broker.tick()
    status = latest_status(node.store, time.time())
    assert status is not None
    view = view_from_status(status, cpu_slots=1)
    last = node.store.get_job("w1199")
    assert last is not None
    assert len(node.store.queued_jobs()) == 1000  # the old read stopped short of it
    lines = explain_job(last, node.store, node.broker.registry, view)
    assert any("all 1 cpu slots are in use" in line for line in lines), lines
    release.touch()
