"""A job's ``source = {repo, commit}`` through every way in: the manifest read and
written back, ``submit --source-repo/--source-commit`` into the local store and
over ``--url``, the client and the API, a coordinator's payload to its agent; and
each refusal (a branch, a short id, a URL outside ``[sources] allow``, a node with
no container runtime) said clearly through each (SPEC.md, "Jobs from a pinned
commit"). No container runtime is needed: nothing here runs the job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden import client as c
from gpuwarden.api.app import create_app
from gpuwarden.api.auth import issue_token
from gpuwarden.app import source_cache
from gpuwarden.cli import common
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.cluster.sync import payload_source
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec, Role
from gpuwarden.core.sources import JobSource
from gpuwarden.errors import BundleError
from gpuwarden.intake.manifest import manifest_doc, parse_manifest
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_est_s import LOCAL, MODULES, _run
from tests.integration.test_job_gpus import _node
from tests.sourcerepo import make_repo

SHA = "0123456789abcdef0123456789abcdef01234567"
#: a pinned sandbox image's id (nothing here runs it)
IMAGE = "sha256:" + "ab" * 32


@pytest.fixture
def repo(tmp_path: Path) -> tuple[str, str]:
    commit = make_repo(tmp_path / "repo")
    return f"file://{tmp_path / 'repo'}", commit


def _manifest(**job: Any) -> bytes:
    body = {"id": "j1", "type": "mymod.train", **job}
    return json.dumps({"version": 1, "jobs": [body]}).encode()


def test_the_manifest_takes_a_source_and_writes_it_back() -> None:
    source = {"repo": "https://git.example.org/team/mymod", "commit": SHA}
    [job] = parse_manifest(_manifest(source=source))
    assert job.source == JobSource(source["repo"], SHA)
    [plain] = parse_manifest(_manifest())
    assert plain.source is None and "source" not in manifest_doc([plain])["jobs"][0]
    # a prepared job's stored type (mymod.train@SHA) is written as module.toml names it
    stored = JobSpec("j1", f"mymod.train@{SHA}", source=job.source)
    [entry] = manifest_doc([stored])["jobs"]
    assert entry["type"] == "mymod.train" and entry["source"] == source
    [back] = parse_manifest(json.dumps(manifest_doc([stored])).encode())
    assert back.source == job.source and back.type == "mymod.train"


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"repo": "https://git.example.org/m", "commit": "main"}, "branches and tags are refused"),
        ({"repo": "https://git.example.org/m", "commit": SHA[:12]}, "is a short commit id"),
        ({"repo": "git.example.org:team/m", "commit": SHA}, "must start with https://"),
        ({"repo": "https://u:pw@git.example.org/m", "commit": SHA}, "holds credentials"),
        ({"repo": "https://git.example.org/m"}, "key 'commit' is missing"),
        ("https://git.example.org/m", "must be a table"),
    ],
)
def test_the_manifest_refuses_a_bad_source(source: Any, says: str) -> None:
    with pytest.raises(BundleError, match=says) as got:
        parse_manifest(_manifest(source=source))
    assert "pw" not in str(got.value)


def _config(tmp_path: Path, *, allow: str, runtime: str = "podman") -> Path:
    state = tmp_path / "state"
    config = tmp_path / "gpuwarden.toml"
    paths = ", ".join(f'"{m}"' for m in MODULES)
    config.write_text(
        f'state_dir = "{state}"\nmodule_paths = [{paths}]\ncontainer_runtime = "{runtime}"\n'
        f'sandbox_image = "{IMAGE if runtime == "podman" else ""}"\n'
        f"[sources]\nallow = [{allow}]\n"
    )
    SqliteStore(state / "gpuwarden.db").close()
    return config


def test_submit_a_source_into_the_local_store(
    tmp_path: Path,
    repo: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    url, commit = repo
    config = _config(tmp_path, allow=f'"file://{tmp_path}/*"')
    base = ["--config", str(config), "submit", "mymod.train", "--source-repo", url]
    code, _, err = _run(capsys, *base, "--id", "s1", "--source-commit", commit)
    assert code == 0, err
    code, _, err = _run(capsys, *base, "--id", "s2", "--source-commit", "main")
    assert code == 2 and "branches and tags are refused" in err
    code, _, err = _run(capsys, *base, "--id", "s3", "--source-commit", commit[:10])
    assert code == 2 and "is a short commit id" in err
    code, _, err = _run(capsys, *base, "--id", "s4")
    assert code == 2 and "--source-repo and --source-commit go together" in err
    elsewhere = ["--source-repo", "https://git.example.org/team/mymod", "--source-commit", commit]
    code, _, err = _run(capsys, "--config", str(config), "submit", "mymod.train", *elsewhere)
    assert code == 2 and "is not allowed on this node" in err
    store = SqliteStore(tmp_path / "state" / "gpuwarden.db")
    try:
        job = store.get_job("s1")
        assert job is not None and job.source == JobSource(url, commit)
        assert job.type == f"mymod.train@{commit}"
        assert [j.id for j in store.list_jobs()] == ["s1"]
    finally:
        store.close()


def test_a_node_without_a_container_runtime_refuses_a_source(
    tmp_path: Path,
    repo: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    url, commit = repo
    config = _config(tmp_path, allow=f'"file://{tmp_path}/*"', runtime="local")
    code, _, err = _run(
        capsys, "--config", str(config), "submit", "mymod.train",
        "--source-repo", url, "--source-commit", commit,
    )  # fmt: skip
    assert code == 2 and "built into an image and run by podman or docker" in err


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[SqliteStore, TestClient, str]]:
    config = Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "module_paths": MODULES,
            "container_runtime": "podman",
            "sandbox_image": IMAGE,
            "allow_host_jobs": True,
            "sources": {"allow": [f"file://{tmp_path}/*"]},
            "api": {"rate_per_s": 10_000, "burst": 10_000},
        }
    )
    store = SqliteStore(tmp_path / "gpuwarden.db")
    _, token = issue_token(store, name="s", role=Role.SUBMITTER, by=LOCAL, now=1.0)
    registry = Registry.load(config.module_paths, config.launch_rules)
    registry.sources = source_cache(config)
    yield store, TestClient(create_app(store, registry, config)), token
    store.close()


def test_the_client_and_the_api_take_a_source(
    api: tuple[SqliteStore, TestClient, str], repo: tuple[str, str]
) -> None:
    store, tc, token = api
    url, commit = repo
    with c.Client("http://testserver", token, http=TestClient(tc.app)) as client:
        job = client.submit("mymod.train", source={"repo": url, "commit": commit})
        assert job["source"] == {"repo": url, "commit": commit}
        assert job["type"] == f"mymod.train@{commit}"
        assert client.get(job["id"])["source"] == {"repo": url, "commit": commit}
        stored = store.get_job(job["id"])
        assert stored is not None and stored.source == JobSource(url, commit)
        again = client.submit("mymod.train", source_repo=url, source_commit=commit)
        assert again["source"] == job["source"]
        assert client.submit("testmods.sleep", {})["source"] is None
        refusals = [
            ({"source_repo": url, "source_commit": "main"}, "branches and tags are refused"),
            ({"source_repo": url, "source_commit": commit[:8]}, "is a short commit id"),
            # the commit is known here by now: the URL is still judged
            ({"source_repo": "https://git.example.org/x", "source_commit": commit}, "not allowed"),
            ({"source_repo": url}, "commit"),
        ]
        for kwargs, says in refusals:
            with pytest.raises(c.RequestRefused, match=says):
                client.submit("mymod.train", **kwargs)


def test_submit_url_passes_a_source(
    api: tuple[SqliteStore, TestClient, str],
    repo: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    store, tc, token = api
    url, commit = repo
    monkeypatch.setattr(
        common, "remote", lambda args: c.Client("http://testserver", token, http=TestClient(tc.app))
    )
    base = ["submit", "--url", "http://testserver", "mymod.train", "--source-repo", url]
    code, _, err = _run(capsys, *base, "--id", "r", "--source-commit", commit)
    assert code == 0, err
    job = store.get_job(f"{token[3:15]}-r")
    assert job is not None and job.source == JobSource(url, commit)
    code, _, err = _run(capsys, *base, "--id", "r2", "--source-commit", "v1.0")
    assert code == 2 and "branches and tags are refused" in err


def test_a_coordinator_sends_the_source_to_its_agent(
    store: Store, tmp_path: Path, repo: tuple[str, str]
) -> None:
    """On both stores: the source is stored with the job and goes in the payload a
    node that runs jobs from commits of its repository is sent when it claims it;
    the agent reads it back into its JobSpec."""
    assert isinstance(store, ClusterStore)
    url, commit = repo
    registry = Registry.load(MODULES)
    registry.sources = source_cache(
        Config.model_validate(
            {"state_dir": tmp_path / "c", "container_runtime": "podman",
             "sources": {"allow": ["file:///**"]}}
        )
    )  # fmt: skip
    source = JobSource(url, commit)
    stored_type = registry.from_source(source, "mymod.train").name
    _node(store, "one", 1)
    record = store.get_node("one")
    assert record is not None  # it says it runs jobs from commits of this repository
    sources = {"runs": True, "allow": ["file:///**"]}
    store.touch_node("one", {**record.report, "sources": sources}, 0.5)
    store.submit([JobSpec("s", stored_type, {}, source=source)], now=1.0)
    job = store.get_job("s")
    assert job is not None and job.source == source
    record = store.get_node("one")
    assert record is not None
    [payload] = co.claim(store, registry, "one", nv.node_view(record), 2.0, lease_s=5.0)
    assert payload["source"] == {"repo": url, "commit": commit}
    assert payload["type"] == stored_type
    assert payload_source(payload["source"]) == source
    assert payload_source({"repo": url, "commit": "main"}) is None


def test_the_api_never_echoes_a_password_in_a_source(
    api: tuple[SqliteStore, TestClient, str],
) -> None:
    _, tc, token = api
    body = {"type": "mymod.train", "source": {"repo": "https://u:s3cret@h.org/m", "commit": SHA}}
    r = tc.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 422 and "holds credentials" in r.text, r.text
    assert "s3cret" not in r.text
