"""PostgreSQL adapter of the Store port: psycopg 3 and a connection pool.

Only what PostgreSQL does its own way is here; the queries and rules both
databases share are :class:`~gpuwarden.store.sql.SqlStore`'s. JSON is JSONB, a
list of ids is a ``text[]`` parameter, and a row written is returned by the
statement that writes it (``RETURNING``).

Several brokers and CLI commands, on one host or many, share one database. What
keeps them apart:

* Every change of a job first locks the job's row (``SELECT ... FOR UPDATE``, the
  ``lock_*`` queries), then writes a guarded update (``WHERE state = ANY(allowed
  sources)``) whose row count is checked, and its event, in one transaction.
* ``start_attempt`` takes the row with ``FOR UPDATE SKIP LOCKED``: of two writers
  starting the same job at once, exactly one wins and the other gets
  :class:`TransitionError` at once instead of waiting.
* Event and audit ids are handed out under a transaction-scoped advisory lock held
  to the commit, so they appear in commit order and a reader following a log by
  id (``events(after_id=...)``) never skips a row that committed late.
* A submission that collides with a concurrent one (the same idempotency key,
  job id or bundle name, or a deadlock on each other's ids) is tried again or
  refused with the error it would have got had it come second
  (:meth:`PostgresStore._submit`).
* Migrations run at open, each in its own transaction under a
  ``pg_advisory_xact_lock``, so two processes opening a fresh database at once
  apply each migration once.

The pool's connections are in autocommit: a read is one statement (one round
trip), a write an explicit transaction (``_write``). A connection is checked
with an empty query before it is handed out only when it sat unused for
``IDLE_CHECK_S``; one that fails anyway fails its call as ``unavailable`` and is
replaced. A claim's leases are one statement and its events one round trip
(``_lease_rows``, ``_events``).

PostgreSQL text cannot hold the NUL character (SQLite text can): NUL in free text
(an attempt's output, a reason, strings inside JSON documents) is stored as
U+FFFD, and a float that JSON cannot carry (NaN, infinities) inside a JSON
document is stored as null.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout

from gpuwarden.core.model import Event, Job, JobSpec
from gpuwarden.errors import ConfigError, StoreUnavailable
from gpuwarden.store.base import DuplicateJobError, Submission
from gpuwarden.store.postgres_cluster import MaintenanceLock
from gpuwarden.store.queries import load_dialect, load_migrations
from gpuwarden.store.rows import Row
from gpuwarden.store.sql import duplicate_bundle
from gpuwarden.store.sql_cluster import SqlClusterStore

Conn = psycopg.Connection[DictRow]

#: seconds to wait for a connection when none is named in the URL
DEFAULT_CONNECT_TIMEOUT_S = 10
#: seconds :class:`PostgresStore` waits for its first pooled connections
POOL_OPEN_TIMEOUT_S = 30.0
#: times a submission is retried after a deadlock with a concurrent submission
_SUBMIT_TRIES = 3
#: a pooled connection unused this long is checked (one empty query) before it is
#: handed out; one used more recently is not (a check per checkout was a round trip
#: for every store call, the most frequent statement under load)
IDLE_CHECK_S = 2.0
#: seconds a store call waits for a pooled connection (the server unreachable: the
#: call fails as :class:`StoreUnavailable` after this, not after psycopg's 30 s)
POOL_WAIT_S = 10.0
#: what a client is told to wait before it tries again while the server is unreachable
RETRY_AFTER_S = 2.0

_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class PostgresStore(SqlClusterStore[Conn]):
    """A pool of connections to one PostgreSQL database, usable from many threads.

    ``url`` is a libpq URL (``postgresql://user@host:5432/dbname``). ``schema``,
    when given, is created if missing and put first on every pooled connection's
    ``search_path``: the store's tables live there (tests use a fresh one each).
    A database that cannot be reached raises :class:`ConfigError` naming the URL
    (never its password) and what to check.
    """

    queries = load_dialect("postgres")
    unique_violation: ClassVar[tuple[type[Exception], ...]] = (pg_errors.UniqueViolation,)

    def __init__(
        self,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        schema: str | None = None,
    ) -> None:
        if schema is not None and not _SCHEMA_NAME.match(schema):
            raise ConfigError(
                f"PostgreSQL schema name {schema!r} is not valid: use letters, digits and "
                "underscores, starting with a letter or underscore (at most 63 characters)"
            )
        self.url = url
        self.schema = schema
        self._shown = redact_url(url)
        #: when each pooled connection was last given back (for :meth:`_check`)
        self._used: weakref.WeakKeyDictionary[Conn, float] = weakref.WeakKeyDictionary()
        kwargs = self._connect_kwargs(url)
        self._check_reachable(url, kwargs)
        self._pool: ConnectionPool[Conn] = ConnectionPool(
            url,
            connection_class=Conn,
            min_size=min_size,
            max_size=max_size,
            open=False,
            # autocommit: a read is one statement, not BEGIN, the statement and COMMIT
            # (three round trips); a write is a transaction of its own (_write)
            kwargs={**kwargs, "row_factory": dict_row, "autocommit": True},
            configure=self._configure,
            check=self._check,
            name="gpuwarden-store",
            timeout=POOL_WAIT_S,
        )
        try:
            self._pool.open(wait=True, timeout=POOL_OPEN_TIMEOUT_S)
        except PoolTimeout:
            self._pool.close()
            raise ConfigError(
                f"PostgreSQL at {self._shown} accepted a test connection but the store "
                f"could not open {min_size} pooled connection(s) in {POOL_OPEN_TIMEOUT_S:.0f} s: "
                "check the server's max_connections and that it is not overloaded"
            ) from None
        try:
            name = schema or self._current_schema()
            self._migrate_key = _lock_key(f"gpuwarden.migrate:{name}")
            self._events_key = _lock_key(f"gpuwarden.events:{name}")
            self._audit_key = _lock_key(f"gpuwarden.audit:{name}")
            self._maintenance = MaintenanceLock(
                url, schema=schema, key=_lock_key(f"gpuwarden.maintenance:{name}")
            )
            self.migrate()
        except BaseException:
            self._pool.close()
            raise

    # -- connections --------------------------------------------------------

    @staticmethod
    def _connect_kwargs(url: str) -> dict[str, Any]:
        try:
            given = conninfo_to_dict(url)
        except psycopg.ProgrammingError:
            raise ConfigError(
                f"the PostgreSQL URL {redact_url(url)} is not valid: write it as "
                "postgresql://USER@HOST:PORT/DBNAME (see the `database` key of the config)"
            ) from None
        kwargs: dict[str, Any] = {}
        if "connect_timeout" not in given:
            kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        return kwargs

    def _check_reachable(self, url: str, kwargs: dict[str, Any]) -> None:
        """One plain connection first, so that a wrong URL or a stopped server is
        told as such, and not as a pool that timed out."""
        try:
            with psycopg.connect(url, **kwargs):
                pass
        except psycopg.Error as exc:
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(
                f"cannot connect to PostgreSQL at {self._shown}: {why}. Check that the "
                "server is running and accepts TCP connections at that host and port, that "
                "the database and the user exist and that this host may log in as that user "
                "(pg_hba.conf, the password); the URL is the `database` key of the config"
            ) from None

    def _current_schema(self) -> str:
        with self._pool.connection() as conn:
            row = conn.execute("SELECT current_schema() AS s").fetchone()
        return str(row["s"]) if row and row["s"] else "public"

    def _configure(self, conn: Conn) -> None:
        """Run on every new pooled connection."""
        if self.schema is not None:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        conn.commit()

    def _check(self, conn: Conn) -> None:
        """The pool's check of a connection it hands out: an empty query, unless the
        connection was in use less than :data:`IDLE_CHECK_S` ago (a server restart
        or a dropped link shows on a connection that sat idle; one that just worked
        is taken as it is, and if it fails anyway the store call fails as
        ``unavailable`` and the pool replaces the connection)."""
        used = self._used.get(conn)
        if used is not None and time.monotonic() - used < IDLE_CHECK_S:
            return
        ConnectionPool.check_connection(conn)

    @contextlib.contextmanager
    def _write(self) -> Iterator[Conn]:
        with self._reachable(), self._pool.connection() as conn:
            try:
                with conn.transaction():
                    yield conn
            finally:
                self._used[conn] = time.monotonic()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Conn]:
        with self._reachable(), self._pool.connection() as conn:
            try:
                yield conn
            finally:
                self._used[conn] = time.monotonic()

    @contextlib.contextmanager
    def _reachable(self) -> Iterator[None]:
        """Raise a lost or refused connection, or no pooled connection in time, as
        :class:`StoreUnavailable` (what the API answers with 503): nothing above the
        store knows psycopg. A deadlock or a serialization abort stays itself (the
        store's own retries catch it)."""
        try:
            yield
        except pg_errors.TransactionRollback:
            raise
        except (psycopg.OperationalError, PoolTimeout) as exc:
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise StoreUnavailable(
                f"the store is unreachable (PostgreSQL): retry in {RETRY_AFTER_S:.0f} s",
                retry_after_s=RETRY_AFTER_S,
                detail=f"PostgreSQL at {self._shown}: {why}",
            ) from exc

    def migrate(self) -> list[int]:
        """Apply the migrations not applied yet; return the versions applied.

        Each migration runs in its own transaction that first takes an advisory
        lock: a second process opening the database at the same time waits, then
        finds the migration recorded and skips it."""
        applied: list[int] = []
        with self._pool.connection() as conn:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._migrate_key])
                if self.schema is not None:
                    conn.execute(
                        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                            sql.Identifier(self.schema)
                        )
                    )
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY,"
                    " name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
                )
            for version, name, script in load_migrations("postgres"):
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._migrate_key])
                    done = conn.execute(
                        "SELECT 1 FROM schema_migrations WHERE version = %s", [version]
                    ).fetchone()
                    if done is not None:
                        continue
                    conn.execute(script)
                    conn.execute(
                        "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                        [version, name],
                    )
                    applied.append(version)
        return applied

    def unavailable(self, exc: BaseException) -> bool:
        # connection lost or refused, server shutting down, serialization and
        # deadlock aborts (psycopg's OperationalError family); no pooled connection
        return isinstance(exc, psycopg.OperationalError | PoolTimeout | StoreUnavailable)

    def close(self) -> None:
        self._pool.close()

    # -- values in and out --------------------------------------------------

    def _json(self, value: Any) -> Jsonb:
        return Jsonb(_pg_safe(value))

    def _decode(self, value: Any) -> Any:
        return value  # JSONB arrives decoded

    def _ids(self, values: Sequence[str]) -> list[str]:
        return list(values)  # a text[] parameter

    def _text(self, value: str) -> str:
        return _no_nul(value)

    # -- rows written -------------------------------------------------------

    def _append(self, conn: Conn, log: str, params: Mapping[str, Any]) -> int:
        key = self._events_key if log == "event" else self._audit_key
        # the log's lock, then the row: one statement (``insert_<log>_locked``)
        row = conn.execute(self.queries[f"insert_{log}_locked"], {**params, "key": key}).fetchone()
        assert row is not None
        return int(row["id"])

    def _returning(
        self, conn: Conn, query: str, params: Mapping[str, Any], *, reread: str
    ) -> Row | None:
        return conn.execute(self.queries[query], params).fetchone()  # RETURNING *: no reread

    def _read_planned(self, query: str, **params: Any) -> list[Row]:
        # never a server-side prepared statement: psycopg prepares a query after 5
        # runs, and PostgreSQL may then keep a generic plan made while the leases
        # table was nearly empty (a scan of leases per queued job), which grew
        # quadratic as leases piled up: 50 ms a claim at 2000 leased jobs, not 2
        with self._connection() as conn:
            return conn.execute(self.queries[query], params, prepare=False).fetchall()

    def _write_one(self, query: str, params: dict[str, Any]) -> int:
        # autocommit: the statement is a transaction of its own, one round trip
        with self._connection() as conn:
            return int(conn.execute(self.queries[query], params).rowcount)

    def _write_one_row(self, query: str, params: dict[str, Any], reread: str) -> Row | None:
        with self._connection() as conn:  # RETURNING *, in autocommit
            return conn.execute(self.queries[query], params).fetchone()

    def _lease_rows(self, conn: Conn, wanted: list[str], params: dict[str, Any]) -> list[str]:
        found = conn.execute(self.queries["lease_free_jobs"], {**params, "ids": wanted})
        return [r["job_id"] for r in found]

    def _events(self, conn: Conn, events: Sequence[Event]) -> None:
        if not events:
            return
        with conn.cursor() as cur:  # one round trip (psycopg pipelines executemany)
            cur.executemany(
                self.queries["insert_event_locked"],
                [
                    {
                        "key": self._events_key,
                        "ts": e.ts,
                        "kind": e.kind,
                        "job_id": e.job_id,
                        "from_state": e.from_state,
                        "to_state": e.to_state,
                        "detail": self._json(e.detail),
                    }
                    for e in events
                ],
            )

    def _insert_jobs(self, conn: Conn, jobs: Sequence[Mapping[str, Any]]) -> None:
        if len(jobs) == 1:  # one statement; executemany would enter and leave a pipeline
            conn.execute(self.queries["insert_job"], jobs[0])
            return
        with conn.cursor() as cur:
            # one row at a time in the given order: seq (an identity) follows it
            cur.executemany(self.queries["insert_job"], jobs)

    # -- submissions that collide --------------------------------------------

    def _submit(
        self,
        specs: Sequence[JobSpec],
        ids: list[str],
        *,
        now: float,
        origin: Submission,
        idempotency: tuple[str, str, str] | None,
    ) -> list[Job]:
        for attempt in range(_SUBMIT_TRIES):
            last = attempt == _SUBMIT_TRIES - 1
            try:
                return super()._submit(specs, ids, now=now, origin=origin, idempotency=idempotency)
            except pg_errors.UniqueViolation as exc:
                # a concurrent submission committed the same idempotency key, job id
                # or bundle name between our check and our insert
                constraint = exc.diag.constraint_name
                if constraint == "idempotency_pkey" and not last:
                    continue  # the retry finds the key and answers as the first did
                if constraint == "bundles_pkey":
                    raise duplicate_bundle(origin) from None
                if constraint == "jobs_pkey":
                    existing = [r["id"] for r in self._read("job_ids_existing", ids=ids)]
                    raise DuplicateJobError(sorted(existing) or ids) from None
                raise
            except pg_errors.DeadlockDetected:
                # two submissions inserting each other's ids in opposite orders: the
                # retry waits for the other one and then sees its ids as taken
                if last:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- maintenance --------------------------------------------------------

    def try_maintenance_lock(self) -> bool:
        return self._maintenance.try_acquire()

    def release_maintenance_lock(self) -> None:
        self._maintenance.release()


# -- URLs, lock keys, values PostgreSQL can store ------------------------------------


def redact_url(url: str) -> str:
    """``url`` as it may be shown: without its password (in the netloc or the query)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that cannot be parsed)"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}@{hostport}" if user else hostport
    query = urlencode(
        [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "password"]
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _lock_key(name: str) -> int:
    """A stable signed 64-bit advisory lock key for ``name``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _no_nul(value: str) -> str:
    """``value`` without NUL, which PostgreSQL text cannot hold (stored as U+FFFD)."""
    return value.replace("\x00", "\ufffd")


def _pg_safe(value: Any) -> Any:
    """A JSON value that JSONB can store: NUL-free strings, finite numbers."""
    if isinstance(value, str):
        return _no_nul(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {_no_nul(str(k)): _pg_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_pg_safe(v) for v in value]
    return value
