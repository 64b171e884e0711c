"""Coordinator and store outages lose no finished work (issue 28), for real: a
coordinator and two agents, each a process of its own, on a fresh PostgreSQL
database. Each job counts its own work in a ledger file the broker does not
control (``testmods.ledger``: a 'done JOB ATTEMPT' line when it completes).

* The coordinator is killed with SIGKILL three times, each while jobs run, as four
  clients submit 60 jobs (each with an idempotency key, sent again while the
  coordinator cannot be reached). Every job ends done, and every job's 'done'
  line is in the ledger exactly once.
* PostgreSQL unreachable (the coordinator reaches it through a forwarder the test
  cuts; the server itself is shared and never stopped): the API answers 503 with
  ``Retry-After``, never another 5xx; ``gpuwarden submit --url`` waits it out,
  saying so; once the forwarder is restored everything is served and the jobs
  submitted before the cut are done, once each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from gpuwarden.client import ApiError
from tests.acceptance.test_cluster import Cluster, _healthy, wait_for
from tests.acceptance.test_cluster_preemption import running_cluster
from tests.pgproxy import Proxy, proxy_to

pytestmark = pytest.mark.timeout(600)

CLIENTS = 4
PER_CLIENT = 15
KILLS = 3
#: long enough that a coordinator restarting on a slow, loaded host never makes an
#: agent stop its jobs (its watchdog: 2/3 of this); a small fence grace keeps it quick
LEASE_S = 30
FENCE_S = 3
#: long enough that a kill right after seeing a job run still lands while it runs
JOB_S = 1.5


def done_lines(ledger: Path) -> Counter[str]:
    """How many times each job's 'done' line is in the ledger."""
    if not ledger.exists():
        return Counter()
    return Counter(
        line.split()[1] for line in ledger.read_text().splitlines() if line.startswith("done ")
    )


def start_lines(ledger: Path) -> Counter[str]:
    if not ledger.exists():
        return Counter()
    return Counter(
        line.split()[1] for line in ledger.read_text().splitlines() if line.startswith("start ")
    )


def restart_coordinator(c: Cluster) -> None:
    """Start the coordinator again on the same address and store."""
    port = c.urls[0].rsplit(":", 1)[1]
    with (c.tmp / "coordinator.stderr").open("ab") as err:
        c.procs[0] = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpuwarden"),
                *("--config", str(c.tmp / "coordinator.toml")),
                *("coordinator", "--bind", f"127.0.0.1:{port}"),
            ],
            env=c.env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    wait_for("the restarted coordinator", lambda: _healthy(c.urls[0]), timeout=120)


@dataclass
class Submitting:
    """Four clients' progress, shared with the thread that kills the coordinator."""

    submitted: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self) -> int:
        with self.lock:
            return len(self.submitted)


def submitter(c: Cluster, n: int, ledger: Path, progress: Submitting) -> None:
    """Submit this client's jobs, each until the coordinator took it (the same
    idempotency key each time: a submit whose answer was lost is not made twice)."""
    with c.client() as client:
        for i in range(PER_CLIENT):
            job_id = f"c{n}-{i:02d}"
            deadline = time.monotonic() + 240
            while True:
                try:
                    client.submit(
                        "testmods.ledger",
                        {"ledger": str(ledger), "seconds": JOB_S},
                        id=job_id,
                        idempotency_key=job_id,
                    )
                    break
                except ApiError as exc:  # no answer, or 5xx while it starts again
                    if time.monotonic() > deadline:
                        with progress.lock:
                            progress.errors.append(f"{job_id}: {exc.message}")
                        return
                    time.sleep(0.2)
            with progress.lock:
                progress.submitted.add(job_id)
            time.sleep(0.5)


def in_flight(ledger: Path) -> int:
    """Jobs that wrote their 'start' line and not yet their 'done' line: running
    now, as the jobs themselves tell it (not the store)."""
    return sum((start_lines(ledger) - done_lines(ledger)).values())


