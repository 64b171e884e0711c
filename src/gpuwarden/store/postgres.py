"""PostgreSQL adapter of the Store port: psycopg 3 and a connection pool.

Several brokers and CLI commands, on one host or many, share one database. What
keeps them apart:

* Every change of a job first locks the job's row (``SELECT ... FOR UPDATE``),
  then writes a guarded update (``WHERE state = ANY(allowed sources)``) whose row
  count is checked, and its event, in one transaction.
* :meth:`PostgresStore.start_attempt` takes the row with ``FOR UPDATE SKIP
  LOCKED``: of two writers starting the same job at once, exactly one wins and
  the other gets :class:`TransitionError` at once instead of waiting.
* Event and audit ids are handed out under a transaction-scoped advisory lock held
  to the commit, so they appear in commit order and a reader following a log by
  id (``events(after_id=...)``) never skips a row that committed late.
* Migrations run at open, each in its own transaction under a
  ``pg_advisory_xact_lock``, so two processes opening a fresh database at once
  apply each migration once.

PostgreSQL text cannot hold the NUL character (SQLite text can): NUL in free text
(an attempt's output, a reason, strings inside JSON documents) is stored as
U+FFFD, and a float that JSON cannot carry (NaN, infinities) inside a JSON
document is stored as null.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout

from gpuwarden.core import states
from gpuwarden.core.model import Attempt, Event, Job, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import ConfigError, TransitionError, UnknownJobError, UserError
from gpuwarden.store import rows
from gpuwarden.store.base import (
    DIRECT,
    AuditRow,
    BundleRecord,
    DuplicateBundleError,
    DuplicateJobError,
    DuplicateTokenError,
    IdempotencyConflict,
    IdempotencyRecord,
    MeasuredFootprint,
    NodeStatus,
    Store,
    Submission,
    TokenRecord,
)
from gpuwarden.store.postgres_cluster import PostgresCluster
from gpuwarden.store.queries import load_migrations, load_queries
from gpuwarden.store.rows import spec_hash

_Q = load_queries("postgres")

Conn = psycopg.Connection[DictRow]

#: seconds to wait for a connection when none is named in the URL
DEFAULT_CONNECT_TIMEOUT_S = 10
#: seconds :class:`PostgresStore` waits for its first pooled connections
POOL_OPEN_TIMEOUT_S = 30.0
#: times a submission is retried after a deadlock with a concurrent submission
_SUBMIT_TRIES = 3

_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class PostgresStore(PostgresCluster, Store):
    """A pool of connections to one PostgreSQL database, usable from many threads.

    ``url`` is a libpq URL (``postgresql://user@host:5432/dbname``). ``schema``,
    when given, is created if missing and put first on every pooled connection's
    ``search_path``: the store's tables live there (tests use a fresh one each).
    A database that cannot be reached raises :class:`ConfigError` naming the URL
    (never its password) and what to check.
    """

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
        kwargs = self._connect_kwargs(url)
        self._check_reachable(url, kwargs)
        self._pool: ConnectionPool[Conn] = ConnectionPool(
            url,
            connection_class=Conn,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={**kwargs, "row_factory": dict_row},
            configure=self._configure,
            check=ConnectionPool.check_connection,
            name="gpuwarden-store",
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
            self.migrate()
        except BaseException:
            self._pool.close()
            raise

    # -- plumbing -----------------------------------------------------------

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

    @contextlib.contextmanager
    def _write(self) -> Iterator[Conn]:
        """One transaction: committed when the block ends, rolled back on an error."""
        with self._pool.connection() as conn, conn.transaction():
            yield conn

    def _read(self, query: str, **params: Any) -> list[DictRow]:
        with self._pool.connection() as conn:
            return conn.execute(_Q[query], params).fetchall()

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

    def schema_version(self) -> int:
        row = self._read_sql("SELECT COALESCE(MAX(version), 0) AS v FROM schema_migrations")
        return int(row[0]["v"])

    def _read_sql(self, query: str) -> list[DictRow]:
        with self._pool.connection() as conn:
            return conn.execute(query).fetchall()

    def unavailable(self, exc: BaseException) -> bool:
        # connection lost or refused, server shutting down, serialization and
        # deadlock aborts (psycopg's OperationalError family); no pooled connection
        return isinstance(exc, psycopg.OperationalError | PoolTimeout)

    def close(self) -> None:
        self._pool.close()

    def _event(self, conn: Conn, event: Event) -> Event:
        conn.execute(_Q["lock_log"], {"key": self._events_key})
        row = conn.execute(
            _Q["insert_event"],
            {
                "ts": event.ts,
                "kind": event.kind,
                "job_id": event.job_id,
                "from_state": event.from_state,
                "to_state": event.to_state,
                "detail": _jsonb(event.detail),
            },
        ).fetchone()
        assert row is not None
        return Event(
            ts=event.ts,
            kind=event.kind,
            job_id=event.job_id,
            from_state=event.from_state,
            to_state=event.to_state,
            detail=dict(event.detail),
            id=int(row["id"]),
        )

    @staticmethod
    def _job_in(conn: Conn, job_id: str, *, lock: bool = False) -> Job:
        row = conn.execute(_Q["lock_job" if lock else "get_job"], {"id": job_id}).fetchone()
        if row is None:
            raise UnknownJobError(f"no job with id {job_id!r} (see `gpuwarden jobs`)")
        return _job(row)

    # -- jobs ---------------------------------------------------------------

    def submit(
        self,
        specs: Sequence[JobSpec],
        *,
        now: float,
        origin: Submission = DIRECT,
        idempotency: tuple[str, str, str] | None = None,
    ) -> list[Job]:
        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids):
            raise UserError("the same job id appears twice in one submission")
        for attempt in range(_SUBMIT_TRIES):
            last = attempt == _SUBMIT_TRIES - 1
            try:
                return self._submit_once(specs, ids, now=now, origin=origin, idem=idempotency)
            except pg_errors.UniqueViolation as exc:
                # a concurrent submission committed the same idempotency key, job id
                # or bundle name between our check and our insert
                constraint = exc.diag.constraint_name
                if constraint == "idempotency_pkey" and not last:
                    continue  # the retry finds the key and answers as the first did
                if constraint == "bundles_pkey":
                    raise self._duplicate_bundle(origin) from None
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

    @staticmethod
    def _duplicate_bundle(origin: Submission) -> DuplicateBundleError:
        return DuplicateBundleError(
            f"bundle {origin.bundle} was already received in {origin.queue_root or ''}"
        )

    def _submit_once(
        self,
        specs: Sequence[JobSpec],
        ids: list[str],
        *,
        now: float,
        origin: Submission,
        idem: tuple[str, str, str] | None,
    ) -> list[Job]:
        with self._write() as conn:
            if idem is not None:
                token_id, key, body_hash = idem
                row = conn.execute(
                    _Q["get_idempotency"], {"token_id": token_id, "key": key}
                ).fetchone()
                if row is not None:
                    if row["body_hash"] != body_hash:
                        raise IdempotencyConflict(
                            f"idempotency key {key!r} was already used for a different "
                            "request; use a new key for a new request"
                        )
                    return [self._job_in(conn, i) for i in row["job_ids"]]
                conn.execute(
                    _Q["insert_idempotency"],
                    {
                        "token_id": token_id,
                        "key": key,
                        "body_hash": body_hash,
                        "job_ids": _jsonb(ids),
                        "now": now,
                    },
                )
            existing = [r["id"] for r in conn.execute(_Q["job_ids_existing"], {"ids": ids})]
            if existing:
                raise DuplicateJobError(sorted(existing))
            if origin.bundle is not None:
                qr = origin.queue_root or ""
                if conn.execute(
                    _Q["get_bundle"], {"queue_root": qr, "name": origin.bundle}
                ).fetchone():
                    raise self._duplicate_bundle(origin)
                conn.execute(
                    _Q["insert_bundle"],
                    {
                        "queue_root": qr,
                        "name": origin.bundle,
                        "job_ids": _jsonb(ids),
                        "now": now,
                    },
                )
            with conn.cursor() as cur:
                # one row at a time in the given order: seq (an identity) follows it
                cur.executemany(
                    _Q["insert_job"],
                    [
                        {
                            "id": spec.id,
                            "type": spec.type,
                            "priority": spec.priority,
                            "params": _jsonb(spec.params),
                            "inputs": _jsonb(list(spec.inputs)),
                            "outputs": _jsonb(list(spec.outputs)),
                            "vram_bytes": spec.vram_bytes,
                            "spec_hash": spec_hash(spec),
                            "constraints": _jsonb(spec.constraints),
                            "now": now,
                            "bundle": origin.bundle,
                            "queue_root": origin.queue_root,
                            "input_dir": origin.input_dir,
                            "owner": origin.owner,
                        }
                        for spec in specs
                    ],
                )
            # the events last: the events lock is taken after every row lock
            for spec in specs:
                detail: dict[str, Any] = {"type": spec.type}
                if origin.bundle:
                    detail["bundle"] = origin.bundle
                self._event(
                    conn,
                    Event(
                        ts=now, kind="submitted", job_id=spec.id, to_state="queued", detail=detail
                    ),
                )
            rows = conn.execute(_Q["jobs_by_ids"], {"ids": ids}).fetchall()
            return [_job(r) for r in rows]

    def get_job(self, job_id: str) -> Job | None:
        rows = self._read("get_job", id=job_id)
        return _job(rows[0]) if rows else None

    def idempotency_record(self, token_id: str, key: str) -> IdempotencyRecord | None:
        rows = self._read("get_idempotency", token_id=token_id, key=key)
        if not rows:
            return None
        r = rows[0]
        return IdempotencyRecord(
            token_id=r["token_id"],
            key=r["key"],
            body_hash=r["body_hash"],
            job_ids=tuple(r["job_ids"]),
            created_at=r["created_at"],
        )

    def list_jobs(
        self,
        *,
        states: frozenset[JobState] | None = None,
        limit: int = 100,
        owner: str | None = None,
    ) -> list[Job]:
        in_states = [s.value for s in states] if states is not None else None
        if owner is None and in_states is None:
            rows = self._read("list_jobs", limit=limit)
        elif owner is None:
            rows = self._read("list_jobs_in_states", states=in_states, limit=limit)
        elif in_states is None:
            rows = self._read("list_jobs_of_owner", owner=owner, limit=limit)
        else:
            rows = self._read(
                "list_jobs_of_owner_in_states", owner=owner, states=in_states, limit=limit
            )
        return [_job(r) for r in rows]

    def queued_jobs(self, *, limit: int = 1000) -> list[Job]:
        return [_job(r) for r in self._read("queued_jobs", limit=limit)]

    def running_jobs(self) -> list[Job]:
        return [_job(r) for r in self._read("running_jobs")]

    def count_by_state(self) -> dict[JobState, int]:
        return {JobState(r["state"]): int(r["n"]) for r in self._read("count_by_state")}

    def _transition_in(
        self,
        conn: Conn,
        job_id: str,
        target: JobState,
        *,
        now: float,
        reason: str,
        detail: Mapping[str, Any] | None,
        exit_code: int | None,
        result: Mapping[str, Any] | None,
        sources: frozenset[JobState] | None = None,
    ) -> Job:
        before = self._job_in(conn, job_id, lock=True)
        # ``sources`` narrows the table for callers that know more (an attempt's end
        # comes only from running); it never widens it.
        allowed = states.sources(target) & (sources or states.sources(target))
        if before.state not in allowed:
            raise TransitionError(
                f"job {job_id} is {before.state.value}; it cannot become {target.value} from there"
            )
        cur = conn.execute(
            _Q["transition_job"],
            {
                "id": job_id,
                "target": target.value,
                "now": now,
                "reason": _text(reason),
                "exit_code": exit_code,
                "result": _jsonb(dict(result)) if result is not None else None,
                "sources": [s.value for s in allowed],
            },
        )
        if cur.rowcount != 1:  # pragma: no cover - the row lock makes this a bug
            raise TransitionError(f"job {job_id} changed state during the transition")
        ev = {"reason": reason} if reason else {}
        ev.update(detail or {})
        self._event(
            conn,
            Event(
                ts=now,
                kind="transition",
                job_id=job_id,
                from_state=before.state.value,
                to_state=target.value,
                detail=ev,
            ),
        )
        return self._job_in(conn, job_id)

    def transition(
        self,
        job_id: str,
        target: JobState,
        *,
        now: float,
        reason: str = "",
        detail: Mapping[str, Any] | None = None,
        exit_code: int | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> Job:
        with self._write() as conn:
            return self._transition_in(
                conn,
                job_id,
                target,
                now=now,
                reason=reason,
                detail=detail,
                exit_code=exit_code,
                result=result,
            )

    def start_attempt(
        self, job_id: str, *, node: str, gpu_uuid: str | None, now: float
    ) -> tuple[Job, Attempt]:
        with self._write() as conn:
            row = conn.execute(_Q["lock_job_to_start"], {"id": job_id}).fetchone()
            if row is None:
                self._job_in(conn, job_id)  # UnknownJobError when there is no such job
                raise TransitionError(
                    f"job {job_id} is being changed by another writer (another broker may be "
                    "starting it); it was not started here"
                )
            before = _job(row)
            states.check(before.state, JobState.RUNNING)
            if before.cancel_requested:
                raise TransitionError(f"job {job_id} has a cancel request; it will not start")
            cur = conn.execute(_Q["start_job"], {"id": job_id, "now": now})
            if cur.rowcount != 1:  # pragma: no cover - guarded above under the row lock
                raise TransitionError(f"job {job_id} changed state before it could start")
            number = before.attempts + 1
            conn.execute(
                _Q["insert_attempt"],
                {
                    "job_id": job_id,
                    "number": number,
                    "node": node,
                    "gpu_uuid": gpu_uuid,
                    "now": now,
                },
            )
            self._event(
                conn,
                Event(
                    ts=now,
                    kind="transition",
                    job_id=job_id,
                    from_state="queued",
                    to_state="running",
                    detail={"attempt": number, "node": node, "gpu": gpu_uuid},
                ),
            )
            job = self._job_in(conn, job_id)
            return job, Attempt(
                job_id=job_id, number=number, node=node, gpu_uuid=gpu_uuid, started_at=now
            )

    def set_attempt_pid(self, job_id: str, number: int, pid: int) -> None:
        with self._write() as conn:
            conn.execute(_Q["set_attempt_pid"], {"job_id": job_id, "number": number, "pid": pid})

    def finish_attempt(
        self,
        job_id: str,
        number: int,
        *,
        target: JobState,
        now: float,
        outcome: str,
        reason: str,
        exit_code: int | None = None,
        stdout: str = "",
        stderr: str = "",
        result: Mapping[str, Any] | None = None,
    ) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            cur = conn.execute(
                _Q["finish_attempt"],
                {
                    "job_id": job_id,
                    "number": number,
                    "now": now,
                    "exit_code": exit_code,
                    "outcome": outcome,
                    "reason": _text(reason),
                    "stdout": _text(stdout),
                    "stderr": _text(stderr),
                },
            )
            if cur.rowcount != 1:
                raise TransitionError(
                    f"attempt {number} of job {job_id} is not the current running attempt "
                    f"(job is {job.state.value}, attempt {job.attempts}); its report is refused"
                )
            return self._transition_in(
                conn,
                job_id,
                target,
                now=now,
                reason=reason,
                detail={"attempt": number, "outcome": outcome, "exit_code": exit_code},
                exit_code=exit_code,
                result=result,
                sources=frozenset({JobState.RUNNING}),
            )

    def attempts(self, job_id: str) -> list[Attempt]:
        return [_attempt(r) for r in self._read("attempts", job_id=job_id)]

    def request_cancel(self, job_id: str, *, now: float) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            if job.state is JobState.QUEUED:
                return self._transition_in(
                    conn,
                    job_id,
                    JobState.CANCELLED,
                    now=now,
                    reason="cancelled before it started",
                    detail=None,
                    exit_code=None,
                    result=None,
                )
            if job.state is JobState.RUNNING:
                conn.execute(_Q["mark_cancel_requested"], {"id": job_id, "now": now})
                self._event(conn, Event(ts=now, kind="cancel_requested", job_id=job_id))
                return self._job_in(conn, job_id)
            raise UserError(
                f"job {job_id} has already ended ({job.state.value}); nothing to cancel"
            )

    # -- events -------------------------------------------------------------

    def add_event(self, event: Event) -> Event:
        with self._write() as conn:
            return self._event(conn, event)

    def last_event_id(self) -> int:
        return int(self._read("last_event_id")[0]["id"])

    def events(
        self, *, job_id: str | None = None, after_id: int = 0, limit: int = 1000
    ) -> list[Event]:
        if job_id is None:
            rows = self._read("events_all", after_id=after_id, limit=limit)
        else:
            rows = self._read("events_for_job", job_id=job_id, after_id=after_id, limit=limit)
        return [
            Event(
                id=int(r["id"]),
                ts=r["ts"],
                kind=r["kind"],
                job_id=r["job_id"],
                from_state=r["from_state"],
                to_state=r["to_state"],
                detail=r["detail"],
            )
            for r in rows
        ]

    # -- bundles ------------------------------------------------------------

    def get_bundle(self, queue_root: str, name: str) -> BundleRecord | None:
        rows = self._read("get_bundle", queue_root=queue_root, name=name)
        return _bundle(rows[0]) if rows else None

    def open_bundles(self) -> list[BundleRecord]:
        return [_bundle(r) for r in self._read("open_bundles")]

    def finish_bundle(
        self, queue_root: str, name: str, *, now: float, outcome: str, result_path: str
    ) -> None:
        with self._write() as conn:
            conn.execute(
                _Q["finish_bundle"],
                {
                    "queue_root": queue_root,
                    "name": name,
                    "now": now,
                    "outcome": outcome,
                    "result_path": result_path,
                },
            )

    def record_rejected_bundle(
        self, queue_root: str, name: str, *, now: float, reason: str, result_path: str
    ) -> None:
        with self._write() as conn:
            conn.execute(
                _Q["insert_rejected_bundle"],
                {"queue_root": queue_root, "name": name, "now": now, "result_path": result_path},
            )
            self._event(
                conn,
                Event(
                    ts=now,
                    kind="bundle_rejected",
                    detail={"queue_root": queue_root, "bundle": name, "reason": reason},
                ),
            )

    # -- footprints -----------------------------------------------------------

    def footprints(self) -> dict[str, MeasuredFootprint]:
        return {
            r["type"]: MeasuredFootprint(
                type=r["type"], bytes=r["bytes"], job_id=r["job_id"], updated_at=r["updated_at"]
            )
            for r in self._read("footprints")
        }

    def recent_run_times(self, *, limit: int = 5000) -> list[tuple[str, float]]:
        return [
            (r["type"], float(r["seconds"])) for r in self._read("recent_run_times", limit=limit)
        ]

    def raise_footprint(self, type_name: str, nbytes: int, *, now: float, job_id: str) -> bool:
        with self._write() as conn:
            row = conn.execute(_Q["lock_footprint"], {"type": type_name}).fetchone()
            old = int(row["bytes"]) if row else None
            cur = conn.execute(
                _Q["raise_footprint"],
                {"type": type_name, "bytes": nbytes, "job_id": job_id, "now": now},
            )
            if cur.rowcount != 1:
                return False
            self._event(
                conn,
                Event(
                    ts=now,
                    kind="footprint_raised",
                    job_id=job_id,
                    detail={"type": type_name, "bytes": nbytes, "previous_bytes": old},
                ),
            )
            return True

    # -- operator requests ----------------------------------------------------

    def request_gpu_clear(self, gpu_uuid: str, *, now: float) -> None:
        with self._write() as conn:
            conn.execute(_Q["request_gpu_clear"], {"gpu_uuid": gpu_uuid, "now": now})
            self._event(conn, Event(ts=now, kind="gpu_clear_requested", detail={"gpu": gpu_uuid}))

    def take_gpu_clears(self, *, now: float) -> list[str]:
        with self._write() as conn:
            rows = conn.execute(_Q["take_gpu_clears"], {"now": now}).fetchall()
            return [r["gpu_uuid"] for r in sorted(rows, key=lambda r: int(r["id"]))]

    # -- API tokens -----------------------------------------------------------

    def create_token(
        self,
        *,
        token_id: str,
        name: str,
        role: Role,
        secret_hash: str,
        now: float,
        created_by: str,
        expires_at: float | None = None,
        node: str | None = None,
    ) -> TokenRecord:
        duplicate = DuplicateTokenError(f"a token with id {token_id} exists already")
        try:
            with self._write() as conn:
                if conn.execute(_Q["get_token"], {"id": token_id}).fetchone() is not None:
                    raise duplicate
                row = conn.execute(
                    _Q["insert_token"],
                    {
                        "id": token_id,
                        "name": name,
                        "role": Role(role).value,
                        "secret_hash": secret_hash,
                        "now": now,
                        "created_by": created_by,
                        "expires_at": expires_at,
                        "node": node,
                    },
                ).fetchone()
                assert row is not None
                return _token(row)
        except pg_errors.UniqueViolation:  # created by another writer since the check
            raise duplicate from None

    def get_token(self, token_id: str) -> TokenRecord | None:
        rows = self._read("get_token", id=token_id)
        return _token(rows[0]) if rows else None

    def list_tokens(self) -> list[TokenRecord]:
        return [_token(r) for r in self._read("list_tokens")]

    def revoke_token(self, token_id: str, *, now: float) -> bool:
        with self._write() as conn:
            return conn.execute(_Q["revoke_token"], {"id": token_id, "now": now}).rowcount == 1

    # -- audit --------------------------------------------------------------

    def add_audit(self, row: AuditRow) -> AuditRow:
        with self._write() as conn:
            conn.execute(_Q["lock_log"], {"key": self._audit_key})
            got = conn.execute(
                _Q["insert_audit"],
                {
                    "ts": row.ts,
                    "actor": _text(row.actor),
                    "actor_name": _text(row.actor_name),
                    "role": _text(row.role),
                    "action": _text(row.action),
                    "target": _text(row.target),
                    "outcome": _text(row.outcome),
                    "detail": _jsonb(row.detail),
                },
            ).fetchone()
            assert got is not None
            return dataclasses.replace(row, detail=dict(row.detail), id=int(got["id"]))

    def audit_rows(self, *, after_id: int = 0, limit: int = 1000) -> list[AuditRow]:
        return [
            AuditRow(
                id=int(r["id"]),
                ts=r["ts"],
                actor=r["actor"],
                actor_name=r["actor_name"],
                role=r["role"],
                action=r["action"],
                target=r["target"],
                outcome=r["outcome"],
                detail=r["detail"],
            )
            for r in self._read("audit_rows", after_id=after_id, limit=limit)
        ]

    # -- node status --------------------------------------------------------

    def put_node_status(self, status: NodeStatus) -> None:
        with self._write() as conn:
            conn.execute(
                _Q["put_node_status"],
                {
                    "node": status.node,
                    "pid": status.pid,
                    "updated_at": status.updated_at,
                    "payload": _jsonb(status.payload),
                },
            )

    def node_statuses(self) -> list[NodeStatus]:
        return [
            NodeStatus(
                node=r["node"],
                pid=r["pid"],
                updated_at=r["updated_at"],
                payload=r["payload"],
            )
            for r in self._read("node_statuses")
        ]


# -- values in and out ------------------------------------------------------------


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


def _text(value: str) -> str:
    """PostgreSQL text cannot hold NUL."""
    return value.replace("\x00", "\ufffd")


def _pg_safe(value: Any) -> Any:
    """A JSON value that JSONB can store: NUL-free strings, finite numbers."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {_text(str(k)): _pg_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_pg_safe(v) for v in value]
    return value


def _jsonb(value: Any) -> Jsonb:
    return Jsonb(_pg_safe(value))


_job = functools.partial(rows.job, decode=rows.as_is)
_bundle = functools.partial(rows.bundle, decode=rows.as_is)
_token = rows.token
_attempt = rows.attempt
