"""Job constraints from the command line (`--constraint KEY=VALUE`) and the client:
straight into the local store, and through the HTTP API (`--url`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpuwarden import cli
from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.cli import common
from gpuwarden.cli.submit import parse_constraints
from gpuwarden.config import Config
from gpuwarden.core.model import GIB, Role
from gpuwarden.errors import ValidationError
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[2]
LOCAL = Principal(token_id="local", name="t", role=Role.OWNER)


def test_parse_constraints() -> None:
    got = parse_constraints(
        ["min_gpu_vram_gib=40", "gpu_model=H100", "node=n1", "label.rack=a", "label.zone=x=y"]
    )
    assert got == {
        "min_gpu_vram_gib": 40,
        "gpu_model": "H100",
        "node": "n1",
        "labels": {"rack": "a", "zone": "x=y"},
    }
    assert parse_constraints(["min_gpu_vram_gib=0.5"]) == {"min_gpu_vram_gib": 0.5}
    assert parse_constraints([]) == {}
    for bad, says in [
        ("node", "write it as KEY=VALUE"),
        ("=x", "write it as KEY=VALUE"),
        ("label.=x", "name the label"),
        ("labels=a", "label.KEY=VALUE"),
        ("min_gpu_vram_gib=lots", "must be a number"),
    ]:
        with pytest.raises(ValidationError, match=says):
            parse_constraints([bad])


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_submit_with_constraints_into_the_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    state = tmp_path / "state"
    store = SqliteStore(state / "gpuwarden.db")
    store.close()
    base = ["--state-dir", str(state), "submit", "echo.echo", "--text", "hi"]
    code, _, err = _run(capsys, *base, "--id", "c1", "--constraint", "node=n1",
                        "--constraint", "label.rack=a")  # fmt: skip
    assert code == 0, err
    code, _, err = _run(capsys, *base, "--constraint", "gpu_model=A100")
    assert code == 2 and "runs on the cpu lane" in err
    code, _, err = _run(capsys, *base, "--constraint", "zone=x")
    assert code == 2 and "unknown constraint 'zone'" in err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        job = store.get_job("c1")
        assert job is not None and job.constraints == {"node": "n1", "labels": {"rack": "a"}}
        # once a node is enrolled, a job none can run is refused here too
        store.upsert_node("n2", token_id="t" * 12, capabilities={}, now=1.0)
    finally:
        store.close()
    code, _, err = _run(capsys, *base, "--constraint", "node=n1")
    assert code == 2 and "no node can ever run it: n2: the job asks for node 'n1'" in err


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[SqliteStore, TestClient, str]]:
    config = Config.model_validate(
        {
            "state_dir": tmp_path,
            "module_paths": [REPO / "src" / "gpuwarden" / "modules", REPO / "tests" / "modules"],
            "allow_unsandboxed_containers": True,
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )
    store = SqliteStore(tmp_path / "gpuwarden.db")
    _, token = issue_token(store, name="s", role=Role.SUBMITTER, by=LOCAL, now=1.0)
    app = create_app(store, Registry.load(config.module_paths, config.launch_rules), config)
    yield store, TestClient(app), token
    store.close()


def test_the_client_sends_constraints(api: tuple[SqliteStore, TestClient, str]) -> None:
    store, tc, token = api
    with c.Client("http://testserver", token, http=TestClient(tc.app)) as client:
        want = {"min_gpu_vram_gib": 8, "labels": {"rack": "a"}}
        job = client.submit("testmods.gpu", {}, vram_gib=1, constraints=want)
        assert job["constraints"] == want
        assert client.get(job["id"])["constraints"] == want
        store.upsert_node("n1", token_id="t" * 12, capabilities={}, now=1.0)
        store.touch_node(
            "n1",
            {"gpus": [{"uuid": "G", "name": "sim", "total_bytes": 80 * GIB, "free_bytes": 0}]},
            2.0,
        )
        with pytest.raises(c.RequestRefused, match=r"needs 100\.0 GiB on one GPU"):
            client.submit("testmods.gpu", {}, vram_gib=100)


def test_submit_url_passes_constraints(
    api: tuple[SqliteStore, TestClient, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    store, tc, token = api
    monkeypatch.setattr(
        common, "remote", lambda args: c.Client("http://testserver", token, http=TestClient(tc.app))
    )
    code, out, err = _run(capsys, "submit", "--url", "http://testserver", "testmods.gpu",
                          "--id", "r1", "--vram-gib", "1", "--constraint", "gpu_model=sim",
                          "--constraint", "label.rack=a")  # fmt: skip
    assert code == 0, err
    r1 = f"{token[3:15]}-r1"  # a submitter's job ids begin with its token id
    assert f"submitted {r1}" in out
    job = store.get_job(r1)
    assert job is not None and job.constraints == {"gpu_model": "sim", "labels": {"rack": "a"}}
