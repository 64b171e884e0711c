"""Several hosts on one machine, for real: two coordinators on one fresh PostgreSQL
database and three agents with simulated GPUs of 8, 24 and 80 GiB, each a
process of its own, each agent with its own state directory.

The coordinators set no launch rules that count: the first's config has only the
store, the second's sets a runtime (bubblewrap). The agents' own rules decide:
n8 runs container and serve types in bubblewrap (no host types), n24 only host
types (local, no sandbox), n80 everything (local, container types unsandboxed).

Short leases (10 s) and offline time (12 s) keep it quick. The tests run in order
and share the cluster: placement by fit, each node's launch rules, drain and
resume, warm affinity, an agent killed with SIGKILL mid-job, an agent stopped
with SIGSTOP past its lease (silent meanwhile), no job run twice across two
coordinators, and a revoked agent refused and gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from gpuwarden.client import Client

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3
LEASE_S = 10
OFFLINE_S = 12
#: each agent's launch rules (the coordinators' configs have none that count)
RULES: dict[str, dict[str, Any]] = {
    "n8": {"container_runtime": "bubblewrap"},  # container and serve types, sandboxed
    "n24": {},  # local: host types only
    "n80": {"allow_unsandboxed_containers": True},  # local: every type but vram host
}

pytestmark = pytest.mark.timeout(400)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@dataclass
class Agent:
    name: str
    gib: int
    coordinator: str
    config: Path
    state: Path
    proc: subprocess.Popen[bytes] | None = None
    #: the one-time token it enrolled with (its "environment file")
    token: str = ""

    @property
    def log(self) -> Path:
        return self.state.parent / f"{self.name}.events.jsonl"

    @property
    def stderr(self) -> Path:
        return self.state.parent / f"{self.name}.stderr"


@dataclass
class Cluster:
    tmp: Path
    db_url: str
    env: dict[str, str]
    urls: list[str]
    owner: str
    agents: dict[str, Agent] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self, i: int = 0) -> Client:
        return Client(self.urls[i], self.owner, timeout=30)

    def gw(
        self, *args: str, config: Path | None = None, token: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        token = token or self.owner
        env = {**self.env, "GPUWARDEN_TOKEN": token} if token else self.env
        return subprocess.run(
            self.cmd(*args, config=config), env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip

    def cmd(self, *args: str, config: Path | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "gpuwarden"]
        if config is not None:
            cmd += ["--config", str(config)]
        return [*cmd, *args]

    def start_agent(self, a: Agent, enroll: str | None) -> None:
        cmd = [
            *(sys.executable, "-m", "gpuwarden", "--mock-gpu", "--config", str(a.config)),
            *("agent", "--coordinator", a.coordinator, "--log", str(a.log)),
        ]
        if enroll is not None:  # from a file only its owner reads, never on the command line
            token_file = a.state.parent / f"{a.name}.enroll"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(enroll + "\n")
            cmd += ["--enroll-file", str(token_file)]
        with a.stderr.open("ab") as err:
            a.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(a.proc)

    def nodes(self) -> dict[str, dict[str, Any]]:
        with self.client() as c:
            return {n["name"]: n for n in c.request_json("GET", "/v1/nodes")}

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.db_url) as conn:
            return conn.execute(query, params).fetchall()


def _config(path: Path, body: dict[str, Any]) -> Path:
    lines: list[str] = []
    tables: dict[str, dict[str, Any]] = {}
    for key, value in body.items():
        if isinstance(value, dict):
            tables[key] = value
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    dbname = f"gw_cluster_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    db_url = pg_url.rsplit("/", 1)[0] + f"/{dbname}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    modules = [str(REPO / "src" / "gpuwarden" / "modules"), str(REPO / "tests" / "modules")]
    # the store and the cluster's timings; no launch rules (they are the agents')
    common = {
        "state_dir": str(tmp / "coordinator"),
        "database": db_url,
        "module_paths": modules,
        "api": {"rate_per_s": 10_000, "burst": 10_000},
        "cluster": {
            "lease_s": LEASE_S,
            "offline_after_s": OFFLINE_S,
            "sweep_every_s": 0.5,
            "affinity_wait_s": 30,
        },
    }
    coord_cfg = _config(tmp / "coordinator.toml", common)
    # the second has a runtime set, which means nothing on a coordinator either
    coord_cfgs = [coord_cfg, _config(tmp / "coordinator1.toml", {**common, **RULES["n8"]})]
    c = Cluster(tmp=tmp, db_url=db_url, env=env, urls=[], owner="")
    try:
        made = c.gw("token", "create", "admin", "--role", "owner", "--json", config=coord_cfg)
        assert made.returncode == 0, made.stderr
        c.owner = json.loads(made.stdout)["token"]
        for i in range(2):
            port = free_port()
            with (tmp / f"coordinator{i}.stderr").open("ab") as err:
                proc = subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--config", str(coord_cfgs[i])),
                        *("coordinator", "--bind", f"127.0.0.1:{port}"),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            c.procs.append(proc)
            c.urls.append(f"http://127.0.0.1:{port}")
        for url in c.urls:
            wait_for(f"coordinator {url}", lambda u=url: _healthy(u), timeout=60)
        # two agents talk to the first coordinator, one to the second
        for name, gib, ci in (("n8", 8, 0), ("n24", 24, 1), ("n80", 80, 0)):
            state = tmp / name
            cfg = _config(
                tmp / f"{name}.toml",
                {
                    "state_dir": str(state),
                    "module_paths": modules,
                    **RULES[name],
                    "sim_gpu": {"vram_gib": gib, "release_delay_s": 0.05},
                    "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 2},
                    "cluster": {"claim_every_s": 0.3, "max_jobs": 4},
                },
            )
            a = Agent(name=name, gib=gib, coordinator=c.urls[ci], config=cfg, state=state)
            c.agents[name] = a
            invited = c.gw("node", "invite", name, "--url", c.urls[0], "--json")
            assert invited.returncode == 0, invited.stderr
            a.token = json.loads(invited.stdout)["token"]
            c.start_agent(a, a.token)
        wait_for("three agents with their GPUs", lambda: _all_up(c), timeout=60)
        yield c
    finally:
        for proc in c.procs:
            if proc.poll() is None:
                with _suppress():
                    os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
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


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _all_free(c: Cluster) -> bool:
    """Every node's GPUs: nothing held, all usable memory free for a new job."""
    return all(
        g.get("free_bytes") == g.get("usable_bytes") for n in c.nodes().values() for g in n["gpus"]
    )


