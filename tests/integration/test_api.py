"""The HTTP API on a SqliteStore: roles, isolation, idempotency, limits, audit."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import MATRIX, Principal, hash_secret, issue_token, parse_token
from gpuwarden.api.limits import BodyLimitMiddleware, RateLimiter
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.policy import GpuView
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.base import NodeStatus, Submission
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Api:
    tmp: Path
    config: Config
    store: SqliteStore
    client: TestClient
    clock: Clock
    tokens: dict[str, str] = field(default_factory=dict)  # name -> token
    _extra: list[SqliteStore] = field(default_factory=list)

    def h(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def id_of(self, name: str) -> str:
        parts = parse_token(self.tokens[name])
        assert parts is not None
        return parts[0]

    def token(self, name: str, role: Role, **kw: Any) -> str:
        _, token = issue_token(self.store, name=name, role=role, by=ADMIN, now=1.0, **kw)
        self.tokens[name] = token
        return token

    def reopen(self) -> None:
        """A new app on a new connection to the same database: a restart."""
        self.store.close()
        self.store = SqliteStore(self.tmp / "gpuwarden.db")
        self.client = make_client(self.store, self.config, self.clock)


def make_config(tmp: Path, **api: Any) -> Config:
    return Config.model_validate(
        {
            "state_dir": tmp,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "allow_unsandboxed_containers": True,
            "api": {"rate_per_s": 10_000, "burst": 10_000, **api},
        }
    )


def make_client(store: SqliteStore, config: Config, clock: Clock) -> TestClient:
    registry = Registry.load(config.module_paths, config.launch_rules)
    return TestClient(create_app(store, registry, config, monotonic=clock))


def build(tmp: Path, **api: Any) -> Api:
    config = make_config(tmp, **api)
    store = SqliteStore(tmp / "gpuwarden.db")
    clock = Clock()
    a = Api(
        tmp=tmp, config=config, store=store, client=make_client(store, config, clock), clock=clock
    )
    for role in Role:  # an enroll token is bound to a node (refused otherwise)
        a.token(role.value, role, **({"node": "n"} if role is Role.ENROLL else {}))
    a.token("submitter2", Role.SUBMITTER)
    return a


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


ECHO = {"type": "echo.echo", "params": {"text": "hi"}}


def submit(a: Api, who: str, **body: Any) -> dict[str, Any]:
    r = a.client.post("/v1/jobs", json={**ECHO, **body}, headers=a.h(who))
    assert r.status_code == 201, r.text
    job: dict[str, Any] = r.json()
    return job


def done_job(a: Api, owner: str, job_id: str) -> None:
    """A job of ``owner`` that ended done with one output, out.txt."""
    a.store.submit(
        [JobSpec(id=job_id, type="echo.echo", params={"text": "x"})],
        now=1.0,
        origin=Submission(owner=a.id_of(owner)),
    )
    out = a.tmp / "jobs" / job_id / "attempt-1" / "out"
    out.mkdir(parents=True)
    (out / "out.txt").write_text("the output")
    a.store.start_attempt(job_id, node="n", gpu_uuid=None, now=2.0)
    a.store.finish_attempt(
        job_id,
        1,
        target=JobState.DONE,
        now=3.0,
        outcome="succeeded",
        reason="done",
        exit_code=0,
        result={"outputs": ["out.txt"], "output_dir": str(out), "message": "ok"},
    )


# -- the role matrix --------------------------------------------------------------

R, SUB, OP = "owner", "submitter", "operator"
READERS = {R, OP, SUB}


@dataclass(frozen=True)
class Case:
    method: str
    path: str  # {job} is a job of the caller's own, {token} a token to revoke
    allowed: frozenset[str]
    ok: int
    body: dict[str, Any] | None = None

    @property
    def template(self) -> str:
        return (
            self.path.replace("{job}", "{job_id}")
            .replace("{lease}", "{lease_id}")
            .replace("{token}", "{token_id}")
            .replace("out.txt", "{path}")
            .replace("logs/stdout", "logs/{stream}")
            .replace("GPU-sim-0000-12345678", "{gpu_uuid}")
            .partition("?")[0]
        )


CASES = [
    Case("POST", "/v1/jobs", frozenset(READERS), 201, ECHO),
    Case("GET", "/v1/jobs", frozenset(READERS), 200),
    Case("GET", "/v1/jobs/{job}", frozenset(READERS), 200),
    Case("POST", "/v1/jobs/{job}/cancel", frozenset(READERS), 200),
    # a queued job: past the role check, stop says there is nothing to stop
    Case("POST", "/v1/jobs/{job}/stop", frozenset(READERS), 409),
    # job control (tests/integration/test_api_jobcontrol.py): a queued job is held,
    # one not held has nothing to release (past the role check), a done job is
    # requeued, and a lower priority is every reader's to set on its own job
    Case("POST", "/v1/jobs/{job}/hold", frozenset(READERS), 200),
    Case("POST", "/v1/jobs/{job}/release", frozenset(READERS), 409),
    Case("POST", "/v1/jobs/{job}/requeue", frozenset(READERS), 200),
    Case("POST", "/v1/jobs/{job}/priority", frozenset(READERS), 200, {"priority": -1}),
    Case("GET", "/v1/jobs/{job}/explain", frozenset(READERS), 200),
    Case("GET", "/v1/jobs/{job}/result", frozenset(READERS), 200),
    Case("GET", "/v1/jobs/{job}/outputs/out.txt", frozenset(READERS), 200),
    Case("GET", "/v1/jobs/{job}/logs/stdout", frozenset(READERS), 200),
    # VRAM leases (tests/integration/test_api_leases.py): a queued lease of the
    # caller's is read, not renewed nor given pids (409: not granted yet), ended
    Case("POST", "/v1/leases", frozenset(READERS), 201, {"vram_bytes": 1 << 30}),
    Case("GET", "/v1/leases", frozenset(READERS), 200),
    Case("GET", "/v1/leases/{lease}", frozenset(READERS), 200),
    Case("POST", "/v1/leases/{lease}/renew", frozenset(READERS), 409),
    Case("POST", "/v1/leases/{lease}/pids", frozenset(READERS), 409, {"pids": [1]}),
    Case("DELETE", "/v1/leases/{lease}", frozenset(READERS), 200),
    Case("GET", "/v1/status", frozenset(READERS), 200),
    Case("GET", "/v1/types", frozenset(READERS), 200),
    Case("GET", "/v1/preview?type=echo.echo", frozenset(READERS), 200),
    Case("GET", "/v1/share", frozenset(READERS), 200),
    Case("GET", "/v1/health", frozenset(r.value for r in Role), 200),
    Case("POST", "/v1/tokens", frozenset({R}), 201, {"name": "new", "role": "submitter"}),
    Case("GET", "/v1/tokens", frozenset({R}), 200),
    Case("DELETE", "/v1/tokens/{token}", frozenset({R}), 200),
    Case("GET", "/v1/audit", frozenset({R, OP}), 200),
    Case(
        "POST", "/v1/gpus/GPU-sim-0000-12345678/clear", frozenset({R}), 202, {"reason": "reseated"}
    ),
    Case("GET", "/v1/events?follow=false", frozenset(READERS), 200),
    # the dashboard's (POST /v1/session takes a token in its body, not a header: its
    # own tests are in tests/integration/test_dashboard_api.py)
    Case("GET", "/v1/session", frozenset(READERS), 200),
    Case("DELETE", "/v1/session", frozenset(READERS), 200),
    Case("GET", "/v1/dashboard/overview", frozenset(READERS), 200),
    Case("GET", "/v1/dashboard/history", frozenset(READERS), 200),
    Case("GET", "/v1/dashboard/stats", frozenset(READERS), 200),
]


def test_the_cases_cover_every_endpoint(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    served = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    # the node endpoints have their own matrix test (tests/integration/test_nodes_api.py)
    served = {(m, p) for m, p in served if not p.startswith(("/v1/node/", "/v1/nodes"))}
    served.discard(("POST", "/v1/session"))  # a public sign-in: test_dashboard_api.py
    assert served == {(c.method, c.template) for c in CASES}


def _url(a: Api, role: str, case: Case) -> str:
    path = case.path
    if "{job}" in path:
        job_id = f"own-{role}"
        if any(w in path for w in ("cancel", "stop", "hold", "release", "priority")):
            a.store.submit(
                [JobSpec(id=job_id, type="echo.echo", params={"text": "x"})],
                now=1.0,
                origin=Submission(owner=a.id_of(role)),
            )
        else:
            done_job(a, role, job_id)
        path = path.replace("{job}", job_id)
    if "{lease}" in path:
        lease_id = f"lease-of-{role}"
        a.store.submit(
            [JobSpec(id=lease_id, type="lease", vram_bytes=1 << 30)],
            now=1.0,
            origin=Submission(owner=a.id_of(role)),
        )
        path = path.replace("{lease}", lease_id)
    if "{token}" in path:
        victim = a.token("victim", Role.SUBMITTER)
        path = path.replace("{token}", parse_token(victim)[0])  # type: ignore[index]
    return path


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.method} {c.path}")
@pytest.mark.parametrize("role", [r.value for r in Role])
def test_role_matrix(api: Api, role: str, case: Case) -> None:
    url = _url(api, role, case)
    r = api.client.request(case.method, url, json=case.body, headers=api.h(role))
    if role in case.allowed:
        assert r.status_code == case.ok, r.text
    else:
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert f"has the role {role}" in error and "needs the role" in error


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.method} {c.path}")
def test_no_token_is_401_except_health(api: Api, case: Case) -> None:
    url = _url(api, "owner", case)
    r = api.client.request(case.method, url, json=case.body)
    if case.path == "/v1/health":
        assert r.status_code == 200
        return
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert "no token" in r.json()["error"]


def test_matrix_table_matches_the_tested_one() -> None:
    actions = {
        "job.submit": READERS,
        "job.list": READERS,
        "job.read": READERS,
        "job.cancel": READERS,
        "job.stop": READERS,
        "job.hold": READERS,
        "job.release": READERS,
        "job.requeue": READERS,
        "job.priority": READERS,  # a submitter may only lower (test_api_jobcontrol.py)
        # VRAM leases (tests/integration/test_api_leases.py)
        "lease.create": READERS,
        "lease.list": READERS,
        "lease.read": READERS,
        "lease.renew": READERS,
        "lease.end": READERS,
        "lease.pids": READERS,
        "types.read": READERS,
        "job.preview": READERS,  # what would become of one more job (test_preview.py)
        "status.read": READERS,
        "share.read": READERS,  # a submitter sees its own row (test_fair_share.py)
        "audit.read": {R, OP},
        "token.create": {R},
        "token.list": {R},
        "token.revoke": {R},
        # the node endpoints (tests/integration/test_nodes_api.py)
        "node.invite": {R},
        "node.enroll": {"enroll"},
        "node.heartbeat": {"node"},
        "node.claim": {"node"},
        "node.start": {"node"},
        "node.finish": {"node"},
        "node.report": {"node"},
        "node.upload": {"node"},
        "node.fetch": {"node"},
        "node.logs": {"node"},
        "node.list": {R, OP},
        "node.drain": {R, OP},
        "node.resume": {R, OP},
        "node.revoke": {R},
        "node.diagnostic": {R},
        "gpu.clear": {R},
        # GET /metrics (tests/integration/test_metrics.py)
        "metrics.read": {R, OP},
        "events.read": READERS,
        # the dashboard (tests/integration/test_dashboard_api.py)
        "session.read": READERS,
        "session.delete": READERS,
        "dashboard.read": READERS,
        # /run/<name>/ (tests/integration/test_service_proxy.py)
        "service.use": READERS,
    }
    order = [r.value for r in Role]
    got = {a: {order[i] for i, s in enumerate(row) if s is not None} for a, row in MATRIX.items()}
    assert got == actions


# -- tokens ------------------------------------------------------------------------


def test_tokens_are_stored_hashed_and_shown_once(api: Api) -> None:
    r = api.client.post(
        "/v1/tokens", json={"name": "ci bot", "role": "submitter"}, headers=api.h("owner")
    )
    assert r.status_code == 201
    made = r.json()
    token = made["token"]
    token_id, secret = parse_token(token)  # type: ignore[misc]
    assert made["id"] == token_id and made["role"] == "submitter" and made["active"]
    record = api.store.get_token(token_id)
    assert record is not None and record.secret_hash == hash_secret(secret)
    assert secret not in json.dumps(api.client.get("/v1/tokens", headers=api.h("owner")).json())
    # the new token works
    assert (
        api.client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    )


@pytest.mark.parametrize(
    "header",
    [
        "Bearer gw_000000000000_" + "A" * 43,  # unknown id
        "Basic dXNlcjpwYXNz",
        "Bearer nonsense",
        "Bearer ",
    ],
)
def test_bad_tokens_are_401(api: Api, header: str) -> None:
    r = api.client.get("/v1/jobs", headers={"Authorization": header})
    assert r.status_code == 401 and r.json()["error"]
    assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_wrong_secret_is_401(api: Api) -> None:
    token_id = api.id_of("owner")
    r = api.client.get("/v1/jobs", headers={"Authorization": f"Bearer gw_{token_id}_{'B' * 43}"})
    assert r.status_code == 401 and "not valid" in r.json()["error"]


def test_revoked_token_is_401(api: Api) -> None:
    victim = api.id_of("submitter")
    assert api.client.get("/v1/jobs", headers=api.h("submitter")).status_code == 200
    r = api.client.delete(f"/v1/tokens/{victim}", headers=api.h("owner"))
    assert r.status_code == 200 and r.json()["revoked_at"] is not None and not r.json()["active"]
    r = api.client.get("/v1/jobs", headers=api.h("submitter"))
    assert r.status_code == 401 and "revoked" in r.json()["error"]
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    again = api.client.delete(f"/v1/tokens/{victim}", headers=api.h("owner"))
    assert again.status_code == 409 and "already" in again.json()["error"]
    assert api.client.delete("/v1/tokens/ffffffffffff", headers=api.h("owner")).status_code == 404


def test_expired_token_is_401(api: Api) -> None:
    api.token("short", Role.SUBMITTER, expires_at=2.0)  # the app's clock is the real time
    r = api.client.get("/v1/jobs", headers=api.h("short"))
    assert r.status_code == 401 and "expired" in r.json()["error"]


# -- jobs --------------------------------------------------------------------------


def test_submit_validates_like_a_bundle(api: Api) -> None:
    h = api.h("submitter")
    r = api.client.post("/v1/jobs", json={"type": "echo.nope"}, headers=h)
    assert r.status_code == 422 and "unknown job type 'echo.nope'" in r.json()["error"]
    r = api.client.post("/v1/jobs", json={"type": "echo.echo", "params": {"txt": 1}}, headers=h)
    assert r.status_code == 422 and "unknown parameter 'txt'" in r.json()["error"]
    r = api.client.post("/v1/jobs", json={**ECHO, "id": "../x"}, headers=h)
    assert r.status_code == 422 and "is not valid" in r.json()["error"]
    r = api.client.post("/v1/jobs", json={**ECHO, "vram_gib": 1}, headers=h)
    assert r.status_code == 422 and "cpu lane" in r.json()["error"]
    r = api.client.post("/v1/jobs", json={**ECHO, "priority": 2**63}, headers=h)
    assert r.status_code == 422 and "priority" in r.json()["error"]
    r = api.client.post(
        "/v1/jobs", json={"type": "testmods.cat", "params": {"file": "a"}}, headers=h
    )
    assert r.status_code == 422 and "file inputs are not accepted over HTTP" in r.json()["error"]
    job = submit(api, "submitter", id="mine-1", priority=3, outputs=["echo.txt"])
    # a submitter's ids are its own: they begin with its token's id
    assert job["id"] == f"{api.id_of('submitter')}-mine-1"
    assert job["state"] == "queued" and job["priority"] == 3
    assert job["owner"] == api.id_of("submitter") and job["params"]["output"] == "echo.txt"
    dup = api.client.post("/v1/jobs", json={**ECHO, "id": "mine-1"}, headers=h)
    assert dup.status_code == 409 and "already accepted" in dup.json()["error"]


def test_a_type_no_node_can_run_is_refused(tmp_path: Path) -> None:
    a = build(tmp_path)
    try:
        r = a.client.post(
            "/v1/jobs", json={"type": "echo.serve", "params": {"text": "x"}}, headers=a.h("owner")
        )
        assert r.status_code == 201  # allow_unsandboxed_containers is set here
        a.store.put_node_status(
            NodeStatus(
                node="n1",
                pid=1,
                updated_at=time.time(),
                payload={"gpus": [GpuView(uuid="GPU-1", total_bytes=24 * GIB).to_json()]},
            )
        )
        r = a.client.post(
            "/v1/jobs",
            json={"type": "burn.llm", "vram_gib": 100, "params": {}},
            headers=a.h("owner"),
        )
        assert r.status_code == 422 and "can never run" in r.json()["error"], r.text
    finally:
        a.store.close()
    # a node whose launch rules refuse the type: 422 saying what to change
    b = build(tmp_path / "strict")
    b.config = b.config.model_copy(update={"allow_unsandboxed_containers": False})
    b.client = make_client(b.store, b.config, b.clock)
    try:
        r = b.client.post(
            "/v1/jobs", json={"type": "echo.serve", "params": {"text": "x"}}, headers=b.h("owner")
        )
        assert r.status_code == 422 and "launch rules" in r.json()["error"]
    finally:
        b.store.close()


def test_submitters_see_only_their_own_jobs(api: Api) -> None:
    done_job(api, "submitter", "theirs")
    mine = submit(api, "submitter2")
    for url in (
        "/v1/jobs/theirs",
        "/v1/jobs/theirs/explain",
        "/v1/jobs/theirs/result",
        "/v1/jobs/theirs/outputs/out.txt",
    ):
        r = api.client.get(url, headers=api.h("submitter2"))
        assert r.status_code == 404, url
        assert r.json()["error"] == "no job with id 'theirs' (GET /v1/jobs lists yours)"
    r = api.client.post("/v1/jobs/theirs/cancel", headers=api.h("submitter2"))
    assert r.status_code == 404
    ids = [j["id"] for j in api.client.get("/v1/jobs", headers=api.h("submitter2")).json()]
    assert ids == [mine["id"]]
    # operators and owners see every job
    for who in ("operator", "owner"):
        ids = {j["id"] for j in api.client.get("/v1/jobs", headers=api.h(who)).json()}
        assert ids == {"theirs", mine["id"]}
        assert api.client.get("/v1/jobs/theirs", headers=api.h(who)).status_code == 200
    # the owner of the job sees it; an unknown id looks the same as another's
    assert api.client.get("/v1/jobs/theirs", headers=api.h("submitter")).status_code == 200
    assert api.client.get("/v1/jobs/nope", headers=api.h("owner")).status_code == 404


def test_list_filters_and_limit(api: Api) -> None:
    a1 = submit(api, "submitter")
    submit(api, "submitter")
    api.client.post(f"/v1/jobs/{a1['id']}/cancel", headers=api.h("submitter"))
    h = api.h("submitter")
    got = api.client.get("/v1/jobs", params={"state": "cancelled"}, headers=h).json()
    assert [j["id"] for j in got] == [a1["id"]]
    both = api.client.get(
        "/v1/jobs", params=[("state", "cancelled"), ("state", "queued")], headers=h
    )
    assert len(both.json()) == 2
    assert len(api.client.get("/v1/jobs", params={"limit": 1}, headers=h).json()) == 1
    bad = api.client.get("/v1/jobs", params={"state": "sleeping"}, headers=h)
    assert bad.status_code == 422 and "query.state" in bad.json()["error"]
    assert api.client.get("/v1/jobs", params={"limit": 0}, headers=h).status_code == 422


def test_get_cancel_explain_result_outputs(api: Api) -> None:
    job = submit(api, "submitter")
    h = api.h("submitter")
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=h).json()
    assert got["attempts_detail"] == [] and got["events"][0]["event"] == "submitted"
    lines = api.client.get(f"/v1/jobs/{job['id']}/explain", headers=h).json()["lines"]
    assert lines[0] == f"{job['id']} (echo.echo) is queued" and "no broker is running" in lines[-1]
    r = api.client.get(f"/v1/jobs/{job['id']}/result", headers=h)
    assert r.status_code == 409 and "is queued" in r.json()["error"]
    r = api.client.get(f"/v1/jobs/{job['id']}/outputs/echo.txt", headers=h)
    assert r.status_code == 409 and "done jobs only" in r.json()["error"]
    c = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=h)
    assert c.status_code == 200 and c.json()["state"] == "cancelled"
    again = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=h)
    assert again.status_code == 409 and "already ended" in again.json()["error"]
    done_job(api, "submitter", "finished")
    result = api.client.get("/v1/jobs/finished/result", headers=h).json()
    assert result["status"] == "done" and result["outputs"] == ["out.txt"]
    assert "output_dir" not in result  # no host paths
    f = api.client.get("/v1/jobs/finished/outputs/out.txt", headers=h)
    assert f.status_code == 200 and f.content == b"the output"
    assert f.headers["content-type"] == "application/octet-stream"


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("..%2F..%2F..%2Fetc%2Fpasswd", 422),
        ("%2Fetc%2Fpasswd", 422),
        ("a%5Cb", 422),
        ("missing.txt", 404),
        ("link.txt", 404),
    ],
)
def test_outputs_refuse_traversal_and_links(api: Api, path: str, status: int) -> None:
    done_job(api, "owner", "j")
    job = api.store.get_job("j")
    assert job is not None
    out = Path(job.result["output_dir"])
    (out / "link.txt").symlink_to("/etc/passwd")
    # even listed as an output, a link is not followed
    api.store._db.execute(
        "UPDATE jobs SET result = ? WHERE id = 'j'",
        (json.dumps({**job.result, "outputs": ["out.txt", "link.txt"]}),),
    )
    r = api.client.get(f"/v1/jobs/j/outputs/{path}", headers=api.h("owner"))
    assert r.status_code == status, r.text
    assert "root:" not in r.text


def test_status_and_types(api: Api) -> None:
    api.store.put_node_status(
        NodeStatus(node="n1", pid=7, updated_at=5.0, payload={"probe": "sim"})
    )
    submit(api, "submitter")
    s = api.client.get("/v1/status", headers=api.h("submitter")).json()
    assert s["nodes"] == [{"node": "n1", "pid": 7, "updated_at": 5.0, "probe": "sim"}]
    assert s["jobs"] == {"queued": 1}
    types = {t["type"]: t for t in api.client.get("/v1/types", headers=api.h("submitter")).json()}
    echo = types["echo.echo"]
    assert echo["runs_here"] and {p["name"] for p in echo["params"]} >= {"text", "output"}


# -- idempotency -------------------------------------------------------------------


def test_idempotency_key_returns_the_same_job(api: Api) -> None:
    h = {**api.h("submitter"), "Idempotency-Key": "k-1"}
    first = api.client.post("/v1/jobs", json=ECHO, headers=h)
    assert first.status_code == 201
    again = api.client.post("/v1/jobs", json=ECHO, headers=h)
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert len(api.client.get("/v1/jobs", headers=api.h("submitter")).json()) == 1
    other = api.client.post("/v1/jobs", json={**ECHO, "priority": 5}, headers=h)
    assert (
        other.status_code == 422 and "already used for a different request" in other.json()["error"]
    )
    # the key belongs to the token: another token's same key is a new job
    h2 = {**api.h("submitter2"), "Idempotency-Key": "k-1"}
    assert api.client.post("/v1/jobs", json=ECHO, headers=h2).json()["id"] != first.json()["id"]
    # it survives a restart: it is in the store
    api.reopen()
    after = api.client.post("/v1/jobs", json=ECHO, headers=h)
    assert after.status_code == 200 and after.json()["id"] == first.json()["id"]
    bad = api.client.post(
        "/v1/jobs", json=ECHO, headers={**api.h("submitter"), "Idempotency-Key": " "}
    )
    assert bad.status_code == 422 and "Idempotency-Key" in bad.json()["error"]


# -- malformed requests --------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "says"),
    [
        (b'{"type": "echo.echo",', "application/json", "not valid JSON"),
        (b"[1, 2]", "application/json", "must be a JSON object"),
        (b"", "application/json", "needs a JSON body"),
        (b'{"type": "echo.echo", "colour": "red"}', "application/json", "unknown field 'colour'"),
        (b'{"type": "echo.echo", "params": {"text": NaN}}', "application/json", "finite"),
        (b'{"type": "echo.echo", "priority": "high"}', "application/json", "body.priority"),
        (b'{"type": "echo.echo", "priority": 1.5}', "application/json", "body.priority"),
        (b'{"type": "echo.echo", "params": []}', "application/json", "body.params"),
        (b'{"type": "echo.\\ud800"}', "application/json", "body.type"),
        (b'{"type": "echo.echo", "params": {"text": "\\udfff"}}', "application/json", "Unicode"),
        (b"type=echo.echo", "application/x-www-form-urlencoded", "JSON object"),
        (b"\x8e\x8ek", "application/json", "UTF-8"),
    ],
)
def test_malformed_bodies_are_422(api: Api, body: bytes, content_type: str, says: str) -> None:
    r = api.client.post(
        "/v1/jobs", content=body, headers={**api.h("submitter"), "Content-Type": content_type}
    )
    assert r.status_code == 422, r.text
    assert says in r.json()["error"], r.json()


def test_unknown_field_names_the_allowed_ones(api: Api) -> None:
    r = api.client.post("/v1/jobs", json={**ECHO, "inputs": ["a"]}, headers=api.h("owner"))
    assert r.status_code == 422
    assert r.json()["error"] == (
        "unknown field 'inputs' in body "
        "(allowed: after, command, constraints, env, est_s, gpus, id, name, outputs, params, "
        "preempt, priority, ram_floor_gib, ram_gib, ram_start_min_gib, service, share, "
        "share_gpu, source, timeout_s, type, vram_gib)"
    )
    r = api.client.post("/v1/tokens", json={"name": "x", "role": "king"}, headers=api.h("owner"))
    assert r.status_code == 422 and "body.role" in r.json()["error"]


def test_unknown_endpoint_and_method(api: Api) -> None:
    r = api.client.get("/v1/nothing", headers=api.h("owner"))
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]
    r = api.client.put("/v1/jobs", headers=api.h("owner"))
    assert r.status_code == 405 and "not allowed" in r.json()["error"]


# -- limits --------------------------------------------------------------------------


def test_body_over_the_limit_is_413(tmp_path: Path) -> None:
    a = build(tmp_path, max_body_mib=1 / 1024)  # 1 KiB
    try:
        big = {"type": "echo.echo", "params": {"text": "x" * 2000}}
        r = a.client.post("/v1/jobs", json=big, headers=a.h("submitter"))
        assert r.status_code == 413 and "larger than the API accepts" in r.json()["error"]

        def chunks() -> Iterator[bytes]:
            yield b'{"type": "echo.echo", "params": {"text": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}}'

        r = a.client.post(
            "/v1/jobs",
            content=chunks(),
            headers={**a.h("submitter"), "Content-Type": "application/json"},
        )
        assert r.status_code == 413, r.text
        small = a.client.post("/v1/jobs", json=ECHO, headers=a.h("submitter"))
        assert small.status_code == 201
        rows = [r for r in a.store.audit_rows() if r.action == "job.submit"]
        assert [r.outcome[:9] for r in rows] == ["refused: ", "refused: ", "ok"]
        assert "larger than the API accepts" in rows[0].outcome
    finally:
        a.store.close()


def _asgi_run(
    mw: BodyLimitMiddleware, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[list[dict[str, Any]], int]:
    import anyio

    sent: list[dict[str, Any]] = []
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received <= len(chunks):
            return {
                "type": "http.request",
                "body": chunks[received - 1],
                "more_body": received < len(chunks),
            }
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    anyio.run(mw, scope, receive, send)
    return sent, received


def test_body_limit_reads_no_more_than_it_allows() -> None:
    """Plain ASGI: a declared length over the limit reads nothing; a chunked body is
    cut off at the first chunk past the limit, and the app's own answer is dropped."""
    read: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        total = 0
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                break
            total += len(m["body"])
            if not m.get("more_body"):
                break
        read.append(total)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    mw = BodyLimitMiddleware(app, max_bytes=4096)
    sent, received = _asgi_run(mw, [(b"content-length", b"100000")], [b"x" * 1024] * 100)
    assert received == 0 and read == []
    assert sent[0]["status"] == 413 and b"larger" in sent[1]["body"]
    sent, received = _asgi_run(mw, [], [b"x" * 1024] * 100)
    assert received == 5  # 5 KiB read, then refused: not 100 KiB
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [413]
    assert all(m.get("body") != b"app" for m in sent)
    sent, received = _asgi_run(mw, [], [b"x" * 1024] * 4)
    assert sent[0]["status"] == 200 and read[-1] == 4096


