"""Several hosts, measured: submits per second over HTTP, claims per second with
several agents asking at once, and end-to-end no-op jobs per second with three
real agents, on PostgreSQL and on SQLite.

Each figure gets a fresh database and a coordinator process of its own
(`gpuwarden coordinator`), driven over HTTP as clients and agents drive it:

- submits_per_s: 4 client threads POST /v1/jobs (echo.echo) as fast as they can;
- claims_per_s: jobs leased per second while 3 enrolled nodes (threads speaking
  the agents' API) claim from a queue of queued jobs, 10 at a time;
- jobs_per_s: 3 `gpuwarden agent` processes (simulated GPUs) run N echo jobs
  end to end: submitted, claimed, run, reported; from the first submit to the
  last job done.

    .venv/bin/python bench/cluster.py [--jobs 120] [--submits 400] [--pg URL]

PostgreSQL: a database of its own is created on the server of --pg (default
postgresql://postgres@127.0.0.1:5432/test) and dropped at the end. The last line
is one JSON object: {"postgres": {...}, "sqlite": {...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
GW = [sys.executable, "-m", "gpuwarden"]
THREADS = 4
AGENTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def write_config(path: Path, db: str, **extra: str) -> Path:
    lines = [
        f'state_dir = "{path.parent / "state"}"',
        f'module_paths = ["{REPO / "src" / "gpuwarden" / "modules"}"]',
    ]
    if db.startswith("postgresql://"):
        lines.append(f'database = "{db}"')
    lines += [f"{k} = {v}" for k, v in extra.items()]
    # the bench is one client hammering the API: lift the per-token rate limit
    lines += ["[api]", "rate_per_s = 1000000", "burst = 1000000"]
    lines += ["[cluster]", "claim_every_s = 0.05"]
    path.write_text("\n".join(lines) + "\n")
    return path


class Coordinator:
    def __init__(self, work: Path, db: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.config = write_config(work / "coordinator.toml", db)
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
            [*GW, "--config", str(self.config), "coordinator", "--db", db, "--bind", self.bind],
            stdout=subprocess.DEVNULL,
            stderr=(work / "coordinator.log").open("w"),
        )
        self.client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.client.get("/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the coordinator did not start: see {work / 'coordinator.log'}")
            time.sleep(0.1)

    def submit(self, n: int, threads: int = THREADS) -> float:
        """Submit n echo jobs from ``threads`` threads; return submits per second."""
        errors: list[str] = []

        def worker(count: int) -> None:
            with httpx.Client(base_url=self.url, headers=self.client.headers, timeout=30) as c:
                for _ in range(count):
                    r = c.post("/v1/jobs", json={"type": "echo.echo", "params": {"text": "x"}})
                    if r.status_code != 201:
                        errors.append(r.text)

        per = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
        started = time.perf_counter()
        pool = [threading.Thread(target=worker, args=(k,)) for k in per]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - started
        if errors:
            raise SystemExit(f"{len(errors)} submits failed, e.g. {errors[0]}")
        return n / elapsed

    def enroll(self, name: str) -> str:
        invite = self.client.post("/v1/nodes/invite", json={"name": name})
        invite.raise_for_status()
        enrol = httpx.post(
            f"{self.url}/v1/nodes/enroll",
            json={"capabilities": {}},
            headers={"Authorization": f"Bearer {invite.json()['token']}"},
            timeout=30,
        )
        enrol.raise_for_status()
        return str(enrol.json()["token"])

    def invite(self, name: str) -> str:
        invite = self.client.post("/v1/nodes/invite", json={"name": name})
        invite.raise_for_status()
        return str(invite.json()["token"])

    def done(self) -> int:
        r = self.client.get("/v1/jobs", params={"state": "done", "limit": 1000})
        r.raise_for_status()
        return len(r.json())

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def claims_per_s(co: Coordinator, queued: int) -> float:
    """Leased jobs per second while AGENTS nodes claim 10 at a time until the queue
    is empty (each claim is one guarded lease of up to 10 jobs)."""
    tokens = [co.enroll(f"bench-node-{i}") for i in range(AGENTS)]
    report = {"gpus": [], "warm": [], "busy": 0, "max_jobs": 100000, "accepting": True}
    leased = [0] * AGENTS

    def agent(i: int) -> None:
        with httpx.Client(
            base_url=co.url, headers={"Authorization": f"Bearer {tokens[i]}"}, timeout=30
        ) as c:
            empty = 0
            while empty < 2:
                r = c.post("/v1/node/claim", json={"report": report, "want": 10})
                r.raise_for_status()
                got = len(r.json().get("jobs", []))
                leased[i] += got
                empty = empty + 1 if got == 0 else 0

    started = time.perf_counter()
    pool = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - started
    if sum(leased) != queued:
        raise SystemExit(
            f"claims leased {sum(leased)} of {queued} jobs: a job leased twice or lost"
        )
    return queued / elapsed


def jobs_per_s(co: Coordinator, work: Path, n: int) -> float:
    agents = []
    try:
        for i in range(AGENTS):
            home = work / f"agent-{i}"
            home.mkdir()
            cfg = home / "agent.toml"
            cfg.write_text(
                f'state_dir = "{home / "state"}"\n'
                f'node_name = "bench-agent-{i}"\n'
                f'module_paths = ["{REPO / "src" / "gpuwarden" / "modules"}"]\n'
                "[broker]\npoll_interval_s = 0.02\ncpu_slots = 4\n"
                "[cluster]\nclaim_every_s = 0.05\nmax_jobs = 8\n"
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
        time.sleep(2.0)  # let every agent enrol and send its first heartbeat
        started = time.perf_counter()
        co.submit(n, threads=2)
        deadline = time.monotonic() + 60 + n
        while (done := co.done()) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {done} of {n} jobs done: see {work}/agent-*/agent.log")
            time.sleep(0.1)
        return n / (time.perf_counter() - started)
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            try:
                a.wait(20)
            except subprocess.TimeoutExpired:
                a.kill()


def run(kind: str, pg: str, submits: int, jobs: int, keep: bool) -> dict[str, float]:
    figures: dict[str, float] = {}
    base = Path(tempfile.mkdtemp(prefix=f"gw-bench-{kind}-"))
    try:
        for step in ("submits", "jobs"):
            work = base / step
            with database(kind, pg, work) as db:
                co = Coordinator(work, db)
                try:
                    if step == "submits":
                        figures["submits_per_s"] = co.submit(submits)
                        print(
                            f"{kind}: {submits} submits over HTTP: "
                            f"{figures['submits_per_s']:.1f}/s",
                            flush=True,
                        )
                        figures["claims_per_s"] = claims_per_s(co, submits)
                        print(
                            f"{kind}: {submits} jobs leased by {AGENTS} nodes: "
                            f"{figures['claims_per_s']:.1f}/s",
                            flush=True,
                        )
                    else:
                        figures["jobs_per_s"] = jobs_per_s(co, work, jobs)
                        print(
                            f"{kind}: {jobs} no-op jobs end to end on {AGENTS} agents: "
                            f"{figures['jobs_per_s']:.2f}/s",
                            flush=True,
                        )
                finally:
                    co.close()
    finally:
        if keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return {k: round(v, 2) for k, v in figures.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--submits", type=int, default=400)
    ap.add_argument("--jobs", type=int, default=120)
    ap.add_argument(
        "--pg",
        default=os.environ.get(
            "GPUWARDEN_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folders")
    args = ap.parse_args()
    result = {
        kind: run(kind, args.pg, args.submits, args.jobs, args.keep)
        for kind in ("postgres", "sqlite")
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
