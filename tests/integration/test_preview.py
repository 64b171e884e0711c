"""``preview`` beyond the host's own store (issue 31: it had no ``--url`` and
ignored ``GPUWARDEN_URL``; against a cluster it answered for a local node with no
GPU): ``GET /v1/preview`` on a broker's API and on a coordinator (each node's
answer), and the CLI's ``preview --url``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpuwarden import cli
from gpuwarden import client as gwclient
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.app import Node, open_node
from gpuwarden.cli.httpserver import ApiThread
from gpuwarden.core.model import Role
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_broker import make_config as node_config
from tests.integration.test_coordinator import enrol

ADMIN = Principal(token_id="local", name="t", role=Role.OWNER)
MODULES = [
    Path(__file__).resolve().parents[2] / p for p in ("src/gpuwarden/modules", "tests/modules")
]


def _client(store: Store, config: object, registry: Registry) -> tuple[TestClient, str]:
    _, token = issue_token(store, name="sub", role=Role.SUBMITTER, by=ADMIN, now=time.time())
    return TestClient(create_app(store, registry, config)), token  # type: ignore[arg-type]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with open_node(node_config(tmp_path), mock_gpu=True) as n:
        n.broker.tick()  # its status is published
        yield n


def test_the_api_previews_against_its_brokers_last_status(node: Node) -> None:
    http, token = _client(node.store, node.config, node.broker.registry)
    h = {"Authorization": f"Bearer {token}"}
    r = http.get("/v1/preview", params={"type": "testmods.gpu", "vram_gib": 4}, headers=h)
    assert r.status_code == 200, r.text
    lines = r.json()["lines"]
    assert lines[0] == "testmods.gpu: footprint 4.0 GiB"
    assert lines[1].startswith("would start now on GPU-sim-"), lines
    assert lines[-1].startswith("(as seen by the broker on ")
    assert node.store.list_jobs() == []  # nothing submitted
    cpu = http.get("/v1/preview", params={"type": "echo.echo", "vram_gib": 1}, headers=h)
    assert cpu.status_code == 422 and "cpu lane" in cpu.json()["error"]
    unknown = http.get("/v1/preview", params={"type": "no.such"}, headers=h)
    assert unknown.status_code == 422 and "no.such" in unknown.json()["error"]
    with gwclient.Client("http://testserver", token, http=http) as c:
        assert c.preview("testmods.gpu", vram_gib=4) == lines


def test_without_a_brokers_status_the_api_says_so(tmp_path: Path, node: Node) -> None:
    bare = SqliteStore(tmp_path / "bare.db")
    try:
        http, token = _client(bare, node.config, node.broker.registry)
        r = http.get(
            "/v1/preview",
            params={"type": "testmods.gpu"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200
        [line] = r.json()["lines"]
        assert "no broker has published its status here lately" in line
    finally:
        bare.close()


def test_a_coordinator_previews_what_each_node_would_do(store: Store, tmp_path: Path) -> None:
    """On both stores: each node's answer, as explain gives it for a queued job."""
    assert isinstance(store, ClusterStore)
    registry = Registry.load(MODULES)
    now = time.time()
    enrol(store, "big", 80, now=now)
    enrol(store, "small", 8, now=now)
    config = node_config(tmp_path)
    http, token = _client(store, config, registry)
    r = http.get(
        "/v1/preview",
        params={"type": "testmods.gpu", "vram_gib": 20},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200, r.text
    lines = r.json()["lines"]
    assert lines[0] == "testmods.gpu: footprint 20.0 GiB"
    by_node = {ln.split()[1]: ln for ln in lines if ln.startswith("node ")}
    assert set(by_node) == {"big", "small"}, lines
    assert "could take it" in by_node["big"]
    assert "could take it" not in by_node["small"]
    assert lines[-1] == "(as the coordinator sees its 2 node(s))"
    assert store.list_jobs() == []


def test_preview_url_asks_the_api(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI over HTTP, against a real API server on the broker's store."""
    _, token = issue_token(node.store, name="sub", role=Role.SUBMITTER, by=ADMIN, now=time.time())
    api_store = SqliteStore(node.config.db_path)  # the API's own connection
    thread = ApiThread(api_store, node.broker.registry, node.config, "127.0.0.1", 0, name="pv")
    assert thread.start()
    try:
        env = ["--url", thread.url]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GPUWARDEN_TOKEN", token)
            code = cli.main(["preview", "testmods.gpu", "--vram-gib", "3", *env])
        out = capsys.readouterr().out.splitlines()
        assert code == 0, out
        assert out[0] == "testmods.gpu: footprint 3.0 GiB"
        assert out[1].startswith("would start now on GPU-sim-"), out
        assert out[-1].startswith("(as seen by the broker on testnode")
    finally:
        thread.stop()
        api_store.close()