def _all_up(c: Cluster) -> bool:
    nodes = c.nodes()
    return all(
        n in nodes and nodes[n]["state"] == "active" and nodes[n]["gpus"]
        and "free_bytes" in nodes[n]["gpus"][0]
        for n in c.agents
    )  # fmt: skip


def gpu_job(
    client: Client, job_id: str, gib: float, seconds: float = 0.3, **kw: Any
) -> dict[str, Any]:
    return client.submit(
        "testmods.gpu",
        {"gib": gib, "seconds": seconds},
        id=job_id,
        vram_gib=gib,
        **kw,
    )


def nodes_of(client: Client, job_id: str) -> list[str]:
    return [a["node"] for a in client.get(job_id)["attempts_detail"]]


def running_on(client: Client, job_id: str) -> str | None:
    job = client.get(job_id)
    if job["state"] != "running":
        return None
    return str(job["attempts_detail"][-1]["node"])


# -- the tests, in order ---------------------------------------------------------------


def test_jobs_land_on_hosts_whose_gpus_fit(cluster: Cluster) -> None:
    with cluster.client() as c, cluster.client(1) as c2:
        for i in range(3):
            gpu_job(c, f"fit20-{i}", 20)
        for i in range(2):
            gpu_job(c2, f"fit40-{i}", 40)
        for i in range(4):
            gpu_job(c2, f"fit2-{i}", 2)
        ids = [f"fit20-{i}" for i in range(3)] + [f"fit40-{i}" for i in range(2)]
        ids += [f"fit2-{i}" for i in range(4)]
        for job_id in ids:
            assert c.wait(job_id, timeout=90)["state"] == "done", c.get(job_id)
        for i in range(3):  # n24 has the room but refuses container types; n8 has not
            assert nodes_of(c, f"fit20-{i}") == ["n80"]
        for i in range(2):
            assert nodes_of(c, f"fit40-{i}") == ["n80"]
        for i in range(4):  # container types: on n8 (in bubblewrap) or n80, never n24
            assert nodes_of(c, f"fit2-{i}")[0] in {"n8", "n80"}
        result = c.result("fit20-0")
        assert result["status"] == "done" and result["attempts"] == 1


