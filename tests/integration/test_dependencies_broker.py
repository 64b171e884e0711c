"""A broker loop and job dependencies: a held job stays out of the queue index (the
plan never looks at it), enters it when its dependency holds, and a restart's
recovery judges held jobs again."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.node.explain import explain_job
from tests.brokerkit import run_until, submit
from tests.integration.test_broker import make_config


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Node, Config]]:
    config = make_config(tmp_path, cpu_slots=2)
    with open_node(config, mock_gpu=True) as node:
        yield node, config


def _state(node: Node, job_id: str) -> JobState:
    job = node.store.get_job(job_id)
    assert job is not None
    return job.state


def test_a_held_job_is_out_of_the_index_until_its_dependency_holds(
    setup: tuple[Node, Config], tmp_path: Path
) -> None:
    node, _ = setup
    release = tmp_path / "release"
    submit(
        node,
        JobSpec("h", "testmods.hold", {"until": str(release)}),
        JobSpec("next", "echo.echo", {"text": "after h"}, after=("afterok:h",)),
    )
    run_until(node, lambda: _state(node, "h") is JobState.RUNNING)
    for _ in range(3):  # a free cpu slot, and still it does not start
        node.broker.tick()
    assert "next" not in node.broker.queue.index
    assert _state(node, "next") is JobState.QUEUED
    assert node.broker.wait_reason("next") is None  # not planned at all
    job = node.store.get_job("next")
    assert job is not None
    lines = explain_job(job, node.store, node.broker.registry, None)
    assert "it waits: waits for job h (running)" in lines

    release.touch()
    run_until(node, lambda: _state(node, "next") is JobState.DONE)
    assert _state(node, "h") is JobState.DONE


def test_a_restart_rechecks_held_jobs(tmp_path: Path) -> None:
    config = make_config(tmp_path, cpu_slots=1)
    with open_node(config, mock_gpu=True) as node:
        submit(
            node,
            JobSpec("a", "echo.echo", {"text": "a"}),
            JobSpec("b", "echo.echo", {"text": "b"}, after=("afterok:a",)),
            JobSpec("c", "echo.echo", {"text": "c"}, after=("afternotok:a",)),
        )
    # a change the cascade never saw (written behind the store's back)
    with sqlite3.connect(config.db_path) as db:
        db.execute("UPDATE jobs SET state = 'done' WHERE id = 'a'")
    with sqlite3.connect(config.db_path) as db:
        held = db.execute("SELECT id FROM jobs WHERE held = 1 ORDER BY id").fetchall()
    assert held == [("b",), ("c",)]  # the fault happened: both still held
    with open_node(config, mock_gpu=True) as node:
        node.broker.recover()
        c = node.store.get_job("c")
        assert c is not None and c.state is JobState.FAILED
        assert c.reason == "dependency afternotok:a can never hold: a done"
        run_until(node, lambda: _state(node, "b") is JobState.DONE)
