"""Job control over HTTP: hold, release, requeue and priority, each audited, with
the priority rule by role and the refusals (SPEC.md section 1, "Job control")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.states import JobState
from tests.integration.test_api import ECHO, Api, build, submit


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


def post(api: Api, who: str, job_id: str, what: str, body: Any = None) -> Any:
    return api.client.post(f"/v1/jobs/{job_id}/{what}", json=body, headers=api.h(who))


def test_hold_explain_release_audited(api: Api) -> None:
    job = submit(api, "submitter", id="h1")
    r = post(api, "submitter", "h1", "hold")
    assert r.status_code == 200, r.text
    assert r.json()["hold_by"] == "submitter" and r.json()["state"] == "queued"
    assert api.store.queue_entries([job["id"]]) == []

    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.h("submitter")).json()
    line = f"held by submitter: release with `gpuwarden release {job['id']}`"
    assert got["reason"] == line and got["hold_by"] == "submitter"
    lines = api.client.get(f"/v1/jobs/{job['id']}/explain", headers=api.h("operator")).json()
    assert line in lines["lines"]

    again = post(api, "submitter", "h1", "hold")
    assert again.status_code == 409 and "already held by submitter" in again.json()["error"]

    r = post(api, "operator", job["id"], "release")
    assert r.status_code == 200 and r.json()["hold_by"] is None
    assert [e.id for e in api.store.queue_entries([job["id"]])] == [job["id"]]
    nothing = post(api, "operator", job["id"], "release")
    assert nothing.status_code == 409 and "nothing to release" in nothing.json()["error"]

    rows = [(r.action, r.outcome, r.target) for r in api.store.audit_rows()]
    assert ("job.hold", "ok", job["id"]) in rows
    assert ("job.release", "ok", job["id"]) in rows
    refused = [r for r in api.store.audit_rows() if r.action == "job.hold" and r.outcome != "ok"]
    assert refused and refused[0].target == job["id"]


def test_hold_of_a_running_or_ended_job_is_409(api: Api) -> None:
    job = submit(api, "owner", id="r1")
    api.store.start_attempt(job["id"], node="n", gpu_uuid=None, now=2.0)
    r = post(api, "owner", job["id"], "hold")
    assert r.status_code == 409 and "only a queued job can be held" in r.json()["error"]
    unknown = post(api, "owner", "nope", "hold")
    assert unknown.status_code == 404


def test_requeue_over_http_keeps_the_id_and_the_earlier_run(api: Api) -> None:
    job = submit(api, "submitter", id="rq")
    early = post(api, "submitter", job["id"], "requeue")
    assert early.status_code == 409 and "has not ended" in early.json()["error"]
    api.store.request_cancel(job["id"], now=3.0)

    r = post(api, "submitter", "rq", "requeue")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == job["id"] and r.json()["state"] == "queued"
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.h("submitter")).json()
    kinds = [(e["event"], e.get("from"), e.get("to")) for e in got["events"]]
    assert ("transition", "queued", "cancelled") in kinds
    assert ("requeued", "cancelled", "queued") in kinds
    rows = [(r.outcome, r.target) for r in api.store.audit_rows() if r.action == "job.requeue"]
    assert rows[1:] == [("ok", job["id"])] and rows[0][0] != "ok"  # the refusal, then it


def test_priority_by_role(api: Api) -> None:
    job = submit(api, "submitter", id="p1", priority=5)
    up = post(api, "submitter", job["id"], "priority", {"priority": 6})
    assert up.status_code == 409
    assert "a submitter may only lower the priority of its own jobs" in up.json()["error"]
    down = post(api, "submitter", job["id"], "priority", {"priority": 1})
    assert down.status_code == 200 and down.json()["priority"] == 1
    raised = post(api, "operator", job["id"], "priority", {"priority": 50})
    assert raised.status_code == 200 and raised.json()["priority"] == 50
    owner = post(api, "owner", job["id"], "priority", {"priority": -7})
    assert owner.status_code == 200 and owner.json()["priority"] == -7
    other = post(api, "submitter2", job["id"], "priority", {"priority": -9})
    assert other.status_code == 404  # another's job is not there for it
    stored = api.store.get_job(job["id"])
    assert stored is not None and stored.priority == -7
    rows = [r for r in api.store.audit_rows() if r.action == "job.priority"]
    assert [r.outcome == "ok" for r in rows] == [False, True, True, True, False]


@pytest.mark.parametrize("body", [{"priority": "5"}, {"priority": 1.5}, {"priority": True}, {}])
def test_a_priority_that_is_not_an_integer_is_422(api: Api, body: dict[str, Any]) -> None:
    job = submit(api, "owner", id="p2", priority=3)
    r = post(api, "owner", job["id"], "priority", body)
    assert r.status_code == 422 and "priority" in r.json()["error"]
    stored = api.store.get_job(job["id"])
    assert stored is not None and stored.priority == 3


def test_priority_of_an_ended_job_is_409(api: Api) -> None:
    job = submit(api, "owner", id="p3")
    api.store.request_cancel(job["id"], now=2.0)
    r = post(api, "owner", job["id"], "priority", {"priority": 1})
    assert r.status_code == 409 and "only a queued job's priority" in r.json()["error"]
    stored = api.store.get_job(job["id"])
    assert stored is not None and stored.state is JobState.CANCELLED


def test_a_submitter_may_not_jump_the_queue_with_a_huge_priority(api: Api) -> None:
    """Priority goes before fair share: a submitter's bound ([api.max_priority]
    submitter, 10 by default) keeps one tenant from jumping every other's queue."""
    huge = 2**63 - 1
    r = api.client.post("/v1/jobs", json={**ECHO, "priority": huge}, headers=api.h("submitter"))
    assert r.status_code == 403, r.text
    assert r.json()["error"] == (
        f"priority {huge} is above the highest a submitter may give a job "
        "(10, [api.max_priority] submitter): ask for 10 or less, or ask an operator to "
        "raise the job's priority"
    )
    assert api.store.list_jobs() == []  # nothing was queued
    lease = {"vram_bytes": 1 << 30, "ttl_s": 60, "priority": 11}
    r = api.client.post("/v1/leases", json=lease, headers=api.h("submitter"))
    assert r.status_code == 403 and "give a lease (10," in r.json()["error"]
    # at the bound it is taken; operators and owners are not bound by default
    assert submit(api, "submitter", priority=10)["priority"] == 10
    assert submit(api, "operator", priority=huge)["priority"] == huge
    refused = [r for r in api.store.audit_rows() if r.outcome != "ok"]
    assert [r.action for r in refused] == ["job.submit", "lease.create"]


def test_an_operator_bound_holds_at_submit_and_when_raising(tmp_path: Path) -> None:
    a = build(tmp_path, max_priority={"operator": 100, "submitter": 0})
    try:
        r = a.client.post("/v1/jobs", json={**ECHO, "priority": 101}, headers=a.h("operator"))
        assert r.status_code == 403 and "(100, [api.max_priority] operator)" in r.json()["error"]
        job = submit(a, "submitter", priority=0)
        too_high = post(a, "operator", job["id"], "priority", {"priority": 101})
        assert too_high.status_code == 403
        assert post(a, "operator", job["id"], "priority", {"priority": 100}).status_code == 200
        assert post(a, "owner", job["id"], "priority", {"priority": 10**6}).status_code == 200
        stored = a.store.get_job(job["id"])
        assert stored is not None and stored.priority == 10**6
    finally:
        a.store.close()
