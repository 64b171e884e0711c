"""Preemption across hosts at the lease boundary, for real: a coordinator on a fresh
PostgreSQL database and one agent with a simulated 24 GiB GPU (no reserve), each a
process of its own. A training stand-in (``tests/modules/trainmods``) holds 16 GiB;
an urgent job of higher priority needs 12 GiB, so no node has room for it until the
training run yields: the coordinator marks the run's lease (not renewed), the agent
signals it, it checkpoints (exit 6), the urgent job runs on that node, and the run
resumes there with ``GPUWARDEN_RESUME=1`` and finishes once. A job that is not
preemptible is never signalled: the urgent job waits for it to end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.test_cluster import (
    REPO,
    Agent,
    Cluster,
    _config,
    _events,
    _healthy,
    free_port,
    wait_for,
)

LEASE_S = 10
pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def running_cluster(
    pg_url: str,
    tmp: Path,
    agents: dict[str, dict[str, Any]],
    lease_s: float = LEASE_S,
    agent_config: dict[str, Any] | None = None,
    cluster_config: dict[str, Any] | None = None,
    database_via: Callable[[str], str] | None = None,
) -> Iterator[Cluster]:
    """A coordinator on a fresh PostgreSQL database (leases of ``lease_s``) and one
    agent per entry of ``agents`` (its name: its ``[sim_gpu]`` settings; each
    agent's config has ``agent_config``'s keys too), each a process of its own;
    yielded once every agent has reported its GPUs, stopped and dropped after.
    ``cluster_config``: more keys of the coordinator's ``[cluster]``;
    ``database_via``: the URL the coordinator reaches the database by, from the
    database's own (a forwarder a test can cut)."""
    dbname = f"gw_{tmp.name[:20]}_{uuid.uuid4().hex[:12]}".lower()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    db_url = pg_url.rsplit("/", 1)[0] + f"/{dbname}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    modules = [str(REPO / "src" / "gpuwarden" / "modules"), str(REPO / "tests" / "modules")]
    coord_cfg = _config(
        tmp / "coordinator.toml",
        {
            "state_dir": str(tmp / "coordinator"),
            "database": database_via(db_url) if database_via is not None else db_url,
            "module_paths": modules,
            "api": {"rate_per_s": 10_000, "burst": 10_000},
            "cluster": {
                "lease_s": lease_s,
                "offline_after_s": 12,
                "sweep_every_s": 0.5,
                **(cluster_config or {}),
            },
        },
    )
    c = Cluster(tmp=tmp, db_url=db_url, env=env, urls=[], owner="")
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
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        c.procs.append(proc)
        c.urls.append(f"http://127.0.0.1:{port}")
        wait_for("the coordinator", lambda: _healthy(c.urls[0]), timeout=60)
        for name, sim_gpu in agents.items():
            state = tmp / name
            cfg = _config(
                tmp / f"{name}.toml",
                {
                    "state_dir": str(state),
                    "module_paths": modules,
                    "allow_unsandboxed_containers": True,
                    "sim_gpu": {"release_delay_s": 0.05, **sim_gpu},
                    "vram": {"reserve_gib": 0, "reclaim_timeout_s": 5},
                    "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 2},
                    "cluster": {"claim_every_s": 0.3, "max_jobs": 4},
                    **(agent_config or {}),
                },
            )
            gib = int(sim_gpu.get("vram_gib", 24))
            a = Agent(name=name, gib=gib, coordinator=c.urls[0], config=cfg, state=state)
            c.agents[name] = a
            invited = c.gw("node", "invite", name, "--url", c.urls[0], "--json")
            assert invited.returncode == 0, invited.stderr
            a.token = json.loads(invited.stdout)["token"]
            c.start_agent(a, a.token)
        for name in agents:
            wait_for(f"the agent {name} with its GPUs", lambda n=name: _gpu_up(c, n), timeout=60)
        yield c
    finally:
        for proc in c.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in c.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        pg_url, tmp_path_factory.mktemp("xpreempt"), {"n24": {"vram_gib": 24}}
    ) as c:
        yield c


def _gpu_up(c: Cluster, name: str) -> bool:
    node = c.nodes().get(name)
    return bool(
        node and node["state"] == "active" and node["gpus"] and "free_bytes" in node["gpus"][0]
    )


def job(c: Cluster, job_id: str) -> dict[str, Any]:
    with c.client() as client:
        got: dict[str, Any] = client.get(job_id)
    return got


def state_of(c: Cluster, job_id: str) -> str:
    return str(job(c, job_id)["state"])


def ended(c: Cluster, *jobs: str) -> bool:
    return all(state_of(c, j) in ("done", "failed", "cancelled", "quarantined") for j in jobs)


def running_here(c: Cluster, job_id: str, out: Path) -> bool:
    """It runs on the agent and has logged its start (its process holds its memory)."""
    return state_of(c, job_id) == "running" and (out / "log.txt").exists()


def asked(c: Cluster) -> list[tuple[str, dict[str, Any]]]:
    """The coordinator's ``preemption_requested`` events: (victim, detail)."""
    found = c.sql(
        "SELECT job_id, detail FROM events WHERE kind = 'preemption_requested' ORDER BY id"
    )
    return [(str(j), dict(d)) for j, d in found]


def agent_events(a: Agent, kind: str) -> list[dict[str, Any]]:
    """The agent's own event log (its local store's events), of ``kind``."""
    return [e for e in _events(a.log) if e.get("event") == kind]


def out_dir(a: Agent, job_id: str, attempt: int) -> Path:
    return a.state / "jobs" / job_id / f"attempt-{attempt}" / "out"


