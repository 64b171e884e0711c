"""A coordinator reads a queue root like the single-host broker does: one coordinator
process (SQLite, and PostgreSQL when reachable) and one agent with a simulated GPU,
each a process of its own. A bundle of two echo jobs ends in outbox/ with both
results and their outputs (uploaded by the agent to the coordinator); a bundle
with an input file runs on the agent (it fetched the file) and ends in outbox/; a
bad bundle ends in failed/ with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql

from gpuwarden.core.model import JobSpec
from gpuwarden.intake.bundle import read_result_bundle
from gpuwarden.intake.bundlewrite import write_bundle
from tests.acceptance.test_cluster import _config, _healthy, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None: the coordinator's own SQLite; else a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield None
        return
    pg_url: str = request.getfixturevalue("pg_url")
    dbname = f"gw_cq_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        yield pg_url.rsplit("/", 1)[0] + f"/{dbname}"
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_coordinator_reads_its_queue_root(database: str | None, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    modules = [str(REPO / "src" / "gpuwarden" / "modules"), str(REPO / "tests" / "modules")]
    queue = tmp_path / "queue"
    coord: dict[str, object] = {
        "state_dir": str(tmp_path / "coordinator"),
        "module_paths": modules,
        "allow_unsandboxed_containers": True,
        "broker": {"poll_interval_s": 0.1},
        "cluster": {"sweep_every_s": 0.5},
    }
    if database is not None:
        coord["database"] = database
    coord_cfg = _config(tmp_path / "coordinator.toml", coord)

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
    owner = json.loads(made.stdout)["token"]
    procs: list[subprocess.Popen[bytes]] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with (tmp_path / "coordinator.stderr").open("ab") as err:
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--config", str(coord_cfg)),
                        *("coordinator", "--bind", f"127.0.0.1:{port}", "--queue", str(queue)),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
        wait_for("the coordinator", lambda: _healthy(url), timeout=60)
        for sub in ("inbox", "processing", "outbox", "failed"):
            assert (queue / sub).is_dir()  # made at start
        agent_cfg = _config(
            tmp_path / "agent.toml",
            {
                "state_dir": str(tmp_path / "agent"),
                "module_paths": modules,
                "allow_unsandboxed_containers": True,
                "sim_gpu": {"vram_gib": 24, "release_delay_s": 0.05},
                "broker": {"poll_interval_s": 0.05, "shutdown_grace_s": 2},
                "cluster": {"claim_every_s": 0.3, "max_jobs": 4},
            },
        )
        invited = gw("node", "invite", "a1", "--url", url, "--json", token=owner)
        assert invited.returncode == 0, invited.stderr
        with (tmp_path / "agent.stderr").open("ab") as err:
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gpuwarden", "--mock-gpu"),
                        *("--config", str(agent_cfg), "agent", "--coordinator", url),
                        *("--log", str(tmp_path / "agent.events.jsonl")),
                    ],
                    env={**env, "GPUWARDEN_ENROLL_TOKEN": json.loads(invited.stdout)["token"]},
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )

        now = time.time()
        good = write_bundle(
            queue / "inbox",
            [
                JobSpec(id="cq-one", type="echo.echo", params={"text": "one"}),
                JobSpec(id="cq-two", type="echo.echo", params={"text": "two"}),
            ],
            now=now,
        )
        bad = write_bundle(
            queue / "inbox",
            [JobSpec(id="cq-bad", type="echo.echo", params={"text": 5, "bogus": 1})],
            now=now + 1,
        )
        given = tmp_path / "data.txt"
        given.write_text("data\n")
        with_inputs = write_bundle(
            queue / "inbox",
            [
                JobSpec(
                    id="cq-in",
                    type="testmods.cat",
                    params={"file": "data.txt"},
                    inputs=("data.txt",),
                )
            ],
            {"data.txt": given},
            now=now + 2,
        )

        done = queue / "outbox" / good.name
        wait_for("the result bundle in outbox/", done.exists, timeout=120)
        results = read_result_bundle(done)
        assert set(results) == {"cq-one", "cq-two"}
        for job_id, text in (("cq-one", "one"), ("cq-two", "two")):
            r = results[job_id]
            assert r["status"] == "done", r
            assert r["node"] == "a1"
            assert text in r["stdout"]
        with zipfile.ZipFile(done) as zf:
            names = set(zf.namelist())
        # the agent uploaded its outputs: the coordinator packs its own copy
        assert "cq-one/outputs/echo.txt" in names
        assert not any(n.endswith("OUTPUTS.txt") for n in names)
        with zipfile.ZipFile(done) as zf:
            packed = zf.read("cq-one/outputs/echo.txt")
        copies = list((tmp_path / "coordinator" / "outputs" / "cq-one").glob("*/echo.txt"))
        assert len(copies) == 1 and copies[0].read_bytes() == packed
        got = httpx.get(
            f"{url}/v1/jobs/cq-one/outputs/echo.txt",
            headers={"Authorization": f"Bearer {owner}"},
            timeout=10,
        )
        assert got.status_code == 200 and got.content == packed, got.text
        assert b"one" in packed
        assert not (queue / "processing" / good.name).exists()
        assert not list((queue / "inbox").glob("*.zip"))

        refused = queue / "failed" / bad.name
        wait_for("the bad bundle in failed/", refused.exists, timeout=30)
        reason = read_result_bundle(refused)["cq-bad"]["reason"]
        assert "the bundle was refused" in reason and "text" in reason, reason
        assert (queue / "failed" / f"{bad.name}.input").exists()

        ran = queue / "outbox" / with_inputs.name
        wait_for("the bundle with an input file in outbox/", ran.exists, timeout=120)
        r = read_result_bundle(ran)["cq-in"]
        assert r["status"] == "done" and r["node"] == "a1", r
        with zipfile.ZipFile(ran) as zf:
            assert zf.read("cq-in/outputs/copy") == b"data\n"
        # the agent ran it on its own copy of the input, fetched from the coordinator
        assert (tmp_path / "agent" / "inputs" / "cq-in" / "data.txt").is_file()
    finally:
        _stop(procs)
    for name in ("coordinator.stderr", "agent.stderr"):
        text = (tmp_path / name).read_text()
        assert "Traceback" not in text, text
