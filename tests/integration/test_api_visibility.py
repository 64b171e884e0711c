"""A submitter learns nothing of another token's jobs, on any route: a job id that
another holds gets the same answer, byte for byte, as an id no job has. A
submitter's job ids are its own (``<token id>-<id>``), so a submit with an id
another holds is taken like a submit with a free one."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.ledger import Holding
from gpuwarden.core.model import GIB, Event, JobSpec
from gpuwarden.core.policy import GpuView
from gpuwarden.store.base import NodeStatus, Submission
from tests.integration.test_api import ECHO, Api, build, done_job


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


def shape(r: Any, *ids: str) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers but the date, and the body, with each id in ``ids`` (and
    its JSON form) replaced by the same placeholder: what a client can compare."""
    body: bytes = r.content
    for job_id in ids:
        for form in (job_id, json.dumps(job_id)[1:-1], repr(job_id)[1:-1]):
            body = body.replace(form.encode(), b"<ID>")
    headers = sorted(
        (k, v if k != "content-length" else "n") for k, v in r.headers.items() if k != "date"
    )
    return r.status_code, headers, body


# routes that read or act on one job (the job's output: out.txt; a bad path too)
ROUTES = [
    ("GET", "/v1/jobs/{id}"),
    ("POST", "/v1/jobs/{id}/cancel"),
    ("GET", "/v1/jobs/{id}/explain"),
    ("GET", "/v1/jobs/{id}/result"),
    ("GET", "/v1/jobs/{id}/outputs/out.txt"),
    ("GET", "/v1/jobs/{id}/logs/stdout"),
    ("GET", "/v1/jobs/{id}/logs/stderr?attempt=1&follow=true"),
    ("GET", "/v1/jobs/{id}/outputs/..%2F..%2Fetc%2Fpasswd"),
    ("GET", "/v1/jobs/{id}/outputs/" + "x" * 300),
]


@pytest.mark.parametrize(("method", "route"), ROUTES)
def test_another_submitters_job_answers_as_one_that_does_not_exist(
    api: Api, method: str, route: str
) -> None:
    theirs = f"{api.id_of('submitter')}-theirs"
    done_job(api, "submitter", theirs)  # submitter's, done, with an output
    api.store.submit(  # one from the host's CLI or a bundle: no owner
        [JobSpec(id="host-1", type="echo.echo", params={"text": "x"})], now=1.0
    )
    # the attack is in place: the jobs exist, and their owner sees them
    assert api.store.get_job(theirs) is not None and api.store.get_job("host-1") is not None
    own = api.client.get(f"/v1/jobs/{theirs}", headers=api.h("submitter"))
    assert own.status_code == 200
    answers = {}
    for job_id in (theirs, "host-1", f"{api.id_of('submitter')}-nope", "nope"):
        r = api.client.request(method, route.format(id=job_id), headers=api.h("submitter2"))
        answers[job_id] = shape(r, job_id)
    first = next(iter(answers.values()))
    assert first[0] == 404, first
    assert b"no job with id" in first[2]
    assert all(a == first for a in answers.values()), answers
    # nothing changed: the cancel did not reach either job
    job = api.store.get_job("host-1")
    assert job is not None and not job.cancel_requested


