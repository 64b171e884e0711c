"""Claims per second of the coordinator's service functions on PostgreSQL.

In one process, no HTTP: ``--nodes`` simulated nodes (one 80 GiB GPU each) claim
from a queue of ``--jobs`` small echo jobs, ``--threads`` at once, each claim
asking for up to ``--want`` jobs; every job claimed is started and finished at
once, so the queue drains. Prints the figures, then one JSON line.

    .venv/bin/python bench/claims.py --url postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python bench/claims.py --smoke      # seconds: tests/bench/test_claims_smoke.py
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import nodeview as nv
from gpuwarden.core.model import GIB, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.registry import Registry
from gpuwarden.store.postgres import PostgresStore

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--want", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="a size for tests: a few seconds")
    args = p.parse_args()
    if args.smoke:
        args.jobs, args.nodes, args.threads = 40, 2, 2
    schema = f"gw_bench_{uuid.uuid4().hex[:12]}"
    store = PostgresStore(args.url, schema=schema, max_size=args.threads + 2)
    registry = Registry.load([REPO / "src" / "gpuwarden" / "modules"])
    try:
        run(store, registry, args)
    finally:
        store.close()
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def run(store: PostgresStore, registry: Registry, args: argparse.Namespace) -> None:
    now = time.time()
    report = {
        "gpus": [{"uuid": "GPU-0", "name": "sim", "total_bytes": 80 * GIB, "free_bytes": 80 * GIB}],
        "max_jobs": args.want,
    }
    names = [f"node{i}" for i in range(args.nodes)]
    for name in names:
        token_id = uuid.uuid4().hex[:12]
        store.create_token(
            token_id=token_id, name=name, role=Role.NODE, secret_hash="x", now=now,
            created_by="local", node=name,
        )  # fmt: skip
        co.enroll(store, name, token_id=token_id, capabilities={}, now=now)
        store.touch_node(name, report, now)
    for start in range(0, args.jobs, 500):
        store.submit(
            [
                JobSpec(id=f"j{i:06d}", type="echo.echo", params={"text": "x"})
                for i in range(start, min(args.jobs, start + 500))
            ],
            now=now,
        )
    claims = empty = leased = 0
    lock = threading.Lock()
    latencies: list[float] = []

    def worker(k: int) -> None:
        nonlocal claims, empty, leased
        name = names[k % len(names)]
        while True:
            t0 = time.perf_counter()
            record = store.get_node(name)
            assert record is not None
            got = co.claim(store, registry, name, nv.node_view(record), time.time(), want=args.want)
            dt = time.perf_counter() - t0
            with lock:
                claims += 1
                latencies.append(dt)
                leased += len(got)
                empty += not got
            if not got:
                if not store.queued_jobs(limit=1):
                    return
                time.sleep(0.01)  # the rest is leased to others: as an agent, wait a little
            for job in got:
                co.start(store, name, job["id"], lease_id=job["lease_id"], gpu_uuid=None,
                         now=time.time())  # fmt: skip
                co.finish(
                    store, registry, name, job["id"], lease_id=job["lease_id"],
                    state=JobState.DONE, outcome="succeeded", reason="done", now=time.time(),
                )  # fmt: skip

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    counts = store.count_by_state()
    latencies.sort()
    out = {
        "jobs": args.jobs,
        "nodes": args.nodes,
        "threads": args.threads,
        "claims": claims,
        "claims_per_s": round(claims / took, 1),
        "jobs_per_s": round(leased / took, 1),
        "claim_p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
        "claim_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 1),
        "empty_claims": empty,
        "done": counts.get(JobState.DONE, 0),
    }
    print(
        f"{leased} jobs leased in {claims} claims over {took:.1f} s by {args.threads} threads "
        f"for {args.nodes} nodes: {out['claims_per_s']} claims/s, {out['jobs_per_s']} jobs/s "
        f"(each claimed job also started and finished)"
    )
    print(json.dumps(out))
    assert counts.get(JobState.DONE, 0) == args.jobs, counts


if __name__ == "__main__":
    main()
