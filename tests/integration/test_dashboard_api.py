"""The dashboard's HTTP side: signing in by cookie, the gate's origin and CSRF
checks for a browser session, and the /v1/dashboard routes (roles respected)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.auth import parse_token
from gpuwarden.api.dashdata import gpu_hours, wait_histogram
from gpuwarden.api.session import CSRF_COOKIE, SESSION_COOKIE, Sessions
from gpuwarden.core.ledger import Holding
from gpuwarden.core.model import GIB, JobSpec
from gpuwarden.core.policy import GpuView
from gpuwarden.core.states import JobState
from gpuwarden.node import leases
from gpuwarden.store.base import AttemptSpan, NodeStatus, Store, Submission
from tests.integration.test_api import Api, build, make_client

ORIGIN = "http://testserver"
PAGE = Path(__file__).resolve().parents[2] / "src" / "gpuwarden" / "api" / "dashboard"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


def browser(a: Api) -> TestClient:
    """A fresh client with its own cookie jar (a browser), on the same app."""
    return TestClient(a.client.app)


def sign_in(client: TestClient, token: str, **headers: str) -> Any:
    return client.post("/v1/session", json={"token": token}, headers={"Origin": ORIGIN, **headers})


def signed_in(a: Api, who: str) -> tuple[TestClient, str]:
    """A browser signed in as ``who``, and its CSRF secret."""
    client = browser(a)
    r = sign_in(client, a.tokens[who])
    assert r.status_code == 200, r.text
    return client, r.json()["csrf"]


def job(a: Api, owner: str, job_id: str, **kw: Any) -> None:
    a.store.submit(
        [JobSpec(id=job_id, type="echo.echo", params={"text": "x"}, **kw)],
        now=1.0,
        origin=Submission(owner=a.id_of(owner)),
    )


def state(a: Api, job_id: str) -> JobState:
    j = a.store.get_job(job_id)
    assert j is not None
    return j.state


def audits(a: Api, action: str) -> list[Any]:
    return [r for r in a.store.audit_rows() if r.action == action]


# -- the page ---------------------------------------------------------------------


def test_the_page_and_its_files_need_no_token_and_load_nothing_from_elsewhere(api: Api) -> None:
    client = browser(api)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    for name, media in (("app.js", "text/javascript"), ("app.css", "text/css")):
        r = client.get(f"/dashboard/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media)
        assert r.text == (PAGE / name).read_text()
    for name in ("index.html", "app.js", "app.css"):
        text = (PAGE / name).read_text()
        assert not re.search(r"(src|href)=\"(https?:)?//", text), name  # no CDN
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert client.get("/dashboard/other.js").status_code == 404


# -- signing in -------------------------------------------------------------------


def test_sign_in_sets_a_strict_httponly_session_cookie_that_is_not_the_token(api: Api) -> None:
    client = browser(api)
    r = sign_in(client, api.tokens["operator"])
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["role"] == "operator" and doc["via"] == "cookie" and doc["csrf"]
    assert doc["can"]["node.drain"] and not doc["can"]["gpu.clear"]
    cookies = r.headers.get_list("set-cookie")
    session = next(c for c in cookies if c.startswith(f"{SESSION_COOKIE}="))
    csrf = next(c for c in cookies if c.startswith(f"{CSRF_COOKIE}="))
    for c in (session, csrf):
        assert "SameSite=Strict" in c and "Path=/" in c and "Secure" not in c  # plain http
    assert "HttpOnly" in session and "HttpOnly" not in csrf
    token_id, secret = parse_token(api.tokens["operator"])  # type: ignore[misc]
    assert secret not in session and token_id not in session
    assert csrf.split(";")[0] == f"{CSRF_COOKIE}={doc['csrf']}"
    # the cookie alone authenticates every route now
    me = client.get("/v1/session")
    assert me.status_code == 200 and me.json()["name"] == "operator"
    assert me.json()["csrf"] == doc["csrf"]
    assert client.get("/v1/jobs").status_code == 200
    assert client.get("/v1/dashboard/overview").status_code == 200
    [row] = audits(api, "session.create")
    assert row.outcome == "ok" and row.actor == token_id


def test_over_https_the_cookies_are_secure(api: Api) -> None:
    client = TestClient(api.client.app, base_url="https://testserver")
    r = client.post(
        "/v1/session", json={"token": api.tokens["owner"]}, headers={"Origin": "https://testserver"}
    )
    assert r.status_code == 200, r.text
    assert all("; Secure" in c for c in r.headers.get_list("set-cookie"))


def test_a_form_sign_in_redirects_to_the_page(api: Api) -> None:
    client = browser(api)
    r = client.post(
        "/v1/session",
        content=f"token={api.tokens['owner']}",
        headers={"Origin": ORIGIN, "Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert client.get("/v1/session").json()["role"] == "owner"


def test_a_form_with_too_many_fields_is_refused_not_a_server_error(api: Api) -> None:
    client = browser(api)
    fields = "&".join(f"f{i}=x" for i in range(12))
    assert len(fields.split("&")) > 10, "the attack: more fields than parse_qs may take"
    r = client.post(
        "/v1/session",
        content=f"token={api.tokens['owner']}&{fields}",
        headers={"Origin": ORIGIN, "Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    assert r.status_code == 422 and "more than 10" in r.json()["error"], r.text
    assert client.get("/v1/session").status_code == 401, "no session was made"


@pytest.mark.parametrize(
    ("token", "headers", "status", "says"),
    [
        ("gw_000000000000_" + "A" * 43, {"Origin": ORIGIN}, 401, "not valid"),
        ("nonsense", {"Origin": ORIGIN}, 401, "malformed"),
        ("owner", {"Origin": "https://evil.example"}, 403, "Origin"),
        ("owner", {"Sec-Fetch-Site": "cross-site"}, 403, "cross-site"),
        ("owner", {}, 403, "no Origin"),
        ("node", {"Origin": ORIGIN}, 403, "cannot sign in"),
        ("enroll", {"Origin": ORIGIN}, 403, "cannot sign in"),
    ],
)
def test_sign_in_refusals_are_audited_and_set_no_cookie(
    api: Api, token: str, headers: dict[str, str], status: int, says: str
) -> None:
    client = browser(api)
    value = api.tokens.get(token, token)
    r = client.post("/v1/session", json={"token": value}, headers=headers)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]
    assert not r.headers.get_list("set-cookie")
    [row] = audits(api, "session.create")
    assert row.outcome.startswith("refused") and row.detail["status"] == status


def test_a_sign_in_without_a_token_is_422(api: Api) -> None:
    r = browser(api).post("/v1/session", json={"nope": 1}, headers={"Origin": ORIGIN})
    assert r.status_code == 422 and "token" in r.json()["error"]


# -- the gate: a browser session's mutating calls -----------------------------------


def test_a_cookie_cancel_from_the_page_with_the_csrf_header_works(api: Api) -> None:
    client, csrf = signed_in(api, "owner")
    job(api, "owner", "j1")
    r = client.post("/v1/jobs/j1/cancel", headers={"Origin": ORIGIN, "X-Gpuwarden-CSRF": csrf})
    assert r.status_code == 200, r.text
    assert state(api, "j1") is JobState.CANCELLED
    [row] = audits(api, "job.cancel")
    assert row.outcome == "ok" and row.actor == api.id_of("owner")


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ({"Origin": ORIGIN}, "no x-gpuwarden-csrf header"),
        ({"Origin": ORIGIN, "X-Gpuwarden-CSRF": "wrong"}, "does not match"),
        ({"Origin": "https://evil.example", "X-Gpuwarden-CSRF": "{csrf}"}, "Origin"),
        ({"Origin": "null", "X-Gpuwarden-CSRF": "{csrf}"}, "Origin"),
        ({"Sec-Fetch-Site": "same-site", "X-Gpuwarden-CSRF": "{csrf}"}, "Sec-Fetch-Site"),
        ({"Referer": "https://evil.example/x", "X-Gpuwarden-CSRF": "{csrf}"}, "Referer"),
        ({"X-Gpuwarden-CSRF": "{csrf}"}, "no Origin, Sec-Fetch-Site or Referer"),
    ],
)
def test_a_cookie_cancel_cross_site_or_without_csrf_is_refused_and_audited(
    api: Api, headers: dict[str, str], says: str
) -> None:
    client, csrf = signed_in(api, "owner")
    job(api, "owner", "j1")
    sent = {k: v.replace("{csrf}", csrf) for k, v in headers.items()}
    r = client.post("/v1/jobs/j1/cancel", headers=sent)
    assert r.status_code == 403, r.text
    assert says in r.json()["error"] and "browser session" in r.json()["error"]
    assert state(api, "j1") is JobState.QUEUED  # nothing happened
    [row] = audits(api, "job.cancel")
    assert row.outcome.startswith("refused") and row.detail["status"] == 403


@pytest.mark.parametrize(
    "headers",
    [{"Sec-Fetch-Site": "same-origin"}, {"Referer": f"{ORIGIN}/"}],
)
def test_without_origin_sec_fetch_site_or_referer_decide(api: Api, headers: dict[str, str]) -> None:
    client, csrf = signed_in(api, "owner")
    job(api, "owner", "j1")
    r = client.post("/v1/jobs/j1/cancel", headers={**headers, "X-Gpuwarden-CSRF": csrf})
    assert r.status_code == 200, r.text


def test_reads_by_cookie_need_no_csrf_and_bearer_calls_are_unchanged(api: Api) -> None:
    client, _ = signed_in(api, "owner")
    assert client.get("/v1/jobs", headers={"Origin": "https://evil.example"}).status_code == 200
    job(api, "owner", "j2")
    # a bearer token needs neither the page's origin nor a CSRF header
    bearer = TestClient(api.client.app)
    r = bearer.post(
        "/v1/jobs/j2/cancel", headers={**api.h("owner"), "Origin": "https://evil.example"}
    )
    assert r.status_code == 200, r.text


def test_without_the_cookie_an_action_is_401(api: Api) -> None:
    job(api, "owner", "j1")
    r = browser(api).post("/v1/jobs/j1/cancel", headers={"Origin": ORIGIN})
    assert r.status_code == 401
    assert state(api, "j1") is JobState.QUEUED
    r = browser(api).post(
        "/v1/jobs/j1/cancel", headers={"Cookie": f"{SESSION_COOKIE}=made-up", "Origin": ORIGIN}
    )
    assert r.status_code == 401 and "session has ended" in r.json()["error"]


def test_sign_out_ends_the_session_for_a_replayed_cookie_too(api: Api) -> None:
    client, csrf = signed_in(api, "submitter")
    stolen = client.cookies.get(SESSION_COOKIE)
    assert stolen
    refused = client.delete("/v1/session", headers={"Origin": ORIGIN})  # no CSRF header
    assert refused.status_code == 403
    r = client.delete("/v1/session", headers={"Origin": ORIGIN, "X-Gpuwarden-CSRF": csrf})
    assert r.status_code == 200 and r.json() == {"signed_out": True}
    assert any(c.startswith(f"{SESSION_COOKIE}=;") for c in r.headers.get_list("set-cookie"))
    replay = browser(api).get("/v1/jobs", headers={"Cookie": f"{SESSION_COOKIE}={stolen}"})
    assert replay.status_code == 401


def test_a_revoked_token_ends_its_sessions_and_a_restart_ends_all(api: Api) -> None:
    client, _ = signed_in(api, "submitter")
    r = api.client.delete(f"/v1/tokens/{api.id_of('submitter')}", headers=api.h("owner"))
    assert r.status_code == 200
    assert client.get("/v1/jobs").status_code == 401
    other, _ = signed_in(api, "operator")
    assert other.get("/v1/jobs").status_code == 200
    restarted = make_client(api.store, api.config, api.clock)  # a new API process
    cookie = other.cookies.get(SESSION_COOKIE)
    r = restarted.get("/v1/jobs", headers={"Cookie": f"{SESSION_COOKIE}={cookie}"})
    assert r.status_code == 401


def test_sessions_expire() -> None:
    now = [1000.0]
    sessions = Sessions(ttl_s=60, clock=lambda: now[0])
    s = sessions.create("abc")
    assert sessions.get(s.id) == s and len(s.id) >= 43 and s.csrf != s.id
    now[0] += 59
    assert sessions.get(s.id) is not None
    now[0] += 1
    assert sessions.get(s.id) is None and len(sessions) == 0


# -- the dashboard's data -----------------------------------------------------------


def publish(a: Api, **payload: Any) -> None:
    a.store.put_node_status(
        NodeStatus(node="n1", pid=7, updated_at=a.clock.t, payload={"probe": "sim", **payload})
    )


def gpu(uuid: str, holdings: tuple[Holding, ...], degraded: str = "") -> dict[str, Any]:
    view = GpuView(
        uuid=uuid,
        name="Sim GPU",
        total_bytes=24 * GIB,
        reserve_bytes=GIB,
        foreign_bytes=2 * GIB,
        holdings=holdings,
        degraded=degraded,
    )
    return {**view.to_json(), "used_bytes": 9 * GIB, "processes": [], "free_bytes": 0}


def test_overview_shows_holdings_faults_waits_and_only_a_submitters_own_jobs(api: Api) -> None:
    api.clock.t = time.time()
    job(api, "submitter", "mine")
    job(api, "submitter2", "theirs")
    held = (
        Holding(holder="theirs/1", type="echo.echo", bytes=4 * GIB, job_id="theirs"),
        Holding(holder="warm:embed.embed", type="embed.embed", bytes=2 * GIB),
    )
    fault = "hardware fault: Xid 79 (fallen off the bus)"
    publish(
        api,
        gpus=[gpu("GPU-sim-a", held), gpu("GPU-sim-b", (), degraded=fault)],
        degraded={"GPU-sim-b": fault},
        waiting={"mine": "waits for job theirs to end", "theirs": "waits: busy"},
    )
    owner, _ = signed_in(api, "owner")
    doc = owner.get("/v1/dashboard/overview").json()
    [node] = doc["nodes"]
    a, b = node["gpus"]
    assert [h["kind"] for h in a["holdings"]] == ["job", "warm"]
    assert a["holdings"][0]["job"] == "theirs" and a["ledger_bytes"] == 6 * GIB
    assert a["foreign_bytes"] == 2 * GIB and a["reserve_bytes"] == GIB
    assert a["used_bytes"] == 9 * GIB
    assert b["fault"] and b["degraded"] == fault
    assert {q["id"] for q in doc["queued"]} == {"mine", "theirs"}
    assert next(q for q in doc["queued"] if q["id"] == "theirs")["reason"] == "waits: busy"

    sub, _ = signed_in(api, "submitter")
    doc = sub.get("/v1/dashboard/overview").json()
    assert doc["own_jobs_only"]
    [q] = doc["queued"]
    own_id = q["id"]
    assert own_id.endswith("mine") or own_id == "mine"
    assert q["reason"] == "waits for another job to end"
    [held_a] = [h for h in doc["nodes"][0]["gpus"][0]["holdings"] if h["kind"] == "job"]
    assert held_a["job"] is None and "theirs" not in held_a["holder"]
    assert "theirs" not in sub.get("/v1/dashboard/overview").text
    me = sub.get("/v1/session").json()
    assert me["own_jobs_only"] and not any(
        me["can"][a] for a in ("gpu.clear", "node.drain", "node.resume", "node.list")
    )


def test_a_submitter_session_cannot_act_on_anothers_job_or_as_an_admin(api: Api) -> None:
    job(api, "submitter2", "theirs")
    sub, csrf = signed_in(api, "submitter")
    h = {"Origin": ORIGIN, "X-Gpuwarden-CSRF": csrf}
    assert sub.post("/v1/jobs/theirs/cancel", headers=h).status_code == 404
    assert state(api, "theirs") is JobState.QUEUED
    assert sub.post("/v1/gpus/GPU-sim-a/clear", headers=h).status_code == 403
    assert sub.post("/v1/nodes/n1/drain", headers=h).status_code == 403
    assert sub.get("/v1/nodes").status_code == 403


def test_history_samples_the_published_status(api: Api) -> None:
    api.clock.t = time.time()
    held = (Holding(holder="j/1", type="echo.echo", bytes=3 * GIB, job_id="j"),)
    publish(api, gpus=[gpu("GPU-sim-a", held)])
    client, _ = signed_in(api, "operator")
    doc = client.get("/v1/dashboard/history").json()
    assert doc["every_s"] == 10 and doc["keep_s"] == 3600 and doc["since"] is not None
    [g] = doc["gpus"]
    assert g["uuid"] == "GPU-sim-a" and g["total_bytes"] == 24 * GIB
    row = dict(zip(doc["fields"], g["samples"][-1], strict=True))
    assert row["used_bytes"] == 9 * GIB and row["ledger_bytes"] == 3 * GIB
    assert row["foreign_bytes"] == 2 * GIB


def test_stats_give_gpu_hours_by_owner_waits_and_footprints(api: Api) -> None:
    now = time.time()
    for i, owner in enumerate(("owner", "submitter", "submitter")):
        job_id = f"g{i}"
        api.store.submit(
            [JobSpec(id=job_id, type="echo.echo", params={"text": "x"})],
            now=now - 7200,
            origin=Submission(owner=api.id_of(owner)),
        )
        api.store.start_attempt(job_id, node="n1", gpu_uuid="GPU-sim-a", now=now - 3600)
        api.store.finish_attempt(
            job_id, 1, target=JobState.DONE, now=now - 1800, outcome="succeeded", reason="ok"
        )
    owner, _ = signed_in(api, "owner")
    doc = owner.get("/v1/dashboard/stats").json()
    day = {r["name"]: r["hours"] for r in doc["gpu_hours"]["day"]}
    assert day == {"owner": pytest.approx(0.5, abs=0.01), "submitter": pytest.approx(1.0, abs=0.01)}
    assert doc["waits"]["attempts"] == 3 and sum(doc["waits"]["counts"]) == 3
    assert doc["waits"]["counts"][-1] == 3  # an hour's wait: the last bin (>= 1 h)
    assert any(f["type"] == "testmods.gpu" for f in doc["footprints"])
    sub, _ = signed_in(api, "submitter")
    rows = sub.get("/v1/dashboard/stats").json()["gpu_hours"]["week"]
    assert [r["name"] for r in rows] == ["submitter", "everyone else"]
    assert rows[0]["hours"] == pytest.approx(1.0, abs=0.01)


def test_wait_histogram_and_gpu_hours_by_hand() -> None:
    def span(job: str, n: int, start: float, end: float | None, gpu: str | None = "G") -> Any:
        return AttemptSpan(job, n, "t", "o", gpu, 0.0, start, end, None)

    spans = [span("a", 1, 0.5, 10.0), span("a", 2, 40.0, None), span("b", 1, 400.0, 500.0, None)]
    hist = wait_histogram(spans)
    assert hist["attempts"] == 3
    # 0.5 s (from the submission), 30 s (from the first attempt's end), 400 s
    assert hist["counts"][0] == 1 and hist["counts"][3] == 1 and hist["counts"][5] == 1
    hours = gpu_hours(spans, now=3600.0, window_s=3600.0)
    assert hours == {"o": pytest.approx((9.5 + 3560.0) / 3600)}


def test_warm_servers_show_the_grace_left(api: Api) -> None:
    api.clock.t = time.time()
    warm = {"type": "testmods.warm", "gpu": "GPU-sim-a", "state": "idle", "idle_s": 100.0}
    views = [{"type": "testmods.warm", "idle_grace_s": 300.0, "holder": "warm:testmods.warm"}]
    kept = {**warm, "type": "testmods.pinned", "keep_warm": True}
    publish(api, gpus=[gpu("GPU-sim-a", ())], warm=[warm, kept], warm_views=views)
    client, _ = signed_in(api, "operator")
    idle, pinned = client.get("/v1/dashboard/overview").json()["nodes"][0]["warm"]
    assert idle["grace_left_s"] == 200.0 and idle["idle_grace_s"] == 300.0
    assert pinned["grace_left_s"] is None


def test_overview_shows_vram_leases_beside_the_jobs(api: Api) -> None:
    api.clock.t = time.time()
    asked = {}
    for who, size, pin in (("submitter", 3, "GPU-sim-a"), ("submitter2", 5, None)):
        body = {"vram_bytes": size * GIB, "ttl_s": 30, "gpu": pin, "holder": f"{who}'s app"}
        r = api.client.post("/v1/leases", json=body, headers=api.h(who))
        assert r.status_code == 201, r.text
        asked[who] = r.json()["id"]
    mine, theirs = asked["submitter"], asked["submitter2"]
    api.store.start_attempt(mine, node="n1", gpu_uuid="GPU-sim-a", now=api.clock.t - 10)
    leases.grant(leases.attempt_dir_of(api.config.state_dir, mine, 1), 30.0, api.clock.t - 10)
    held = (Holding(holder=f"{mine}/1", type="lease", bytes=3 * GIB, job_id=mine),)
    publish(api, gpus=[gpu("GPU-sim-a", held)], waiting={theirs: "needs 5.0 GiB on one GPU"})

    owner, _ = signed_in(api, "owner")
    doc = owner.get("/v1/dashboard/overview").json()["leases"]
    rows = {x["id"]: x for x in doc["rows"]}
    assert set(rows) == {mine, theirs}
    granted, waiting = rows[mine], rows[theirs]
    assert (granted["state"], granted["gpu"], granted["vram_bytes"]) == (
        "granted", "GPU-sim-a", 3 * GIB
    )  # fmt: skip
    assert granted["holder"] == "submitter's app" and granted["owner"] == "submitter"
    assert 15.0 <= granted["ttl_left_s"] <= 20.0  # granted 10 s ago with a ttl of 30 s
    assert granted["ttl_s"] == 30.0 and granted["pinned"]
    assert granted["reason"] is None
    assert (waiting["state"], waiting["gpu"], waiting["ttl_left_s"]) == ("waiting", None, None)
    assert waiting["owner"] == "submitter2" and waiting["reason"] == "needs 5.0 GiB on one GPU"
    assert doc["totals"] == {"granted": 1, "waiting": 1, "held_bytes": {"GPU-sim-a": 3 * GIB}}
    assert owner.get("/v1/session").json()["can"]["lease.end"]

    sub, _ = signed_in(api, "submitter")
    doc = sub.get("/v1/dashboard/overview").json()["leases"]
    assert [x["id"] for x in doc["rows"]] == [mine]
    assert doc["totals"]["waiting"] == 0 and theirs not in str(doc)


def test_in_a_cluster_the_overview_lists_the_nodes_and_an_operator_drains_one(api: Api) -> None:
    r = api.client.post("/v1/nodes/invite", json={"name": "gpu-a"}, headers=api.h("owner"))
    assert r.status_code == 201, r.text
    invite = r.json()["token"]
    r = api.client.post(
        "/v1/nodes/enroll",
        json={"capabilities": {"gpus": []}},
        headers={"Authorization": f"Bearer {invite}"},
    )
    assert r.status_code == 201, r.text
    agent = {"Authorization": f"Bearer {r.json()['token']}"}
    api.clock.t = time.time()
    fault = "hardware fault: Xid 79"
    reported = {
        "uuid": "GPU-agent-0",
        "name": "A100",
        "total_bytes": 40 * GIB,
        "free_bytes": 20 * GIB,
        "used_bytes": 15 * GIB,
        "ledger_bytes": 12 * GIB,
        "foreign_bytes": GIB,
        "reserve_bytes": GIB,
        "degraded": fault,
    }
    beat = {"report": {"gpus": [reported], "warm": ["embed.minilm"], "max_jobs": 2}}
    assert api.client.post("/v1/node/heartbeat", json=beat, headers=agent).status_code == 200
    op, csrf = signed_in(api, "operator")
    doc = op.get("/v1/dashboard/overview").json()
    [node] = doc["cluster"]
    assert node["name"] == "gpu-a" and node["state"] == "active" and "seen_s_ago" in node
    # its GPUs are drawn from the agent's report: the ledger's total, the device, a fault
    [drawn] = [n for n in doc["nodes"] if n["node"] == "gpu-a"]
    [g] = drawn["gpus"]
    assert g["ledger_bytes"] == 12 * GIB and g["used_bytes"] == 15 * GIB and g["fault"]
    assert [h["kind"] for h in g["holdings"]] == ["ledger"]
    assert [w["type"] for w in drawn["warm"]] == ["embed.minilm"]
    timeline = op.get("/v1/dashboard/history").json()["gpus"]
    [row] = [t for t in timeline if t["uuid"] == "GPU-agent-0"]
    assert row["node"] == "gpu-a" and row["samples"][-1][2] == 12 * GIB
    h = {"Origin": ORIGIN, "X-Gpuwarden-CSRF": csrf}
    assert op.post("/v1/nodes/gpu-a/drain", headers={"Origin": ORIGIN}).status_code == 403
    r = op.post("/v1/nodes/gpu-a/drain", headers=h)
    assert r.status_code == 200 and r.json()["state"] == "draining"
    assert op.post("/v1/nodes/gpu-a/resume", headers=h).json()["resumed"] is True
    sub, _ = signed_in(api, "submitter")
    assert sub.get("/v1/dashboard/overview").json()["cluster"] is None


def test_a_submitters_failures_name_no_other_job(api: Api) -> None:
    job(api, "submitter2", "theirs")
    job(api, "submitter", "mine")
    api.store.start_attempt("mine", node="n1", gpu_uuid="GPU-sim-a", now=2.0)
    api.store.finish_attempt(
        "mine",
        1,
        target=JobState.FAILED,
        now=3.0,
        outcome="cuda_oom",
        reason="CUDA out of memory while its GPU was used by job theirs.",
    )
    sub, _ = signed_in(api, "submitter")
    [failed] = sub.get("/v1/dashboard/overview").json()["failures"]
    assert failed["id"] == "mine" and "theirs" not in failed["reason"]
    assert "another job" in failed["reason"]
    owner, _ = signed_in(api, "owner")
    [seen] = owner.get("/v1/dashboard/overview").json()["failures"]
    assert "by job theirs" in seen["reason"]


def test_attempt_spans_on_every_backend(store: Store) -> None:
    """The store query behind GPU-hours and queue waits: attempts running, or
    ended at ``since`` or later, the latest started first, with their job's owner."""
    store.submit(
        [JobSpec(id=i, type="echo.echo", params={}) for i in ("old", "recent", "live")],
        now=10.0,
        origin=Submission(owner="tok"),
    )
    for job_id, start, end in (("old", 20.0, 30.0), ("recent", 40.0, 60.0), ("live", 70.0, None)):
        store.start_attempt(job_id, node="n", gpu_uuid="G", now=start)
        if end is not None:
            store.finish_attempt(
                job_id, 1, target=JobState.DONE, now=end, outcome="succeeded", reason="ok"
            )
    spans = store.attempt_spans(since=50.0)
    assert [(s.job_id, s.started_at, s.ended_at) for s in spans] == [
        ("live", 70.0, None),
        ("recent", 40.0, 60.0),
    ]
    assert all(s.owner == "tok" and s.submitted_at == 10.0 and s.gpu_uuid == "G" for s in spans)
    assert [s.job_id for s in store.attempt_spans(since=0.0, limit=1)] == ["live"]


def test_the_session_cookie_is_found_beside_another_applications_odd_cookies(api: Api) -> None:
    client, _ = signed_in(api, "owner")
    sid = client.cookies.get(SESSION_COOKIE)
    odd = f'other={{"a": 1}}; broken; {SESSION_COOKIE}={sid}; x="y z"'
    r = browser(api).get("/v1/session", headers={"Cookie": odd})
    assert r.status_code == 200 and r.json()["name"] == "owner"


def test_a_session_cookie_replayed_from_another_address_is_refused(api: Api) -> None:
    client, _ = signed_in(api, "owner")
    stolen = client.cookies.get(SESSION_COOKIE)
    elsewhere = TestClient(api.client.app, client=("10.9.8.7", 4000))
    r = elsewhere.get("/v1/jobs", headers={"Cookie": f"{SESSION_COOKIE}={stolen}"})
    assert r.status_code == 401 and "another address" in r.json()["error"]
    assert client.get("/v1/jobs").status_code == 200  # where it was made, it works
