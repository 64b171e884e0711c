"""SQLite adapter of the Store port: WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE`` writers.

Only what SQLite does its own way is here; the queries and rules both databases
share are :class:`~gpuwarden.store.sql.SqlStore`'s. JSON is stored as text, a list
of ids is passed as a JSON array (read with ``json_each``), and every writer holds
the database's one write lock from its first statement, so the ``lock_*``
queries are plain reads and no check-then-insert can race.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gpuwarden.core.model import Job
from gpuwarden.errors import UserError
from gpuwarden.store.queries import load_dialect, load_migrations, split_sql
from gpuwarden.store.rows import Row
from gpuwarden.store.sql_cluster import SqlClusterStore

log = logging.getLogger(__name__)

#: SQLite's result codes for a damaged file (SQLITE_CORRUPT, SQLITE_NOTADB)
_DAMAGED = {11, 26}


class DamagedDatabaseError(UserError):
    """The SQLite database file is damaged; nothing was written to it."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(
            f"the database {path} is damaged ({detail}); gpuwarden wrote nothing to it. "
            "Stop every gpuwarden process that uses it, then restore it from a backup, or "
            f"move it and its -wal and -shm files away to start with an empty store "
            f"(`sqlite3 {path} .recover` may save what is left)"
        )


def _damaged(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGED
    return "malformed" in str(exc) or "not a database" in str(exc)


def quick_check(path: Path, *, timeout_s: float = 30.0) -> None:
    """Run ``PRAGMA quick_check`` on the database file at ``path`` over a read-only
    connection (a missing or empty file passes). Raises
    :class:`DamagedDatabaseError`, naming the file and what to do, when it is
    damaged; nothing is written to the database either way."""
    try:
        if path.stat().st_size == 0:
            return
    except FileNotFoundError:
        return
    try:
        db = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error as exc:
        if _damaged(exc):
            raise DamagedDatabaseError(path, str(exc)) from None
        raise
    try:
        rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.Error as exc:
        if _damaged(exc):
            raise DamagedDatabaseError(path, str(exc)) from None
        raise
    finally:
        db.close()
    problems = [str(r[0]) for r in rows if str(r[0]) != "ok"]
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise DamagedDatabaseError(path, f"quick_check: {problems[0]}{more}")


#: SQLite's primary result codes that mean "not now" rather than "never": busy,
#: locked, out of memory, read-only (a file system remounted), I/O error, full,
#: cannot open, locking protocol
_UNAVAILABLE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})


