"""Fair share across hosts with real processes (SPEC.md section 11, "Fair share"): a
coordinator on PostgreSQL and one agent on a simulated GPU that runs one job at a
time. Two submitters (tokens): one with heavy recorded use. At equal priority the
light owner's job is offered first, the heavy owner's higher-priority job still
goes before both, explain on the coordinator says why the heavy owner's job
waits, and the VRAM-hours of the jobs the agent ran show up in `GET /v1/share` on
the coordinator (the agent's own store keeps none: one account, the
coordinator's)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from gpuwarden.client import Client
from tests.acceptance.test_cluster import _config, _healthy, free_port, wait_for
from tests.acceptance.test_coordinator_queue import _stop

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    dbname = f"gw_fs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        yield pg_url.rsplit("/", 1)[0] + f"/{dbname}"
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )


def test_the_light_owner_goes_first_across_hosts_and_use_is_counted_on_the_coordinator(
    database: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    modules = [str(REPO / "src" / "gpuwarden" / "modules"), str(REPO / "tests" / "modules")]
    coord_cfg = _config(
        tmp_path / "coordinator.toml",
        {
            "state_dir": str(tmp_path / "coordinator"),
            "database": database,
            "module_paths": modules,
            "api": {"rate_per_s": 10_000, "burst": 10_000},
            "cluster": {"sweep_every_s": 0.5},
        },
    )

    def gw(*args: str, token: str = "") -> subprocess.CompletedProcess[str]:
        e = {**env, "GPUWARDEN_TOKEN": token} if token else env
        return subprocess.run(
            [sys.executable, "-m", "gpuwarden", "--config", str(coord_cfg), *args],
            env=e,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    made = gw("token", "create", "admin", "--role", "owner", "--json")
    assert made.returncode == 0, made.stderr
    admin = json.loads(made.stdout)["token"]
    procs: list[subprocess.Popen[bytes]] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with (tmp_path / "coordinator.stderr").open("ab") as err:
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--config", str(coord_cfg)),
                        *("coordinator", "--bind", f"127.0.0.1:{port}"),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        wait_for("the coordinator", lambda: _healthy(url), timeout=60)
        with Client(url, admin, timeout=30) as c:
            heavy = c.create_token("heavy", "submitter")
            light = c.create_token("light", "submitter")
        # the heavy owner's recorded use: 500 GiB-hours, as of now
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO fair_share (owner, gib_h, as_of) VALUES (%s, %s, %s)",
                (heavy["id"], 500.0, time.time()),
            )
        agent_state = tmp_path / "agent"
        agent_cfg = _config(
            tmp_path / "agent.toml",
            {
                "state_dir": str(agent_state),
                "module_paths": modules,
                "allow_unsandboxed_containers": True,
                "sim_gpu": {"vram_gib": 24, "release_delay_s": 0.05},
                "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 2},
                "cluster": {"claim_every_s": 0.2, "max_jobs": 1},
            },
        )
        invited = gw("node", "invite", "a1", "--url", url, "--json", token=admin)
        assert invited.returncode == 0, invited.stderr
        with (tmp_path / "agent.stderr").open("ab") as err:
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--mock-gpu"),
                        *("--config", str(agent_cfg), "agent", "--coordinator", url),
                    ],
                    env={**env, "GPUWARDEN_ENROLL_TOKEN": json.loads(invited.stdout)["token"]},
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        admin_c = Client(url, admin, timeout=30)

        def agent_up() -> bool:
            nodes = admin_c.request_json("GET", "/v1/nodes")
            return any(n["name"] == "a1" and n["gpus"] for n in nodes)

        wait_for("the agent with its GPU", agent_up, timeout=60)
        # no new work while the queue is filled: the order is the coordinator's alone
        drained = gw("node", "drain", "a1", "--url", url, token=admin)
        assert drained.returncode == 0, drained.stderr
        params = {"gib": 4, "seconds": 1.0, "leak": False}
        with Client(url, heavy["token"], timeout=30) as h, Client(url, light["token"]) as lc:
            h_eq = h.submit("testmods.gpu", params, id="fs-heavy", vram_gib=4)["id"]
            l_eq = lc.submit("testmods.gpu", params, id="fs-light", vram_gib=4)["id"]
            h_hi = h.submit("testmods.gpu", params, id="fs-urgent", vram_gib=4, priority=5)["id"]
            why = h.explain(h_eq)
        assert any(
            "it waits behind another owner's jobs: fair share: another owner has used less" in line
            for line in why
        ), why  # a submitter sees no other token's id
        why = admin_c.explain(h_eq)
        assert any(f"owner {light['id']} has used less" in line for line in why), why
        assert not any("fair share" in line for line in admin_c.explain(l_eq))
        resumed = gw("node", "resume", "a1", "--url", url, token=admin)
        assert resumed.returncode == 0, resumed.stderr
        ids = (h_hi, l_eq, h_eq)
        wait_for(
            "the three jobs done",
            lambda: all(admin_c.get(i)["state"] == "done" for i in ids),
            timeout=120,
        )
        started = {i: admin_c.get(i)["attempts_detail"][0]["started_at"] for i in ids}
        # priority first, then the owner who used less, though it was submitted later
        assert sorted(ids, key=started.__getitem__) == list(ids), started
        share = {r["name"]: r for r in admin_c.share()}
        assert share["light"]["gib_h"] > 0  # 4 GiB for about a second, counted here
        assert share["light"]["standing"] == 1 and share["heavy"]["standing"] == 2
        with Client(url, light["token"]) as lc:
            [own] = lc.share()  # a submitter: its own row only
        assert own["owner"] == light["id"] and own["gib_h"] == share["light"]["gib_h"]
        with psycopg.connect(database) as conn:
            rows = dict(conn.execute("SELECT owner, gib_h FROM fair_share").fetchall())
        assert rows[light["id"]] > 0 and rows[heavy["id"]] > 499  # both charged there
        admin_c.close()
    finally:
        _stop(procs)
    # the agent's own store counted nothing: the coordinator's is the one account
    with sqlite3.connect(agent_state / "gpuwarden.db") as db:
        assert db.execute("SELECT COUNT(*) FROM fair_share").fetchone() == (0,)
        done = db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'done'").fetchone()
    assert done == (3,)  # it did run them
