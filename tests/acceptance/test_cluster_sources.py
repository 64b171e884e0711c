"""Jobs from a pinned commit across hosts, for real (SPEC.md section 20, "Across
hosts"): a coordinator on a fresh PostgreSQL database whose own container runtime
is local, an agent that runs no job from a commit (local runtime) and, later, an
agent with podman, each a process of its own. A local git repository made here
holds a module and its Containerfile. The coordinator takes a job by the commit's
SHA (reading its module.toml only), refuses a branch and a URL outside its own
``[sources] allow`` (storing nothing); the job waits while only the local agent
runs, ``explain`` saying why; the podman agent builds the image once and a second
job reuses it (the same image id); the coordinator's events record the commit,
the image and the node, and ``gpuwarden logs JOB --stream build`` through the
coordinator shows the build's output. Needs podman and the test base image
(tests/conftest.py): skipped with the reason where they are missing, failed where
GPUWARDEN_REQUIRE_CONTAINERS=1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from gpuwarden.launch.imagebuild import image_tag
from tests.acceptance.test_cluster import Agent, Cluster, free_port, wait_for
from tests.sourcerepo import make_repo

REPO = Path(__file__).resolve().parents[2]
MODULES = [str(REPO / "src" / "gpuwarden" / "modules"), str(REPO / "tests" / "modules")]

pytestmark = pytest.mark.timeout(900)


@dataclass
class Sources:
    c: Cluster
    url: str
    commit: str
    base_id: str


def _toml(path: Path, body: dict[str, Any]) -> Path:
    top = [f"{k} = {json.dumps(v)}" for k, v in body.items() if not isinstance(v, dict)]
    for name, table in ((k, v) for k, v in body.items() if isinstance(v, dict)):
        top += [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    path.write_text("\n".join(top) + "\n")
    return path


def _agent_config(s: Sources, name: str, extra: dict[str, Any]) -> Agent:
    state = s.c.tmp / name
    cfg = _toml(
        s.c.tmp / f"{name}.toml",
        {
            "state_dir": str(state),
            "module_paths": MODULES,
            **extra,
            "sim_gpu": {"release_delay_s": 0.05, "vram_gib": 24},
            "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 2},
            "cluster": {"claim_every_s": 0.3, "max_jobs": 4},
            "sources": {"allow": [f"file://{s.c.tmp}/repos/*"]},
        },
    )
    return Agent(name=name, gib=24, coordinator=s.c.urls[0], config=cfg, state=state)


def start_agent(s: Sources, name: str, extra: dict[str, Any]) -> None:
    a = _agent_config(s, name, extra)
    s.c.agents[name] = a
    invited = s.c.gw("node", "invite", name, "--url", s.c.urls[0], "--json")
    assert invited.returncode == 0, invited.stderr
    a.token = json.loads(invited.stdout)["token"]
    s.c.start_agent(a, a.token)

    def reported() -> bool:
        node = s.c.nodes().get(name)
        return bool(node and node["state"] == "active" and node["gpus"])

    wait_for(f"the agent {name}", reported, timeout=90)


@pytest.fixture(scope="module")
def sources(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, podman_base_image: str
) -> Iterator[Sources]:
    tmp = tmp_path_factory.mktemp("xsrc")
    base_id = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", podman_base_image],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    commit = make_repo(tmp / "repos" / "mymod", base=podman_base_image)
    dbname = f"gw_xsrc_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    db_url = pg_url.rsplit("/", 1)[0] + f"/{dbname}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    coord_cfg = _toml(
        tmp / "coordinator.toml",
        {
            "state_dir": str(tmp / "coordinator"),
            "database": db_url,
            "module_paths": MODULES,
            # its own allow list; its runtime is local: it builds nothing
            "sources": {"allow": [f"file://{tmp}/repos/*"]},
            "api": {"rate_per_s": 10_000, "burst": 10_000},
            "cluster": {"lease_s": 30, "offline_after_s": 40, "sweep_every_s": 0.5},
        },
    )
    c = Cluster(tmp=tmp, db_url=db_url, env=env, urls=[], owner="")
    s = Sources(c, f"file://{tmp / 'repos' / 'mymod'}", commit, base_id)
    try:
        made = c.gw("token", "create", "admin", "--role", "owner", "--json", config=coord_cfg)
        assert made.returncode == 0, made.stderr
        c.owner = json.loads(made.stdout)["token"]
        port = free_port()
        with (tmp / "coordinator.stderr").open("ab") as err:
            proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gpuwarden", "--config", str(coord_cfg)),
                    *("coordinator", "--bind", f"127.0.0.1:{port}"),
                ],
                env=env, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        c.procs.append(proc)
        c.urls.append(f"http://127.0.0.1:{port}")
        wait_for("the coordinator", lambda: _health(c), timeout=60)
        start_agent(s, "plain", {})  # local runtime: no job from a commit
        yield s
    finally:
        for p in c.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in c.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        subprocess.run(["podman", "rmi", "--force", image_tag(commit)], capture_output=True)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )


def _health(c: Cluster) -> bool:
    try:
        with c.client() as client:
            return bool(client.health())
    except Exception:
        return False


def _job_count(c: Cluster) -> int:
    return int(c.sql("SELECT count(*) FROM jobs")[0][0])


def _submit(s: Sources, *args: str) -> subprocess.CompletedProcess[str]:
    return s.c.gw("submit", "--url", s.c.urls[0], "mymod.train", "--source-repo", *args)


def _state(s: Sources, job_id: str) -> str:
    with s.c.client() as client:
        return str(client.get(job_id)["state"])


def test_1_a_branch_and_a_url_outside_the_allow_list_are_refused(sources: Sources) -> None:
    s = sources
    before = _job_count(s.c)
    got = _submit(s, s.url, "--source-commit", "main", "--id", "branch")
    assert got.returncode == 2 and "branches and tags are refused" in got.stderr, got.stderr
    other = f"file://{s.c.tmp}/elsewhere/mymod"
    got = _submit(s, other, "--source-commit", s.commit, "--id", "outside")
    assert got.returncode == 2, got.stderr
    assert "is not allowed on this coordinator" in got.stderr
    assert f"file://{s.c.tmp}/repos/*" in got.stderr  # the patterns it allows
    assert _job_count(s.c) == before


def test_2_a_node_that_runs_no_commit_is_not_offered_it(sources: Sources) -> None:
    s = sources
    got = _submit(s, s.url, "--source-commit", s.commit, "--id", "first")
    assert got.returncode == 0, got.stderr
    job_id = _id(s, "first")
    [[stored]] = s.c.sql("SELECT type FROM jobs WHERE id = %s", job_id)
    assert stored == f"mymod.train@{s.commit}"

    def says_why() -> str | None:
        with s.c.client() as client:
            text = "\n".join(client.explain(job_id))
        return text if f"no node runs jobs from commits of {s.url}" in text else None

    why = wait_for("explain to say why it waits", says_why, timeout=30)
    assert "plain: runs no jobs from commits (its container_runtime is not podman" in why
    time.sleep(3)  # the plain agent claims every 0.3 s: it is never offered the job
    assert _state(s, job_id) == "queued"
    assert s.c.sql("SELECT count(*) FROM leases WHERE job_id = %s", job_id)[0][0] == 0
    # the plain agent never had it
    assert not (s.c.tmp / "plain" / "jobs" / job_id).exists()


def test_3_a_podman_agent_builds_once_and_runs_both(sources: Sources) -> None:
    s = sources
    start_agent(
        s, "builder", {"container_runtime": "podman", "sandbox_image": s.base_id}
    )  # the waiting job goes there
    first = _id(s, "first")
    wait_for("the first job", lambda: _state(s, first) in ("done", "failed"), timeout=600)
    assert _state(s, first) == "done", _job(s, first)
    got = _submit(s, s.url, "--source-commit", s.commit, "--id", "second")
    assert got.returncode == 0, got.stdout + got.stderr
    second = _id(s, "second")
    wait_for("the second job", lambda: _state(s, second) in ("done", "failed"), timeout=300)
    images = []
    for job_id, reused in ((first, False), (second, True)):
        job = _job(s, job_id)
        assert job["state"] == "done" and job["source"] == {"repo": s.url, "commit": s.commit}
        transitions = [e for e in job["events"] if e["event"] == "transition"]
        start = next(e for e in transitions if e.get("to") == "running")
        end = next(e for e in transitions if e.get("from") == "running")
        for e in (start, end):
            assert e["source_repo"] == s.url and e["source_commit"] == s.commit, e
            assert e["node"] == "builder", e
        assert end["image_id"] and end["image_reused"] is reused, end
        images.append(end["image_id"])
    assert images[0] == images[1]
    built = subprocess.run(
        ["podman", "images", "--quiet", "--no-trunc", "--filter",
         f"label=gpuwarden.source.commit={s.commit}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(set(built)) == 1 and images[0].removeprefix("sha256:") in built[0], built


def test_4_the_build_log_reads_through_the_coordinator(sources: Sources) -> None:
    s = sources
    first = _id(s, "first")
    second = _id(s, "second")
    got = s.c.gw("logs", first, "--stream", "build", "--url", s.c.urls[0])
    assert got.returncode == 0, got.stderr
    assert "RUN echo built-into-image" in got.stdout, got.stdout
    got = s.c.gw("logs", second, "--stream", "build", "--url", s.c.urls[0])
    assert got.returncode == 0 and "reused" in got.stdout, got.stdout + got.stderr
    # on the coordinator's own store (no --url) too
    here = s.c.gw("logs", first, "--stream", "build", config=s.c.tmp / "coordinator.toml")
    assert here.returncode == 0 and "RUN echo built-into-image" in here.stdout, here.stderr
    # the coordinator's own copy, not the agent's file: it is under its state dir
    copies = list((s.c.tmp / "coordinator" / "logs" / first).glob("attempt-*/build.log"))
    assert copies and "built-into-image" in copies[0].read_text()


def _id(s: Sources, name: str) -> str:
    """The stored id of the job submitted with ``--id name`` (a token's prefix, or none)."""
    [[got]] = s.c.sql("SELECT id FROM jobs WHERE id = %s OR id LIKE %s", name, f"%-{name}")
    return str(got)


def _job(s: Sources, job_id: str) -> dict[str, Any]:
    with s.c.client() as client:
        got: dict[str, Any] = client.get(job_id)
    return got