def test_rate_limit_is_per_token(tmp_path: Path) -> None:
    a = build(tmp_path, rate_per_s=1, burst=3)
    try:
        for _ in range(3):
            assert a.client.get("/v1/jobs", headers=a.h("submitter")).status_code == 200
        r = a.client.get("/v1/jobs", headers=a.h("submitter"))
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert "too many requests" in r.json()["error"]
        post = a.client.post("/v1/jobs", json=ECHO, headers=a.h("submitter"))
        assert post.status_code == 429
        # another token is not affected
        assert a.client.get("/v1/jobs", headers=a.h("submitter2")).status_code == 200
        a.clock.t += 1.0  # one request's worth comes back per second
        assert a.client.get("/v1/jobs", headers=a.h("submitter")).status_code == 200
        assert a.client.get("/v1/jobs", headers=a.h("submitter")).status_code == 429
        [row] = [r for r in a.store.audit_rows() if r.action == "job.submit"]
        assert row.outcome.startswith("refused: too many requests")
        assert row.actor == a.id_of("submitter")
    finally:
        a.store.close()


def test_rate_limiter_token_bucket() -> None:
    clock = Clock(0.0)
    rl = RateLimiter(2.0, 4, clock=clock)
    assert [rl.take("a") for _ in range(4)] == [0.0] * 4
    assert rl.take("a") == pytest.approx(0.5)
    assert rl.take("b") == 0.0
    clock.t = 10.0  # refills up to the burst, not beyond
    assert [rl.take("a") for _ in range(5)][-1] > 0


