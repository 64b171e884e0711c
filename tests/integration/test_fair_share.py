"""Fair share in VRAM-hours (SPEC.md section 11, "Fair share"): the stored table
(migration 0009) on every backend, and the broker on the simulated GPU: an owner
with heavy past use waits behind one with none at equal priority, priority still
goes first, and each attempt's GiB-hours are counted for its owner."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpuwarden import cli
from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.cluster import report
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec, Role
from gpuwarden.intake.jobs import prepare
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store, Submission
from gpuwarden.store.sqlite import SqliteStore
from tests.brokerkit import run_until
from tests.conftest import MODULES

TEST_MODULES = Path(__file__).resolve().parents[1] / "modules"
WEEK = 7 * 86400.0
LOCAL = Principal(token_id="local", name="t", role=Role.OWNER)


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
    # each owner's queued and running jobs (share's columns)
    registry = Registry.load([MODULES, TEST_MODULES])
    specs = [JobSpec(id=f"e{i}", type="echo.echo", params={"text": "x"}) for i in range(3)]
    jobs = [prepare(registry, s) for s in specs]
    store.submit(jobs[:2], now=1.0, origin=Submission(owner="tok-a"))
    store.submit(jobs[2:], now=1.0)
    store.start_attempt("e0", node="n", gpu_uuid=None, now=2.0)
    assert store.owner_counts() == {"tok-a": (1, 1), None: (1, 0)}


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
        submit_as(node, "tok-b", gpu_job("b1"), gpu_job("b2"))
        node.broker.tick()
        assert node.broker.running == 1
        assert node.store.get_job("b1").state.value == "running"  # type: ignore[union-attr]
        a1 = node.store.get_job("a1")
        assert a1 is not None and a1.state.value == "queued"
        # while b1 runs, what it held so far counts for tok-b (not yet in the store)
        running = node.broker.fair.table(time.time(), node.broker.attempts)
        assert running.get("tok-b", 0.0) > 0 and "tok-b" not in dict(
            (o, v) for o, v, _ in node.store.fair_share()
        )
        # explain says why: B's queued b2 goes before it, by fair share
        run_until(node, lambda: node.broker.wait_reason("a1") is not None)
        node.broker.tick()
        lines = report.explain(a1, node.store, node.broker.registry, 4, time.time())
        assert any(
            "owner tok-b has used less: 0.00 GiB-h against 500.00" in line for line in lines
        ), lines
        run_until(node, lambda: all(j.state.terminal for j in node.store.list_jobs()))
        assert started_at(node, "b1") < started_at(node, "b2") < started_at(node, "a1")
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


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_share_locally_and_over_the_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    store = SqliteStore(state / "gpuwarden.db")
    a_rec, a_token = issue_token(store, name="alice", role=Role.SUBMITTER, by=LOCAL, now=1.0)
    b_rec, _ = issue_token(store, name="bob", role=Role.SUBMITTER, by=LOCAL, now=1.0)
    _, owner_token = issue_token(store, name="boss", role=Role.OWNER, by=LOCAL, now=1.0)
    now = time.time()
    store.add_fair_share(a_rec.id, 40.0, now=now, half_life_s=WEEK)
    store.add_fair_share(b_rec.id, 2.0, now=now, half_life_s=WEEK)
    registry = Registry.load([MODULES, TEST_MODULES])
    job = prepare(registry, JobSpec(id="a1", type="echo.echo", params={"text": "x"}))
    store.submit([job], now=now, origin=Submission(owner=a_rec.id))
    store.close()

    code, text, err = _run(capsys, "--state-dir", str(state), "share", "--json")
    assert code == 0, err
    doc = json.loads(text)
    assert doc["half_life_s"] == WEEK
    rows = {r["name"]: r for r in doc["owners"]}
    assert rows["bob"]["standing"] == 1 and rows["alice"]["standing"] == 2
    assert rows["alice"]["gib_h"] == pytest.approx(40.0, rel=1e-3)
    assert (rows["alice"]["queued"], rows["alice"]["running"]) == (1, 0)
    assert rows["alice"]["owner"] == a_rec.id
    code, text, err = _run(capsys, "--state-dir", str(state), "share")
    assert code == 0, err
    assert "alice" in text and "40.00" in text and "bob" in text

    config = Config.model_validate(
        {"state_dir": state, "module_paths": [MODULES, TEST_MODULES], "api": {"rate_per_s": 1e4}}
    )
    store = SqliteStore(state / "gpuwarden.db")
    try:
        app = create_app(store, registry, config)
        with c.Client("http://testserver", owner_token, http=TestClient(app)) as client:
            everyone = client.share()
        assert [r["name"] for r in everyone] == ["bob", "alice"]
        with c.Client("http://testserver", a_token, http=TestClient(app)) as client:
            mine = client.share()  # a submitter: its own row only
        assert [(r["name"], r["standing"]) for r in mine] == [("alice", 2)]
    finally:
        store.close()
