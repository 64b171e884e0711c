"""``wait`` on a submit and on a result (the long poll, SPEC.md section 15): against
a broker running in this process (its loop wakes on the submit and says when the
job ended), and against a store alone (the API polls it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden import client as c
from gpuwarden.api import waiting
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import Role
from gpuwarden.core.states import JobState
from gpuwarden.node.jobends import JobEnds
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)


def make_config(tmp_path: Path, *, poll: float = 0.05) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "waitnode",
            "gpu": "sim",
            "allow_unsandboxed_containers": True,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": poll, "kill_grace_s": 0.3},
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )


@dataclass
class Served:
    node: Node
    api: SqliteStore  # the API's own connection, as serve --api has it
    http: TestClient
    tokens: dict[str, str]

    def h(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def submit(self, who: str, body: dict[str, Any], wait: str | None) -> Any:
        params = {"wait": wait} if wait is not None else {}
        return self.http.post("/v1/jobs", json=body, params=params, headers=self.h(who))


def serve(tmp_path: Path, *, poll: float = 0.05) -> Iterator[Served]:
    config = make_config(tmp_path, poll=poll)
    with open_node(config, mock_gpu=True) as node:
        broker = node.broker
        broker.recover()
        stop = threading.Event()
        loop = threading.Thread(target=broker.run, args=(stop,), daemon=True)
        loop.start()
        api = SqliteStore(config.state_dir / "gpuwarden.db")
        tokens = {
            name: issue_token(api, name=name, role=Role.SUBMITTER, by=ADMIN, now=time.time())[1]
            for name in ("alice", "bob")
        }
        app = create_app(api, broker.registry, config, wake=broker.wake, ends=broker.ends)
        try:
            yield Served(node, api, TestClient(app), tokens)
        finally:
            stop.set()
            broker.wake()
            loop.join(60)
            api.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path)


ECHO = {"type": "echo.echo", "params": {"text": "hi"}}


def test_a_job_that_ends_within_the_wait_comes_back_with_its_result(served: Served) -> None:
    r = served.submit("alice", ECHO, "30")
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "done" and job["wait"]["ended"] is True
    assert job["wait"]["asked_s"] == 30 and 0 <= job["wait"]["waited_s"] <= 30
    result = job["result"]
    assert result["id"] == job["id"] and result["status"] == "done"
    assert result["outputs"] == ["echo.txt"]
    # the same as the result route gives
    again = served.http.get(f"/v1/jobs/{job['id']}/result", headers=served.h("alice"))
    assert again.json() == result


def test_a_job_that_does_not_end_within_the_wait_comes_back_as_it_is(served: Served) -> None:
    slow = {"type": "echo.echo", "params": {"text": "z", "sleep_s": 30}}
    r = served.submit("alice", slow, "0.3")
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] in ("queued", "running")
    assert job["wait"]["ended"] is False and job["wait"]["waited_s"] >= 0.29
    assert job["result"] is None
    # the result route's wait says it waited, and how long
    got = served.http.get(
        f"/v1/jobs/{job['id']}/result", params={"wait": "0.1"}, headers=served.h("alice")
    )
    assert got.status_code == 409 and "after waiting 0.1 s" in got.json()["error"]
    served.http.post(f"/v1/jobs/{job['id']}/cancel", headers=served.h("alice"))


def test_without_wait_the_answer_is_as_before(served: Served) -> None:
    r = served.submit("alice", ECHO, None)
    assert r.status_code == 201
    job = r.json()
    assert job["state"] == "queued" and job["wait"] is None and job["result"] is None


@pytest.mark.parametrize("bad", ["61", "-1", "abc", "nan", "inf", "1e9", ""])
def test_a_bad_wait_is_refused_before_anything_is_stored(served: Served, bad: str) -> None:
    r = served.submit("alice", ECHO, bad)
    assert r.status_code == 422, r.text
    assert "wait must be a number of seconds from 0 to 60" in r.json()["error"]
    assert served.api.list_jobs() == []
    got = served.http.get("/v1/jobs/x/result", params={"wait": bad}, headers=served.h("alice"))
    assert got.status_code == 422 and "from 0 to 60" in got.json()["error"]


def test_a_submitter_waits_only_on_its_own_job(served: Served) -> None:
    job = served.submit("alice", ECHO, "30").json()
    assert job["state"] == "done"
    theirs = served.http.get(
        f"/v1/jobs/{job['id']}/result", params={"wait": "5"}, headers=served.h("bob")
    )
    assert theirs.status_code == 404  # as if it did not exist
    assert f"no job with id {job['id']!r}" in theirs.json()["error"]
    mine = served.http.get(
        f"/v1/jobs/{job['id']}/result", params={"wait": "5"}, headers=served.h("alice")
    )
    assert mine.status_code == 200 and mine.json()["status"] == "done"


def test_the_broker_says_when_the_job_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store read only once an hour, a wait still ends as the job does:
    the broker loop in this process said so (JobEnds). And its loop, with a poll
    interval of 60 s, took the submitted job at once: the submit woke it."""
    monkeypatch.setattr(waiting, "NOTIFIED_POLL_S", 3600.0)
    for s in serve(tmp_path, poll=60):
        job = s.submit("alice", ECHO, "55").json()
        assert job["state"] == "done" and job["wait"]["ended"] is True
        assert job["wait"]["waited_s"] < 55  # it did not run out the wait
        assert len(s.node.broker.ends) == 0  # the request stopped watching


def test_the_client_and_a_store_without_a_broker(tmp_path: Path) -> None:
    """No broker in the API's process (a coordinator's API): the wait reads the
    store, with a backoff, and sees the job end when another process ends it."""
    config = make_config(tmp_path)
    store = SqliteStore(tmp_path / "api.db")
    token = issue_token(store, name="s", role=Role.SUBMITTER, by=ADMIN, now=1.0)[1]
    app = create_app(store, Registry.load(config.module_paths, config.launch_rules), config)
    other = SqliteStore(tmp_path / "api.db")  # the broker's connection, elsewhere
    with c.Client("http://testserver", token, http=TestClient(app)) as api:
        job = api.submit("echo.echo", {"text": "x"}, wait=0)
        assert job["state"] == "queued" and job["wait"]["ended"] is False
        job_id = job["id"]

        def end_it() -> None:
            time.sleep(0.3)
            other.start_attempt(job_id, node="n", gpu_uuid=None, now=2.0)
            other.finish_attempt(
                job_id, 1, target=JobState.DONE, now=3.0, outcome="succeeded", reason="done"
            )

        ender = threading.Thread(target=end_it)
        ender.start()
        result = api.result(job_id, wait=30)
        ender.join()
        assert result["status"] == "done" and result["id"] == job_id
        with pytest.raises(c.Invalid, match="from 0 to 60"):
            api.submit("echo.echo", {"text": "x"}, wait=61)
    other.close()
    store.close()


def test_job_ends_wakes_each_watcher_until_unwatched() -> None:
    ends = JobEnds()
    woken: list[str] = []
    stop_a = ends.watch("j", lambda: woken.append("a"))
    ends.watch("j", lambda: woken.append("b"))

    def broken() -> None:
        raise RuntimeError("a watcher that fails")

    ends.watch("j", broken)
    ends.watch("k", lambda: woken.append("k"))
    ends.ended("j")  # the broken one is logged; the others are woken all the same
    assert sorted(woken) == ["a", "b"]
    stop_a()
    ends.ended("j")
    assert sorted(woken) == ["a", "b", "b"]
    assert len(ends) == 2
    ends.ended("nobody")
    assert sorted(woken) == ["a", "b", "b"]