# -- audit -------------------------------------------------------------------------


def test_mutating_calls_write_audit_rows(api: Api) -> None:
    before = len(api.store.audit_rows())
    job = submit(api, "submitter", id="a1")
    api.client.post("/v1/jobs/a1/cancel", headers=api.h("submitter"))
    api.client.post("/v1/jobs", json={"type": "no.such"}, headers=api.h("submitter"))
    api.client.post(
        "/v1/tokens", json={"name": "n", "role": "operator"}, headers=api.h("submitter")
    )
    made = api.client.post(
        "/v1/tokens", json={"name": "n", "role": "operator"}, headers=api.h("owner")
    )
    api.client.delete(f"/v1/tokens/{made.json()['id']}", headers=api.h("owner"))
    api.client.post("/v1/jobs/a1/cancel")  # no token
    # reads write nothing
    api.client.get("/v1/jobs", headers=api.h("submitter"))
    api.client.get(f"/v1/jobs/{job['id']}", headers=api.h("submitter"))
    rows = api.store.audit_rows()[before:]
    got = [(r.action, r.actor_name, r.target, r.outcome.split(":")[0]) for r in rows]
    assert job["id"] == f"{api.id_of('submitter')}-a1"
    assert got == [
        ("job.submit", "submitter", job["id"], "ok"),
        ("job.cancel", "submitter", job["id"], "ok"),
        ("job.submit", "submitter", "", "refused"),
        ("token.create", "submitter", "", "refused"),
        ("token.create", "owner", made.json()["id"], "ok"),
        ("token.revoke", "owner", made.json()["id"], "ok"),
        ("job.cancel", "(not authenticated)", "a1", "refused"),
    ]
    assert "unknown job type" in rows[2].outcome
    assert "needs the role owner" in rows[3].outcome
    assert rows[0].role == "submitter" and rows[0].detail["type"] == "echo.echo"
    listed = api.client.get("/v1/audit", params={"after_id": rows[0].id}, headers=api.h("operator"))
    assert [r["action"] for r in listed.json()][:2] == ["job.cancel", "job.submit"]


