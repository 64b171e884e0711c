"""Several hosts, measured: submits per second over HTTP, claims per second with
eight nodes asking at once, and end-to-end no-op jobs per second with three
real agents, on PostgreSQL and on SQLite.

Each figure gets a fresh database and a coordinator process of its own
(`gpuwarden coordinator`), driven over HTTP as clients and agents drive it:

- submits_per_s: --clients client processes (default 4), each on one keep-alive
  connection, POST /v1/jobs one job at a time as fast as they can;
- claims_per_s: jobs leased per second while --nodes enrolled nodes (default 8;
  processes speaking the agents' API, one keep-alive connection each) claim from
  the queue of those jobs, --want (10) at a time, until it is empty; every job
  must be leased exactly once;
- jobs_per_s: --agents `gpuwarden agent` processes (default 3; simulated GPUs)
  run --jobs no-op jobs end to end: submitted over HTTP, claimed, run by each
  agent's broker, reported; from the first submit to the last job done.

The jobs are of the type `benchnoop.true`, a module written into the work folder
whose command is `/bin/true` (`launch = "host"`, `lane = "cpu"`): the job itself
costs one fork/exec, so what is measured is the broker, the agents and the
coordinator, not a Python start per job.

    .venv/bin/python bench/cluster.py [--submits 2000] [--jobs 600] [--pg URL]
    .venv/bin/python bench/cluster.py --smoke --backend sqlite    # seconds

PostgreSQL: a database of its own is created on the server of --pg (default
postgresql://postgres@127.0.0.1:5432/test) and dropped at the end. The last line
is one JSON object: {"postgres": {...}, "sqlite": {...}} (only the backends run).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
GW = [sys.executable, "-m", "gpuwarden"]
NOOP_TYPE = "benchnoop.true"
#: the smoke size: a few seconds per backend, for tests/bench/test_cluster_smoke.py
SMOKE = {"submits": 60, "jobs": 12, "clients": 2, "nodes": 3, "agents": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_noop_module(folder: Path) -> Path:
    """A module folder holding ``benchnoop``: one host type that runs /bin/true."""
    true = shutil.which("true") or "/bin/true"
    mod = folder / "benchnoop"
    mod.mkdir(parents=True, exist_ok=True)
    (mod / "module.toml").write_text(
        "[module]\n"
        'name = "benchnoop"\n'
        'description = "A no-op job: /bin/true (bench/cluster.py)."\n'
        'version = "1"\n\n'
        "[types.true]\n"
        'lane = "cpu"\n'
        'launch = "host"\n'
        f"command = [{json.dumps(true)}]\n"
        "timeout_s = 60\n"
        "max_retries = 0\n"
    )
    return folder


@contextlib.contextmanager
def database(kind: str, pg: str, work: Path) -> Iterator[str]:
    """A fresh, empty database: a new PostgreSQL database, or the SQLite file of
    the coordinator's state directory (``work/state``)."""
    if kind == "sqlite":
        (work / "state").mkdir(parents=True, exist_ok=True)
        yield str(work / "state" / "gpuwarden.db")
        return
    import psycopg

    name = f"gw_bench_{secrets.token_hex(4)}"
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield pg.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def write_config(path: Path, db: str, modules: Path) -> Path:
    lines = [
        f'state_dir = "{path.parent / "state"}"',
        f'module_paths = ["{modules}", "{REPO / "src" / "gpuwarden" / "modules"}"]',
    ]
    if db.startswith("postgresql://"):
        lines.append(f'database = "{db}"')
    # the bench is a few clients hammering the API: lift the per-token rate limit
    lines += ["[api]", "rate_per_s = 1000000", "burst = 1000000"]
    path.write_text("\n".join(lines) + "\n")
    return path


def count_done(kind: str, db: str) -> int:
    """Jobs done, read from the coordinator's store directly (no load on its API)."""
    if kind == "sqlite":
        import sqlite3

        with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM jobs WHERE state = 'done'").fetchone()[0])
    import psycopg

    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT COUNT(*) FROM jobs WHERE state = 'done'").fetchone()
        return int(row[0]) if row else 0


# -- load from other processes, one keep-alive connection each ------------------------


