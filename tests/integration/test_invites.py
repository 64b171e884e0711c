"""Invites and the names of live nodes (SPEC.md section 16, "Enrolment"; issue 30,
item 4): a second invite for a name revokes the first; an enrolment never takes
the name of a node that is enrolled and not revoked unless its invite was made
with ``replace`` (audited); an enroll token bound to no node is refused when it is
made. Every store backend.

Each attack is planted first (the stale invite, an enroll token for a live node)
and shown to have been usable before the fix's refusal is asserted, with the live
node's agent still served and the next legitimate request working."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_invite, issue_token
from gpuwarden.cli import main
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore, NodeState
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Coord:
    """A coordinator's API over ``store`` with an owner's token, and helpers."""

    def __init__(self, tmp: Path, store: Store) -> None:
        assert isinstance(store, ClusterStore)
        self.store: ClusterStore = store
        config = Config.model_validate(
            {
                "state_dir": tmp,
                "module_paths": [
                    REPO / "src" / "gpuwarden" / "modules",
                    REPO / "tests" / "modules",
                ],
                "allow_unsandboxed_containers": True,
                "api": {"rate_per_s": 10_000, "burst": 10_000},
                "cluster": {"lease_s": 10, "offline_after_s": 20},
            }
        )
        self.clock = Clock(time.time())
        registry = Registry.load(config.module_paths, config.launch_rules)
        self.client = TestClient(create_app(store, registry, config, clock=self.clock))
        _, owner = issue_token(store, name="owner", role=Role.OWNER, by=ADMIN, now=1.0)
        self.tokens = {"owner": owner}

    def post(self, path: str, who: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {self.tokens[who]}"}
        return self.client.post(path, json=body if body is not None else {}, headers=headers)

    def invite(self, name: str, *, replace: bool = False) -> dict[str, Any]:
        r = self.post("/v1/nodes/invite", "owner", {"name": name, "replace": replace})
        assert r.status_code == 201, r.text
        got: dict[str, Any] = r.json()
        return got

    def enrol(self, invite: str, host: str) -> Any:
        self.tokens[f"invite-{host}"] = invite
        r = self.post("/v1/nodes/enroll", f"invite-{host}", {"capabilities": {"host": host}})
        if r.status_code == 201:
            self.tokens[host] = r.json()["token"]
        return r

    def beat(self, host: str, jobs: list[str]) -> Any:
        return self.post("/v1/node/heartbeat", host, {"report": report(), "jobs": jobs})

    def run_a_job(self, host: str, job_id: str) -> str:
        """A job leased to ``host`` and started there, as its agent reports; its lease id."""
        self.store.submit(
            [
                JobSpec(
                    id=job_id,
                    type="testmods.gpu",
                    params={"gib": 1, "seconds": 60, "leak": False},
                    vram_bytes=GIB,
                )
            ],
            now=self.clock.t,
        )
        r = self.post("/v1/node/claim", host, {"report": report(), "want": 1})
        assert r.status_code == 200, r.text
        [job] = r.json()["jobs"]
        lease: str = job["lease_id"]
        r = self.post(f"/v1/node/jobs/{job_id}/start", host, {"lease_id": lease})
        assert r.status_code == 200, r.text
        return lease

    def audits(self, action: str) -> list[Any]:
        return [a for a in self.store.audit_rows() if a.action == action]


def report() -> dict[str, Any]:
    total = 24 * GIB
    return {
        "gpus": [{"uuid": "GPU-0", "name": "sim", "total_bytes": total, "free_bytes": total}],
        "warm": [],
        "busy": 0,
        "max_jobs": 4,
    }


@pytest.fixture
def coord(tmp_path: Path, store: Store) -> Coord:
    return Coord(tmp_path, store)


def test_a_second_invite_revokes_the_first_and_a_stale_one_takes_no_live_node(
    coord: Coord,
) -> None:
    first = coord.invite("gpu-a")
    # planted: the first invite is live, as the stale invite of the report was
    before = coord.store.get_token(first["token_id"])
    assert before is not None and before.active(coord.clock.t)
    coord.clock.t += 5
    second = coord.invite("gpu-a")
    assert second["superseded"] == [first["token_id"]]
    stale = coord.store.get_token(first["token_id"])
    assert stale is not None and stale.revoked_at == coord.clock.t
    live = [
        t.id
        for t in coord.store.list_tokens()
        if t.role is Role.ENROLL and t.node == "gpu-a" and t.active(coord.clock.t)
    ]
    assert live == [second["token_id"]]
    # the real gpu-a enrols with the newer invite and runs a job
    assert coord.enrol(second["token"], "real").status_code == 201
    lease = coord.run_a_job("real", "j1")
    node = coord.store.get_node("gpu-a")
    assert node is not None
    credential = node.token_id
    # another host tries the stale invite: refused, and nothing of gpu-a changed
    r = coord.enrol(first["token"], "attacker")
    assert r.status_code == 401 and "revoked" in r.json()["error"], r.text
    after = coord.store.get_node("gpu-a")
    assert after is not None and after.token_id == credential
    assert after.state is NodeState.ACTIVE and after.capabilities["host"] == "real"
    got = coord.store.lease_of("j1")
    assert got is not None and got.lease_id == lease and got.node == "gpu-a"
    job = coord.store.get_job("j1")
    assert job is not None and job.state is JobState.RUNNING
    # the real agent is still served: its heartbeat renews its job
    r = coord.beat("real", ["j1"])
    assert r.status_code == 200 and r.json()["renewed"] == 1 and r.json()["cancels"] == []
    refused = coord.audits("node.enroll")[-1]
    assert refused.outcome.startswith("refused") and "was revoked" in refused.outcome
    assert refused.detail["claimed_token"] == first["token_id"]
    invites = coord.audits("node.invite")
    assert invites[-1].detail["superseded"] == [first["token_id"]]


def test_an_enrolment_does_not_displace_a_live_node_without_replace(coord: Coord) -> None:
    made = coord.invite("gpu-a")
    assert coord.enrol(made["token"], "real").status_code == 201
    coord.run_a_job("real", "j1")
    credential = coord.store.get_node("gpu-a").token_id  # type: ignore[union-attr]
    # planted: an enroll token for the live gpu-a made without replace, the other way
    # an owner makes one (POST /v1/tokens), as an invite from before this rule was
    r = coord.post("/v1/tokens", "owner", {"name": "again", "role": "enroll", "node": "gpu-a"})
    assert r.status_code == 201, r.text
    planted = r.json()
    record = coord.store.get_token(planted["id"])
    assert record is not None and record.active(coord.clock.t) and not record.replace
    r = coord.enrol(planted["token"], "attacker")
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert "node gpu-a is enrolled (active" in error
    assert "gpuwarden node invite gpu-a --replace" in error
    assert "gpuwarden node revoke gpu-a" in error
    spent = coord.store.get_token(planted["id"])
    assert spent is not None and spent.revoked_at is not None  # used up by the refusal
    node = coord.store.get_node("gpu-a")
    assert node is not None and node.token_id == credential
    assert node.capabilities["host"] == "real"
    assert coord.store.get_job("j1").state is JobState.RUNNING  # type: ignore[union-attr]
    assert coord.beat("real", ["j1"]).json()["renewed"] == 1
    refused = coord.audits("node.enroll")[-1]
    assert refused.outcome.startswith("refused: node gpu-a is enrolled")
    # an invite for the live name is refused, saying how
    r = coord.post("/v1/nodes/invite", "owner", {"name": "gpu-a"})
    assert r.status_code == 409 and "--replace" in r.json()["error"]
    # the next legitimate requests work: an invite for another name, its enrolment
    other = coord.invite("gpu-b")
    assert coord.enrol(other["token"], "b").status_code == 201
    assert coord.beat("b", []).status_code == 200


def test_replace_is_explicit_audited_and_blames_no_node(coord: Coord) -> None:
    made = coord.invite("gpu-a")
    assert coord.enrol(made["token"], "old").status_code == 201
    coord.run_a_job("old", "j1")
    old_credential = coord.store.get_node("gpu-a").token_id  # type: ignore[union-attr]
    coord.clock.t += 1
    made = coord.invite("gpu-a", replace=True)
    assert made["replace"] is True and made["replaces"] == "gpu-a"
    invite_row = coord.audits("node.invite")[-1]
    assert invite_row.detail["replace"] is True and invite_row.detail["replaces"] == "gpu-a"
    # not used yet: the old host runs on
    assert coord.beat("old", ["j1"]).status_code == 200
    r = coord.enrol(made["token"], "new")
    assert r.status_code == 201, r.text
    # the old credential is refused; its job went back to the queue, its reason
    # names the replacement, not a fault of the node
    assert coord.beat("old", ["j1"]).status_code == 401
    job = coord.store.get_job("j1")
    assert job is not None and job.state is JobState.QUEUED
    [attempt] = coord.store.attempts("j1")
    assert attempt.outcome == "interrupted" and "--replace" in attempt.reason
    enrolled = coord.audits("node.enroll")[-1]
    assert enrolled.outcome == "ok"
    assert enrolled.detail["replaced"]["credential"] == old_credential
    assert enrolled.detail["replaced"]["interrupted"] == 1
    node = coord.store.get_node("gpu-a")
    assert node is not None and node.state is NodeState.ACTIVE
    assert node.capabilities["host"] == "new"
    assert coord.beat("new", []).status_code == 200


def test_an_invite_for_a_revoked_node_needs_no_replace(coord: Coord) -> None:
    made = coord.invite("gpu-a")
    assert coord.enrol(made["token"], "old").status_code == 201
    assert coord.post("/v1/nodes/gpu-a/revoke", "owner").status_code == 200
    made = coord.invite("gpu-a")
    assert made["replaces"] is None
    assert coord.enrol(made["token"], "new").status_code == 201
    assert coord.beat("new", []).status_code == 200


def test_an_enroll_token_bound_to_no_node_is_refused_when_made(coord: Coord) -> None:
    with pytest.raises(UserError, match="must be bound to a node"):
        issue_token(coord.store, name="loose", role=Role.ENROLL, by=ADMIN, now=1.0)
    r = coord.post("/v1/tokens", "owner", {"name": "loose", "role": "enroll"})
    assert r.status_code == 422 and "must be bound to a node" in r.json()["error"]
    assert not [t for t in coord.store.list_tokens() if t.role is Role.ENROLL]
    # bound to a node, it is made
    r = coord.post("/v1/tokens", "owner", {"name": "bound", "role": "enroll", "node": "x"})
    assert r.status_code == 201, r.text


def test_invites_made_at_once_leave_one_live(store: Store) -> None:
    assert isinstance(store, ClusterStore)
    made: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def one() -> None:
        try:
            start.wait()
            made.append(issue_invite(store, "gpu-a", by=ADMIN, now=time.time()).record.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(made) == 6
    live = [
        t.id
        for t in store.list_tokens()
        if t.role is Role.ENROLL and t.node == "gpu-a" and t.revoked_at is None
    ]
    assert len(live) == 1 and live[0] in made


def test_the_migration_leaves_the_newest_live_invite_of_each_node(tmp_path: Path) -> None:
    import sqlite3

    from gpuwarden.store.queries import load_migrations, split_sql

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
        "applied_at TEXT NOT NULL)"
    )
    for version, name, script in load_migrations("sqlite"):
        if version >= 22:
            break
        for statement in split_sql(script):
            db.execute(statement)
        db.execute("INSERT INTO schema_migrations VALUES (?, ?, 'then')", (version, name))
    insert = (
        "INSERT INTO tokens (id, name, role, secret_hash, created_at, created_by, node) "
        "VALUES (?, 'enroll', 'enroll', 'x', ?, 'local', ?)"
    )
    for token_id, at, node in [("a1", 1.0, "a"), ("a2", 2.0, "a"), ("b1", 1.0, "b")]:
        db.execute(insert, (token_id, at, node))
    db.commit()
    db.close()
    store = SqliteStore(path)
    try:
        live = {t.id for t in store.list_tokens() if t.revoked_at is None}
        assert live == {"a2", "b1"}
    finally:
        store.close()


def test_node_invite_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gpuwarden.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')

    def gw(*args: str) -> tuple[int, str, str]:
        code = main(["--config", str(config), *args])
        got = capsys.readouterr()
        return code, got.out, got.err

    assert gw("token", "create", "admin", "--role", "owner")[0] == 0
    code, _, _ = gw("node", "invite", "gpu-a", "--json")
    assert code == 0
    code, _, said = gw("node", "invite", "gpu-a")
    assert code == 0 and "no longer work" in said
    # an enroll token bound to no node is refused when made
    code, _, said = gw("token", "create", "loose", "--role", "enroll")
    assert code == 2 and "must be bound to a node" in said
    # gpu-a enrols (as the coordinator records it)
    store = SqliteStore(tmp_path / "state" / "gpuwarden.db")
    try:
        record, _ = issue_token(
            store, name="n", role=Role.NODE, by=ADMIN, now=time.time(), node="gpu-a"
        )
        store.upsert_node("gpu-a", token_id=record.id, capabilities={}, now=time.time())
    finally:
        store.close()
    code, _, said = gw("node", "invite", "gpu-a")
    assert code == 2 and "gpuwarden node invite gpu-a --replace" in " ".join(said.split())
    code, _, said = gw("node", "invite", "gpu-a", "--replace")
    assert code == 0 and "its credential is revoked" in " ".join(said.split())
    store = SqliteStore(tmp_path / "state" / "gpuwarden.db")
    try:
        rows = [a for a in store.audit_rows() if a.action == "node.invite"]
        assert rows[-1].detail["replace"] is True and rows[-1].detail["replaces"] == "gpu-a"
        assert len(rows) == 3  # the refused one wrote no invite
    finally:
        store.close()
