"""A job's declared run time (``est_s``) through every way in: the bundle manifest,
the checks every submission shares, ``submit --est-s`` into the local store and
over HTTP, the Python client and the API (SPEC.md sections 4, 9 and 11)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden import cli
from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.cli import common
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.errors import BundleError, ValidationError
from gpuwarden.intake.jobs import prepare
from gpuwarden.intake.manifest import manifest_doc, parse_manifest
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
MODULES = [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"]
LOCAL = Principal(token_id="local", name="t", role=Role.OWNER)


def _manifest(**job: Any) -> bytes:
    return json.dumps({"version": 1, "jobs": [{"id": "j1", "type": "echo.echo", **job}]}).encode()


def test_the_manifest_takes_est_s_and_writes_it_back() -> None:
    [job] = parse_manifest(_manifest(est_s=90))
    assert job.est_s == 90.0
    [plain] = parse_manifest(_manifest())
    assert plain.est_s is None
    [back] = parse_manifest(json.dumps(manifest_doc([job])).encode())
    assert back.est_s == 90.0
    assert "est_s" not in manifest_doc([plain])["jobs"][0]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("soon", "est_s must be a number of seconds"),
        (True, "est_s must be a number of seconds"),
        (0, "est_s must be a positive number"),
        (-5, "est_s must be a positive number"),
        (10**9, "est_s must be at most"),
    ],
)
def test_the_manifest_refuses_a_bad_est_s(value: Any, says: str) -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_manifest(est_s=value))
    assert f"jobs[0].{says}" in str(info.value)


def test_every_submission_path_checks_est_s() -> None:
    registry = Registry.load(MODULES)
    assert prepare(registry, JobSpec("a", "echo.echo", {"text": "x"}, est_s=5)).est_s == 5.0
    with pytest.raises(ValidationError, match="job b: est_s must be a positive"):
        prepare(registry, JobSpec("b", "echo.echo", {"text": "x"}, est_s=-1.0))


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_submit_est_s_into_the_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    SqliteStore(state / "gpuwarden.db").close()
    base = ["--state-dir", str(state), "submit", "echo.echo", "--text", "hi"]
    code, _, err = _run(capsys, *base, "--id", "e1", "--est-s", "45")
    assert code == 0, err
    code, _, err = _run(capsys, *base, "--id", "e2", "--est-s", "0")
    assert code == 2 and "est_s must be a positive number" in err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        job = store.get_job("e1")
        assert job is not None and job.est_s == 45.0
        assert store.get_job("e2") is None
    finally:
        store.close()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[SqliteStore, TestClient, str]]:
    config = Config.model_validate(
        {
            "state_dir": tmp_path,
            "module_paths": MODULES,
            "allow_unsandboxed_containers": True,
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )
    store = SqliteStore(tmp_path / "gpuwarden.db")
    _, token = issue_token(store, name="s", role=Role.SUBMITTER, by=LOCAL, now=1.0)
    app = create_app(store, Registry.load(config.module_paths, config.launch_rules), config)
    yield store, TestClient(app), token
    store.close()


def test_the_client_and_the_api_take_est_s(api: tuple[SqliteStore, TestClient, str]) -> None:
    store, tc, token = api
    with c.Client("http://testserver", token, http=TestClient(tc.app)) as client:
        job = client.submit("testmods.gpu", {}, vram_gib=1, est_s=12.5)
        assert job["est_s"] == 12.5 and client.get(job["id"])["est_s"] == 12.5
        stored = store.get_job(job["id"])
        assert stored is not None and stored.est_s == 12.5
        assert client.submit("testmods.gpu", {}, vram_gib=1)["est_s"] is None
        with pytest.raises(c.RequestRefused, match="est_s"):
            client.submit("testmods.gpu", {}, vram_gib=1, est_s=-3)


def test_submit_url_passes_est_s(
    api: tuple[SqliteStore, TestClient, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    store, tc, token = api
    monkeypatch.setattr(
        common, "remote", lambda args: c.Client("http://testserver", token, http=TestClient(tc.app))
    )
    code, _, err = _run(capsys, "submit", "--url", "http://testserver", "testmods.gpu",
                          "--id", "r1", "--vram-gib", "1", "--est-s", "300")  # fmt: skip
    assert code == 0, err
    job = store.get_job(f"{token[3:15]}-r1")
    assert job is not None and job.est_s == 300.0


def test_a_coordinators_claim_hands_the_agent_the_jobs_est_s(store: Store) -> None:
    """On both stores: the payload an agent puts into its own store carries est_s."""
    assert isinstance(store, ClusterStore)
    registry = Registry.load(MODULES)
    store.create_token(
        token_id="a" * 12, name="n", role=Role.NODE, secret_hash="x", now=0.0,
        created_by="local", node="n",
    )  # fmt: skip
    co.enroll(store, "n", token_id="a" * 12, capabilities={}, now=0.0)
    gpu = {"uuid": "G", "name": "sim", "total_bytes": 24 * GIB, "free_bytes": 24 * GIB}
    store.touch_node(
        "n",
        {"gpus": [{**gpu, "usable_bytes": 24 * GIB}], "warm": [], "busy": 0, "max_jobs": 4,
         "labels": {}, "accepting": True},
        0.0,
    )  # fmt: skip
    store.submit(
        [
            JobSpec("e", "testmods.gpu", {"gib": 1}, vram_bytes=GIB, est_s=20),
            JobSpec("p", "testmods.gpu", {"gib": 1}, vram_bytes=GIB),
        ],
        now=1.0,
    )
    record = store.get_node("n")
    assert record is not None
    got = co.claim(store, registry, "n", nv.node_view(record), 2.0, lease_s=5.0)
    assert {p["id"]: p["est_s"] for p in got} == {"e": 20.0, "p": None}
