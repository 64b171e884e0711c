"""Jobs from a pinned commit on a coordinator (SPEC.md section 20, "Across hosts"),
on both stores, through its HTTP API with injected time: the coordinator takes such
a job at submission (it reads the commit's module.toml under its own ``[sources]
allow``; its own container runtime does not count), refuses a branch, a short id,
credentials and a URL outside its allow list (storing nothing); a node is offered
the job only when its report says it runs jobs from commits of that repository,
and ``explain`` says why the job waits otherwise; the finish's image goes into
the end event with the node. No container runtime is needed: nothing runs here
(tests/acceptance/test_cluster_sources.py runs one with podman)."""

from __future__ import annotations

import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuwarden.api.app import create_app
from gpuwarden.api.auth import Principal, issue_token
from gpuwarden.api.routers.nodes import install_coordinator
from gpuwarden.app import coordinator_source_cache
from gpuwarden.client import Client, RequestRefused
from gpuwarden.cluster.coordinator_client import source_ability
from gpuwarden.cluster.queues import QueueWatcher
from gpuwarden.config import Config
from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.sources import JobSource
from gpuwarden.intake.bundlewrite import write_bundle
from gpuwarden.intake.queueroot import QueueRoot
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_est_s import MODULES, _run
from tests.integration.test_job_gpus import _node
from tests.sourcerepo import MODULE_TOML, SECRET_TOML, git, make_repo

ADMIN = Principal(token_id="local", name="tester", role=Role.OWNER)

