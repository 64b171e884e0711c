"""gpuwarden.client.Client against the API app in this process (no sockets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
LOCAL = Principal(token_id="local", name="t", role=Role.OWNER)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[SqliteStore, TestClient, dict[str, str]]]:
    config = Config.model_validate(
        {
            "state_dir": tmp_path,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules"],
            "api": {"rate_per_s": 0.001, "burst": 30},
        }
    )
    store = SqliteStore(tmp_path / "gpuwarden.db")
    tokens = {
        role.value: issue_token(store, name=role.value, role=role, by=LOCAL, now=1.0)[1]
        for role in (Role.OWNER, Role.SUBMITTER)
    }
    app = create_app(store, Registry.load(config.module_paths, config.launch_rules), config)
    yield store, TestClient(app), tokens
    store.close()


def client(tc: TestClient, token: str | None) -> c.Client:
    return c.Client("http://testserver", token, http=TestClient(tc.app))


def test_submit_get_list_cancel_and_errors(setup: tuple[SqliteStore, TestClient, dict]) -> None:
    _, tc, tokens = setup
    with client(tc, tokens["submitter"]) as api:
        job = api.submit("echo.echo", {"text": "hi"}, id="c-1", priority=2, idempotency_key="k")
        # a submitter's job ids begin with its token id; it may leave that out
        full = f"{tokens['submitter'][3:15]}-c-1"
        assert job["id"] == full and job["priority"] == 2
        assert (
            api.submit("echo.echo", {"text": "hi"}, id="c-1", priority=2, idempotency_key="k")["id"]
            == full
        )
        assert [j["id"] for j in api.list(states=["queued"])] == [full]
        assert api.get("c-1")["events"][0]["event"] == "submitted"
        assert api.get(full)["id"] == full
        assert api.explain("c-1")[0] == f"{full} (echo.echo) is queued"
        with pytest.raises(c.Conflict, match="is queued"):
            api.result("c-1")
        assert api.cancel("c-1")["state"] == "cancelled"
        with pytest.raises(c.Conflict, match="already ended"):
            api.cancel("c-1")
        with pytest.raises(c.NotFound, match="no job with id 'nope'") as nf:
            api.get("nope")
        assert nf.value.status == 404 and isinstance(nf.value, UserError)
        with pytest.raises(c.Invalid, match="unknown parameter"):
            api.submit("echo.echo", {"txt": "x"})
        with pytest.raises(c.Forbidden, match="needs the role owner"):
            api.tokens()
        assert {t["type"] for t in api.types()} >= {"echo.echo"}
        assert api.status() == {"nodes": [], "jobs": {"cancelled": 1}}
    with client(tc, None) as anon:
        assert anon.health()["ok"]
        with pytest.raises(c.Unauthorized, match="no token"):
            anon.list()
    with client(tc, tokens["owner"]) as owner:
        made = owner.create_token("bot", "submitter")
        assert made["token"].startswith("gw_") and made["role"] == "submitter"
        assert owner.revoke_token(made["id"])["revoked_at"] is not None
        assert [r["action"] for r in owner.audit()][-1] == "token.revoke"


def test_rate_limited_carries_retry_after(setup: tuple[SqliteStore, TestClient, dict]) -> None:
    _, tc, tokens = setup
    with client(tc, tokens["submitter"]) as api:
        with pytest.raises(c.RateLimited) as info:
            for _ in range(40):
                api.list()
        assert info.value.status == 429 and info.value.retry_after >= 1


def test_wait_and_download(setup: tuple[SqliteStore, TestClient, dict], tmp_path: Path) -> None:
    store, tc, tokens = setup
    api = client(tc, tokens["submitter"])
    job = api.submit("echo.echo", {"text": "x"}, id="w-1")
    full = job["id"]
    seen: list[str] = []
    out = tmp_path / "jobs" / full / "attempt-1" / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "f.txt").write_bytes(b"data" * 1000)

    def progress(j: dict) -> None:
        seen.append(j["state"])
        if j["state"] == "queued":
            store.start_attempt(full, node="n", gpu_uuid=None, now=2.0)
        elif j["state"] == "running":
            store.finish_attempt(
                full,
                1,
                target=JobState.DONE,
                now=3.0,
                outcome="succeeded",
                reason="done",
                result={"outputs": ["sub/f.txt"], "output_dir": str(out)},
            )

    done = api.wait(job["id"], timeout=30, progress=progress)
    assert done["state"] == "done" and seen == ["queued", "running", "done"]
    assert api.result("w-1")["outputs"] == ["sub/f.txt"]
    dest = tmp_path / "got"
    dest.mkdir()
    path = api.download("w-1", "sub/f.txt", dest)
    assert path == dest / "sub" / "f.txt" and path.read_bytes() == b"data" * 1000
    with pytest.raises(c.NotFound):
        api.download("w-1", "other.txt", tmp_path / "x.txt")
    assert not (tmp_path / "x.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
    # a path that could lead out of the folder is refused before anything is sent or made
    inner = tmp_path / "inner"
    inner.mkdir()
    for bad in ("../escape.txt", "/etc/x", "a//b", "sub/./f.txt"):
        with pytest.raises(c.Invalid, match="must be relative"):
            api.download("w-1", bad, inner)
    assert list(inner.iterdir()) == [] and not (tmp_path / "escape.txt").exists()
    # a refused name makes no folder either
    with pytest.raises(c.Invalid, match="255 bytes"):
        api.download("w-1", "deep/" + "x" * 300, inner)
    assert list(inner.iterdir()) == []
    store.submit(
        [JobSpec(id="never", type="echo.echo", params={"text": "x"})],
        now=1.0,
        origin=Submission(owner=tokens["submitter"][3:15]),
    )
    with pytest.raises(TimeoutError):
        api.wait("never", timeout=0.3)
    api.close()


def test_unreachable_server() -> None:
    with (
        c.Client("http://127.0.0.1:1", "gw_x", timeout=2) as api,
        pytest.raises(c.Unreachable, match="cannot reach"),
    ):
        api.list()


def test_submit_with_after(setup: tuple[SqliteStore, TestClient, dict[str, str]]) -> None:
    _, tc, tokens = setup
    with client(tc, tokens["submitter"]) as api:
        first = api.submit("echo.echo", {"text": "1"}, id="step-1")
        second = api.submit("echo.echo", {"text": "2"}, id="step-2", after=["afterok:step-1"])
        assert second["after"] == [f"afterok:{first['id']}"] and second["held"] is True
        assert api.get("step-2")["reason"] == f"waits for job {first['id']} (queued)"
        with pytest.raises(c.Invalid, match="no job with id 'ghost'"):
            api.submit("echo.echo", {"text": "3"}, after=["afterok:ghost"])
