"""Acceptance: a state directory whose SQLite file has damaged pages (a real
store, its pages overwritten) under the real CLI. Every command that writes
(``submit``, ``token create``, ``cancel``, ``serve``) refuses it with the one line
``serve`` says and writes nothing; readers (``jobs``, ``status``, ``events``) say
that it is damaged."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from gpuwarden.core.model import JobSpec
from gpuwarden.intake.jobs import prepare
from gpuwarden.registry import Registry
from gpuwarden.store.sqlite import SqliteStore
from tests.conftest import MODULES

GW = [sys.executable, "-m", "gpuwarden"]
PAGE = 4096


def gw(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    env["COLUMNS"] = "400"  # the line is compared whole: no wrapping
    return subprocess.run(
        [*GW, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.iterdir()
        if p.name in ("gpuwarden.db", "gpuwarden.db-wal")  # -shm: an index readers touch
    }


def error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "is damaged" in ln]
    assert len(lines) == 1, stderr
    return lines[0].split(":", 1)[1].strip()


def test_a_damaged_store_is_refused_by_every_writer_and_said_by_readers(tmp_path: Path) -> None:
    config = tmp_path / "gpuwarden.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\ngpu = "sim"\nmodule_paths = ["{MODULES}"]\n'
    )
    db = tmp_path / "state" / "gpuwarden.db"
    store = SqliteStore(db)
    registry = Registry.load([MODULES])
    specs = [
        prepare(registry, JobSpec(id=f"j{i}", type="echo.echo", params={"text": "x" * 300}))
        for i in range(600)
    ]
    store.submit(specs, now=time.time())
    store.close()
    with sqlite3.connect(db) as conn:  # everything in the main file, no -wal
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw = bytearray(db.read_bytes())
    pages = len(raw) // PAGE
    assert pages > 20, pages
    middle = pages // 2
    raw[middle * PAGE : (middle + 3) * PAGE] = b"\xab" * (3 * PAGE)
    db.write_bytes(bytes(raw))
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:  # the damage is real: SQLite says so, yet the file opens as before
        verdict = str(conn.execute("PRAGMA quick_check").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        verdict = str(exc)
    finally:
        conn.close()
    assert verdict != "ok"
    SqliteStore(db).close()  # what `submit` opened before: no error at open
    before = digest(db.parent)

    serve = gw(config, "serve")
    assert serve.returncode == 2, serve.stderr
    said = error_line(serve.stderr)
    assert said.startswith(f"the database {db} is damaged") and "wrote nothing" in said
    writers = [
        ("submit", "echo.echo", "--text", "x", "--id", "late"),
        ("token", "create", "admin", "--role", "owner"),
        ("cancel", "j1"),
    ]
    for args in writers:
        r = gw(config, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert error_line(r.stderr) == said, args  # the same line as serve's
        assert "submitted" not in r.stdout
    assert digest(db.parent) == before  # nothing written

    for args in (("jobs",), ("status",), ("events",)):
        r = gw(config, *args)
        assert "is damaged" in r.stderr, (args, r.returncode, r.stderr)
        assert r.returncode in (0, 1, 2), (args, r.stderr)  # said, never a traceback
        assert "Traceback" not in r.stderr, r.stderr
