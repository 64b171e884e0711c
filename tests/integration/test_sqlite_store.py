"""SQLite-specific checks: pragmas, migrations, several processes on one file."""

from __future__ import annotations

import multiprocessing
import os
import re
import sqlite3
import stat
from pathlib import Path

import pytest

from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError
from gpuwarden.store.queries import load_migrations, load_queries, split_sql
from gpuwarden.store.sqlite import SqliteStore


def test_pragmas_and_migrations(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    try:
        db = sqlite3.connect(tmp_path / "s.db")
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        versions = [v for v, _, _ in load_migrations("sqlite")]
        assert store.schema_version() == max(versions)
        assert store.migrate() == []  # idempotent
        db.close()
    finally:
        store.close()
    reopened = SqliteStore(tmp_path / "s.db")
    assert reopened.migrate() == []
    reopened.close()


def test_every_named_query_parses(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.close()
    db = sqlite3.connect(tmp_path / "s.db")
    for name, sql in load_queries("sqlite").items():
        db.execute(f"EXPLAIN {sql}", {k: None for k in _params(sql)}), name
    db.close()


def _params(sql: str) -> set[str]:
    return set(re.findall(r":(\w+)", sql))


def _start_in_child(path: str, q: multiprocessing.Queue[str]) -> None:
    store = SqliteStore(Path(path))
    try:
        store.start_attempt("a", node="child", gpu_uuid=None, now=2.0)
        q.put("won")
    except TransitionError:
        q.put("lost")
    finally:
        store.close()


def test_two_processes_start_a_job_once(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    store.submit([JobSpec(id="a", type="echo.echo", params={})], now=1.0)
    ctx = multiprocessing.get_context("spawn")
    q: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_start_in_child, args=(str(path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    results = sorted(q.get(timeout=5) for _ in procs)
    assert results == ["lost", "lost", "won"]
    job = store.get_job("a")
    assert job is not None and job.state is JobState.RUNNING and job.attempts == 1
    store.close()


def test_migrating_an_older_database_keeps_its_jobs(tmp_path: Path) -> None:
    """A database made by an earlier version (migrations 1 and 2 only) opens, is
    migrated, and keeps every job row."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE schema_migrations "
        "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    for version, name, sql in load_migrations("sqlite")[:2]:
        for statement in split_sql(sql):
            db.execute(statement)
        db.execute("INSERT INTO schema_migrations VALUES (?, ?, 'then')", (version, name))
    db.execute(
        "INSERT INTO jobs (id, seq, type, state, priority, params, inputs, outputs, spec_hash,"
        " submitted_at, updated_at) VALUES ('old', 1, 'echo.echo', 'done', 0, '{}', '[]', '[]',"
        " 'h', 1.0, 2.0)"
    )
    db.commit()
    db.close()
    store = SqliteStore(path)
    try:
        job = store.get_job("old")
        assert job is not None and job.state is JobState.DONE
        assert store.schema_version() == max(v for v, _, _ in load_migrations("sqlite"))
        store.submit([JobSpec(id="new", type="echo.echo", params={})], now=3.0)
        assert store.get_job("new") is not None
    finally:
        store.close()


def test_a_locked_database_is_unavailable_and_the_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "new" / "gpuwarden.db"
    store = SqliteStore(path, busy_timeout_s=0.05)
    try:
        # created 0600 before SQLite opened it; its WAL and SHM files follow its mode
        for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            assert stat.S_IMODE(os.lstat(f).st_mode) == 0o600, f
        assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        try:
            with pytest.raises(sqlite3.OperationalError) as locked:
                store.submit([JobSpec(id="x", type="echo.echo", params={"text": "x"})], now=1.0)
            assert "locked" in str(locked.value)  # the fault is in place
            assert store.unavailable(locked.value) is True
        finally:
            other.execute("ROLLBACK")
            other.close()
        with pytest.raises(sqlite3.OperationalError) as broken, sqlite3.connect(path) as db:
            db.execute("SELECT * FROM no_such_table")  # a bug's error, not "not now"
        assert store.unavailable(broken.value) is False
    finally:
        store.close()
