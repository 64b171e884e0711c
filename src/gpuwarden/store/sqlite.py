"""SQLite adapter of the Store port: WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE`` writers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gpuwarden.core import states
from gpuwarden.core.model import Attempt, Event, Job, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError, UnknownJobError, UserError
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
from gpuwarden.store.queries import load_migrations, load_queries
from gpuwarden.store.rows import spec_hash
from gpuwarden.store.sqlite_cluster import SqliteCluster

_Q = load_queries("sqlite")

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


class SqliteStore(SqliteCluster, Store):
    """One connection, guarded by a lock; usable from one process's threads.

    Several processes (the broker, CLI commands) share the database file: writers
    take the write lock up front with ``BEGIN IMMEDIATE`` and wait up to
    ``busy_timeout_s`` for it.
    """

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

    # -- plumbing -----------------------------------------------------------

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """The one place where write transactions begin, commit and roll back."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")

    def _read(self, query: str, **params: Any) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(_Q[query], params).fetchall()

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
                for statement in _split_sql(sql):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_migrations VALUES (?, ?, datetime('now'))",
                    (version, name),
                )
                applied.append(version)
        return applied

    def unavailable(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        code = getattr(exc, "sqlite_errorcode", None)
        return code is None or (code & 0xFF) in _UNAVAILABLE_CODES

    def schema_version(self) -> int:
        row = self._db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _event(db: sqlite3.Connection, event: Event) -> Event:
        cur = db.execute(
            _Q["insert_event"],
            {
                "ts": event.ts,
                "kind": event.kind,
                "job_id": event.job_id,
                "from_state": event.from_state,
                "to_state": event.to_state,
                "detail": json.dumps(event.detail, sort_keys=True),
            },
        )
        return Event(
            ts=event.ts,
            kind=event.kind,
            job_id=event.job_id,
            from_state=event.from_state,
            to_state=event.to_state,
            detail=dict(event.detail),
            id=cur.lastrowid,
        )

    def _job_in(self, db: sqlite3.Connection, job_id: str) -> Job:
        row = db.execute(_Q["get_job"], {"id": job_id}).fetchone()
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
        with self._write() as db:
            if idempotency is not None:
                token_id, key, body_hash = idempotency
                row = db.execute(
                    _Q["get_idempotency"], {"token_id": token_id, "key": key}
                ).fetchone()
                if row is not None:
                    if row["body_hash"] != body_hash:
                        raise IdempotencyConflict(
                            f"idempotency key {key!r} was already used for a different "
                            "request; use a new key for a new request"
                        )
                    return [self._job_in(db, i) for i in json.loads(row["job_ids"])]
                db.execute(
                    _Q["insert_idempotency"],
                    {
                        "token_id": token_id,
                        "key": key,
                        "body_hash": body_hash,
                        "job_ids": json.dumps(ids),
                        "now": now,
                    },
                )
            existing = [r[0] for r in db.execute(_Q["job_ids_existing"], {"ids": json.dumps(ids)})]
            if existing:
                raise DuplicateJobError(sorted(existing))
            if origin.bundle is not None:
                qr = origin.queue_root or ""
                if db.execute(
                    _Q["get_bundle"], {"queue_root": qr, "name": origin.bundle}
                ).fetchone():
                    raise DuplicateBundleError(
                        f"bundle {origin.bundle} was already received in {qr}"
                    )
                db.execute(
                    _Q["insert_bundle"],
                    {
                        "queue_root": qr,
                        "name": origin.bundle,
                        "job_ids": json.dumps(ids),
                        "now": now,
                    },
                )
            seq = int(db.execute(_Q["next_seq"]).fetchone()[0])
            for offset, spec in enumerate(specs):
                db.execute(
                    _Q["insert_job"],
                    {
                        "id": spec.id,
                        "seq": seq + offset,
                        "type": spec.type,
                        "priority": spec.priority,
                        "params": json.dumps(spec.params, sort_keys=True),
                        "inputs": json.dumps(list(spec.inputs)),
                        "outputs": json.dumps(list(spec.outputs)),
                        "vram_bytes": spec.vram_bytes,
                        "spec_hash": spec_hash(spec),
                        "constraints": json.dumps(spec.constraints, sort_keys=True),
                        "now": now,
                        "bundle": origin.bundle,
                        "queue_root": origin.queue_root,
                        "input_dir": origin.input_dir,
                        "owner": origin.owner,
                    },
                )
                detail: dict[str, Any] = {"type": spec.type}
                if origin.bundle:
                    detail["bundle"] = origin.bundle
                self._event(
                    db,
                    Event(
                        ts=now, kind="submitted", job_id=spec.id, to_state="queued", detail=detail
                    ),
                )
            return [self._job_in(db, i) for i in ids]

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
            job_ids=tuple(json.loads(r["job_ids"])),
            created_at=r["created_at"],
        )

    def list_jobs(
        self,
        *,
        states: frozenset[JobState] | None = None,
        limit: int = 100,
        owner: str | None = None,
    ) -> list[Job]:
        in_states = json.dumps([s.value for s in states]) if states is not None else None
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
        db: sqlite3.Connection,
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
        before = self._job_in(db, job_id)
        # ``sources`` narrows the table for callers that know more (an attempt's end
        # comes only from running); it never widens it.
        allowed = states.sources(target) & (sources or states.sources(target))
        if before.state not in allowed:
            raise TransitionError(
                f"job {job_id} is {before.state.value}; it cannot become {target.value} from there"
            )
        cur = db.execute(
            _Q["transition_job"],
            {
                "id": job_id,
                "target": target.value,
                "now": now,
                "reason": reason,
                "exit_code": exit_code,
                "result": json.dumps(dict(result), sort_keys=True) if result is not None else None,
                "sources": json.dumps([s.value for s in allowed]),
            },
        )
        if cur.rowcount != 1:  # pragma: no cover - the IMMEDIATE lock makes this a bug
            raise TransitionError(f"job {job_id} changed state during the transition")
        ev = {"reason": reason} if reason else {}
        ev.update(detail or {})
        self._event(
            db,
            Event(
                ts=now,
                kind="transition",
                job_id=job_id,
                from_state=before.state.value,
                to_state=target.value,
                detail=ev,
            ),
        )
        return self._job_in(db, job_id)

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
        with self._write() as db:
            return self._transition_in(
                db,
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
        with self._write() as db:
            before = self._job_in(db, job_id)
            states.check(before.state, JobState.RUNNING)
            if before.cancel_requested:
                raise TransitionError(f"job {job_id} has a cancel request; it will not start")
            cur = db.execute(_Q["start_job"], {"id": job_id, "now": now})
            if cur.rowcount != 1:  # pragma: no cover - guarded above under the write lock
                raise TransitionError(f"job {job_id} changed state before it could start")
            number = before.attempts + 1
            db.execute(
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
                db,
                Event(
                    ts=now,
                    kind="transition",
                    job_id=job_id,
                    from_state="queued",
                    to_state="running",
                    detail={"attempt": number, "node": node, "gpu": gpu_uuid},
                ),
            )
            job = self._job_in(db, job_id)
            return job, Attempt(
                job_id=job_id, number=number, node=node, gpu_uuid=gpu_uuid, started_at=now
            )

    def set_attempt_pid(self, job_id: str, number: int, pid: int) -> None:
        with self._write() as db:
            db.execute(_Q["set_attempt_pid"], {"job_id": job_id, "number": number, "pid": pid})

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
        with self._write() as db:
            cur = db.execute(
                _Q["finish_attempt"],
                {
                    "job_id": job_id,
                    "number": number,
                    "now": now,
                    "exit_code": exit_code,
                    "outcome": outcome,
                    "reason": reason,
                    "stdout": stdout,
                    "stderr": stderr,
                },
            )
            if cur.rowcount != 1:
                job = self._job_in(db, job_id)
                raise TransitionError(
                    f"attempt {number} of job {job_id} is not the current running attempt "
                    f"(job is {job.state.value}, attempt {job.attempts}); its report is refused"
                )
            return self._transition_in(
                db,
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
        with self._write() as db:
            job = self._job_in(db, job_id)
            if job.state is JobState.QUEUED:
                return self._transition_in(
                    db,
                    job_id,
                    JobState.CANCELLED,
                    now=now,
                    reason="cancelled before it started",
                    detail=None,
                    exit_code=None,
                    result=None,
                )
            if job.state is JobState.RUNNING:
                db.execute(_Q["mark_cancel_requested"], {"id": job_id, "now": now})
                self._event(db, Event(ts=now, kind="cancel_requested", job_id=job_id))
                return self._job_in(db, job_id)
            raise UserError(
                f"job {job_id} has already ended ({job.state.value}); nothing to cancel"
            )

    # -- events -------------------------------------------------------------

    def add_event(self, event: Event) -> Event:
        with self._write() as db:
            return self._event(db, event)

    def last_event_id(self) -> int:
        return int(self._read("last_event_id")[0][0])

    def events(
        self, *, job_id: str | None = None, after_id: int = 0, limit: int = 1000
    ) -> list[Event]:
        if job_id is None:
            rows = self._read("events_all", after_id=after_id, limit=limit)
        else:
            rows = self._read("events_for_job", job_id=job_id, after_id=after_id, limit=limit)
        return [
            Event(
                id=r["id"],
                ts=r["ts"],
                kind=r["kind"],
                job_id=r["job_id"],
                from_state=r["from_state"],
                to_state=r["to_state"],
                detail=json.loads(r["detail"]),
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
        with self._write() as db:
            db.execute(
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
        with self._write() as db:
            db.execute(
                _Q["insert_rejected_bundle"],
                {"queue_root": queue_root, "name": name, "now": now, "result_path": result_path},
            )
            self._event(
                db,
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
        with self._write() as db:
            row = db.execute(_Q["get_footprint"], {"type": type_name}).fetchone()
            old = int(row[0]) if row else None
            cur = db.execute(
                _Q["raise_footprint"],
                {"type": type_name, "bytes": nbytes, "job_id": job_id, "now": now},
            )
            if cur.rowcount != 1:
                return False
            self._event(
                db,
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
        with self._write() as db:
            db.execute(_Q["request_gpu_clear"], {"gpu_uuid": gpu_uuid, "now": now})
            self._event(db, Event(ts=now, kind="gpu_clear_requested", detail={"gpu": gpu_uuid}))

    def take_gpu_clears(self, *, now: float) -> list[str]:
        with self._write() as db:
            taken = []
            for row in db.execute(_Q["pending_gpu_clears"]).fetchall():
                if db.execute(_Q["take_gpu_clear"], {"id": row["id"], "now": now}).rowcount:
                    taken.append(row["gpu_uuid"])
            return taken

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
        with self._write() as db:
            if db.execute(_Q["get_token"], {"id": token_id}).fetchone() is not None:
                raise DuplicateTokenError(f"a token with id {token_id} exists already")
            db.execute(
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
            )
            return _token(db.execute(_Q["get_token"], {"id": token_id}).fetchone())

    def get_token(self, token_id: str) -> TokenRecord | None:
        rows = self._read("get_token", id=token_id)
        return _token(rows[0]) if rows else None

    def list_tokens(self) -> list[TokenRecord]:
        return [_token(r) for r in self._read("list_tokens")]

    def revoke_token(self, token_id: str, *, now: float) -> bool:
        with self._write() as db:
            return db.execute(_Q["revoke_token"], {"id": token_id, "now": now}).rowcount == 1

    # -- audit --------------------------------------------------------------

    def add_audit(self, row: AuditRow) -> AuditRow:
        with self._write() as db:
            cur = db.execute(
                _Q["insert_audit"],
                {
                    "ts": row.ts,
                    "actor": row.actor,
                    "actor_name": row.actor_name,
                    "role": row.role,
                    "action": row.action,
                    "target": row.target,
                    "outcome": row.outcome,
                    "detail": json.dumps(row.detail, sort_keys=True),
                },
            )
            return dataclasses.replace(row, detail=dict(row.detail), id=cur.lastrowid)

    def audit_rows(self, *, after_id: int = 0, limit: int = 1000) -> list[AuditRow]:
        return [
            AuditRow(
                id=r["id"],
                ts=r["ts"],
                actor=r["actor"],
                actor_name=r["actor_name"],
                role=r["role"],
                action=r["action"],
                target=r["target"],
                outcome=r["outcome"],
                detail=json.loads(r["detail"]),
            )
            for r in self._read("audit_rows", after_id=after_id, limit=limit)
        ]

    # -- node status --------------------------------------------------------

    def put_node_status(self, status: NodeStatus) -> None:
        with self._write() as db:
            db.execute(
                _Q["put_node_status"],
                {
                    "node": status.node,
                    "pid": status.pid,
                    "updated_at": status.updated_at,
                    "payload": json.dumps(status.payload, sort_keys=True),
                },
            )

    def node_statuses(self) -> list[NodeStatus]:
        return [
            NodeStatus(
                node=r["node"],
                pid=r["pid"],
                updated_at=r["updated_at"],
                payload=json.loads(r["payload"]),
            )
            for r in self._read("node_statuses")
        ]


def _split_sql(script: str) -> list[str]:
    """Split a migration into statements (our migrations hold no ``;`` inside strings)."""
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


_job = functools.partial(rows.job, decode=json.loads)
_bundle = functools.partial(rows.bundle, decode=json.loads)
_token = rows.token
_attempt = rows.attempt


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