@pytest.fixture
def cluster(pg_url: str, tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(
        pg_url,
        tmp_path,
        {"k1": {"vram_gib": 24}, "k2": {"vram_gib": 24}},
        lease_s=LEASE_S,
        cluster_config={"fence_grace_s": FENCE_S},
    ) as c:
        yield c


def test_three_coordinator_kills_under_four_clients_lose_and_repeat_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster
    ledger = tmp_path / "work.ledger"  # outside every state directory
    progress = Submitting()
    threads = [
        threading.Thread(target=submitter, args=(c, n, ledger, progress), daemon=True)
        for n in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    kills: list[dict[str, Any]] = []
    total = CLIENTS * PER_CLIENT
    for k in range(KILLS):
        # each kill lands while jobs run and more are being submitted
        wait_for(
            f"jobs running before kill {k + 1}",
            lambda k=k: progress.count() >= (5, 12, 20)[k] and in_flight(ledger) > 0,
            timeout=180,
        )
        coordinator = c.procs[0]
        coordinator.send_signal(signal.SIGKILL)
        status = coordinator.wait(30)
        # the jobs' own word: which had started and not finished when it died
        # (a job lasts JOB_S; the kill follows the sighting within milliseconds)
        running = in_flight(ledger)
        kills.append({"status": status, "running": running, "submitted": progress.count()})
        assert status == -signal.SIGKILL  # it really died, mid-work
        assert not _healthy(c.urls[0])
        time.sleep(1.0)  # down a moment: the agents' reports and the clients wait
        restart_coordinator(c)
    for t in threads:
        t.join(300)
    assert not progress.errors, progress.errors
    assert len(kills) == KILLS and all(k["running"] > 0 for k in kills), kills
    assert all(k["submitted"] < total for k in kills), kills  # during submission
    ids = sorted(progress.submitted)
    assert len(ids) == total

    def all_ended() -> bool:
        rows = c.sql("SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')")
        return int(rows[0][0]) == 0

    wait_for("every job ended", all_ended, timeout=300)
    states = dict(c.sql("SELECT id, state FROM jobs"))
    assert {j: states.get(j) for j in ids if states.get(j) != "done"} == {}  # 0 lost
    done = done_lines(ledger)
    twice = {j: n for j, n in done.items() if n > 1}
    missing = [j for j in ids if done[j] == 0]
    starts = {j: n for j, n in start_lines(ledger).items() if n > 1}
    assert (twice, missing) == ({}, []), f"completed twice {twice}; missing {missing}; {starts}"
    attempts = dict(c.sql("SELECT id, attempts FROM jobs"))
    assert {j: attempts[j] for j in ids if attempts[j] != 1} == {}, starts  # no retry spent


@pytest.fixture
def proxied(pg_url: str, tmp_path: Path) -> Iterator[tuple[Cluster, Proxy]]:
    with (
        proxy_to(pg_url) as proxy,
        running_cluster(
            pg_url,
            tmp_path,
            {"p1": {"vram_gib": 24}},
            lease_s=LEASE_S,
            cluster_config={"fence_grace_s": FENCE_S},
            database_via=proxy.url,
        ) as c,
    ):
        try:
            yield c, proxy
        finally:
            proxy.restore()


def test_postgresql_unreachable_answers_503_with_retry_after_then_recovers(
    proxied: tuple[Cluster, Proxy], tmp_path: Path
) -> None:
    c, proxy = proxied
    ledger = tmp_path / "pg.ledger"
    with c.client() as client:
        for i in range(3):
            client.submit("testmods.ledger", {"ledger": str(ledger), "seconds": JOB_S}, id=f"p{i}")
    h = {"Authorization": f"Bearer {c.owner}"}
    proxy.cut()
    seen: list[httpx.Response] = []
    with httpx.Client(base_url=c.urls[0], headers=h, timeout=60) as http:
        # the cut is felt: the coordinator's store cannot read
        wait_for(
            "a 503",
            lambda: seen.append(http.get("/v1/jobs")) or seen[-1].status_code == 503,
            timeout=60,
        )
        with pytest.raises(psycopg.OperationalError):  # the cut is real
            psycopg.connect(proxy.url(c.db_url), connect_timeout=5).close()
        r = http.post("/v1/jobs", json={"type": "testmods.ledger", "params": {}})
        seen.append(r)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
        assert "the store is unreachable (PostgreSQL): retry in" in r.json()["error"]
        # the CLI waits it out, saying what it waits for
        env = {**c.env, "GPUWARDEN_TOKEN": c.owner}
        err_path = tmp_path / "submit.stderr"
        with err_path.open("wb") as err:
            cli = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gpuwarden", "submit", "--url", c.urls[0]),
                    *("testmods.ledger", "--id", "p-cli"),
                    *("-p", f"ledger={ledger}", "-p", "seconds=0.3"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        try:
            wait_for("the CLI to wait", lambda: b"503" in err_path.read_bytes(), timeout=90)
            assert cli.poll() is None  # still waiting, not failed
            seen.append(http.get("/v1/jobs"))
            proxy.restore()
            out, _ = cli.communicate(timeout=180)
        finally:
            if cli.poll() is None:
                cli.kill()
        assert cli.returncode == 0, err_path.read_text()
        assert b"p-cli" in out
        assert "the store is unreachable (PostgreSQL)" in err_path.read_text()
        # (the store's pool connects again with a backoff of its own: up to a minute)
        wait_for("the API back", lambda: http.get("/v1/jobs").status_code == 200, timeout=150)
    codes = Counter(r.status_code for r in seen)
    assert codes[503] >= 2 and set(codes) <= {200, 503}, codes  # never a 500
    ids = ["p0", "p1", "p2", "p-cli"]

    def done() -> bool:
        with c.client() as client:
            return all(client.get(j)["state"] == "done" for j in ids)

    wait_for("the jobs done", done, timeout=180)
    assert {j: n for j, n in done_lines(ledger).items() if n != 1} == {}
    assert sorted(done_lines(ledger)) == sorted(ids)
    assert os.path.exists(ledger)