def test_a_submit_with_an_id_another_holds_is_taken_like_a_free_one(api: Api) -> None:
    """The only answer that leaks nothing is the one a free id gets: the caller's
    ids are its own, so another's id is never in its way."""
    sub1, sub2 = api.id_of("submitter"), api.id_of("submitter2")
    r = api.client.post("/v1/jobs", json={**ECHO, "id": "run-1"}, headers=api.h("submitter"))
    assert r.status_code == 201 and r.json()["id"] == f"{sub1}-run-1"
    api.store.submit(
        [JobSpec(id=i, type="echo.echo", params={"text": "x"}) for i in ("run-1", "run-k")],
        now=1.0,
    )
    # the attack is in place: 'run-1' exists twice (the host's and submitter's)
    assert api.store.get_job("run-1") is not None and api.store.get_job("run-k") is not None
    assert api.store.get_job(f"{sub1}-run-1") is not None

    def submit(job_id: str, key: str | None = None) -> Any:
        headers = api.h("submitter2")
        if key is not None:
            headers = {**headers, "Idempotency-Key": key}
        return api.client.post("/v1/jobs", json={**ECHO, "id": job_id}, headers=headers)

    def same(r: Any, job_id: str) -> tuple[int, list[tuple[str, str]], dict[str, Any]]:
        status, headers, _ = shape(r)
        body = r.json()
        body["id"] = body["id"].replace(job_id, "<ID>")
        body.pop("submitted_at")
        body.pop("updated_at")
        return status, headers, body

    for taken, free in (("run-1", "free-1"), (f"{sub1}-run-1", f"{sub1}-free-2")):
        a, b = submit(taken), submit(free)
        assert a.status_code == 201, a.text
        assert a.json()["id"] == f"{sub2}-{taken}" and b.json()["id"] == f"{sub2}-{free}"
        assert same(a, taken) == same(b, free)
    # the same again, with idempotency keys: taken, then replayed, like a free id
    a, b = submit("run-k", key="k-a"), submit("free-3", key="k-b")
    ra, rb = submit("run-k", key="k-a"), submit("free-3", key="k-b")
    assert (a.status_code, ra.status_code) == (b.status_code, rb.status_code) == (201, 200)
    assert ra.headers["Idempotent-Replayed"] == rb.headers["Idempotent-Replayed"] == "true"
    assert ra.json()["id"] == a.json()["id"]
    # its own id used again: 409, as for any id it holds (it sees its own)
    again = submit("free-1")
    assert again.status_code == 409 and "already accepted" in again.json()["error"]
    # and nothing of the others changed
    first = api.store.get_job(f"{sub1}-run-1")
    assert first is not None and first.owner == sub1


def test_a_submitter_may_name_its_job_with_or_without_its_prefix(api: Api) -> None:
    sub1 = api.id_of("submitter")
    r = api.client.post("/v1/jobs", json={**ECHO, "id": "mine"}, headers=api.h("submitter"))
    assert r.json()["id"] == f"{sub1}-mine"
    for name in ("mine", f"{sub1}-mine"):
        got = api.client.get(f"/v1/jobs/{name}", headers=api.h("submitter"))
        assert got.status_code == 200 and got.json()["id"] == f"{sub1}-mine"
    # an id given with its own prefix is not prefixed twice
    r = api.client.post("/v1/jobs", json={**ECHO, "id": f"{sub1}-b"}, headers=api.h("submitter"))
    assert r.json()["id"] == f"{sub1}-b"
    # generated ids carry it too
    r = api.client.post("/v1/jobs", json=ECHO, headers=api.h("submitter"))
    assert r.status_code == 201 and r.json()["id"].startswith(f"{sub1}-echo-")
    # the short name of another's job is not a way in
    r = api.client.get("/v1/jobs/mine", headers=api.h("submitter2"))
    assert r.status_code == 404
    # too long once prefixed: said so, with the room left
    r = api.client.post("/v1/jobs", json={**ECHO, "id": "x" * 120}, headers=api.h("submitter"))
    assert r.status_code == 422 and "at most 115 characters" in r.json()["error"]


def test_operators_and_owners_choose_ids_but_not_a_submitters(api: Api) -> None:
    for who in ("operator", "owner"):
        r = api.client.post("/v1/jobs", json={**ECHO, "id": f"plain-{who}"}, headers=api.h(who))
        assert r.status_code == 201 and r.json()["id"] == f"plain-{who}"
        # they see every job, so a 409 tells them nothing new
        r = api.client.post("/v1/jobs", json={**ECHO, "id": f"plain-{who}"}, headers=api.h(who))
        assert r.status_code == 409
    r = api.client.post(
        "/v1/jobs",
        json={**ECHO, "id": f"{api.id_of('submitter')}-later"},
        headers=api.h("owner"),
    )
    assert r.status_code == 422 and "belong to the API token" in r.json()["error"]
    assert api.store.get_job(f"{api.id_of('submitter')}-later") is None


