"""``gpuwarden coordinator --workers N``: N processes serve the API on one address
over one PostgreSQL store, and stop together."""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest

from tests.conftest import MODULES

GW = [sys.executable, "-m", "gpuwarden"]

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    name = f"gw_test_workers_{secrets.token_hex(4)}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield pg_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def config(tmp_path: Path, db: str = "") -> Path:
    cfg = tmp_path / "coordinator.toml"
    lines = [f'state_dir = "{tmp_path / "state"}"', f'module_paths = ["{MODULES}"]']
    if db:
        lines.append(f'database = "{db}"')
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_several_workers_need_postgresql(tmp_path: Path) -> None:
    done = subprocess.run(
        [*GW, "--config", str(config(tmp_path)), "coordinator", "--bind", "127.0.0.1:0",
         "--workers", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--workers above 1 needs a PostgreSQL store" in done.stderr


def test_two_workers_serve_one_address_and_stop_together(tmp_path: Path, database: str) -> None:
    cfg = config(tmp_path, database)
    token = subprocess.run(
        [*GW, "--config", str(cfg), "token", "create", "t", "--role", "owner"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    log = tmp_path / "coordinator.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*GW, "--config", str(cfg), "coordinator", "--db", database, "--bind",
             "127.0.0.1:0", "--workers", "2"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = m.group(1)
        assert "workers     2 processes" in log.read_text()
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 1  # the second process, forked by the first
        headers = {"Authorization": f"Bearer {token}"}
        ids = []
        for i in range(12):  # a new connection each: the kernel spreads them
            r = httpx.post(
                f"{url}/v1/jobs",
                json={"type": "echo.echo", "params": {"text": str(i)}},
                headers=headers,
                timeout=30,
            )
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        listed = httpx.get(f"{url}/v1/jobs", headers=headers, timeout=30).json()
        assert sorted(j["id"] for j in listed) == sorted(ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for w in workers:
            assert not w.is_running() or w.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