def test_error_bodies_are_one_json_object(api: Api) -> None:
    checks: list[Callable[[], Any]] = [
        lambda: api.client.get("/v1/jobs"),
        lambda: api.client.get("/v1/tokens", headers=api.h("submitter")),
        lambda: api.client.get("/v1/jobs/x", headers=api.h("owner")),
        lambda: api.client.post("/v1/jobs", content=b"{", headers=api.h("owner")),
    ]
    for call in checks:
        r = call()
        assert r.headers["content-type"] == "application/json"
        body = r.json()
        assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]


def test_only_an_owner_clears_a_gpu_fault_and_the_request_reaches_the_broker(api: Api) -> None:
    gpu = "GPU-sim-0000-12345678"
    why = {"reason": "reseated the card"}
    for who in ("operator", "submitter"):
        r = api.client.post(f"/v1/gpus/{gpu}/clear", json=why, headers=api.h(who))
        assert r.status_code == 403 and "owner" in r.json()["error"]
    assert api.store.take_gpu_clears(now=api.clock()) == []
    # a reason is required: no body, none, or a blank one is refused (422), nothing asked
    r = api.client.post(f"/v1/gpus/{gpu}/clear", headers=api.h("owner"))
    assert r.status_code == 422 and "JSON body" in r.json()["error"]
    for body in ({}, {"reason": "   "}):
        r = api.client.post(f"/v1/gpus/{gpu}/clear", json=body, headers=api.h("owner"))
        assert r.status_code == 422 and "reason" in r.json()["error"], r.text
    assert api.store.take_gpu_clears(now=api.clock()) == []
    r = api.client.post(f"/v1/gpus/{gpu}/clear", json=why, headers=api.h("owner"))
    assert r.status_code == 202 and r.json()["gpu"] == gpu and r.json()["requested"] is True
    # what the broker that owns the GPU takes on its next pass: who asked, and why
    (taken,) = api.store.take_gpu_clears(now=api.clock())
    assert taken.gpu_uuid == gpu and taken.reason == "reseated the card"
    assert taken.by == f"token:{api.id_of('owner')} (owner)"
    bad = api.client.post("/v1/gpus/not-a-gpu/clear", json=why, headers=api.h("owner"))
    assert bad.status_code == 422 and "GPU UUID" in bad.json()["error"]
    rows = [r for r in api.store.audit_rows() if r.action == "gpu.clear"]
    assert [r.outcome.split(":")[0] for r in rows] == ["refused"] * 5 + ["ok", "refused"]
    assert rows[5].detail["reason"] == "reseated the card"
