"""The SQL store: every query and every rule that SQLite and PostgreSQL share, once.

:class:`SqlStore` implements the :class:`~gpuwarden.store.base.Store` port on a
connection and the dialect's named queries (``sql/<backend>/queries.sql``). The
adapters, :mod:`gpuwarden.store.sqlite` and :mod:`gpuwarden.store.postgres`, give
only what differs between the two databases, through the hooks in the first
section of the class: how a write transaction and a connection to read on are
had, how JSON, lists of strings and free text are passed in and JSON read back,
how a row is appended to the event or the audit log, how a row just written is
read back, and how a submission's job rows are inserted. This module holds the
jobs, their attempts, events and bundles; the other records are
:mod:`gpuwarden.store.sql_records`, and nodes and leases
:mod:`gpuwarden.store.sql_cluster`, each a subclass, the last the one both
adapters are.

Row locks and ``SKIP LOCKED`` claims are in each dialect's SQL text: a query named
``lock_*`` locks the rows it reads in PostgreSQL (``FOR UPDATE``, with ``SKIP
LOCKED`` where a writer must not wait) and is a plain read in SQLite, whose
writers hold the database's one write lock from their first statement.

The guarded update, the rule that keeps the store true under several writers, is
written here once: a job changes state only from the states the transition table
(:mod:`gpuwarden.core.states`) allows, by an ``UPDATE ... WHERE state IN
(allowed)`` whose row count is checked, with its event in the same transaction.
:meth:`SqlStore._transition_in` makes every change but a job's start, which is
:meth:`SqlStore.start_attempt`'s; an attempt's end (``finish_attempt``) also
names the current attempt of a running job.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from gpuwarden.core import dependencies, jobcontrol, states
from gpuwarden.core.dependencies import Dependency, DepKind, Standing, Verdict
from gpuwarden.core.model import Attempt, Event, Job, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import JobControlError, TransitionError, UnknownJobError, UserError
from gpuwarden.store import rows
from gpuwarden.store.base import (
    DIRECT,
    BundleRecord,
    DuplicateBundleError,
    DuplicateJobError,
    DuplicateTokenError,
    IdempotencyConflict,
    IdempotencyRecord,
    QueueEntry,
    Store,
    Submission,
)
from gpuwarden.store.rows import Row, source_detail, spec_hash


class Cursor(Protocol):
    """What the store uses of a cursor (``sqlite3.Cursor``, psycopg's ``Cursor``)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What the store uses of a connection: a query with named parameters."""

    def execute(self, query: str, params: Mapping[str, Any], /) -> Cursor: ...


C = TypeVar("C", bound=Connection)


def duplicate_bundle(origin: Submission) -> DuplicateBundleError:
    """The error for a bundle name already received in ``origin``'s queue root."""
    return DuplicateBundleError(
        f"bundle {origin.bundle} was already received in {origin.queue_root or ''}"
    )


def duplicate_token(token_id: str) -> DuplicateTokenError:
    """The error for a token id that exists already."""
    return DuplicateTokenError(f"a token with id {token_id} exists already")


class SqlStore(Store, Generic[C]):
    """The :class:`Store` contract in SQL, on connections of type ``C``."""

    #: the dialect's named queries (:func:`gpuwarden.store.queries.load_dialect`)
    queries: ClassVar[Mapping[str, str]]

    # -- dialect hooks -------------------------------------------------------

    @abc.abstractmethod
    def _write(self) -> AbstractContextManager[C]:
        """One write transaction: committed when the block ends, rolled back on an
        error. The one place where write transactions begin."""

    @abc.abstractmethod
    def _connection(self) -> AbstractContextManager[C]:
        """A connection to read on, outside any write transaction."""

    @abc.abstractmethod
    def _append(self, conn: C, log: str, params: Mapping[str, Any]) -> int:
        """Run ``insert_<log>`` (``log`` is ``event`` or ``audit``) and return the
        new row's id. Ids must appear in commit order, so that a reader following
        the log by id never skips a row that committed late."""

    @abc.abstractmethod
    def _returning(
        self, conn: C, query: str, params: Mapping[str, Any], *, reread: str
    ) -> Row | None:
        """Run the write ``query`` and return the row it wrote, or None when it
        wrote none; where the dialect cannot return it, ``reread`` (a query taking
        the same parameters) reads it back in the same transaction."""

    @abc.abstractmethod
    def _insert_jobs(self, conn: C, jobs: Sequence[Mapping[str, Any]]) -> None:
        """Insert ``insert_job`` rows, in the order given: ``seq`` follows it."""

    @abc.abstractmethod
    def _json(self, value: Any) -> Any:
        """A JSON document as the driver takes it for a JSON column."""

    @abc.abstractmethod
    def _decode(self, value: Any) -> Any:
        """A JSON column's value as Python values."""

    @abc.abstractmethod
    def _ids(self, values: Sequence[str]) -> Any:
        """A list of strings (job ids, states) as the queries take it."""

    def _submitted(self) -> None:
        """Jobs were submitted, or a cancel asked, and committed: wake a broker
        where the dialect can (:meth:`Store.on_submit`)."""
        return None

    def _text(self, value: str) -> str:
        """Free text (a reason, an attempt's output, an audit field) as it is stored."""
        return value

    #: the driver's error for a unique key that a concurrent writer inserted after
    #: this writer checked it was free; none where writers cannot race that way
    unique_violation: ClassVar[tuple[type[Exception], ...]] = ()

    # -- plumbing -----------------------------------------------------------

    def _run(self, conn: C, query: str, params: Mapping[str, Any]) -> Cursor:
        return conn.execute(self.queries[query], params)

    def _read(self, query: str, **params: Any) -> list[Row]:
        with self._connection() as conn:
            return conn.execute(self.queries[query], params).fetchall()

    def _job(self, row: Row) -> Job:
        return rows.job(row, self._decode)

    def _job_in(self, conn: C, job_id: str, *, lock: bool = False) -> Job:
        row = self._run(conn, "lock_job" if lock else "get_job", {"id": job_id}).fetchone()
        if row is None:
            raise UnknownJobError(f"no job with id {job_id!r} (see `gpuwarden jobs`)")
        return self._job(row)

    def _event(self, conn: C, event: Event) -> Event:
        new_id = self._append(
            conn,
            "event",
            {
                "ts": event.ts,
                "kind": event.kind,
                "job_id": event.job_id,
                "from_state": event.from_state,
                "to_state": event.to_state,
                "detail": self._json(event.detail),
            },
        )
        return dataclasses.replace(event, detail=dict(event.detail), id=new_id)

    def schema_version(self) -> int:
        """The newest migration applied."""
        return int(self._read("schema_version")[0]["v"])

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
        jobs = self._submit(specs, ids, now=now, origin=origin, idempotency=idempotency)
        self._submitted()
        return jobs

    def _submit(
        self,
        specs: Sequence[JobSpec],
        ids: list[str],
        *,
        now: float,
        origin: Submission,
        idempotency: tuple[str, str, str] | None,
    ) -> list[Job]:
        """One try at a submission, in one transaction (a dialect whose concurrent
        submissions can collide tries again around it)."""
        with self._write() as conn:
            if idempotency is not None:
                first = self._answered(conn, idempotency, ids, now=now)
                if first is not None:
                    return first
            existing = [
                r["id"] for r in self._run(conn, "job_ids_existing", {"ids": self._ids(ids)})
            ]
            if existing:
                raise DuplicateJobError(sorted(existing))
            if origin.bundle is not None:
                qr = origin.queue_root or ""
                if self._run(
                    conn, "get_bundle", {"queue_root": qr, "name": origin.bundle}
                ).fetchone():
                    raise duplicate_bundle(origin)
                self._run(
                    conn,
                    "insert_bundle",
                    {
                        "queue_root": qr,
                        "name": origin.bundle,
                        "job_ids": self._json(ids),
                        "now": now,
                    },
                )
            verdicts = self._dependencies_at_submit(conn, specs)
            self._insert_jobs(
                conn,
                [self._job_row(spec, origin, now=now, held=spec.id in verdicts) for spec in specs],
            )
            self._insert_deps(conn, specs)
            for spec in specs:
                self._set_columns(conn, spec)
            # the events last: PostgreSQL's events lock is taken after every row lock
            for spec in specs:
                detail: dict[str, Any] = {"type": spec.type}
                if origin.bundle:
                    detail["bundle"] = origin.bundle
                if spec.after:
                    detail["after"] = list(spec.after)
                self._event(
                    conn,
                    Event(
                        ts=now, kind="submitted", job_id=spec.id, to_state="queued", detail=detail
                    ),
                )
            self._apply_verdicts(conn, verdicts, now=now)
            return [self._job(r) for r in self._run(conn, "jobs_by_ids", {"ids": self._ids(ids)})]

    def _dependencies_at_submit(self, conn: C, specs: Sequence[JobSpec]) -> dict[str, Verdict]:
        """Check a submission's dependencies (unknown ids, cycles: refused) and judge
        them: the jobs that are not released at once, with their verdicts (waiting,
        or never: those fail at once). The stored jobs named are locked, so that none
        ends unseen before this submission commits."""
        new = {s.id: dependencies.parse_all(s.after) for s in specs if s.after}
        if not new:
            return {}
        batch = {s.id for s in specs}
        named = sorted({d.job_id for deps in new.values() for d in deps} - batch)
        found = {
            r["id"]: states.JobState(r["state"])
            for r in self._run(conn, "lock_job_states", {"ids": self._ids(named)})
        }
        dependencies.check_graph(new, lambda i: i in found or i in batch)
        verdicts = dependencies.initial(new, found)
        return {j: v for j, v in verdicts.items() if v.standing is not Standing.HOLDS}

    def _insert_deps(self, conn: C, specs: Sequence[JobSpec]) -> None:
        for spec in specs:
            for dep in dependencies.parse_all(spec.after):
                self._run(
                    conn,
                    "insert_dep",
                    {"job_id": spec.id, "kind": dep.kind.value, "dep_id": dep.job_id},
                )

    def _apply_verdicts(
        self,
        conn: C,
        verdicts: Sequence[tuple[str, Verdict]] | Mapping[str, Verdict],
        *,
        now: float,
    ) -> None:
        """Release or fail held jobs as decided (waiting ones stay held)."""
        items = verdicts.items() if isinstance(verdicts, Mapping) else verdicts
        for job_id, verdict in items:
            if verdict.standing is Standing.NEVER:
                self._change_in(
                    conn,
                    job_id,
                    JobState.FAILED,
                    now=now,
                    reason=verdict.reason,
                    detail={"dependencies": "never"},
                    exit_code=None,
                    result=None,
                )
            elif verdict.standing is Standing.HOLDS:
                self._run(conn, "release_job", {"id": job_id, "now": now})
                self._event(conn, Event(ts=now, kind="dependencies_held", job_id=job_id))

    def _cascade_in(self, conn: C, job_id: str, target: JobState) -> list[tuple[str, Verdict]]:
        """What job ``job_id`` ending as ``target`` does to the held jobs that name it
        (their rows locked, before any event is written)."""

        def dependents(of: str) -> list[str]:
            return [r["id"] for r in self._run(conn, "lock_dependents", {"id": of})]

        return dependencies.cascade(
            job_id, target, dependents, lambda of: self._dependencies_in(conn, of)
        )

    def _dependencies_in(self, conn: C, job_id: str) -> list[tuple[Dependency, JobState]]:
        return [
            (Dependency(DepKind(r["kind"]), r["dep_id"]), JobState(r["state"]))
            for r in self._run(conn, "deps_of", {"id": job_id})
        ]

    def dependencies(self, job_id: str) -> list[tuple[Dependency, JobState]]:
        with self._connection() as conn:
            return self._dependencies_in(conn, job_id)

    def settle_dependencies(self, *, now: float) -> int:
        changed = 0
        with self._write() as conn:
            for row in list(self._run(conn, "held_jobs", {})):
                job = self._job_in(conn, row["id"], lock=True)
                if job.state is not JobState.QUEUED or not job.held:
                    continue  # decided already, down the chain of one before it
                verdict = dependencies.judge(self._dependencies_in(conn, job.id))
                if verdict.standing is Standing.WAITING:
                    continue
                changed += 1
                if verdict.standing is Standing.NEVER:
                    self._transition_in(
                        conn,
                        job.id,
                        JobState.FAILED,
                        now=now,
                        reason=verdict.reason,
                        detail={"dependencies": "never"},
                        exit_code=None,
                        result=None,
                    )
                else:
                    self._apply_verdicts(conn, [(job.id, verdict)], now=now)
        return changed

    def _answered(
        self, conn: C, idempotency: tuple[str, str, str], ids: list[str], *, now: float
    ) -> list[Job] | None:
        """The jobs of the first submission made with this idempotency key, or None
        (then the key is recorded with ``ids``); :class:`IdempotencyConflict` when
        the key was used for another request."""
        token_id, key, body_hash = idempotency
        row = self._run(conn, "get_idempotency", {"token_id": token_id, "key": key}).fetchone()
        if row is not None:
            if row["body_hash"] != body_hash:
                raise IdempotencyConflict(
                    f"idempotency key {key!r} was already used for a different "
                    "request; use a new key for a new request"
                )
            return [self._job_in(conn, i) for i in self._decode(row["job_ids"])]
        self._run(
            conn,
            "insert_idempotency",
            {
                "token_id": token_id,
                "key": key,
                "body_hash": body_hash,
                "job_ids": self._json(ids),
                "now": now,
            },
        )
        return None

    def _job_row(
        self, spec: JobSpec, origin: Submission, *, now: float, held: bool = False
    ) -> dict[str, Any]:
        return {
            "id": spec.id,
            "type": spec.type,
            "priority": spec.priority,
            "params": self._json(spec.params),
            "inputs": self._json(list(spec.inputs)),
            "outputs": self._json(list(spec.outputs)),
            "vram_bytes": spec.vram_bytes,
            "spec_hash": spec_hash(spec),
            "constraints": self._json(spec.constraints),
            "depends_on": self._json(list(spec.after)),
            "held": held,
            "now": now,
            "bundle": origin.bundle,
            "queue_root": origin.queue_root,
            "input_dir": origin.input_dir,
            "owner": origin.owner,
        }

    def get_job(self, job_id: str) -> Job | None:
        found = self._read("get_job", id=job_id)
        return self._job(found[0]) if found else None

    def idempotency_record(self, token_id: str, key: str) -> IdempotencyRecord | None:
        found = self._read("get_idempotency", token_id=token_id, key=key)
        return rows.idempotency(found[0], self._decode) if found else None

    def list_jobs(
        self,
        *,
        states: frozenset[JobState] | None = None,
        limit: int = 100,
        owner: str | None = None,
    ) -> list[Job]:
        in_states = self._ids([s.value for s in states]) if states is not None else None
        if owner is None and in_states is None:
            found = self._read("list_jobs", limit=limit)
        elif owner is None:
            found = self._read("list_jobs_in_states", states=in_states, limit=limit)
        elif in_states is None:
            found = self._read("list_jobs_of_owner", owner=owner, limit=limit)
        else:
            found = self._read(
                "list_jobs_of_owner_in_states", owner=owner, states=in_states, limit=limit
            )
        return [self._job(r) for r in found]

    def live_jobs_of_type(self, type_name: str) -> list[Job]:
        return [self._job(r) for r in self._read("live_jobs_of_type", type=type_name)]

    def queued_jobs(self, *, limit: int = 1000) -> list[Job]:
        return [self._job(r) for r in self._read("queued_jobs", limit=limit)]

    def terminal_count(self, job_ids: Sequence[str]) -> int:
        if not job_ids:
            return 0
        return int(self._read("terminal_count", ids=self._ids(list(job_ids)))[0]["n"])

    def queue_entries(self, ids: Sequence[str] | None = None) -> list[QueueEntry]:
        if ids is None:
            found = self._read("queue_entries")
        else:
            found = self._read("queue_entries_of", ids=self._ids(list(ids)))
        return [
            QueueEntry(
                id=r["id"],
                type=r["type"],
                priority=int(r["priority"]),
                seq=int(r["seq"]),
                vram_bytes=None if r["vram_bytes"] is None else int(r["vram_bytes"]),
                cancel_requested=bool(r["cancel_requested"]),
                est_s=None if r["est_s"] is None else float(r["est_s"]),
                owner=r["owner"],
                gpus=None if r["gpus"] is None else int(r["gpus"]),
                ram=rows.ram_need(r),
                gpu=r["gpu_pin"] or "",
            )
            for r in found
        ]

    def queued_count(self) -> int:
        return int(self._read("queued_count")[0]["n"])

    def running_jobs(self) -> list[Job]:
        return [self._job(r) for r in self._read("running_jobs")]

    def count_by_state(self) -> dict[JobState, int]:
        return {JobState(r["state"]): int(r["n"]) for r in self._read("count_by_state")}

    def _transition_in(
        self,
        conn: C,
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
        """The guarded update: every change of a job's state but its start. An end
        also releases or fails the held jobs that name this one, down the chain,
        in the same transaction (their rows are locked before any event)."""
        follows = self._cascade_in(conn, job_id, target) if target.terminal else []
        job = self._change_in(
            conn,
            job_id,
            target,
            now=now,
            reason=reason,
            detail=detail,
            exit_code=exit_code,
            result=result,
            sources=sources,
        )
        self._apply_verdicts(conn, follows, now=now)
        return job

    def _change_in(
        self,
        conn: C,
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
        """One job's guarded update and its event, nothing that follows from it."""
        before = self._job_in(conn, job_id, lock=True)
        # ``sources`` narrows the table for callers that know more (an attempt's end
        # comes only from running); it never widens it.
        allowed = states.sources(target) & (sources or states.sources(target))
        if before.state not in allowed:
            raise TransitionError(
                f"job {job_id} is {before.state.value}; it cannot become {target.value} from there"
            )
        cur = self._run(
            conn,
            "transition_job",
            {
                "id": job_id,
                "target": target.value,
                "now": now,
                "reason": self._text(reason),
                "exit_code": exit_code,
                "result": self._json(dict(result)) if result is not None else None,
                "sources": self._ids([s.value for s in allowed]),
            },
        )
        if cur.rowcount != 1:  # pragma: no cover - the row or write lock makes this a bug
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
            return self._start_in(conn, job_id, node=node, gpu_uuid=gpu_uuid, now=now)

    def _start_in(
        self, conn: C, job_id: str, *, node: str, gpu_uuid: str | None, now: float
    ) -> tuple[Job, Attempt]:
        """:meth:`start_attempt` in the transaction of ``conn``."""
        row = self._run(conn, "lock_job_to_start", {"id": job_id}).fetchone()
        if row is None:
            self._job_in(conn, job_id)  # UnknownJobError when there is no such job
            raise TransitionError(
                f"job {job_id} is being changed by another writer (another broker may be "
                "starting it); it was not started here"
            )
        before = self._job(row)
        states.check(before.state, JobState.RUNNING)
        if before.cancel_requested:
            raise TransitionError(f"job {job_id} has a cancel request; it will not start")
        if before.held:
            raise TransitionError(f"job {job_id} waits for its dependencies; it was not started")
        if before.hold_by is not None:
            raise TransitionError(f"job {job_id} is held by {before.hold_by}; it was not started")
        cur = self._run(conn, "start_job", {"id": job_id, "now": now})
        if cur.rowcount != 1:  # pragma: no cover - guarded above under the lock
            raise TransitionError(f"job {job_id} changed state before it could start")
        number = before.attempts + 1
        self._run(
            conn,
            "insert_attempt",
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
                detail={"attempt": number, "node": node, "gpu": gpu_uuid, **source_detail(before)},
            ),
        )
        job = self._job_in(conn, job_id)
        return job, Attempt(
            job_id=job_id, number=number, node=node, gpu_uuid=gpu_uuid, started_at=now
        )

    def set_attempt_pid(self, job_id: str, number: int, pid: int) -> None:
        with self._write() as conn:
            self._run(conn, "set_attempt_pid", {"job_id": job_id, "number": number, "pid": pid})

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
        detail: Mapping[str, Any] | None = None,
    ) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            cur = self._run(
                conn,
                "finish_attempt",
                {
                    "job_id": job_id,
                    "number": number,
                    "now": now,
                    "exit_code": exit_code,
                    "outcome": outcome,
                    "reason": self._text(reason),
                    "stdout": self._text(stdout),
                    "stderr": self._text(stderr),
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
                detail={
                    "attempt": number,
                    "outcome": outcome,
                    "exit_code": exit_code,
                    **source_detail(job),
                    **(detail or {}),
                },
                exit_code=exit_code,
                result=result,
                sources=frozenset({JobState.RUNNING}),
            )

    def attempts(self, job_id: str) -> list[Attempt]:
        return [rows.attempt(r) for r in self._read("attempts", job_id=job_id)]

    def request_cancel(self, job_id: str, *, now: float) -> Job:
        job = self._request_cancel(job_id, now=now)
        self._submitted()
        return job

    def _request_cancel(self, job_id: str, *, now: float) -> Job:
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
                self._run(conn, "mark_cancel_requested", {"id": job_id, "now": now})
                self._event(conn, Event(ts=now, kind="cancel_requested", job_id=job_id))
                return self._job_in(conn, job_id)
            raise UserError(
                f"job {job_id} has already ended ({job.state.value}); nothing to cancel"
            )

    def _set_service(self, conn: C, spec: JobSpec) -> None:
        """A service job's ``service`` and ``share`` (migration 0016), if it has them."""
        if spec.service is not None or spec.share:
            share = json.dumps(list(spec.share))
            self._run(
                conn, "set_job_service", {"id": spec.id, "service": spec.service, "share": share}
            )

    def _set_columns(self, conn: C, spec: JobSpec) -> None:
        """The keys with a column of their own (0008 on), written only for the jobs
        that declare them."""
        if spec.est_s is not None:
            self._run(conn, "set_job_est_s", {"id": spec.id, "est_s": spec.est_s})
        if spec.gpus is not None:  # likewise (0010)
            self._run(conn, "set_job_gpus", {"id": spec.id, "gpus": spec.gpus})
        self._set_service(conn, spec)  # likewise (0016)
        self._set_source(conn, spec)  # likewise (0018)
        if spec.command is not None:  # likewise (0019)
            body = {"id": spec.id, "command": self._json(spec.command.to_json())}
            self._run(conn, "set_job_command", body)
        if spec.ram.asks:  # likewise (0015)
            ram = spec.ram
            self._run(
                conn,
                "set_job_ram",
                {
                    "id": spec.id,
                    "cap": ram.cap_bytes,
                    "floor": ram.floor_bytes,
                    "start_min": ram.start_min_bytes,
                },
            )

    def _set_source(self, conn: C, spec: JobSpec) -> None:
        """A job's source repository and commit (migration 0018), if it has one."""
        if spec.source is not None:
            src = {"id": spec.id, "repo": spec.source.repo, "commit": spec.source.commit}
            self._run(conn, "set_job_source", src)

    def request_stop(self, job_id: str, *, by: str, now: float) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            if job.state is not JobState.RUNNING:
                raise UserError(
                    f"job {job_id} is {job.state.value}, not running: nothing to stop "
                    "(a queued job is cancelled with `gpuwarden cancel`)"
                )
            if job.stop_requested_by is None:
                self._run(conn, "mark_stop_requested", {"id": job_id, "by": by, "now": now})
                self._event(
                    conn, Event(ts=now, kind="stop_requested", job_id=job_id, detail={"by": by})
                )
            job = self._job_in(conn, job_id)
        self._submitted()
        return job

    # -- job control (SPEC.md section 1, "Job control") ---------------------------

    def hold(self, job_id: str, *, by: str, now: float) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            jobcontrol.check_hold(job)
            leased = self._run(conn, "live_lease_node", {"id": job_id, "now": now}).fetchone()
            if leased is not None:
                raise JobControlError(
                    f"job {job_id} is leased to node {leased['node']}, which may be starting "
                    f"it: it cannot be held now (`gpuwarden cancel {job_id}` ends it)"
                )
            self._run(conn, "hold_job", {"id": job_id, "by": self._text(by), "now": now})
            self._event(conn, Event(ts=now, kind="held", job_id=job_id, detail={"by": by}))
            return self._job_in(conn, job_id)

    def release(self, job_id: str, *, by: str, now: float) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            jobcontrol.check_release(job)
            self._run(conn, "release_hold", {"id": job_id, "now": now})
            detail = {"by": by, "held_by": job.hold_by}
            self._event(conn, Event(ts=now, kind="released", job_id=job_id, detail=detail))
            job = self._job_in(conn, job_id)
        self._submitted()
        return job

    def requeue(self, job_id: str, *, by: str, now: float) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            jobcontrol.check_requeue(job)
            verdict = dependencies.judge(self._dependencies_in(conn, job_id))
            if verdict.standing is Standing.NEVER:
                raise JobControlError(f"job {job_id} cannot run again: its {verdict.reason}")
            held = verdict.standing is Standing.WAITING
            params = {"id": job_id, "now": now, "reason": self._text(f"requeued by {by}")}
            sources = self._ids(sorted(s.value for s in states.REQUEUE))
            cur = self._run(conn, "requeue_job", {**params, "held": held, "sources": sources})
            if cur.rowcount != 1:  # pragma: no cover - the row or write lock makes this a bug
                raise TransitionError(f"job {job_id} changed state during its requeue")
            # everything its end recorded on the job's row, kept here for good
            ended = {"attempts": job.attempts, "reason": job.reason, "exit_code": job.exit_code}
            detail = {"by": by, **ended, "result": job.result, "dependencies_wait": held}
            self._event(
                conn,
                Event(
                    ts=now,
                    kind="requeued",
                    job_id=job_id,
                    from_state=job.state.value,
                    to_state=JobState.QUEUED.value,
                    detail=detail,
                ),
            )
            job = self._job_in(conn, job_id)
        self._submitted()
        return job

    def set_priority(
        self, job_id: str, priority: int, *, by: str, now: float, may_raise: bool = True
    ) -> Job:
        with self._write() as conn:
            job = self._job_in(conn, job_id, lock=True)
            jobcontrol.check_priority(job, priority, may_raise=may_raise)
            self._run(conn, "set_priority", {"id": job_id, "priority": priority, "now": now})
            detail = {"by": by, "from": job.priority, "to": priority}
            self._event(conn, Event(ts=now, kind="priority_changed", job_id=job_id, detail=detail))
            job = self._job_in(conn, job_id)
        self._submitted()
        return job

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
            found = self._read("events_all", after_id=after_id, limit=limit)
        else:
            found = self._read("events_for_job", job_id=job_id, after_id=after_id, limit=limit)
        return [rows.event(r, self._decode) for r in found]

    # -- bundles ------------------------------------------------------------

    def get_bundle(self, queue_root: str, name: str) -> BundleRecord | None:
        found = self._read("get_bundle", queue_root=queue_root, name=name)
        return rows.bundle(found[0], self._decode) if found else None

    def open_bundles(self) -> list[BundleRecord]:
        return [rows.bundle(r, self._decode) for r in self._read("open_bundles")]

    def finish_bundle(
        self, queue_root: str, name: str, *, now: float, outcome: str, result_path: str
    ) -> None:
        with self._write() as conn:
            self._run(
                conn,
                "finish_bundle",
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
            self._run(
                conn,
                "insert_rejected_bundle",
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