class SqliteStore(SqlClusterStore[sqlite3.Connection]):
    """One connection, guarded by a lock; usable from one process's threads.

    Several processes (the broker, CLI commands) share the database file: writers
    take the write lock up front with ``BEGIN IMMEDIATE`` and wait up to
    ``busy_timeout_s`` for it. One coordinator uses a SQLite file, so its
    maintenance lock is always this process's.
    """

    queries = load_dialect("sqlite")

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0, check: bool = False) -> None:
        """Open (and migrate) the database at ``path``. With ``check`` (a broker's
        start) the whole file is checked first (:func:`quick_check`). A damaged
        file raises :class:`DamagedDatabaseError`, with or without ``check``, and
        is never written to."""
        self.path = path
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)
        if check:
            quick_check(path, timeout_s=busy_timeout_s)
        _create_private(path)
        self._lock = threading.RLock()
        #: per thread: the depth of its open :meth:`batch`, and whether the batch's
        #: transaction has begun (it begins at the batch's first write)
        self._local = threading.local()
        #: where a broker on this database listens for wakes (:meth:`on_submit`)
        self.wake_path = path.with_name(path.name + ".wake")
        self._wake_callbacks: list[Callable[[], None]] = []
        self._wake_sock: socket.socket | None = None
        #: the queued jobs of the last :meth:`queued_jobs`, by id: (the row, the Job)
        self._queued: dict[str, tuple[tuple[Any, ...], Job]] = {}
        self._db = sqlite3.connect(
            str(path), isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        try:
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            self.migrate()
        except sqlite3.Error as exc:
            self._db.close()
            if _damaged(exc):
                raise DamagedDatabaseError(path, str(exc)) from None
            raise

    # -- connections --------------------------------------------------------

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        if getattr(self._local, "depth", 0):
            with self._batched() as db:
                yield db
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")

    @contextlib.contextmanager
    def _batched(self) -> Iterator[sqlite3.Connection]:
        """One write inside this thread's batch: the batch's transaction (begun,
        with the write lock taken, at its first write) and a savepoint, so that a
        write that raises undoes only itself."""
        if not getattr(self._local, "tx", False):
            self._lock.acquire()  # held until the batch commits: one writer on the connection
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except BaseException:
                self._lock.release()
                raise
            self._local.tx = True
        self._db.execute("SAVEPOINT gw_write")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK TO gw_write")
            self._db.execute("RELEASE gw_write")
            raise
        self._db.execute("RELEASE gw_write")

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:  # the outermost batch commits (also when its block raised)
                self.commit()

    def commit(self) -> None:
        if not getattr(self._local, "tx", False):
            return
        self._local.tx = False
        try:
            self._db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            raise
        finally:
            self._lock.release()

    # -- wakes ----------------------------------------------------------------

    def on_submit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every submission or cancel request made through
        this object, and (on a thread of its own) when another process's store
        on the same file made one: it sends a datagram to :attr:`wake_path`, a
        socket in the state directory (mode 0700: only its owner can wake)."""
        self._wake_callbacks.append(callback)
        if self._wake_sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self.wake_path.unlink(missing_ok=True)  # one broker per state directory (its lock)
            sock.bind(str(self.wake_path))
        except OSError as exc:  # a path too long for a socket: the loop's poll remains
            log.info("no wake socket at %s (%s): submits wait for the poll", self.wake_path, exc)
            sock.close()
            return
        self._wake_sock = sock
        threading.Thread(target=self._listen, args=(sock,), name="store-wake", daemon=True).start()

    def _listen(self, sock: socket.socket) -> None:
        with sock:
            while True:
                try:
                    sock.recv(64)
                except OSError:
                    return
                if self._wake_sock is not sock:  # closed: the datagram was close()'s
                    return
                self._woken()

    def _woken(self) -> None:
        for callback in list(self._wake_callbacks):
            try:
                callback()
            except Exception:  # a wake is best effort
                log.exception("a submit wake failed")

    def _submitted(self) -> None:
        if self._wake_callbacks:
            self._woken()
        else:
            self._send_wake()

    def _send_wake(self) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.setblocking(False)
                s.sendto(b"!", str(self.wake_path))
        except OSError:  # no broker listening, or a wake already pending: fine
            pass

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.DatabaseError as exc:
                if _damaged(exc):  # a reader meets a damaged page: one clear line
                    raise DamagedDatabaseError(self.path, str(exc)) from None
                raise

    def migrate(self) -> list[int]:
        """Apply the migrations not applied yet; return the versions applied."""
        applied: list[int] = []
        with self._write() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
            )
            done = {r[0] for r in db.execute("SELECT version FROM schema_migrations")}
            for version, name, sql in load_migrations("sqlite"):
                if version in done:
                    continue
                for statement in split_sql(sql):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_migrations VALUES (?, ?, datetime('now'))",
                    (version, name),
                )
                applied.append(version)
        return applied

    def durability(self) -> dict[str, str]:
        """What this connection runs with (every connection of this class is
        opened the same way): ``journal_mode`` and ``synchronous``."""
        names = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
        with self._connection() as db:
            mode = str(db.execute("PRAGMA journal_mode").fetchone()[0])
            sync = int(db.execute("PRAGMA synchronous").fetchone()[0])
        return {"journal_mode": mode, "synchronous": names.get(sync, str(sync))}

    def unavailable(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        code = getattr(exc, "sqlite_errorcode", None)
        return code is None or (code & 0xFF) in _UNAVAILABLE_CODES

    def close(self) -> None:
        if self._wake_sock is not None:
            self._wake_sock = None
            self._send_wake()  # its listener sees it is closed, closes it and ends
            with contextlib.suppress(OSError):
                self.wake_path.unlink()
        with self._lock:
            self._db.close()

    # -- reads --------------------------------------------------------------

    def queued_jobs(self, *, limit: int = 1000) -> list[Job]:
        """As every store does; a row exactly as it was at the last call gives the
        same :class:`Job` again, not a new decode (the loop reads every queued
        job each pass, and most are unchanged)."""
        before, now = self._queued, {}
        out: list[Job] = []
        for row in self._read("queued_jobs", limit=limit):
            key = tuple(row)
            seen = before.get(row["id"])
            job = seen[1] if seen is not None and seen[0] == key else self._job(row)
            now[job.id] = (key, job)
            out.append(job)
        self._queued = now
        return out

    # -- values in and out --------------------------------------------------

    def _json(self, value: Any) -> str:
        return json.dumps(value, sort_keys=True)

    def _decode(self, value: Any) -> Any:
        # most of a job row's JSON columns are empty: no parser for those (the
        # loop reads every queued job each pass)
        if value == "{}":
            return {}
        if value == "[]":
            return []
        if value == "null":
            return None
        return json.loads(value)

    def _ids(self, values: Sequence[str]) -> str:
        return json.dumps(list(values))

    # -- rows written -------------------------------------------------------

    def _append(self, conn: sqlite3.Connection, log: str, params: Mapping[str, Any]) -> int:
        # the write lock orders writers: ids are handed out in commit order
        cur = conn.execute(self.queries[f"insert_{log}"], params)
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _returning(
        self, conn: sqlite3.Connection, query: str, params: Mapping[str, Any], *, reread: str
    ) -> Row | None:
        # no RETURNING: SQLite has it only from 3.35, and Python may be built on older
        conn.execute(self.queries[query], params)
        return conn.execute(self.queries[reread], params).fetchone()

    def _insert_jobs(self, conn: sqlite3.Connection, jobs: Sequence[Mapping[str, Any]]) -> None:
        seq = int(conn.execute(self.queries["next_seq"]).fetchone()[0])
        for offset, job in enumerate(jobs):
            conn.execute(self.queries["insert_job"], {**job, "seq": seq + offset})

    # -- maintenance --------------------------------------------------------

    def try_maintenance_lock(self) -> bool:
        return True

    def release_maintenance_lock(self) -> None:
        return None


def _create_private(path: Path) -> None:
    """Create the database file empty with mode 0600 before SQLite opens it, so it
    is never readable by others, not even for a moment. SQLite creates the
    ``-wal`` and ``-shm`` files with the database file's mode (and owner)."""
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        return
    os.close(fd)
