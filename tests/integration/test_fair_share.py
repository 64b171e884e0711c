"""Fair share in VRAM-hours (SPEC.md section 11, "Fair share"): the stored table
(migration 0009) on every backend, and the broker on the simulated GPU: an owner
with heavy past use waits behind one with none at equal priority, priority still
goes first, and each attempt's GiB-hours are counted for its owner."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.intake.jobs import prepare
from gpuwarden.store.base import Store, Submission
from tests.brokerkit import run_until
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"
WEEK = 7 * 86400.0


def test_the_stored_table_decays_and_adds(store: Store) -> None:
    assert store.fair_share() == []
    store.add_fair_share("tok-a", 8.0, now=1000.0, half_life_s=WEEK)
    store.add_fair_share("tok-a", 1.0, now=1000.0 + WEEK, half_life_s=WEEK)  # 8 is 4 by then
    store.add_fair_share(None, 2.0, now=1000.0, half_life_s=WEEK)  # the local CLI: owner ""
    rows = {o: (v, t) for o, v, t in store.fair_share()}
    assert rows["tok-a"] == (pytest.approx(5.0), 1000.0 + WEEK)
    assert rows[""] == (2.0, 1000.0)
    store.add_fair_share("tok-a", 2.0, now=1000.0, half_life_s=WEEK)  # counted late
    assert {o: v for o, v, _ in store.fair_share()}["tok-a"] == pytest.approx(6.0)


def make_config(tmp_path: Path) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "fairnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [MODULES, TEST_MODULES],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 0.3},
            "vram": {"reserve_gib": 0, "reclaim_timeout_s": 2},
        }
    )


def submit_as(node: Node, owner: str, *specs: JobSpec) -> None:
    node.store.submit(
        [prepare(node.broker.registry, s) for s in specs],
        now=time.time(),
        origin=Submission(owner=owner),
    )


def gpu_job(job_id: str, priority: int = 0) -> JobSpec:
    # a GPU to itself (not co-resident): one at a time on the one GPU
    return JobSpec(id=job_id, type="testmods.gpu", params={"seconds": 0.3}, priority=priority)


def started_at(node: Node, job_id: str) -> float:
    [attempt] = node.store.attempts(job_id)
    return attempt.started_at


def test_the_owner_who_used_least_starts_first(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as first:  # owner A's heavy past use, stored
        first.store.add_fair_share("tok-a", 500.0, now=time.time(), half_life_s=WEEK)
    with open_node(config, mock_gpu=True) as node:  # a broker loads it at start
        assert node.broker.fair.table(time.time())["tok-a"] == pytest.approx(500.0, rel=1e-3)
        submit_as(node, "tok-a", gpu_job("a1"))  # A submits first
        submit_as(node, "tok-b", gpu_job("b1"))
        node.broker.tick()
        assert node.broker.running == 1
        assert node.store.get_job("b1").state.value == "running"  # type: ignore[union-attr]
        assert node.store.get_job("a1").state.value == "queued"  # type: ignore[union-attr]
        run_until(node, lambda: all(j.state.terminal for j in node.store.list_jobs()))
        assert started_at(node, "b1") < started_at(node, "a1")
        # each attempt's GiB-hours went to its owner, in the store and in the loop
        stored = {o: v for o, v, _ in node.store.fair_share()}
        assert 0 < stored["tok-b"] < 0.01  # 8 GiB for about 0.3 s
        assert stored["tok-a"] > 499.0
        assert node.broker.fair.table(time.time())["tok-b"] == pytest.approx(
            stored["tok-b"], rel=1e-3
        )
        node.broker.shutdown(0)


def test_priority_beats_fair_share_on_the_broker(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with open_node(config, mock_gpu=True) as first:
        first.store.add_fair_share("tok-a", 500.0, now=time.time(), half_life_s=WEEK)
    with open_node(config, mock_gpu=True) as node:
        submit_as(node, "tok-b", gpu_job("b1"))
        submit_as(node, "tok-a", gpu_job("a1", priority=5))  # heavy use, but urgent
        node.broker.tick()
        assert node.store.get_job("a1").state.value == "running"  # type: ignore[union-attr]
        run_until(node, lambda: all(j.state.terminal for j in node.store.list_jobs()))
        assert started_at(node, "a1") < started_at(node, "b1")
        node.broker.shutdown(0)
