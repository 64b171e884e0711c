"""Service names are per owner (issue 30, item 6; SPEC.md section 14, "Service
jobs"): a submitter's service names are its own, ``<token id>-<name>``, as its job
ids are, so one submitter cannot squat a name another's service needs, and a
refusal never names another owner's job. Every store backend.

The squat is planted first: submitter A takes the name ``hello`` for a running
service. Then B's service ``hello`` is taken too, under B's own name; neither
refusal nor answer tells B anything of A's job; and A's name cannot be taken by
B (B asking for it gets a name of its own)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.config import Config
from gpuwarden.core.model import Role
from gpuwarden.node.services import Services
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store

REPO = Path(__file__).resolve().parents[2]
ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)
#: a service type of tests/modules/testmods (never started here)
SERVICE_TYPE = "testmods.web"


class Api:
    def __init__(self, tmp: Path, store: Store) -> None:
        self.store = store
        config = Config.model_validate(
            {
                "state_dir": tmp,
                "module_paths": [
                    REPO / "src" / "gpuwarden" / "modules",
                    REPO / "tests" / "modules",
                ],
                "allow_unsandboxed_containers": True,
                "api": {"rate_per_s": 10_000, "burst": 10_000},
            }
        )
        registry = Registry.load(config.module_paths, config.launch_rules)
        self.client = TestClient(create_app(store, registry, config))
        self.tokens: dict[str, str] = {}
        self.ids: dict[str, str] = {}
        for name, role in (("owner", Role.OWNER), ("a", Role.SUBMITTER), ("b", Role.SUBMITTER)):
            record, self.tokens[name] = issue_token(
                store, name=name, role=role, by=ADMIN, now=time.time()
            )
            self.ids[name] = record.id

    def submit(self, who: str, **body: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.tokens[who]}"}
        return self.client.post("/v1/jobs", json={"type": SERVICE_TYPE, **body}, headers=headers)

    def jobs(self, who: str) -> list[dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self.tokens[who]}"}
        got: list[dict[str, Any]] = self.client.get("/v1/jobs", headers=headers).json()
        return got


@pytest.fixture
def api(tmp_path: Path, store: Store) -> Api:
    return Api(tmp_path, store)


def test_a_submitters_service_names_are_its_own(api: Api) -> None:
    a, b = api.ids["a"], api.ids["b"]
    # planted: A squats "hello"
    r = api.submit("a", id="squatter", service="hello")
    assert r.status_code == 201, r.text
    squat = api.store.get_job(r.json()["id"])
    assert squat is not None and squat.service == f"{a}-hello"
    # B's "hello" is taken, under B's own name: nothing of A's job in the answer
    r = api.submit("b", id="b1", service="hello")
    assert r.status_code == 201, r.text
    mine = api.store.get_job(r.json()["id"])
    assert mine is not None and mine.service == f"{b}-hello"
    assert a not in r.text and "squatter" not in r.text
    [listed] = api.jobs("b")
    assert listed["service_url_path"] == f"/run/{b}-hello/" and a not in str(listed)
    # A's name is A's alone: B asking for it gets a name of its own
    r = api.submit("b", id="b2", service=f"{a}-hello")
    assert r.status_code == 201, r.text
    assert api.store.get_job(f"{b}-b2").service == f"{b}-{a}-hello"  # type: ignore[union-attr]
    assert "squatter" not in r.text
    # an owner names freely, but not in a submitter's form
    r = api.submit("owner", id="o1", service="hello")
    assert r.status_code == 201 and api.store.get_job("o1").service == "hello"  # type: ignore[union-attr]
    assert api.submit("owner", id="o2", service=f"{a}-x").status_code == 422
    # a name already of the submitter's own form is kept; one too long is refused
    r = api.submit("a", id="a2", service=f"{a}-again")
    assert r.status_code == 201 and api.store.get_job(f"{a}-a2").service == f"{a}-again"  # type: ignore[union-attr]
    r = api.submit("a", id="a3", service="x" * 120)
    assert r.status_code == 422 and "at most 115 characters" in r.json()["error"]
    # without a name, a service is served under its job id (its own already)
    r = api.submit("b", id="b4")
    assert r.status_code == 201
    [b4] = [j for j in api.jobs("b") if j["id"] == f"{b}-b4"]
    assert b4["service_url_path"] == f"/run/{b}-b4/"


def _running(name: str, job_id: str, owner: str | None) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, run=SimpleNamespace(job=SimpleNamespace(id=job_id, owner=owner))
    )


def test_a_node_refuses_a_taken_name_without_naming_anothers_job() -> None:
    services = Services(lambda *_: None, lambda *_, **__: None, time.time, lambda _: False)  # type: ignore[arg-type]
    services._by_job["j-a"] = _running("hello", "aaaaaaaaaaaa-a1", "aaaaaaaaaaaa")  # type: ignore[assignment]
    theirs = services.taken("hello", "bbbbbbbbbbbb")
    assert theirs is not None and "another job" in theirs and "aaaaaaaaaaaa" not in theirs
    host = services.taken("hello", None)  # a job of the host's, or one an agent holds
    assert host is not None and "another job" in host and "a1" not in host
    own = services.taken("hello", "aaaaaaaaaaaa")
    assert own is not None and "your job aaaaaaaaaaaa-a1" in own
    assert services.taken("other", "bbbbbbbbbbbb") is None