def _post_loop(
    go: Any, out: Any, port: int, token: str, path: str, bodies: list[bytes], expect: int
) -> None:
    """Child process: POST each body on one keep-alive connection, after ``go``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.connect()
    go.wait()
    started = time.monotonic()
    errors: list[str] = []
    for body in bodies:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != expect:
            errors.append(f"{r.status} {data[:300]!r}")
    out.put((started, time.monotonic(), errors))
    conn.close()


def _claim_loop(go: Any, out: Any, port: int, token: str, want: int) -> None:
    """Child process: a node claiming ``want`` at a time until two claims in a row
    find nothing; puts the job ids it leased."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    report = {"gpus": [], "warm": [], "busy": 0, "max_jobs": 1_000_000, "accepting": True}
    body = json.dumps({"report": report, "want": want}).encode()
    conn.connect()
    go.wait()
    started = time.monotonic()
    leased: list[str] = []
    errors: list[str] = []
    empty = claims = 0
    while empty < 2:
        conn.request("POST", "/v1/node/claim", body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        claims += 1
        if r.status != 200:
            errors.append(f"{r.status} {data[:300]!r}")
            break
        got = [j["id"] for j in json.loads(data).get("jobs", [])]
        leased += got
        empty = empty + 1 if not got else 0
    out.put((started, time.monotonic(), errors, leased, claims))
    conn.close()


def _in_processes(target: Any, argsets: list[tuple[Any, ...]]) -> tuple[float, list[Any]]:
    """Run ``target(go, out, *args)`` in one process per args; start them together;
    return (seconds from the first start to the last end, what each put)."""
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(go, out, *a)) for a in argsets]
    for p in procs:
        p.start()
    time.sleep(0.2)  # every client connected
    go.set()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    span = max(g[1] for g in got) - min(g[0] for g in got)
    return span, got