#: the repository's module with a parameter (checked by the coordinator)
WITH_PARAM = MODULE_TOML + '\n[types.train.params.steps]\ntype = "integer"\ndefault = 1\n'


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Coord:
    """A coordinator's API over ``store``: its own [sources] allow is ``allow``, its
    own container_runtime local (it builds nothing)."""

    def __init__(self, tmp: Path, store: ClusterStore, allow: list[str]) -> None:
        self.config = Config.model_validate(
            {
                "state_dir": tmp / "coord",
                "module_paths": MODULES,
                "container_runtime": "local",
                "sources": {"allow": allow},
                "api": {"rate_per_s": 10_000, "burst": 10_000},
                "cluster": {"lease_s": 30, "offline_after_s": 60, "sweep_every_s": 3600},
            }
        )
        self.store = store
        self.clock = Clock()
        self.registry = self.fresh_registry()
        self.app = create_app(store, self.registry, self.config, clock=self.clock)
        install_coordinator(self.app, clock=self.clock)
        self.client = TestClient(self.app)
        self.tokens: dict[str, str] = {}
        for role in (Role.OWNER, Role.SUBMITTER):
            _, self.tokens[role.value] = issue_token(
                store, name=role.value, role=role, by=ADMIN, now=1.0
            )

    def fresh_registry(self) -> Registry:
        registry = Registry.load(self.config.module_paths, LaunchRules.unchecked())
        registry.sources = coordinator_source_cache(self.config)
        return registry

    def h(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def post(self, path: str, who: str, body: Any = None) -> Any:
        return self.client.post(path, json=body if body is not None else {}, headers=self.h(who))

    def get(self, path: str, who: str = "owner") -> Any:
        return self.client.get(path, headers=self.h(who))

    def enrol(self, name: str, sources: dict[str, Any] | None) -> None:
        """Enrol node ``name`` and send its first heartbeat, its report saying
        ``sources`` (None: nothing of jobs from commits, as before the key)."""
        r = self.post("/v1/nodes/invite", "owner", {"name": name})
        assert r.status_code == 201, r.text
        self.tokens[f"enroll-{name}"] = r.json()["token"]
        r = self.post("/v1/nodes/enroll", f"enroll-{name}", {"capabilities": {"gpus": []}})
        assert r.status_code == 201, r.text
        self.tokens[name] = r.json()["token"]
        report: dict[str, Any] = {
            "gpus": [{"uuid": f"{name}-0", "name": "sim", "total_bytes": 24 * GIB,
                      "free_bytes": 24 * GIB, "usable_bytes": 24 * GIB}],
            "warm": [], "busy": 0, "max_jobs": 4, "labels": {}, "accepting": True,
            "types": ["echo.echo"], "modules": ["echo.echo"],
            "launch_rules": {"runtime": "podman", "allow_unsandboxed_containers": False,
                             "allow_host_jobs": False},
        }  # fmt: skip
        if sources is not None:
            report["sources"] = sources
        r = self.post("/v1/node/heartbeat", name, {"report": report, "jobs": []})
        assert r.status_code == 200, r.text

    def claim(self, name: str) -> list[dict[str, Any]]:
        record = self.store.get_node(name)
        assert record is not None
        r = self.post("/v1/node/claim", name, {"report": record.report, "want": 4})
        assert r.status_code == 200, r.text
        jobs: list[dict[str, Any]] = r.json()["jobs"]
        return jobs


@pytest.fixture
def repo(tmp_path: Path) -> tuple[str, str]:
    commit = make_repo(tmp_path / "repos" / "mymod", files={"module.toml": WITH_PARAM})
    return f"file://{tmp_path / 'repos' / 'mymod'}", commit


@pytest.fixture
def coord(tmp_path: Path, store: Store) -> Coord:
    assert isinstance(store, ClusterStore)
    return Coord(tmp_path, store, [f"file://{tmp_path}/repos/*"])


def _submit(coord: Coord, url: str, commit: str, **body: Any) -> Any:
    doc = {"type": "mymod.train", "source": {"repo": url, "commit": commit}, **body}
    return coord.post("/v1/jobs", "submitter", doc)


def test_a_coordinator_takes_a_job_from_a_commit(coord: Coord, repo: tuple[str, str]) -> None:
    url, commit = repo
    r = _submit(coord, url, commit, params={"steps": 3})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["type"] == f"mymod.train@{commit}"
    assert job["source"] == {"repo": url, "commit": commit}
    stored = coord.store.get_job(job["id"])
    assert stored is not None and stored.source == JobSource(url, commit)
    assert stored.params == {"steps": 3}
    # it read module.toml only: the commit's tree is in its cache, no image anywhere
    assert (coord.config.state_dir / "sources" / "trees" / commit / "module.toml").is_file()
    # the Python client alike
    token = coord.tokens["submitter"]
    with Client("http://testserver", token, http=TestClient(coord.app)) as client:
        again = client.submit("mymod.train", source_repo=url, source_commit=commit)
        assert again["type"] == f"mymod.train@{commit}" and again["source"] == job["source"]
        with pytest.raises(RequestRefused, match="is not allowed on this coordinator"):
            client.submit("mymod.train", source={"repo": "https://h.org/m", "commit": commit})
    assert len(coord.store.list_jobs()) == 2


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"commit": "main"}, "branches and tags are refused"),
        ({"commit": "SHORT"}, "is a short commit id"),
        ({"repo": "https://u:s3cret@git.example.org/m"}, "holds credentials"),
        ({"repo": "http://git.example.org/m"}, "must start with https://"),
        ({"repo": "https://git.example.org/team/m"}, "is not allowed on this coordinator"),
        ({"repo": "file:///elsewhere/mymod"}, "is not allowed on this coordinator"),
        ({"type": "mymod.nosuch"}, "has no job type 'mymod.nosuch'"),
        ({"params": {"steps": "many"}}, "steps"),
        ({"params": {"nosuch": 1}}, "nosuch"),
    ],
)
def test_a_coordinator_refuses_and_stores_nothing(
    coord: Coord, repo: tuple[str, str], tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    url, commit = repo
    source = {"repo": change.get("repo", url), "commit": change.get("commit", commit)}
    if source["commit"] == "SHORT":
        source["commit"] = commit[:10]
    body = {"type": change.get("type", "mymod.train"), "source": source}
    if "params" in change:
        body["params"] = change["params"]
    r = coord.post("/v1/jobs", "submitter", body)
    assert r.status_code == 422, r.text
    assert says in r.text, r.text
    assert "s3cret" not in r.text
    if "not allowed" in says:  # the refusal names the patterns it allows
        assert f"file://{tmp_path}/repos/*" in r.text and "coordinator's [sources] allow" in r.text
    assert coord.store.list_jobs() == []


def test_a_coordinator_with_an_empty_allow_list_takes_none(
    tmp_path: Path, store: Store, repo: tuple[str, str]
) -> None:
    assert isinstance(store, ClusterStore)
    coord = Coord(tmp_path, store, [])
    url, commit = repo
    r = _submit(coord, url, commit)
    assert r.status_code == 422 and "this coordinator accepts no jobs from repositories" in r.text
    assert store.list_jobs() == []


def test_only_a_node_that_runs_the_repository_is_offered_the_job(
    coord: Coord, repo: tuple[str, str], tmp_path: Path
) -> None:
    url, commit = repo
    coord.enrol("old", None)  # says nothing of jobs from commits
    coord.enrol("local", {"runs": False, "allow": [f"file://{tmp_path}/*"]})
    coord.enrol("other", {"runs": True, "allow": ["https://git.example.org/*"]})
    coord.enrol("hostile", {"runs": "yes", "allow": [f"file://{tmp_path}/*"] * 3})
    # no node could run it now: it is taken all the same, and waits
    r = _submit(coord, url, commit)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    for name in ("old", "local", "other", "hostile"):
        assert coord.claim(name) == [], name
    why = coord.get(f"/v1/jobs/{job_id}/explain").json()
    text = "\n".join(why["lines"])
    assert f"no node runs jobs from commits of {url}" in text, text
    assert "local: runs no jobs from commits (its container_runtime is not podman" in text
    assert "other: does not run jobs from commits of" in text
    assert "old: runs no jobs from commits (it did not report" in text
    coord.enrol("srcnode", {"runs": True, "allow": [f"file://{tmp_path}/repos/*"]})
    nodes = {n["name"]: n for n in coord.get("/v1/nodes").json()}
    assert nodes["srcnode"]["sources"] == {"runs": True, "allow": [f"file://{tmp_path}/repos/*"]}
    assert nodes["hostile"]["sources"] is None and nodes["old"]["sources"] is None
    [payload] = coord.claim("srcnode")
    assert payload["id"] == job_id and payload["type"] == f"mymod.train@{commit}"
    assert payload["source"] == {"repo": url, "commit": commit}


def test_a_restarted_coordinator_reads_the_commit_from_its_cache(
    coord: Coord, repo: tuple[str, str], tmp_path: Path
) -> None:
    """Another process took the job (the CLI, another coordinator): this one's
    registry does not know the type yet, and reads the commit's module.toml when a
    node claims (the repository may be gone by then: the cache has it)."""
    url, commit = repo
    r = _submit(coord, url, commit)
    assert r.status_code == 201, r.text
    coord.registry.types.pop(f"mymod.train@{commit}")
    coord.registry.modules.pop(f"mymod@{commit}")
    (tmp_path / "repos" / "mymod").rename(tmp_path / "gone")
    coord.enrol("srcnode", {"runs": True, "allow": [f"file://{tmp_path}/repos/*"]})
    [payload] = coord.claim("srcnode")
    assert payload["type"] == f"mymod.train@{commit}"


def test_the_end_event_records_the_image_and_the_node(
    coord: Coord, repo: tuple[str, str], tmp_path: Path
) -> None:
    url, commit = repo
    coord.enrol("srcnode", {"runs": True, "allow": [f"file://{tmp_path}/repos/*"]})
    job_id = _submit(coord, url, commit).json()["id"]
    [payload] = coord.claim("srcnode")
    lease = payload["lease_id"]
    r = coord.post(f"/v1/node/jobs/{job_id}/start", "srcnode", {"lease_id": lease})
    assert r.status_code == 200, r.text
    image = "ab" * 32
    bad = {"lease_id": lease, "state": "done", "image": {"id": "x; rm -rf /", "reused": True}}
    r = coord.post(f"/v1/node/jobs/{job_id}/finish", "srcnode", bad)
    assert r.status_code == 422, r.text
    body = {"lease_id": lease, "state": "done", "outcome": "ok",
            "image": {"id": image, "reused": False}}  # fmt: skip
    r = coord.post(f"/v1/node/jobs/{job_id}/finish", "srcnode", body)
    assert r.status_code == 200, r.text
    events = [e for e in coord.store.events(job_id=job_id) if e.kind == "transition"]
    start = next(e for e in events if e.to_state == "running")
    end = next(e for e in events if e.from_state == "running")
    for e in (start, end):
        assert e.detail["source_repo"] == url and e.detail["source_commit"] == commit
        assert e.detail["node"] == "srcnode"
    assert end.detail["image_id"] == image and end.detail["image_reused"] is False


def test_an_agent_reports_what_it_runs_of_commits() -> None:
    """The report's and the enrolment's ``sources`` (SPEC.md section 16)."""
    registry = Registry.load(MODULES)
    assert source_ability(registry).to_json() == {"runs": False, "allow": []}

    class Cache:
        allow = ("file:///srv/*",)
        refusal: str | None = None

        def module(self, source: JobSource) -> Any:  # pragma: no cover - not read
            raise AssertionError

    registry.sources = Cache()
    assert source_ability(registry).to_json() == {"runs": True, "allow": ["file:///srv/*"]}
    Cache.refusal = "its container_runtime is local"
    assert source_ability(registry).to_json() == {"runs": False, "allow": ["file:///srv/*"]}


def test_submit_and_explain_on_a_coordinators_store(
    tmp_path: Path,
    repo: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    clean_env: dict[str, str],
) -> None:
    """``gpuwarden submit`` on a coordinator's own store (SQLite with an enrolled
    node): the coordinator's [sources] allow judges the URL, its runtime (local)
    does not count; nothing is stored on a refusal; ``explain`` says why it waits."""
    url, commit = repo
    state = tmp_path / "coord"
    config = tmp_path / "coordinator.toml"
    paths = ", ".join(f'"{m}"' for m in MODULES)
    config.write_text(
        f'state_dir = "{state}"\nmodule_paths = [{paths}]\ncontainer_runtime = "local"\n'
        f'[sources]\nallow = ["file://{tmp_path}/repos/*"]\n'
    )
    store = SqliteStore(state / "gpuwarden.db")
    try:
        _node(store, "one", 1)  # a coordinator's store; its node says nothing of commits
    finally:
        store.close()
    base = ["--config", str(config), "submit", "mymod.train", "--source-repo"]
    code, _, err = _run(capsys, *base, url, "--source-commit", commit, "--id", "c1", "--steps", "2")
    assert code == 0, err
    elsewhere = f"file://{tmp_path}/other/mymod"
    code, _, err = _run(capsys, *base, elsewhere, "--source-commit", commit, "--id", "c2")
    assert code == 2 and "is not allowed on this coordinator" in err, err
    code, _, err = _run(capsys, *base, url, "--source-commit", "v1.0", "--id", "c3")
    assert code == 2 and "branches and tags are refused" in err, err
    store = SqliteStore(state / "gpuwarden.db")
    try:
        [job] = store.list_jobs()
        assert job.id == "c1" and job.type == f"mymod.train@{commit}"
        assert job.source == JobSource(url, commit) and job.params == {"steps": 2}
    finally:
        store.close()
    code, out, err = _run(capsys, "--config", str(config), "explain", "c1")
    assert code == 0, err
    assert f"no node runs jobs from commits of {url}" in out, out


def test_a_coordinators_queue_root_takes_a_job_from_a_commit(
    tmp_path: Path, repo: tuple[str, str]
) -> None:
    """A bundle naming a commit, read by a coordinator's queue root: taken under its
    own [sources] allow (its runtime local); one outside it is refused, stored not."""
    url, commit = repo
    store = SqliteStore(tmp_path / "coord.db")
    try:
        coord = Coord(tmp_path, store, [f"file://{tmp_path}/repos/*"])
        root = QueueRoot.open(tmp_path / "queue", create=True)
        watcher = QueueWatcher(store, coord.registry, coord.config, [root])
        good = JobSpec("qs1", "mymod.train", {"steps": 4}, source=JobSource(url, commit))
        bad = JobSpec("qs2", "mymod.train", source=JobSource("file:///elsewhere/m", commit))
        write_bundle(root.inbox, [good], now=1.0)
        write_bundle(root.inbox, [bad], now=1.0)
        deadline = time.monotonic() + 60
        while not list(root.failed.glob("*.zip")) or store.get_job("qs1") is None:
            assert time.monotonic() < deadline, "the bundles were never read"
            watcher.once()
            time.sleep(0.05)
        watcher.stop()
        job = store.get_job("qs1")
        assert job is not None and job.type == f"mymod.train@{commit}"
        assert job.source == JobSource(url, commit) and job.params == {"steps": 4}
        assert store.get_job("qs2") is None
        [refused] = root.failed.glob("*.zip")
        with zipfile.ZipFile(refused) as zf:
            text = "".join(zf.read(n).decode() for n in zf.namelist() if n.endswith(".json"))
        assert "is not allowed on this coordinator" in text, text
    finally:
        store.close()


# ---- issue 30, item 1: the coordinator's allow list cannot be walked out of ----


@pytest.mark.parametrize(
    ("tail", "says"),
    [
        ("../private/secret", "'.' or '..' part"),
        ("%2e%2e/private/secret", "an encoded '.'"),
        ("mymod/../../private/secret", "'.' or '..' part"),
        ("mymod%2f..%2f..%2fprivate%2fsecret", "an encoded '/'"),
        ("link", "(through a link)"),
    ],
)
def test_a_coordinator_cannot_be_led_out_of_its_allow_list(
    coord: Coord, repo: tuple[str, str], tmp_path: Path, tail: str, says: str
) -> None:
    """`file:///…/repos/../private/secret` (and its encodings, and a link in the
    allowed folder) matched `file:///…/repos/*` as text: the coordinator, as root,
    fetched the private repository and its module's description reached every
    submitter's `GET /v1/types`. Now a 422 that stores nothing and fetches nothing;
    the next submission from the allowed folder is taken."""
    url, commit = repo
    secret = make_repo(tmp_path / "private" / "secret", files={"module.toml": SECRET_TOML})
    (tmp_path / "repos" / "link").symlink_to(tmp_path / "private" / "secret")
    r = _submit(coord, f"file://{tmp_path}/repos/{tail}", secret)
    assert r.status_code == 422, r.text
    assert says in r.text, r.text
    assert coord.store.list_jobs() == []
    sources = coord.config.state_dir / "sources"
    assert not (sources / "trees" / secret).exists()
    for bare in (sources / "repos").glob("*.git"):
        assert not git(bare, "cat-file", "-t", secret, check=False), bare
    for who in ("submitter", "owner"):
        listed = coord.get("/v1/types", who)
        assert listed.status_code == 200, listed.text
        assert "TOP SECRET" not in listed.text and secret not in listed.text
    # the next legitimate request works
    r = _submit(coord, url, commit)
    assert r.status_code == 201, r.text
    assert [j.id for j in coord.store.list_jobs()] == [r.json()["id"]]