def test_status_and_explain_name_no_job_of_another_token(api: Api) -> None:
    sub1 = api.id_of("submitter")
    mine = api.client.post("/v1/jobs", json={**ECHO, "id": "w"}, headers=api.h("submitter"))
    mine_id = mine.json()["id"]
    theirs = f"{api.id_of('submitter2')}-big"
    api.store.submit(
        [JobSpec(id=theirs, type="echo.echo", params={"text": "x"})],
        now=1.0,
        origin=Submission(owner=api.id_of("submitter2")),
    )
    gpu = GpuView(
        uuid="GPU-1",
        total_bytes=24 * GIB,
        holdings=(
            Holding(holder=f"{theirs}/1", type="burn.llm", bytes=20 * GIB, job_id=theirs),
            Holding(holder=f"{mine_id}/1", type="burn.llm", bytes=2 * GIB, job_id=mine_id),
        ),
    )
    api.store.put_node_status(
        NodeStatus(
            node="n1",
            pid=1,
            updated_at=time.time(),
            payload={
                "gpus": [gpu.to_json()],
                "running": [
                    {"job": theirs, "type": "burn.llm", "attempt": 1},
                    {"job": mine_id, "type": "burn.llm", "attempt": 1},
                ],
                "waiting": {
                    theirs: "GPU-1 is held back for job other-1, which waits for it",
                    mine_id: f"GPU-1 is held back for job {theirs}, which waits for it",
                },
                "queues": {"/srv/secret-team/queues/demo": {"inbox": 1, "processing": 0}},
            },
        )
    )
    # the attack is in place: an operator sees the other token's job in the status
    seen = api.client.get("/v1/status", headers=api.h("operator")).text
    assert theirs in seen
    for who, other in (("submitter", theirs), ("submitter2", mine_id)):
        text = api.client.get("/v1/status", headers=api.h(who)).text
        assert other not in text, who
    s = api.client.get("/v1/status", headers=api.h("submitter")).json()
    [node] = s["nodes"]
    assert node["running"] == [
        {"job": None, "type": "burn.llm", "attempt": 1},
        {"job": mine_id, "type": "burn.llm", "attempt": 1},
    ]
    assert node["waiting"] == {mine_id: "GPU-1 is held back for another job, which waits for it"}
    # a queue root by its name, not the host's path (an operator sees the path)
    assert node["queues"] == {"demo": {"inbox": 1, "processing": 0}}
    assert "/srv/secret-team" in seen
    holders = [h["holder"] for h in node["gpus"][0]["holdings"]]
    assert holders == ["another job/1", f"{mine_id}/1"]
    assert [h["job_id"] for h in node["gpus"][0]["holdings"]] == [None, mine_id]
    assert sub1 in mine_id
    # explain of its own job: the wait reason names no other token's job (an operator
    # sees it named)
    url = f"/v1/jobs/{mine_id}/explain"
    lines = api.client.get(url, headers=api.h("operator")).json()["lines"]
    assert f"it waits: GPU-1 is held back for job {theirs}, which waits for it" in lines
    lines = api.client.get(url, headers=api.h("submitter")).json()["lines"]
    assert "it waits: GPU-1 is held back for another job, which waits for it" in lines
    assert theirs not in json.dumps(lines)
    # nor do the events of its own job
    api.store.add_event(
        Event(
            ts=2.0,
            kind="note",
            job_id=mine_id,
            detail={"reason": f"its memory is needed by job {theirs} (20.0 GiB)"},
        )
    )
    assert theirs in api.client.get(f"/v1/jobs/{mine_id}", headers=api.h("owner")).text
    shown = api.client.get(f"/v1/jobs/{mine_id}", headers=api.h("submitter")).json()
    assert theirs not in json.dumps(shown)
    assert shown["events"][-1]["reason"] == "its memory is needed by another job (20.0 GiB)"