def test_status_over_a_coordinator_shows_every_node(cluster: Cluster) -> None:
    wait_for("every GPU's memory back", lambda: _all_free(cluster), timeout=30)
    done = cluster.gw("status", "--url", cluster.urls[1])
    assert done.returncode == 0, done.stdout + done.stderr
    for name in cluster.agents:
        assert re.search(
            rf"node {name}  active  heartbeat \d+\.\d s ago  0 running  ok", done.stdout
        )
    for column in ("total", "used", "gpuwarden", "free"):
        assert column in done.stdout
    assert "80.0 GiB" in done.stdout and "gpuwarden simulated GPU" in done.stdout
    got = json.loads(cluster.gw("status", "--url", cluster.urls[0], "--json").stdout)
    by_node = {n["node"]: n for n in got["cluster"]}
    assert set(by_node) == set(cluster.agents)
    [gpu] = by_node["n80"]["gpus"]
    assert gpu["total_bytes"] == 80 * GIB and gpu["ledger_bytes"] == 0 and gpu["degraded"] == ""
    assert gpu["free_bytes"] == int(79.5 * GIB) and gpu["used_bytes"] is not None


def test_each_node_runs_what_its_own_launch_rules_allow(cluster: Cluster) -> None:
    c0, c1 = cluster.urls
    # through the coordinator whose config has only the store: a container type, run
    # in n8's bubblewrap
    done = cluster.gw(
        "submit", "--url", c0, "echo.container", "--id", "rules-box", "-p", "text=boxed",
        "--constraint", "node=n8", "--wait", "--wait-timeout", "60",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # through the coordinator with a runtime set: a host type, on n24 that allows it
    done = cluster.gw(
        "submit", "--url", c1, "echo.echo", "--id", "rules-host", "-p", "text=plain",
        "--constraint", "node=n24", "--wait", "--wait-timeout", "60",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with cluster.client() as c:
        assert nodes_of(c, "rules-box") == ["n8"] and nodes_of(c, "rules-host") == ["n24"]
        assert c.get("rules-box")["state"] == "done" and c.get("rules-host")["state"] == "done"
        types = {t["type"]: t["runs_here"] for t in c.types()}
    assert types["echo.container"] and types["echo.echo"] and types["testmods.warm"]
    # a job no enrolled node could ever run is refused, with each node's reason
    done = cluster.gw(
        "submit", "--url", c0, "echo.container", "-p", "text=x", "--constraint", "node=n24"
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "no node can ever run it:" in said
    assert "n24: refuses container types (its runtime is local)" in said
    assert "n8: the job asks for node 'n24'" in said and "n80: the job asks for node" in said
    done = cluster.gw(
        "submit", "--url", c1, "echo.echo", "-p", "text=x", "--constraint", "node=n8"
    )  # fmt: skip
    assert done.returncode == 2
    assert "n8: refuses host types (its runtime is bubblewrap)" in " ".join(done.stderr.split())
    assert "container_runtime = 'bubblewrap' in this config means nothing here" in (
        " ".join((cluster.tmp / "coordinator1.stderr").read_text().split())
    )


def test_a_drained_node_resumes_and_explain_says_why_no_node_takes_a_job(
    cluster: Cluster,
) -> None:
    made = cluster.gw("token", "create", "ops", "--role", "operator", "--json",
                      config=cluster.tmp / "coordinator.toml")  # fmt: skip
    assert made.returncode == 0, made.stderr
    operator = json.loads(made.stdout)["token"]
    c0 = cluster.urls[0]
    for name in ("n8", "n80"):
        assert cluster.gw("node", "drain", name, "--url", c0, token=operator).returncode == 0
    with cluster.client() as c:
        job = c.submit("echo.container", {"text": "later"}, id="after-drain")
        assert job["state"] == "queued"  # draining nodes still count: it is taken
        # nothing takes it: n24 refuses it, the others are draining
        done = cluster.gw("explain", "after-drain", "--url", c0)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "node n24 refuses container types (its runtime is local)" in lines, lines
        assert not [ln for ln in lines if "has no module" in ln]
        assert "node n8 is draining: it takes no new work" in done.stdout
        assert "node n80 is draining: it takes no new work" in done.stdout
        listed = cluster.gw("node", "list", "--url", c0, token=operator)
        assert listed.stdout.count("draining") == 2
        assert c.get("after-drain")["state"] == "queued"
        done = cluster.gw("node", "resume", "n80", "--url", c0, token=operator)
        assert done.returncode == 0 and "node n80 takes new work again" in done.stderr
        assert c.wait("after-drain", timeout=60)["state"] == "done"
        assert nodes_of(c, "after-drain") == ["n80"]
        done = cluster.gw("node", "resume", "n8", "--url", cluster.urls[1])  # the owner
        assert done.returncode == 0
        again = cluster.gw("node", "resume", "n8", "--url", c0, token=operator)
        assert again.returncode == 0 and "was not draining (it is active)" in again.stderr
        resumed = [r for r in c.audit(limit=1000) if r["action"] == "node.resume"]
    assert [(r["target"], r["outcome"], r["role"]) for r in resumed] == [
        ("n80", "ok", "operator"), ("n8", "ok", "owner"), ("n8", "ok", "operator"),
    ]  # fmt: skip
    assert {n: cluster.nodes()[n]["state"] for n in cluster.agents} == dict.fromkeys(
        cluster.agents, "active"
    )


def test_node_invite_prints_the_coordinators_url(cluster: Cluster) -> None:
    done = cluster.gw("node", "invite", "n-spare", "--url", cluster.urls[1])
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    # the coordinator names the address it listens on (no coordinator_url configured)
    assert f"gpuwarden agent --coordinator {cluster.urls[1]} --enroll-file FILE" in said
    assert "is a loopback address" in said
    banner = (cluster.tmp / "coordinator1.stderr").read_text()
    assert f"agents use  {cluster.urls[1]}  (set [cluster] coordinator_url to say" in banner
    token = done.stdout.strip()
    assert token.startswith("gw_") and token not in done.stderr
    token_id = token.split("_")[1]
    revoked = cluster.gw("token", "revoke", token_id, config=cluster.tmp / "coordinator.toml")
    assert revoked.returncode == 0, revoked.stderr


def test_warm_affinity(cluster: Cluster) -> None:
    with cluster.client() as c:
        c.submit("testmods.warm", {"sleep_s": 0.05}, id="warm-1")
        assert c.wait("warm-1", timeout=60)["state"] == "done"
        [home] = nodes_of(c, "warm-1")
        wait_for(
            f"{home} to report testmods.warm warm",
            lambda: "testmods.warm" in cluster.nodes()[home]["warm"],
            timeout=20,
        )
        for i in range(2, 5):
            c.submit("testmods.warm", {"sleep_s": 0.05}, id=f"warm-{i}")
            assert c.wait(f"warm-{i}", timeout=60)["state"] == "done"
            assert nodes_of(c, f"warm-{i}") == [home], f"warm-{i} left its warm node {home}"


def test_sigkill_mid_job_reruns_it_elsewhere_once(cluster: Cluster) -> None:
    with cluster.client() as c:
        gpu_job(c, "killed-1", 2, seconds=6)
        victim = wait_for("killed-1 to run", lambda: running_on(c, "killed-1"), timeout=30)
        agent = cluster.agents[victim]
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
        killed_at = time.monotonic()
        job = c.wait("killed-1", timeout=60)
        assert job["state"] == "done", job
        took = time.monotonic() - killed_at
        attempts = job["attempts_detail"]
        assert len(attempts) == 2, attempts
        assert attempts[0]["node"] == victim and attempts[0]["outcome"] == "interrupted"
        assert attempts[0]["reason"].startswith(f"its node {victim} stopped renewing its lease")
        assert attempts[1]["node"] != victim and attempts[1]["outcome"] == "succeeded"
        assert took >= LEASE_S - 1  # not before its lease ran out
        dones = [e for e in job["events"] if e.get("to") == "done"]
        assert len(dones) == 1
        # meanwhile `status` says the node is not well, and exits 1
        done = cluster.gw("status", "--url", cluster.urls[0])
        assert done.returncode == 1, done.stdout
        [header] = [ln for ln in done.stdout.splitlines() if ln.startswith(f"node {victim} ")]
        assert re.search(r"(silent for \d+ s|offline: not heard from for \d+ s)$", header), header
        # the killed agent starts again, as its service would: with the token it enrolled
        # with still in its environment file; it keeps its saved credential
        cluster.start_agent(agent, agent.token)
        wait_for(f"{victim} back", lambda: cluster.nodes()[victim]["seen_s_ago"] < 2, 30)
        assert f"already enrolled as node {victim} with this token" in agent.stderr.read_text()
        assert cluster.gw("status", "--url", cluster.urls[0]).returncode == 0


def test_sigstop_past_the_lease_cannot_report_afterwards(cluster: Cluster) -> None:
    with cluster.client() as c:
        gpu_job(c, "stopped-1", 2, seconds=3)
        victim = wait_for("stopped-1 to run", lambda: running_on(c, "stopped-1"), timeout=30)
        agent = cluster.agents[victim]
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            # while its lease lasts, the node and its job say it is silent
            wait_for(
                f"{victim} to be silent",
                lambda: cluster.nodes()[victim]["silent_s"] is not None,
                timeout=LEASE_S,
            )
            env = {**cluster.env, "GPUWARDEN_TOKEN": cluster.owner}
            url = cluster.urls[0]
            listing, explaining = (
                subprocess.Popen(cluster.cmd(*a), env=env, stdout=subprocess.PIPE, text=True)
                for a in (("node", "list", "--url", url), ("explain", "stopped-1", "--url", url))
            )
            listed, explained = listing.communicate(60)[0], explaining.communicate(60)[0]
            silent = r"silent for \d+ s \(lease ends in \d+ s\)"
            [row] = [ln for ln in listed.splitlines() if f" {victim} " in ln]
            assert re.search(silent, row) and "active" not in row, listed
            assert re.search(rf"its node {victim} is {silent}", explained), explained
            # its lease runs out, the sweep ends the attempt, another node runs it
            wait_for(
                "stopped-1 to run again elsewhere",
                lambda: len(c.get("stopped-1")["attempts_detail"]) == 2,
                timeout=40,
            )
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        job = c.wait("stopped-1", timeout=60)
        assert job["state"] == "done"
        first, second = job["attempts_detail"]
        assert first["node"] == victim and first["outcome"] == "interrupted"
        assert second["node"] != victim and second["outcome"] == "succeeded"
        # the stopped agent comes back, stops its copy, and never reports it
        wait_for(
            f"{victim} to heartbeat again",
            lambda: cluster.nodes()[victim]["seen_s_ago"] < 2,
            timeout=30,
        )
        lost = wait_for(
            f"{victim} to log that it lost the lease",
            lambda: [
                e for e in _events(agent.log) if e.get("event") == "lease_lost"
                and e.get("job") == "stopped-1"
            ],
            timeout=20,
        )  # fmt: skip
        assert lost
        time.sleep(1.0)
        job = c.get("stopped-1")
        assert job["state"] == "done" and len(job["attempts_detail"]) == 2
        assert len([e for e in job["events"] if e.get("to") == "done"]) == 1
        finishes = [
            r
            for r in c.audit(limit=1000)
            if r["action"] == "node.finish" and r["target"] == "stopped-1"
        ]
        ok = [r for r in finishes if r["outcome"] == "ok"]
        assert len(ok) == 1 and ok[0]["actor_name"] != victim, finishes


def test_two_coordinators_never_run_a_job_twice(cluster: Cluster) -> None:
    ids = [f"burst-{i:02d}" for i in range(40)]
    started = time.monotonic()
    with cluster.client() as c, cluster.client(1) as c2:
        for i, job_id in enumerate(ids):
            (c if i % 2 else c2).submit("testmods.sleep", {"seconds": 0.05}, id=job_id)
        for job_id in ids:
            assert c.wait(job_id, timeout=90)["state"] == "done"
    took = time.monotonic() - started
    print(f"\n40 short jobs through 2 coordinators and 3 agents: {took:.1f} s", file=sys.stderr)
    by_node = cluster.sql(
        "SELECT node, count(*) FROM attempts WHERE job_id LIKE 'burst-%%' GROUP BY node"
    )
    assert len(by_node) >= 2, by_node  # the work was spread
    assert "n8" not in dict(by_node)  # a host type: n8 runs only sandboxed ones
    # across every job of the whole run: at most one succeeded attempt, one done
    twice = cluster.sql(
        "SELECT job_id, count(*) FROM attempts WHERE outcome = 'succeeded' "
        "GROUP BY job_id HAVING count(*) > 1"
    )
    assert twice == []
    done_twice = cluster.sql(
        "SELECT job_id, count(*) FROM events WHERE kind = 'transition' AND to_state = 'done' "
        "GROUP BY job_id HAVING count(*) > 1"
    )
    assert done_twice == []
    # two attempts of one job never overlapped in time
    overlaps = cluster.sql(
        "SELECT a.job_id FROM attempts a JOIN attempts b ON a.job_id = b.job_id "
        "AND a.number < b.number WHERE a.ended_at IS NULL OR a.ended_at > b.started_at"
    )
    assert overlaps == []


def test_a_revoked_agent_is_refused_and_exits(cluster: Cluster) -> None:
    agent = cluster.agents["n8"]
    assert agent.proc is not None and agent.proc.poll() is None
    credential = json.loads((agent.state / "node-credential").read_text())
    assert (agent.state / "node-credential").stat().st_mode & 0o777 == 0o600
    done = cluster.gw("node", "revoke", "n8", "--url", cluster.urls[0])
    assert done.returncode == 0, done.stderr
    assert agent.proc.wait(30) == 3
    assert "refused" in agent.stderr.read_text()
    r = httpx.post(
        f"{cluster.urls[1]}/v1/node/heartbeat",
        json={"report": {}},
        headers={"Authorization": f"Bearer {credential['token']}"},
        timeout=10,
    )
    assert r.status_code == 401 and "revoked" in r.json()["error"]
    assert cluster.nodes()["n8"]["state"] == "revoked"


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
