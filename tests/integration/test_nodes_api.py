"""The node endpoints of the HTTP API (api/routers/nodes.py) on a SqliteStore:
enrolment, the agent's calls fenced by lease, drain, revoke, the role matrix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.api.routers.nodes import install_coordinator, install_sweeper
from gpuwarden.cluster import coordinator as co
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.cluster import NodeState
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Env:
    def __init__(self, tmp: Path) -> None:
        self.config = Config.model_validate(
            {
                "state_dir": tmp,
                "module_paths": [
                    REPO / "src" / "gpuwarden" / "modules",
                    REPO / "tests" / "modules",
                ],
                "allow_unsandboxed_containers": True,
                "api": {"rate_per_s": 10_000, "burst": 10_000},
                "cluster": {"lease_s": 10, "offline_after_s": 20, "sweep_every_s": 0.05},
            }
        )
        self.store = SqliteStore(tmp / "gpuwarden.db")
        self.clock = Clock()
        self.registry = Registry.load(self.config.module_paths, self.config.launch_rules)
        self.app = create_app(self.store, self.registry, self.config, clock=self.clock)
        self.client = TestClient(self.app)
        self.tokens: dict[str, str] = {}
        for role in (Role.OWNER, Role.OPERATOR, Role.SUBMITTER):
            _, self.tokens[role.value] = issue_token(
                self.store, name=role.value, role=role, by=ADMIN, now=1.0
            )

    def h(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def post(self, path: str, who: str, body: Any = None) -> Any:
        return self.client.post(path, json=body if body is not None else {}, headers=self.h(who))

    def invite(self, name: str, *, replace: bool = False) -> str:
        r = self.post("/v1/nodes/invite", "owner", {"name": name, "replace": replace})
        assert r.status_code == 201, r.text
        token: str = r.json()["token"]
        return token

    def enrol(self, name: str, gib: float = 24, *, replace: bool = False) -> str:
        self.tokens[f"enroll-{name}"] = self.invite(name, replace=replace)
        r = self.post("/v1/nodes/enroll", f"enroll-{name}", {"capabilities": {"gpus": []}})
        assert r.status_code == 201, r.text
        self.tokens[name] = r.json()["token"]
        return name


def report(gib: float, **kw: Any) -> dict[str, Any]:
    total = int(gib * GIB)
    return {
        "gpus": [{"uuid": "GPU-0", "name": "sim", "total_bytes": total, "free_bytes": total}],
        "warm": [],
        "busy": 0,
        "max_jobs": 4,
        **kw,
    }


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.store.close()


def gpu_job(job_id: str, gib: float) -> JobSpec:
    return JobSpec(
        id=job_id,
        type="testmods.gpu",
        params={"gib": gib, "seconds": 0.1, "leak": False},
        vram_bytes=int(gib * GIB),
    )


def test_invite_and_enrol_once(env: Env) -> None:
    token = env.invite("gpu-a")
    env.tokens["e"] = token
    r = env.post("/v1/nodes/enroll", "e", {"capabilities": {"driver": "550", "gpus": []}})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["node"] == "gpu-a" and body["lease_s"] == 10 and body["token"].startswith("gw_")
    again = env.post("/v1/nodes/enroll", "e", {"capabilities": {}})
    assert again.status_code == 401 and "revoked" in again.json()["error"]
    node = env.store.get_node("gpu-a")
    assert node is not None and node.capabilities["driver"] == "550"
    assert node.state is NodeState.ACTIVE


def test_an_invite_expires_after_15_minutes(env: Env) -> None:
    env.tokens["e"] = env.invite("gpu-a")
    env.clock.t += 15 * 60 + 1
    r = env.post("/v1/nodes/enroll", "e", {"capabilities": {}})
    assert r.status_code == 401 and "expired" in r.json()["error"]


def test_invite_refuses_a_bad_name(env: Env) -> None:
    r = env.post("/v1/nodes/invite", "owner", {"name": "../etc"})
    assert r.status_code == 422


def test_the_node_name_comes_from_the_token(env: Env) -> None:
    env.enrol("a")
    r = env.post("/v1/node/heartbeat", "a", {"report": report(24), "node": "b"})
    assert r.status_code == 422  # no such field: a node cannot speak for another
    r = env.post("/v1/node/heartbeat", "a", {"report": report(24), "jobs": []})
    assert r.status_code == 200, r.text
    assert r.json() == {"state": "active", "lease_s": 10.0, "renewed": 0, "cancels": []}
    node = env.store.get_node("a")
    assert node is not None and node.last_seen == env.clock.t


def test_claim_start_finish_over_http(env: Env) -> None:
    env.enrol("small")
    env.enrol("big")
    env.store.submit([gpu_job("j20", 20)], now=env.clock.t)
    r = env.post("/v1/node/claim", "small", {"report": report(8), "want": 4})
    assert r.status_code == 200 and r.json()["jobs"] == []
    r = env.post("/v1/node/claim", "big", {"report": report(80), "want": 4})
    [job] = r.json()["jobs"]
    assert job["id"] == "j20" and job["params"]["gib"] == 20
    lease = job["lease_id"]
    r = env.post("/v1/node/jobs/j20/start", "small", {"lease_id": lease})
    assert r.status_code == 409  # not small's lease
    r = env.post("/v1/node/jobs/j20/start", "big", {"lease_id": lease, "gpu": "GPU-0"})
    assert r.status_code == 200 and r.json() == {"attempt": 1}
    done = {
        "lease_id": lease,
        "state": "done",
        "outcome": "succeeded",
        "reason": "done",
        "exit_code": 0,
        "result": {"message": "ok"},
        "stdout": "hello",
    }
    r = env.post("/v1/node/jobs/j20/finish", "big", done)
    assert r.status_code == 200 and r.json() == {"state": "done", "lease_kept": False}
    r = env.post("/v1/node/jobs/j20/finish", "big", done)
    assert r.status_code == 409  # once
    job_row = env.store.get_job("j20")
    assert job_row is not None and job_row.state is JobState.DONE
    assert job_row.result["node"] == "big"
    rows = env.store.audit_rows()
    finishes = [(a.action, a.outcome[:7]) for a in rows if a.action == "node.finish"]
    assert finishes == [("node.finish", "ok"), ("node.finish", "refused")]
    assert any(a.action == "node.claim" and a.detail["jobs"] == ["j20"] for a in rows)


def test_reports_in_one_request_each_as_its_own_route(env: Env) -> None:
    env.enrol("a")
    env.enrol("b")
    env.store.submit([gpu_job("r1", 1), gpu_job("r2", 1)], now=env.clock.t)
    jobs = env.post("/v1/node/claim", "a", {"report": report(24), "want": 4}).json()["jobs"]
    lease = {j["id"]: j["lease_id"] for j in jobs}
    assert set(lease) == {"r1", "r2"}
    done = {"state": "done", "outcome": "succeeded", "reason": "done", "exit_code": 0}
    batch = [
        {"kind": "start", "job": "r1", "lease_id": lease["r1"], "gpu": "GPU-0"},
        {"kind": "finish", "job": "r1", "lease_id": lease["r1"], **done},
        {"kind": "start", "job": "r2", "lease_id": "not-its-lease"},
        {"kind": "finish", "job": "r2", "lease_id": lease["r2"], **done},  # never started
        {"kind": "finish", "job": "r1", "lease_id": lease["r1"], "state": "running"},
    ]
    r = env.post("/v1/node/reports", "a", {"reports": batch})
    assert r.status_code == 200, r.text
    got = r.json()["results"]
    assert [(x["job"], x["kind"], x["status"]) for x in got] == [
        ("r1", "start", 200),
        ("r1", "finish", 200),
        ("r2", "start", 409),
        ("r2", "finish", 409),
        ("r1", "finish", 422),  # not a state an attempt ends in
    ]
    assert got[0]["attempt"] == 1 and got[1]["state"] == "done"
    assert "not leased to node a" in got[2]["error"]
    r1, r2 = env.store.get_job("r1"), env.store.get_job("r2")
    assert r1 is not None and r1.state is JobState.DONE and r1.result["node"] == "a"
    assert r2 is not None and r2.state is JobState.QUEUED
    # another node cannot report on a's jobs, one report at a time or several
    r = env.post("/v1/node/reports", "b", {"reports": [batch[2] | {"lease_id": lease["r2"]}]})
    assert r.json()["results"][0]["status"] == 409
    # each report is audited as its own route would be, under its job
    rows = [(a.action, a.target, a.outcome[:7]) for a in env.store.audit_rows()]
    assert ("node.start", "r1", "ok") in rows and ("node.finish", "r1", "ok") in rows
    assert ("node.start", "r2", "refused") in rows and ("node.finish", "r2", "refused") in rows
    assert not [row for row in rows if row[0] == "node.report"]
    # a body that is not a list of reports is refused whole
    bad = [{"kind": "stop", "job": "r1", "lease_id": "x"}]
    assert env.post("/v1/node/reports", "a", {"reports": bad}).status_code == 422
    assert env.post("/v1/node/reports", "a", {"reports": []}).status_code == 422


def _started(env: Env, node: str, job_id: str) -> str:
    """A job leased to ``node`` and started there: its lease id."""
    env.store.submit([gpu_job(job_id, 1)], now=env.clock.t)
    [job] = env.post("/v1/node/claim", node, {"report": report(24)}).json()["jobs"]
    lease: str = job["lease_id"]
    r = env.post(f"/v1/node/jobs/{job_id}/start", node, {"lease_id": lease})
    assert r.status_code == 200, r.text
    return lease


def _put(env: Env, node: str, path: str, content: Any, lease: str) -> Any:
    return env.client.put(path, params={"lease_id": lease}, content=content, headers=env.h(node))


def test_outputs_go_up_and_are_served_by_the_coordinator(env: Env) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    r = _put(env, "a", "/v1/node/jobs/j/outputs/sub/out.txt", b"hello\n", lease)
    assert r.status_code == 200 and r.json() == {"path": "sub/out.txt", "bytes": 6}, r.text
    kept = env.config.state_dir / "outputs" / "j" / "attempt-1" / "sub" / "out.txt"
    assert kept.read_bytes() == b"hello\n"
    assert not [p for p in kept.parent.iterdir() if p.name.endswith(".part")]
    done = {
        "lease_id": lease,
        "state": "done",
        "outcome": "succeeded",
        "result": {"outputs": ["sub/out.txt"], "output_dir": "/on/the/agent/out"},
    }
    r = env.post("/v1/node/jobs/j/finish", "a", done)
    assert r.status_code == 200, r.text
    row = env.store.get_job("j")
    assert row is not None
    assert row.result["output_dir"] == str(kept.parent.parent)
    assert row.result["node_output_dir"] == "/on/the/agent/out"
    got = env.client.get("/v1/jobs/j/outputs/sub/out.txt", headers=env.h("owner"))
    assert got.status_code == 200 and got.content == b"hello\n"
    # the lease ended with the finish: no more uploads
    r = _put(env, "a", "/v1/node/jobs/j/outputs/late.txt", b"x", lease)
    assert r.status_code == 409
    uploads = [a for a in env.store.audit_rows() if a.action == "node.upload"]
    assert [a.outcome[:7] for a in uploads] == ["ok", "refused"]


def _log(env: Env, node: str, stream: str, offset: int, data: bytes, lease: str) -> Any:
    return env.client.post(
        f"/v1/node/jobs/j/logs/{stream}",
        params={"lease_id": lease, "offset": offset},
        content=data,
        headers=env.h(node),
    )


def test_a_running_attempts_stream_goes_up_in_chunks(env: Env) -> None:
    env.enrol("a")
    env.enrol("b")
    lease = _started(env, "a", "j")
    assert _log(env, "a", "stdout", 0, b"one\n", lease).json() == {"offset": 4}
    assert _log(env, "a", "stdout", 0, b"one\n", lease).json() == {"offset": 4}  # a retry
    gap = _log(env, "a", "stdout", 9, b"x", lease)
    assert gap.status_code == 416 and gap.headers["X-Gpuwarden-Offset"] == "4", gap.text
    assert _log(env, "a", "stdout", 4, b"two\n", lease).json() == {"offset": 8}
    assert _log(env, "a", "stdout", 8, b"x" * (64 * 1024 + 1), lease).status_code == 413
    assert _log(env, "b", "stdout", 8, b"x", lease).status_code == 409  # not its lease
    assert _log(env, "a", "../x", 0, b"x", lease).status_code in (404, 422)
    got = env.client.get("/v1/jobs/j/logs/stdout", headers=env.h("owner"))
    assert got.status_code == 200 and got.content == b"one\ntwo\n", got.text
    assert "runs on node a" in got.headers["X-Gpuwarden-Note"]
    r = env.post("/v1/node/jobs/j/finish", "a", {"lease_id": lease, "state": "done"})
    assert r.status_code == 200, r.text
    assert _log(env, "a", "stdout", 8, b"late", lease).status_code == 409
    followed = env.client.get("/v1/jobs/j/logs/stdout?follow=true", headers=env.h("owner"))
    assert followed.content == b"one\ntwo\n"


@pytest.mark.parametrize("path", ["../escape.txt", "a/../../b", "%2Fetc%2Fpasswd", "a%5Cb"])
def test_an_upload_path_out_of_the_folder_is_refused(env: Env, path: str) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    r = _put(env, "a", f"/v1/node/jobs/j/outputs/{path}", b"x", lease)
    assert r.status_code in (404, 422), r.text
    assert not (env.config.state_dir / "escape.txt").exists()
    assert not (env.config.state_dir / "outputs" / "b").exists()


def test_an_upload_through_a_symbolic_link_is_refused(env: Env, tmp_path: Path) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    folder = env.config.state_dir / "outputs" / "j" / "attempt-1"
    folder.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / "link").symlink_to(elsewhere)
    r = _put(env, "a", "/v1/node/jobs/j/outputs/link/x.txt", b"x", lease)
    assert r.status_code == 422, r.text
    assert not (elsewhere / "x.txt").exists()
    r = _put(env, "a", "/v1/node/jobs/j/outputs/link/new/x.txt", b"x", lease)
    assert r.status_code == 422, r.text
    assert not (elsewhere / "new").exists()  # no folder made through the link


def test_an_upload_under_a_wrong_lease_is_refused(env: Env) -> None:
    env.enrol("a")
    env.enrol("b")
    lease = _started(env, "a", "j")
    assert _put(env, "a", "/v1/node/jobs/j/outputs/o.txt", b"x", "not-it").status_code == 409
    assert _put(env, "b", "/v1/node/jobs/j/outputs/o.txt", b"x", lease).status_code == 409
    assert _put(env, "a", "/v1/node/jobs/nope/outputs/o.txt", b"x", lease).status_code == 409
    assert not (env.config.state_dir / "outputs" / "j" / "attempt-1" / "o.txt").exists()


def test_an_upload_past_max_output_mib_is_refused(tmp_path: Path) -> None:
    e = Env(tmp_path)
    e.config = e.config.model_copy(
        update={"api": e.config.api.model_copy(update={"max_output_mib": 1.0, "max_body_mib": 0.5})}
    )
    e.app = create_app(e.store, e.registry, e.config, clock=e.clock)
    e.client = TestClient(e.app)
    try:
        e.enrol("a")
        lease = _started(e, "a", "j")
        folder = e.config.state_dir / "outputs" / "j" / "attempt-1"
        # larger than max_body_mib, within max_output_mib: taken
        r = _put(e, "a", "/v1/node/jobs/j/outputs/ok.bin", b"x" * (800 * 1024), lease)
        assert r.status_code == 200, r.text
        # over it by Content-Length: refused before a byte is read
        r = _put(e, "a", "/v1/node/jobs/j/outputs/big.bin", b"x" * (1024 * 1024 + 1), lease)
        assert r.status_code == 413 and "max_output_mib" in r.json()["error"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
            for _ in range(20):
                yield b"x" * (128 * 1024)

        r = _put(e, "a", "/v1/node/jobs/j/outputs/big.bin", chunks(), lease)
        assert r.status_code == 413, r.text
        assert sorted(p.name for p in folder.iterdir()) == ["ok.bin"]
        # other routes keep max_body_mib
        r = e.client.post(
            "/v1/node/heartbeat",
            content=b"{" + b" " * (600 * 1024) + b"}",
            headers={**e.h("a"), "content-type": "application/json"},
        )
        assert r.status_code == 413 and "max_body_mib" in r.json()["error"]
    finally:
        e.store.close()


def test_a_leased_job_with_staged_inputs_is_offered_and_its_inputs_fetched(
    env: Env, tmp_path: Path
) -> None:
    env.enrol("a")
    env.enrol("b")
    staged = tmp_path / "staged"
    (staged / "sub").mkdir(parents=True)
    (staged / "sub" / "data.txt").write_text("data\n")
    (staged / "other.txt").write_text("not an input of it\n")
    spec = JobSpec(
        id="c", type="testmods.cat", params={"file": "sub/data.txt"}, inputs=("sub/data.txt",)
    )
    env.store.submit([spec], now=env.clock.t, origin=Submission(input_dir=str(staged)))
    gone = JobSpec(id="g", type="testmods.cat", params={"file": "x"}, inputs=("x",))
    env.store.submit([gone], now=env.clock.t, origin=Submission(input_dir=str(tmp_path / "no")))
    [job] = env.post("/v1/node/claim", "a", {"report": report(24)}).json()["jobs"]
    assert job["id"] == "c" and job["inputs"] == ["sub/data.txt"]  # g's folder is not here
    lease = job["lease_id"]

    def get(node: str, name: str, lease_id: str = lease) -> Any:
        return env.client.get(
            f"/v1/node/jobs/c/inputs/{name}", params={"lease_id": lease_id}, headers=env.h(node)
        )

    r = get("a", "sub/data.txt")  # before its start, too
    assert r.status_code == 200 and r.content == b"data\n"
    assert get("a", "other.txt").status_code == 404  # not among its inputs
    assert get("a", "sub/../other.txt").status_code in (404, 422)
    assert get("a", "sub/data.txt", "not-it").status_code == 409
    assert get("b", "sub/data.txt").status_code == 409
    (staged / "sub" / "data.txt").unlink()
    assert get("a", "sub/data.txt").status_code == 404


def test_a_late_finish_is_taken_until_a_later_attempt_supersedes_it(env: Env) -> None:
    env.enrol("a")
    env.enrol("b")
    env.store.submit([gpu_job("j", 1), gpu_job("k", 1)], now=env.clock.t)
    lease: dict[str, str] = {}
    for job_id in ("j", "k"):  # one claim each (the report says one slot)
        [job] = env.post("/v1/node/claim", "a", {"report": report(24)}).json()["jobs"]
        assert job["id"] == job_id
        lease[job_id] = job["lease_id"]
        r = env.post(f"/v1/node/jobs/{job_id}/start", "a", {"lease_id": lease[job_id]})
        assert r.status_code == 200, r.text
    # past the lease and its grace (10 + 15 s): no heartbeat came, no sweep yet
    env.clock.t += 40
    assert not env.store.lease_of("j").live(env.clock.t)  # type: ignore[union-attr]
    end = {"state": "done", "outcome": "succeeded"}
    r = env.post("/v1/node/jobs/j/finish", "a", {"lease_id": lease["j"], **end})
    assert r.status_code == 200, r.text  # nothing replaced the lease: its end is taken
    assert env.store.get_job("j").state is JobState.DONE  # type: ignore[union-attr]
    # the sweep takes k back (another attempt may start now): its late end is refused
    assert co.sweep(env.store, env.clock.t, 20.0, registry=env.registry)["interrupted"] == 1
    r = env.post("/v1/node/jobs/k/finish", "a", {"lease_id": lease["k"], **end})
    assert r.status_code == 409 and "superseded" in r.json()["error"], r.text
    assert env.store.get_job("k").state is JobState.QUEUED  # type: ignore[union-attr]


def test_drain_stops_new_work(env: Env) -> None:
    env.enrol("a")
    env.store.submit([gpu_job("j", 1)], now=env.clock.t)
    r = env.post("/v1/nodes/a/drain", "operator")
    assert r.status_code == 200 and r.json()["state"] == "draining"
    r = env.post("/v1/node/claim", "a", {"report": report(24)})
    assert r.json() == {"jobs": [], "lease_s": 10.0, "state": "draining"}
    r = env.post("/v1/node/heartbeat", "a", {"report": report(24)})
    assert r.json()["state"] == "draining"
    assert env.post("/v1/nodes/nope/drain", "operator").status_code == 404


def test_a_diagnostic_grant_is_the_owners_audited_and_revoked_by_a_cancel(env: Env) -> None:
    env.enrol("a")
    env.store.submit([gpu_job("j", 1), gpu_job("k", 1)], now=env.clock.t)
    body = {"job": "k", "reason": "after the fan swap"}
    assert env.post("/v1/nodes/a/diagnostic", "owner", body).status_code == 409  # not drained
    assert env.post("/v1/nodes/a/drain", "operator").json()["state"] == "draining"
    assert env.post("/v1/nodes/a/diagnostic", "operator", body).status_code == 403
    assert env.post("/v1/nodes/a/diagnostic", "submitter", body).status_code == 403
    r = env.post("/v1/nodes/a/diagnostic", "owner", body)
    assert r.status_code == 200 and r.json()["job"] == "k" and r.json()["used_at"] is None
    second = env.post("/v1/nodes/a/diagnostic", "owner", {"job": "j", "reason": "x"})
    assert second.status_code == 409 and "already" in second.json()["error"]
    rows = [a for a in env.store.audit_rows() if a.action == "node.diagnostic"]
    assert rows[-1].outcome.startswith("refused") and rows[-2].outcome == "ok"
    assert any(a.detail.get("reason") == "after the fan swap" for a in rows)
    assert env.post("/v1/jobs/k/cancel", "owner").status_code == 200
    cancels = [a for a in env.store.audit_rows() if a.action == "job.cancel"]
    assert cancels[-1].detail.get("grants_revoked") == ["a"]
    r = env.post("/v1/node/claim", "a", {"report": report(24)})
    assert r.json()["jobs"] == []  # revoked: the draining node takes nothing


def test_revoke_refuses_the_node_at_once(env: Env) -> None:
    env.enrol("a")
    env.store.submit([gpu_job("j", 1), gpu_job("k", 1)], now=env.clock.t)
    jobs = env.post("/v1/node/claim", "a", {"report": report(24), "want": 2}).json()["jobs"]
    assert len(jobs) == 2
    env.post("/v1/node/jobs/j/start", "a", {"lease_id": jobs[0]["lease_id"]})
    r = env.post("/v1/nodes/a/revoke", "operator")
    assert r.status_code == 403
    r = env.post("/v1/nodes/a/revoke", "owner")
    assert r.status_code == 200 and r.json() == {"node": "a", "requeued": 1, "interrupted": 1}
    r = env.post("/v1/node/heartbeat", "a", {"report": report(24)})
    assert r.status_code == 401 and "revoked" in r.json()["error"]
    assert {j.id for j in env.store.queued_jobs()} == {"j", "k"}
    refused = [a for a in env.store.audit_rows() if a.action == "node.heartbeat"]
    assert refused and refused[-1].outcome.startswith("refused")
    # enrolled again, it works again
    env.enrol("a")
    r = env.post("/v1/node/heartbeat", "a", {"report": report(24)})
    assert r.status_code == 200


def test_an_old_credential_stops_working_when_the_node_enrols_again(env: Env) -> None:
    env.enrol("a")
    old = env.tokens["a"]
    env.enrol("a", replace=True)
    env.tokens["old"] = old
    r = env.post("/v1/node/heartbeat", "old", {"report": {}})
    assert r.status_code == 401


def test_list_nodes(env: Env) -> None:
    env.enrol("a")
    env.post("/v1/node/heartbeat", "a", {"report": report(24, warm=["testmods.warm"])})
    r = env.client.get("/v1/nodes", headers=env.h("operator"))
    assert r.status_code == 200
    [node] = r.json()
    assert node["name"] == "a" and node["state"] == "active" and node["warm"] == ["testmods.warm"]
    assert node["seen_s_ago"] == 0.0 and node["leases"] == 0
    assert env.client.get("/v1/nodes", headers=env.h("submitter")).status_code == 403


ROLE_CASES = [
    ("POST", "/v1/nodes/invite", {"owner"}, {"name": "x"}),
    ("POST", "/v1/nodes/enroll", {"enroll"}, {"capabilities": {}}),
    ("POST", "/v1/node/heartbeat", {"node"}, {"report": {}}),
    ("POST", "/v1/node/claim", {"node"}, {"report": {}}),
    ("POST", "/v1/node/jobs/j/start", {"node"}, {"lease_id": "x"}),
    ("POST", "/v1/node/jobs/j/finish", {"node"}, {"lease_id": "x", "state": "done"}),
    (
        "POST",
        "/v1/node/reports",
        {"node"},
        {"reports": [{"kind": "start", "job": "j", "lease_id": "x"}]},
    ),
    ("PUT", "/v1/node/jobs/j/outputs/o.txt?lease_id=x", {"node"}, None),
    ("GET", "/v1/node/jobs/j/inputs/i.txt?lease_id=x", {"node"}, None),
    ("POST", "/v1/node/jobs/j/logs/stdout?lease_id=x&offset=0", {"node"}, None),
    ("GET", "/v1/nodes", {"owner", "operator"}, None),
    ("POST", "/v1/nodes/n/drain", {"owner", "operator"}, None),
    ("POST", "/v1/nodes/n/resume", {"owner", "operator"}, None),
    ("POST", "/v1/nodes/n/revoke", {"owner"}, None),
    ("POST", "/v1/nodes/n/diagnostic", {"owner"}, {"job": "j", "reason": "r"}),
]


def test_the_role_cases_cover_every_node_endpoint(env: Env) -> None:
    schema = env.client.get("/openapi.json").json()
    served = {
        (m.upper(), p)
        for p, ops in schema["paths"].items()
        for m in ops
        if p.startswith(("/v1/node/", "/v1/nodes"))
    }
    cases = {
        (
            m,
            p.split("?")[0]
            .replace("/j/", "/{job_id}/")
            .replace("/n/", "/{name}/")
            .replace("/o.txt", "/{path}")
            .replace("/i.txt", "/{name}")
            .replace("/stdout", "/{stream}"),
        )
        for m, p, _, _ in ROLE_CASES
    }
    assert served == cases


@pytest.mark.parametrize("case", ROLE_CASES, ids=lambda c: f"{c[0]} {c[1]}")
@pytest.mark.parametrize("role", [r.value for r in Role])
def test_node_role_matrix(env: Env, role: str, case: tuple[Any, ...]) -> None:
    method, path, allowed, body = case
    if role == "node":
        env.enrol("n")
        env.tokens["node"] = env.tokens["n"]
    elif role == "enroll":
        env.tokens["enroll"] = env.invite("n")
    r = env.client.request(method, path, json=body, headers=env.h(role))
    if role in allowed:
        assert r.status_code != 403, r.text
        assert r.status_code < 500
    else:
        assert r.status_code == 403, r.text
        assert f"has the role {role}" in r.json()["error"]


def test_the_sweeper_runs_in_the_apps_lifespan(env: Env) -> None:
    env.enrol("a")
    env.store.submit([gpu_job("j", 1)], now=env.clock.t)
    env.post("/v1/node/claim", "a", {"report": report(24)})
    install_sweeper(env.app)
    install_sweeper(env.app)  # once only
    env.clock.t += 40  # the lease and its grace (10 + 15 s) lapsed while no coordinator ran
    sweeper = env.app.state.gw_sweeper
    with TestClient(env.app):
        # the coordinator that starts gives the lease a full period: swept, not taken
        assert sweeper.started_at == env.clock.t
        deadline = time.monotonic() + 30
        while not sweeper.last.get("leader"):
            assert time.monotonic() < deadline, "the sweeper did not sweep"
            time.sleep(0.05)
        lease = env.store.lease_of("j")
        assert lease is not None and lease.expires_at == env.clock.t + 25
        env.clock.t += 26  # the full period and the grace have passed
        while env.store.lease_of("j") is not None:
            assert time.monotonic() < deadline, "the sweeper did not sweep"
            time.sleep(0.05)
    assert sweeper.leader


def test_explain_says_why_no_node_took_a_job(env: Env) -> None:
    env.clock.t = time.time()  # explain judges a node's heartbeat by the wall clock
    # submitted before any node enrolled: it is taken, and waits
    r = env.post("/v1/jobs", "owner", {"type": "testmods.gpu", "params": {}, "vram_gib": 20})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    env.enrol("small")
    env.post("/v1/node/heartbeat", "small", {"report": report(8)})
    r = env.client.get(f"/v1/jobs/{job_id}/explain", headers=env.h("owner"))
    lines = r.json()["lines"]
    assert any(ln.startswith("no node can ever run it") and "small:" in ln for ln in lines), lines


def test_a_job_no_enrolled_node_can_ever_run_is_refused(env: Env) -> None:
    big = {"type": "testmods.gpu", "params": {}, "vram_gib": 100}
    r = env.post("/v1/jobs", "submitter", {**big, "id": "early"})
    assert r.status_code == 201, r.text  # no node yet: it waits
    env.enrol("n1")
    env.post("/v1/node/heartbeat", "n1", {"report": report(80, labels={"rack": "a"})})
    r = env.post("/v1/jobs", "submitter", big)
    assert r.status_code == 422, r.text
    assert (
        "no node can ever run it: n1: needs 100.0 GiB on one GPU; its largest has 80.0 GiB"
        in (r.json()["error"])
    )
    pinned = {"type": "testmods.gpu", "params": {}, "vram_gib": 1}
    r = env.post("/v1/jobs", "submitter", {**pinned, "constraints": {"node": "n2"}})
    assert r.status_code == 422 and "n1: the job asks for node 'n2'" in r.json()["error"]
    r = env.post("/v1/jobs", "submitter", {**pinned, "constraints": {"labels": {"rack": "b"}}})
    assert r.status_code == 422 and "the job asks for label rack=b" in r.json()["error"]
    # one node that can is enough
    env.enrol("n2")
    env.post("/v1/node/heartbeat", "n2", {"report": report(24)})
    r = env.post("/v1/jobs", "submitter", {**pinned, "constraints": {"node": "n2"}})
    assert r.status_code == 201, r.text
    # a draining node still counts; a revoked one does not
    env.post("/v1/nodes/n1/drain", "owner")
    ok = {**pinned, "constraints": {"labels": {"rack": "a"}}}
    assert env.post("/v1/jobs", "submitter", ok).status_code == 201
    env.post("/v1/nodes/n2/revoke", "owner")
    r = env.post("/v1/jobs", "submitter", {**pinned, "constraints": {"node": "n2"}})
    assert r.status_code == 422 and "n1: the job asks for node 'n2'" in r.json()["error"]


def test_constraints_are_taken_checked_and_shown(env: Env) -> None:
    want = {"min_gpu_vram_gib": 16, "gpu_model": "sim", "labels": {"rack": "a"}, "node": "n1"}
    body = {"type": "testmods.gpu", "params": {}, "vram_gib": 1, "constraints": want}
    r = env.post("/v1/jobs", "submitter", body)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["constraints"] == want
    got = env.client.get(f"/v1/jobs/{job['id']}", headers=env.h("submitter")).json()
    assert got["constraints"] == want
    listed = env.client.get("/v1/jobs", headers=env.h("submitter")).json()
    assert listed[0]["constraints"] == want
    stored = env.store.get_job(job["id"])
    assert stored is not None and stored.constraints == want
    r = env.post("/v1/jobs", "submitter", {**body, "constraints": {"zone": "x"}})
    assert r.status_code == 422 and "unknown constraint 'zone'" in r.json()["error"]
    cpu = {"type": "testmods.sleep", "params": {"seconds": 0}}
    r = env.post("/v1/jobs", "submitter", {**cpu, "constraints": {"gpu_model": "A100"}})
    assert r.status_code == 422 and "runs on the cpu lane" in r.json()["error"]
    r = env.post("/v1/jobs", "submitter", {**cpu, "constraints": {"node": "n1"}})
    assert r.status_code == 201, r.text


def test_a_node_enrolled_but_not_yet_heard_is_judged_by_its_enrolment(env: Env) -> None:
    env.tokens["enroll-n1"] = env.invite("n1")
    gpu = {"uuid": "GPU-1", "name": "NVIDIA A100", "total_bytes": 40 * GIB}
    caps = {"gpus": [gpu], "labels": {"rack": "a"}}
    r = env.post("/v1/nodes/enroll", "enroll-n1", {"capabilities": caps})
    assert r.status_code == 201, r.text
    job = {"type": "testmods.gpu", "params": {}, "vram_gib": 30}
    assert env.post("/v1/jobs", "submitter", job).status_code == 201
    r = env.post("/v1/jobs", "submitter", {**job, "constraints": {"gpu_model": "H100"}})
    assert r.status_code == 422 and "a GPU model matching 'H100'" in r.json()["error"]
    ok = {**job, "constraints": {"gpu_model": "a100", "labels": {"rack": "a"}}}
    assert env.post("/v1/jobs", "submitter", ok).status_code == 201


# -- a coordinator: it runs nothing, the nodes' own rules decide -----------------------


class CoordinatorEnv(Env):
    """As ``gpuwarden coordinator`` makes it: a config with no launch rules (only the
    store), every type of its modules known, judged by the nodes."""

    def __init__(self, tmp: Path, **cluster: Any) -> None:
        from gpuwarden.core.launchrules import LaunchRules

        self.config = Config.model_validate(
            {
                "state_dir": tmp,
                "module_paths": [REPO / "tests" / "modules"],
                "api": {"rate_per_s": 10_000, "burst": 10_000},
                "cluster": {"lease_s": 10, "offline_after_s": 20, **cluster},
            }
        )
        self.store = SqliteStore(tmp / "gpuwarden.db")
        self.clock = Clock(time.time())
        self.registry = Registry.load(self.config.module_paths, LaunchRules.unchecked())
        self.app = create_app(self.store, self.registry, self.config, clock=self.clock)
        install_coordinator(self.app)
        self.client = TestClient(self.app)
        self.tokens = {}
        for role in (Role.OWNER, Role.OPERATOR, Role.SUBMITTER):
            _, self.tokens[role.value] = issue_token(
                self.store, name=role.value, role=role, by=ADMIN, now=1.0
            )


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[CoordinatorEnv]:
    e = CoordinatorEnv(tmp_path)
    yield e
    e.store.close()


def agent_report(gib: float, runtime: str, **allow: bool) -> dict[str, Any]:
    from gpuwarden.core.launchrules import LaunchRules, Runtime

    rules = LaunchRules(runtime=Runtime(runtime), **allow)
    reg = Registry.load([REPO / "tests" / "modules"], rules)
    return report(
        gib,
        types=sorted(t.name for t in reg.types.values() if rules.refusal(t) is None),
        modules=sorted(reg.types),
        launch_rules=rules.to_json(),
        heartbeat_every_s=1.0,
    )


def test_a_coordinator_without_launch_rules_takes_what_a_node_runs(coord: CoordinatorEnv) -> None:
    box = {"type": "testmods.gpu", "params": {}, "vram_gib": 1}  # a container type
    host = {"type": "echo.echo", "params": {"text": "x"}}
    coord.enrol("gpu-a")
    coord.post("/v1/node/heartbeat", "gpu-a", {"report": agent_report(24, "local")})
    r = coord.post("/v1/jobs", "submitter", box)
    assert r.status_code == 422, r.text
    assert r.json()["error"].endswith(
        "no node can ever run it: gpu-a: refuses container types (its runtime is local)"
    )
    assert coord.post("/v1/jobs", "submitter", host).status_code == 201
    types = {t["type"]: t for t in coord.client.get("/v1/types", headers=coord.h("owner")).json()}
    assert types["echo.echo"]["runs_here"] and not types["testmods.gpu"]["runs_here"]
    coord.enrol("gpu-b")
    coord.post("/v1/node/heartbeat", "gpu-b", {"report": agent_report(24, "bubblewrap")})
    r = coord.post("/v1/jobs", "submitter", box)
    assert r.status_code == 201, r.text
    box_id = r.json()["id"]
    types = {t["type"]: t for t in coord.client.get("/v1/types", headers=coord.h("owner")).json()}
    assert types["testmods.gpu"]["runs_here"]
    lines = coord.client.get(f"/v1/jobs/{box_id}/explain", headers=coord.h("owner"))
    assert "node gpu-a refuses container types (its runtime is local)" in lines.json()["lines"]
    got = coord.post("/v1/node/claim", "gpu-a", {"report": agent_report(24, "local"), "want": 4})
    assert len(got.json()["jobs"]) == 1 and box_id not in [j["id"] for j in got.json()["jobs"]]
    got = coord.post("/v1/node/claim", "gpu-b", {"report": agent_report(24, "bubblewrap")})
    assert [j["id"] for j in got.json()["jobs"]] == [box_id]


def test_resume_over_http_is_audited(coord: CoordinatorEnv) -> None:
    coord.enrol("n")
    assert coord.post("/v1/nodes/n/drain", "operator").json()["state"] == "draining"
    r = coord.post("/v1/nodes/n/resume", "operator")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "active" and r.json()["resumed"] is True
    again = coord.post("/v1/nodes/n/resume", "owner")
    assert again.status_code == 200 and again.json()["resumed"] is False
    assert coord.post("/v1/nodes/ghost/resume", "owner").status_code == 404
    assert coord.post("/v1/nodes/n/resume", "submitter").status_code == 403
    coord.post("/v1/nodes/n/revoke", "owner")
    gone = coord.post("/v1/nodes/n/resume", "owner")
    assert gone.status_code == 409 and "was revoked" in gone.json()["error"]
    rows = [(a.action, a.target, a.outcome) for a in coord.store.audit_rows()]
    resumes = [r for r in rows if r[0] == "node.resume"]
    assert ("node.resume", "n", "ok") in resumes
    assert any(r[2].startswith("refused") and "was revoked" in r[2] for r in resumes), resumes
    assert any(r[2].startswith("refused") and "operator" in r[2] for r in resumes), resumes


def test_the_invite_names_the_url_agents_use(tmp_path: Path) -> None:
    coord = CoordinatorEnv(tmp_path / "a")
    try:
        assert coord.post("/v1/nodes/invite", "owner", {"name": "x"}).json()[
            "coordinator_url"
        ] is None  # fmt: skip
    finally:
        coord.store.close()
    coord = CoordinatorEnv(tmp_path / "b", coordinator_url="http://gpu-coord.lan:8765")
    try:
        got = coord.post("/v1/nodes/invite", "owner", {"name": "x"}).json()
        assert got["coordinator_url"] == "http://gpu-coord.lan:8765"
    finally:
        coord.store.close()


def test_status_on_a_coordinator_lists_every_node_and_hides_others_jobs(
    coord: CoordinatorEnv,
) -> None:
    r = coord.client.get("/v1/status", headers=coord.h("owner"))
    assert r.status_code == 200 and r.json()["cluster"] == []
    coord.enrol("gpu-a")
    rep = agent_report(24, "bubblewrap")
    rep["gpus"][0].update(used_bytes=2 * GIB, ledger_bytes=2 * GIB, degraded="")
    coord.post("/v1/node/heartbeat", "gpu-a", {"report": rep})
    owner_job = coord.post("/v1/jobs", "owner", {"type": "testmods.gpu", "params": {}})
    job_id = owner_job.json()["id"]
    [leased] = coord.post("/v1/node/claim", "gpu-a", {"report": rep}).json()["jobs"]
    coord.post(f"/v1/node/jobs/{job_id}/start", "gpu-a", {"lease_id": leased["lease_id"]})
    [node] = coord.client.get("/v1/status", headers=coord.h("operator")).json()["cluster"]
    assert node["node"] == "gpu-a" and node["state"] == "active" and node["problem"] == ""
    assert node["gpus"][0]["used_bytes"] == 2 * GIB and node["gpus"][0]["ledger_bytes"] == 2 * GIB
    assert [r["job"] for r in node["running"]] == [job_id]
    [seen] = coord.client.get("/v1/status", headers=coord.h("submitter")).json()["cluster"]
    assert [r["job"] for r in seen["running"]] == [None]  # not the submitter's job
    # a broker's own API (not a coordinator) has no cluster list
    env = Env(coord.config.state_dir / "plain")
    try:
        assert "cluster" not in env.client.get("/v1/status", headers=env.h("owner")).json()
    finally:
        env.store.close()
