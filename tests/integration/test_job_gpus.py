"""A job's own ``gpus`` through every way in: the bundle manifest (read and written
back), the checks every submission shares, ``submit --gpus`` into the local store
and over HTTP, the Python client and the API, and a coordinator's claim (SPEC.md
sections 4, 9 and 16)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden import client as c
from gpuwarden.cli import common
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.errors import BundleError
from gpuwarden.intake.manifest import manifest_doc, parse_manifest
from gpuwarden.node import explain
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_est_s import MODULES, _run, api

__all__ = ["api"]  # the fixture, shared with test_est_s


def _manifest(**job: Any) -> bytes:
    body = {"id": "j1", "type": "testmods.pair", **job}
    return json.dumps({"version": 1, "jobs": [body]}).encode()


def test_the_manifest_takes_gpus_and_writes_it_back() -> None:
    [job] = parse_manifest(_manifest(gpus=4))
    assert job.gpus == 4
    [plain] = parse_manifest(_manifest())
    assert plain.gpus is None and "gpus" not in manifest_doc([plain])["jobs"][0]
    [back] = parse_manifest(json.dumps(manifest_doc([job])).encode())
    assert back.gpus == 4


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (2.0, "gpus must be an integer"),
        (0, "gpus must be from 1 to 64, got 0"),
        (65, "gpus must be from 1 to 64, got 65"),
    ],
)
def test_the_manifest_refuses_a_bad_gpus(value: Any, says: str) -> None:
    with pytest.raises(BundleError) as info:
        parse_manifest(_manifest(gpus=value))
    assert f"jobs[0].{says}" in str(info.value)


def test_submit_gpus_into_the_local_store(
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    state = tmp_path / "state"
    config = tmp_path / "gpuwarden.toml"
    paths = ", ".join(f'"{m}"' for m in MODULES)
    config.write_text(
        f'state_dir = "{state}"\nmodule_paths = [{paths}]\nallow_unsandboxed_containers = true\n'
    )
    SqliteStore(state / "gpuwarden.db").close()
    base = ["--config", str(config), "submit", "testmods.pair"]
    code, _, err = _run(capsys, *base, "--id", "p3", "--gpus", "3")
    assert code == 0, err
    code, _, err = _run(capsys, *base, "--id", "p0", "--gpus", "0")
    assert code == 2 and "gpus must be from 1 to 64, got 0" in err
    code, _, err = _run(capsys, *base[:-1], "echo.echo", "--text", "x", "--id", "e", "--gpus", "2")
    assert code == 2 and "cpu lane" in err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        job = store.get_job("p3")
        assert job is not None and job.gpus == 3
        assert store.get_job("p0") is None and store.get_job("e") is None
        [entry] = store.queue_entries()
        assert entry.gpus == 3
        # explain and preview plan with it (their view of the queue)
        [queued] = explain.queued_entries(store, Registry.load(MODULES))
        assert queued.id == "p3" and queued.gpus == 3
    finally:
        store.close()


def test_the_client_and_the_api_take_gpus(api: tuple[SqliteStore, TestClient, str]) -> None:
    store, tc, token = api
    with c.Client("http://testserver", token, http=TestClient(tc.app)) as client:
        job = client.submit("testmods.pair", {}, gpus=2)
        assert job["gpus"] == 2 and client.get(job["id"])["gpus"] == 2
        stored = store.get_job(job["id"])
        assert stored is not None and stored.gpus == 2
        assert client.submit("testmods.pair", {})["gpus"] is None
        with pytest.raises(c.RequestRefused, match="gpus"):
            client.submit("testmods.pair", {}, gpus=0)
        with pytest.raises(c.RequestRefused, match="cpu lane"):
            client.submit("echo.echo", {"text": "x"}, gpus=2)


def test_submit_url_passes_gpus(
    api: tuple[SqliteStore, TestClient, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    store, tc, token = api
    monkeypatch.setattr(
        common, "remote", lambda args: c.Client("http://testserver", token, http=TestClient(tc.app))
    )
    code, _, err = _run(
        capsys, "submit", "--url", "http://testserver", "testmods.pair", "--id", "r", "--gpus", "2"
    )
    assert code == 0, err
    job = store.get_job(f"{token[3:15]}-r")
    assert job is not None and job.gpus == 2


def _node(store: ClusterStore, name: str, gpus: int) -> None:
    store.create_token(
        token_id=name[0] * 12, name=name, role=Role.NODE, secret_hash="x", now=0.0,
        created_by="local", node=name,
    )  # fmt: skip
    co.enroll(store, name, token_id=name[0] * 12, capabilities={}, now=0.0)
    room = [
        {"uuid": f"{name}-{i}", "name": "sim", "total_bytes": 24 * GIB, "free_bytes": 24 * GIB,
         "usable_bytes": 24 * GIB}
        for i in range(gpus)
    ]  # fmt: skip
    report = {"gpus": room, "warm": [], "busy": 0, "max_jobs": 4, "labels": {}, "accepting": True}
    store.touch_node(name, report, 0.0)


def test_a_coordinator_offers_a_multi_gpu_job_only_to_a_node_with_its_gpus(store: Store) -> None:
    """On both stores: the one-GPU node is offered only the one-GPU job; the two-GPU
    node gets the pair, and the payload an agent stores carries its gpus."""
    assert isinstance(store, ClusterStore)
    registry = Registry.load(MODULES)
    _node(store, "one", 1)
    _node(store, "two", 2)
    store.submit(
        [
            JobSpec("pair", "testmods.pair", {}),  # its type's gpus: 2
            JobSpec("four", "testmods.pair", {}, gpus=4),  # no node has four
            JobSpec("solo", "testmods.pair", {}, gpus=1),
        ],
        now=1.0,
    )

    def claim(name: str) -> dict[str, Any]:
        record = store.get_node(name)
        assert record is not None
        got = co.claim(store, registry, name, nv.node_view(record), 2.0, lease_s=5.0)
        return {p["id"]: p["gpus"] for p in got}

    assert claim("one") == {"solo": 1}
    assert claim("two") == {"pair": None}  # None: its type's count, 2
