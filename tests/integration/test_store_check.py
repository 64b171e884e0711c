"""The start-up check of the SQLite store: a damaged file is one clear error,
naming the file and what to do, and is never written to."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from gpuwarden.errors import UserError
from gpuwarden.store.sqlite import DamagedDatabaseError, SqliteStore, quick_check


def damaged_page(path: Path) -> Path:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (x TEXT)")
    db.executemany("INSERT INTO t VALUES (?)", [("x" * 200,)] * 2000)
    db.commit()
    db.close()
    raw = bytearray(path.read_bytes())
    raw[4096 * 5 : 4096 * 5 + 3000] = b"\xab" * 3000
    path.write_bytes(bytes(raw))
    return path


def files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_a_file_that_is_not_a_database_is_refused_by_every_opener(tmp_path: Path) -> None:
    path = tmp_path / "gpuwarden.db"
    path.write_bytes(os.urandom(8192))
    before = files(tmp_path)
    for check in (False, True):
        with pytest.raises(DamagedDatabaseError) as excinfo:
            SqliteStore(path, check=check)
        message = excinfo.value.message
        assert isinstance(excinfo.value, UserError)  # printed as one line, exit 2
        assert message.startswith(f"the database {path} is damaged (file is not a database)")
        assert "restore it from a backup" in message and "\n" not in message
    assert files(tmp_path) == before  # nothing written, no -wal or -shm left


def test_a_damaged_page_is_found_by_the_check_at_start(tmp_path: Path) -> None:
    path = damaged_page(tmp_path / "gpuwarden.db")
    db = sqlite3.connect(path)
    try:  # the attack is in place: SQLite itself says so
        verdict = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        verdict = str(exc)
    finally:
        db.close()
    assert verdict != "ok"
    before = files(tmp_path)
    with pytest.raises(DamagedDatabaseError, match=r"is damaged \(.*\); gpuwarden wrote nothing"):
        SqliteStore(path, check=True)
    assert files(tmp_path) == before


def test_a_sound_or_missing_database_passes(tmp_path: Path) -> None:
    quick_check(tmp_path / "missing.db")
    (tmp_path / "empty.db").write_bytes(b"")
    quick_check(tmp_path / "empty.db")
    store = SqliteStore(tmp_path / "sound.db", check=True)
    store.close()
    again = SqliteStore(tmp_path / "sound.db", check=True)  # a WAL database, checked again
    assert again.schema_version() > 0
    again.close()