def heartbeats_after(c: Cluster, seen: float, n: int) -> None:
    """Wait until the agent's report has come ``n`` heartbeat intervals after ``seen``."""
    every = LEASE_S / 6
    wait_for(
        f"{n} more heartbeats",
        lambda: float(c.nodes()["n24"].get("last_seen") or 0) >= seen + n * every,
        timeout=30,
    )


def test_a_job_that_is_not_preemptible_is_never_signalled(cluster: Cluster) -> None:
    c = cluster
    a = c.agents["n24"]
    with c.client() as client:
        client.submit("testmods.gpu", {"gib": 16, "seconds": 12}, id="steady", vram_gib=16)
    wait_for("steady running", lambda: state_of(c, "steady") == "running")
    with c.client() as client:
        client.submit("trainmods.urgent", {}, id="urgent0", priority=5)
    seen = float(c.nodes()["n24"]["last_seen"])
    heartbeats_after(c, seen, 3)
    # the urgent job really waited for lack of room beside a running job...
    assert state_of(c, "steady") == "running" and state_of(c, "urgent0") == "queued"
    # ...and the running job, not preemptible, was never chosen nor signalled
    assert asked(c) == []
    wait_for("both ended", lambda: ended(c, "steady", "urgent0"), timeout=60)
    steady, urgent = job(c, "steady"), job(c, "urgent0")
    assert steady["state"] == "done" and urgent["state"] == "done"
    [only] = steady["attempts_detail"]
    assert only["outcome"] == "succeeded" and only["exit_code"] == 0
    [u] = urgent["attempts_detail"]
    assert u["started_at"] >= only["ended_at"]
    assert asked(c) == [] and agent_events(a, "preemption_requested") == []


def test_a_training_run_yields_across_hosts_and_resumes_once(cluster: Cluster) -> None:
    c = cluster
    a = c.agents["n24"]
    with c.client() as client:
        client.submit("trainmods.train", {"steps": 300, "step_s": 0.05}, id="train")
    wait_for("train running", lambda: running_here(c, "train", out_dir(a, "train", 1)))
    with c.client() as client:
        client.submit("trainmods.urgent", {}, id="urgent", priority=5)
    wait_for("both ended", lambda: ended(c, "train", "urgent"), timeout=120)

    # the coordinator chose it, once, with the job that caused it
    [(victim, detail)] = asked(c)
    assert victim == "train"
    assert detail["for_job"] == "urgent" and detail["node"] == "n24"
    assert detail["signal"] == "SIGUSR1"
    # the agent's broker sent it the signal, and it checkpointed (exit 6)
    [local] = agent_events(a, "preemption_requested")
    assert local["job"] == "train" and local["for_job"] == "urgent" and local["sent"] is True
    [done] = agent_events(a, "checkpointed")
    assert done["job"] == "train" and done["for_job"] == "urgent"

    train, urgent = job(c, "train"), job(c, "urgent")
    assert train["state"] == "done" and urgent["state"] == "done"
    first, second = train["attempts_detail"]
    assert (first["outcome"], first["exit_code"]) == ("checkpointed", 6)
    assert second["outcome"] == "succeeded"
    assert first["node"] == second["node"] == "n24"
    # the urgent job ran on that node, after the run yielded and before it resumed
    [u] = urgent["attempts_detail"]
    assert u["node"] == "n24"
    assert first["ended_at"] <= u["started_at"] <= second["started_at"]
    # it resumed there from its checkpoint, with GPUWARDEN_RESUME=1, and finished once
    step = int((out_dir(a, "train", 1) / "step.txt").read_text())
    assert 0 < step < 300
    log = (out_dir(a, "train", 2) / "log.txt").read_text().splitlines()
    assert log == [
        "attempt 1: start at step 0 resume=0",
        f"attempt 1: checkpointed at step {step}",
        f"attempt 2: start at step {step} resume=1",
        "attempt 2: finished at step 300",
    ]
    assert (out_dir(a, "train", 2) / "done.txt").read_text() == "300"
    # its lease is gone with its end, and no other lease waits on it
    assert c.sql("SELECT job_id FROM leases WHERE job_id IN ('train', 'urgent')") == []


def test_a_run_that_ignores_the_signal_is_stopped_and_requeued_as_preempted(
    cluster: Cluster,
) -> None:
    c = cluster
    a = c.agents["n24"]
    with c.client() as client:
        client.submit("trainmods.stubborn", {"steps": 400, "step_s": 0.05}, id="stub")
    wait_for("stub running", lambda: running_here(c, "stub", out_dir(a, "stub", 1)))
    with c.client() as client:
        client.submit("trainmods.urgent", {}, id="urgent2", priority=5)
    wait_for("both ended", lambda: ended(c, "stub", "urgent2"), timeout=120)

    assert [(v, d["for_job"]) for v, d in asked(c) if v == "stub"] == [("stub", "urgent2")]
    # it ignored the signal: stopped after its grace (10 s, as long as the lease: the
    # marked lease lasts through the grace and one more lease, so it is not lost)
    [over] = agent_events(a, "preemption_grace_ended")
    assert over["job"] == "stub" and over["for_job"] == "urgent2"
    stub = job(c, "stub")
    assert stub["state"] == "done"
    first, second = stub["attempts_detail"]
    assert first["outcome"] == "preempted" and "interruption 1/2" in first["reason"]
    assert second["outcome"] == "succeeded" and first["node"] == second["node"] == "n24"
    [u] = job(c, "urgent2")["attempts_detail"]
    assert u["node"] == "n24" and first["ended_at"] <= u["started_at"] <= second["started_at"]
    log = (out_dir(a, "stub", 2) / "log.txt").read_text().splitlines()
    assert log[0] == "attempt 1: start at step 0 resume=0"
    assert "attempt 2: start at step 0 resume=1" in log
    assert log[-1] == "attempt 2: finished at step 400"