class Coordinator:
    def __init__(self, work: Path, db: str, modules: Path, workers: int = 1) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.config = write_config(work / "coordinator.toml", db, modules)
        self.port = free_port()
        self.bind = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.bind}"
        # the owner token goes straight into the store (the config's database, or
        # the SQLite file of its state directory): what the machine's owner does
        token = subprocess.run(
            [*GW, "--config", str(self.config), "token", "create", "bench", "--role", "owner"],
            capture_output=True,
            text=True,
            check=False,
        )
        if token.returncode != 0:
            raise SystemExit(f"token create failed: {token.stderr}")
        self.token = token.stdout.strip().splitlines()[-1]
        self.proc = subprocess.Popen(
            [
                *(*GW, "--config", str(self.config), "coordinator", "--db", db),
                *("--bind", self.bind, "--workers", str(workers)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(work / "coordinator.log").open("w"),
        )
        self.client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                if self.client.get("/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                log = (work / "coordinator.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"the coordinator did not start (exit {self.proc.wait()}):\n{log}")
            time.sleep(0.1)

    def submit(self, n: int, clients: int) -> float:
        """Submit n no-op jobs from ``clients`` processes; return submits per second."""
        body = json.dumps({"type": NOOP_TYPE, "params": {}}).encode()
        per = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
        span, got = _in_processes(
            _post_loop, [(self.port, self.token, "/v1/jobs", [body] * k, 201) for k in per]
        )
        errors = [e for g in got for e in g[2]]
        if errors:
            raise SystemExit(f"{len(errors)} submits failed, e.g. {errors[0]}")
        return n / span

    def enroll(self, name: str) -> str:
        enrol = httpx.post(
            f"{self.url}/v1/nodes/enroll",
            json={"capabilities": {}},
            headers={"Authorization": f"Bearer {self.invite(name)}"},
            timeout=30,
        )
        enrol.raise_for_status()
        return str(enrol.json()["token"])

    def invite(self, name: str) -> str:
        invite = self.client.post("/v1/nodes/invite", json={"name": name})
        invite.raise_for_status()
        return str(invite.json()["token"])

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def claims_per_s(co: Coordinator, queued: int, nodes: int, want: int) -> float:
    """Leased jobs per second while ``nodes`` nodes claim ``want`` at a time until the
    queue is empty (each claim is one guarded lease of up to ``want`` jobs)."""
    tokens = [co.enroll(f"bench-node-{i}") for i in range(nodes)]
    span, got = _in_processes(_claim_loop, [(co.port, t, want) for t in tokens])
    errors = [e for g in got for e in g[2]]
    if errors:
        raise SystemExit(f"{len(errors)} claims failed, e.g. {errors[0]}")
    leased = [j for g in got for j in g[3]]
    if len(leased) != queued or len(set(leased)) != queued:
        raise SystemExit(
            f"claims leased {len(leased)} ({len(set(leased))} distinct) of {queued} jobs: "
            "a job leased twice or lost"
        )
    return queued / span


def start_agents(
    co: Coordinator, work: Path, modules: Path, count: int
) -> list[subprocess.Popen[bytes]]:
    agents = []
    for i in range(count):
        home = work / f"agent-{i}"
        home.mkdir()
        cfg = home / "agent.toml"
        cfg.write_text(
            f'state_dir = "{home / "state"}"\n'
            f'node_name = "bench-agent-{i}"\n'
            f'module_paths = ["{modules}", "{REPO / "src" / "gpuwarden" / "modules"}"]\n'
            "[broker]\npoll_interval_s = 0.02\ncpu_slots = 8\n"
            "[cluster]\nclaim_every_s = 0.1\nmax_jobs = 16\n"
        )
        token = co.invite(f"bench-agent-{i}")
        agents.append(
            subprocess.Popen(
                [
                    *(*GW, "--config", str(cfg), "agent", "--coordinator", co.url),
                    *("--mock-gpu", "--log", str(home / "events.jsonl")),
                ],
                env={**os.environ, "GPUWARDEN_ENROLL_TOKEN": token},  # never in argv
                stdout=subprocess.DEVNULL,
                stderr=(home / "agent.log").open("w"),
            )
        )
    return agents


def wait_enrolled(co: Coordinator, count: int, timeout: float = 60) -> None:
    """Until every agent enrolled and sent its first heartbeat (its report has types)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = co.client.get("/v1/nodes").json()
        if len(nodes) >= count and all(n.get("max_jobs") is not None for n in nodes):
            return
        time.sleep(0.2)
    raise SystemExit(f"the agents did not enrol in {timeout:.0f} s")


def jobs_per_s(
    co: Coordinator, kind: str, db: str, work: Path, modules: Path, n: int, agents: int
) -> float:
    procs = start_agents(co, work, modules, agents)
    try:
        wait_enrolled(co, agents)
        time.sleep(1.0)  # every agent's first heartbeat is in
        started = time.monotonic()
        co.submit(n, clients=2)
        deadline = time.monotonic() + 60 + n
        while (done := count_done(kind, db)) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {done} of {n} jobs done: see {work}/agent-*/agent.log")
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"an agent exited: see {work}/agent-*/agent.log")
            time.sleep(0.02)
        return n / (time.monotonic() - started)
    finally:
        for a in procs:
            a.terminate()
        for a in procs:
            try:
                a.wait(20)
            except subprocess.TimeoutExpired:
                a.kill()


def run(kind: str, args: argparse.Namespace) -> dict[str, float]:
    figures: dict[str, float] = {}
    base = Path(tempfile.mkdtemp(prefix=f"gw-bench-{kind}-"))
    modules = write_noop_module(base / "modules")
    try:
        for step in ("submits", "jobs"):
            work = base / step
            with database(kind, args.pg, work) as db:
                workers = args.workers if kind == "postgres" else 1
                co = Coordinator(work, db, modules, workers)
                try:
                    if step == "submits":
                        figures["submits_per_s"] = co.submit(args.submits, args.clients)
                        print(
                            f"{kind}: {args.submits} submits over HTTP from {args.clients} "
                            f"clients to {workers} coordinator process(es): "
                            f"{figures['submits_per_s']:.1f}/s",
                            flush=True,
                        )
                        figures["claims_per_s"] = claims_per_s(
                            co, args.submits, args.nodes, args.want
                        )
                        print(
                            f"{kind}: {args.submits} jobs leased by {args.nodes} nodes, "
                            f"{args.want} a claim: {figures['claims_per_s']:.1f}/s",
                            flush=True,
                        )
                    else:
                        figures["jobs_per_s"] = jobs_per_s(
                            co, kind, db, work, modules, args.jobs, args.agents
                        )
                        print(
                            f"{kind}: {args.jobs} no-op jobs end to end on {args.agents} "
                            f"agents: {figures['jobs_per_s']:.2f}/s",
                            flush=True,
                        )
                finally:
                    co.close()
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return {k: round(v, 2) for k, v in figures.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--submits", type=int, default=2000, help="jobs submitted, then claimed")
    ap.add_argument("--jobs", type=int, default=600, help="no-op jobs end to end")
    ap.add_argument("--clients", type=int, default=4, help="client processes submitting")
    ap.add_argument("--nodes", type=int, default=8, help="nodes claiming at once")
    ap.add_argument("--want", type=int, default=10, help="jobs a claim asks for")
    ap.add_argument("--agents", type=int, default=3, help="agents running jobs end to end")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="coordinator processes on PostgreSQL (`coordinator --workers`; SQLite: 1)",
    )
    ap.add_argument("--backend", choices=("both", "postgres", "sqlite"), default="both")
    ap.add_argument("--smoke", action="store_true", help="a size for tests: a few seconds")
    ap.add_argument(
        "--pg",
        default=os.environ.get(
            "GPUWARDEN_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folders")
    args = ap.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    kinds = ("postgres", "sqlite") if args.backend == "both" else (args.backend,)
    result = {kind: run(kind, args) for kind in kinds}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
