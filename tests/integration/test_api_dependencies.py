"""``after`` over HTTP: the submit field, the job's output, the waiting reason,
and the refusals (malformed, unknown, a job the token cannot see), nothing stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.core.states import JobState
from tests.integration.test_api import Api, build, submit
from tests.integration.test_dashboard_api import signed_in


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


def test_a_submitter_depends_on_its_own_job_by_its_short_id(api: Api) -> None:
    first = submit(api, "submitter", id="prep")
    prefix = api.id_of("submitter") + "-"
    assert first["id"] == prefix + "prep"
    second = submit(api, "submitter", id="train", after=["afterok:prep"])
    assert second["after"] == [f"afterok:{prefix}prep"]
    assert second["held"] is True and second["state"] == "queued"

    got = api.client.get(f"/v1/jobs/{second['id']}", headers=api.h("submitter")).json()
    assert got["reason"] == f"waits for job {prefix}prep (queued)"
    listed = api.client.get("/v1/jobs", headers=api.h("submitter")).json()
    assert {j["id"]: j["reason"] for j in listed}[second["id"]] == got["reason"]
    lines = api.client.get(f"/v1/jobs/{second['id']}/explain", headers=api.h("submitter")).json()[
        "lines"
    ]
    assert f"it waits: waits for job {prefix}prep (queued)" in lines

    api.store.request_cancel(first["id"], now=5.0)
    after = api.client.get(f"/v1/jobs/{second['id']}", headers=api.h("submitter")).json()
    assert after["state"] == "failed" and after["held"] is False
    assert (
        after["reason"] == f"dependency afterok:{prefix}prep can never hold: {prefix}prep cancelled"
    )


@pytest.mark.parametrize(
    ("after", "says"),
    [
        (
            ["afterok:nope"],
            "dependency afterok:nope: no job with id 'nope' that this token can see",
        ),
        (["nope"], "is not KIND:ID"),
        (["afterwards:x"], "unknown kind 'afterwards'"),
        ("afterok:x", "after"),
    ],
)
def test_refused_with_422_nothing_stored(api: Api, after: object, says: str) -> None:
    before = len(api.store.list_jobs())
    r = api.client.post(
        "/v1/jobs",
        json={"type": "echo.echo", "params": {"text": "x"}, "id": "d", "after": after},
        headers=api.h("owner"),
    )
    assert r.status_code == 422, r.text
    assert says in r.json()["error"]
    assert len(api.store.list_jobs()) == before


def test_a_submitter_cannot_depend_on_a_job_it_cannot_see(api: Api) -> None:
    theirs = submit(api, "submitter", id="mine")
    r = api.client.post(
        "/v1/jobs",
        json={"type": "echo.echo", "params": {"text": "x"}, "after": [f"afterok:{theirs['id']}"]},
        headers=api.h("submitter2"),
    )
    assert r.status_code == 422, r.text
    assert "that this token can see" in r.json()["error"]
    assert [j.id for j in api.store.list_jobs()] == [theirs["id"]]
    # an operator sees every job, so it may depend on any
    ok = submit(api, "operator", id="op-1", after=[f"afterany:{theirs['id']}"])
    assert ok["after"] == [f"afterany:{theirs['id']}"]
    job = api.store.get_job("op-1")
    assert job is not None and job.state is JobState.QUEUED and job.held


def test_the_dashboard_says_why_a_held_job_waits(api: Api) -> None:
    submit(api, "owner", id="first")
    submit(api, "owner", id="second", after=["afterany:first"])
    owner, _ = signed_in(api, "owner")
    doc = owner.get("/v1/dashboard/overview").json()
    reasons = {q["id"]: q["reason"] for q in doc["queued"]}
    assert reasons["second"] == "waits for job first (queued)"
