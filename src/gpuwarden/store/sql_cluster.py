"""The SQL part of :class:`~gpuwarden.store.cluster.ClusterStore` that SQLite and
PostgreSQL share: nodes, leases and where jobs were lost, on the hooks of
:class:`~gpuwarden.store.sql.SqlStore`, with the queries of
``sql/<backend>/cluster.sql``.

A claim (:meth:`SqlClusterStore.lease_jobs`) locks the queued jobs it wants (in
PostgreSQL ``FOR UPDATE SKIP LOCKED``: a job another coordinator is leasing at that
moment is skipped, not waited for) and writes a lease per job that replaces only an
expired one, then the ``leased`` events: in PostgreSQL one statement for the leases
(``lease_free_jobs``) and one round trip for the events, in SQLite a read and a
``put_lease`` per job. The maintenance lock is each adapter's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpuwarden.core.model import Attempt, Event, Job
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.errors import TransitionError
from gpuwarden.store import rows
from gpuwarden.store.base import AuditRow
from gpuwarden.store.cluster import (
    Claimable,
    ClusterStore,
    Grant,
    Lease,
    NodeRecord,
    NodeState,
    RouteRecord,
    RunningUse,
)
from gpuwarden.store.rows import Row
from gpuwarden.store.sql import C
from gpuwarden.store.sql_records import SqlRecordStore


class SqlClusterStore(SqlRecordStore[C], ClusterStore):
    """The :class:`ClusterStore` contract in SQL, less the maintenance lock."""

    def _node(self, row: Row) -> NodeRecord:
        return rows.node(row, self._decode)

    # -- nodes --------------------------------------------------------------

    def upsert_node(
        self, name: str, *, token_id: str, capabilities: dict[str, Any], now: float
    ) -> NodeRecord:
        with self._write() as conn:
            row = self._returning(
                conn,
                "upsert_node",
                {
                    "name": name,
                    "token_id": token_id,
                    "capabilities": self._json(capabilities),
                    "now": now,
                },
                reread="get_node",
            )
            assert row is not None
            self._event(
                conn,
                Event(ts=now, kind="node_enrolled", detail={"node": name, "token": token_id}),
            )
            return self._node(row)

    def get_node(self, name: str) -> NodeRecord | None:
        found = self._read("get_node", name=name)
        return self._node(found[0]) if found else None

    def list_nodes(self) -> list[NodeRecord]:
        return [self._node(r) for r in self._read("list_nodes")]

    def set_node_state(
        self,
        name: str,
        state: NodeState,
        *,
        now: float,
        only_from: frozenset[NodeState] | None = None,
    ) -> bool:
        sources = self._ids(sorted(s.value for s in only_from)) if only_from is not None else None
        with self._write() as conn:
            before = self._run(conn, "lock_node", {"name": name}).fetchone()
            if before is None:
                return False
            cur = self._run(
                conn,
                "set_node_state",
                {"name": name, "state": NodeState(state).value, "sources": sources},
            )
            if cur.rowcount != 1:
                return False
            self._event(
                conn,
                Event(
                    ts=now,
                    kind="node_state",
                    detail={"node": name, "from": before["state"], "to": state.value},
                ),
            )
            return True

    def touch_node(self, name: str, report: dict[str, Any], now: float) -> NodeRecord | None:
        row = self._write_one_row(
            "touch_node", {"name": name, "report": self._json(report), "now": now}, "get_node"
        )
        return self._node(row) if row is not None else None

    # -- single statements ----------------------------------------------------

    def _write_one(self, query: str, params: dict[str, Any]) -> int:
        """A write that is one statement, committed; its row count. (A dialect
        whose connections are in autocommit runs it without BEGIN and COMMIT.)"""
        with self._write() as conn:
            return int(self._run(conn, query, params).rowcount)

    def _write_one_row(self, query: str, params: dict[str, Any], reread: str) -> Row | None:
        """A write of one row that is one statement, committed; the row written."""
        with self._write() as conn:
            return self._returning(conn, query, params, reread=reread)

    # -- leases -------------------------------------------------------------

    def lease_jobs(
        self,
        node: str,
        job_ids: Sequence[str],
        *,
        lease_id: str,
        expires_at: float,
        now: float,
    ) -> list[str]:
        if not job_ids:
            return []
        wanted = list(dict.fromkeys(job_ids))
        params = {"node": node, "lease_id": lease_id, "expires_at": expires_at, "now": now}
        with self._write() as conn:
            got = set(self._lease_rows(conn, wanted, params))
            leased = [job_id for job_id in wanted if job_id in got]
            # the events last: PostgreSQL's events lock is taken after every row lock
            self._events(
                conn,
                [
                    Event(
                        ts=now,
                        kind="leased",
                        job_id=job_id,
                        detail={"node": node, "lease": lease_id, "expires_at": expires_at},
                    )
                    for job_id in leased
                ],
            )
            return leased

    def _lease_rows(self, conn: C, wanted: list[str], params: dict[str, Any]) -> list[str]:
        """Write the leases of those of ``wanted`` that are free, in the transaction
        of ``conn``; return their ids (any order). Here: read the free ones
        (``lock_leasable_jobs``), then one ``put_lease`` each; a dialect that can
        do it in one statement overrides this."""
        free = {
            r["id"]
            for r in self._run(
                conn, "lock_leasable_jobs", {"ids": self._ids(wanted), "now": params["now"]}
            )
        }
        leased = []
        for job_id in wanted:
            if (
                job_id in free
                and self._run(conn, "put_lease", {**params, "job_id": job_id}).rowcount == 1
            ):
                leased.append(job_id)
        return leased

    def _events(self, conn: C, events: Sequence[Event]) -> None:
        """Append several events in the transaction of ``conn``, in order (a dialect
        may send them in one round trip)."""
        for event in events:
            self._event(conn, event)

    def claimable_jobs(
        self, *, now: float, limit: int = 1000, after: tuple[int, int] | None = None
    ) -> list[Claimable]:
        if after is None:
            found = self._read_planned("claimable_jobs", now=now, limit=limit)
        else:
            found = self._read_planned(
                "claimable_jobs_after",
                now=now,
                limit=limit,
                after_priority=after[0],
                after_seq=after[1],
            )
        return [rows.claimable(r, self._decode) for r in found]

    def queued_owners(self) -> list[str]:
        return [str(r["owner"]) for r in self._read("queued_owners")]

    def claimable_jobs_of(
        self, owner: str, *, now: float, limit: int = 1000, after: tuple[int, int] | None = None
    ) -> list[Claimable]:
        if after is None:
            found = self._read_planned("claimable_jobs_of_owner", owner=owner, now=now, limit=limit)
        else:
            found = self._read_planned(
                "claimable_jobs_of_owner_after",
                owner=owner,
                now=now,
                limit=limit,
                after_priority=after[0],
                after_seq=after[1],
            )
        return [rows.claimable(r, self._decode) for r in found]

    def running_attempts(self) -> list[RunningUse]:
        return [
            RunningUse(
                owner=r["owner"],
                type=r["type"],
                vram_bytes=None if r["vram_bytes"] is None else int(r["vram_bytes"]),
                started_at=float(r["started_at"]),
                gpus=None if r["gpus"] is None else int(r["gpus"]),
            )
            for r in self._read("running_attempts")
        ]

    def _read_planned(self, query: str, **params: Any) -> list[Row]:
        """A read whose best plan depends on the data as it is now (how many queued
        jobs are leased): a dialect that reuses plans plans this one at each run."""
        return self._read(query, **params)

    def live_lease_counts(self, now: float) -> dict[str, int]:
        return {r["node"]: int(r["n"]) for r in self._read("live_lease_counts", now=now)}

    def expired_leases(self, now: float) -> list[Lease]:
        return [rows.lease(r) for r in self._read("leases_expired", now=now)]

    def queued_cancel_requests(self, now: float, *, limit: int = 10_000) -> list[str]:
        found = self._read_planned("queued_cancel_requests", now=now, limit=limit)
        return [r["id"] for r in found]

    def add_audits(self, rows: Sequence[AuditRow]) -> None:
        if not rows:
            return
        with self._write() as conn:  # one transaction for the batch
            for row in rows:
                self._append(conn, "audit", self.audit_values(row))

    def jobs_by_ids(self, job_ids: Sequence[str]) -> list[Job]:
        if not job_ids:
            return []
        ids = self._ids(list(dict.fromkeys(job_ids)))
        return [self._job(r) for r in self._read("jobs_by_ids", ids=ids)]

    def renew_leases(
        self,
        node: str,
        expires_at: float,
        *,
        now: float,
        job_ids: Sequence[str] | None = None,
    ) -> int:
        if job_ids is None:
            return self._write_one(
                "renew_leases", {"node": node, "expires_at": expires_at, "now": now}
            )
        return self._write_one(
            "renew_leases_of",
            {"node": node, "expires_at": expires_at, "now": now, "ids": self._ids(list(job_ids))},
        )

    def extend_leases(self, expires_at: float) -> int:
        return self._write_one("extend_leases", {"expires_at": expires_at})

    def leases(self, node: str | None = None) -> list[Lease]:
        found = (
            self._read("leases_all") if node is None else self._read("leases_of_node", node=node)
        )
        return [rows.lease(r) for r in found]

    def lease_of(self, job_id: str) -> Lease | None:
        found = self._read("lease_of", job_id=job_id)
        return rows.lease(found[0]) if found else None

    def drop_lease(self, job_id: str, *, lease_id: str | None = None) -> bool:
        return self._write_one("drop_lease", {"job_id": job_id, "lease_id": lease_id}) == 1

    def mark_lease_started(
        self, job_id: str, attempt: int | None, *, lease_id: str | None = None
    ) -> bool:
        params = {
            "job_id": job_id,
            "lease_id": lease_id,
            "started": attempt is not None,
            "attempt": attempt,
        }
        return self._write_one("mark_lease_started", params) == 1

    def mark_lease_preempt(
        self, job_id: str, *, lease_id: str, for_job: str, now: float, expires_at: float = 0.0
    ) -> bool:
        params = {
            "job_id": job_id,
            "lease_id": lease_id,
            "for_job": for_job,
            "now": now,
            "expires_at": expires_at,
        }
        return self._write_one("mark_lease_preempt", params) == 1

    # -- where jobs were lost -------------------------------------------------

    def add_lost(self, job_id: str, node: str, *, now: float) -> None:
        self._write_one("add_lost", {"job_id": job_id, "node": node, "now": now})

    def lost_nodes(self, job_id: str) -> list[str]:
        return [r["node"] for r in self._read("lost_nodes", job_id=job_id)]

    # -- diagnostic grants ------------------------------------------------------

    @staticmethod
    def _grant(row: Row) -> Grant:
        return Grant(
            id=int(row["id"]),
            node=row["node"],
            job_id=row["job_id"],
            granted_by=row["granted_by"],
            reason=row["reason"],
            granted_at=float(row["granted_at"]),
            used_at=row["used_at"],
            attempt=row["attempt"],
            revoked_at=row["revoked_at"],
            revoked_reason=row["revoked_reason"],
        )

    def add_grant(
        self, node: str, job_id: str, *, granted_by: str | None, reason: str, now: float
    ) -> Grant | None:
        with self._write() as conn:
            self._run(conn, "lock_node", {"name": node}).fetchone()  # one grant at a time
            if self._run(conn, "open_grant_of_node", {"node": node}).fetchone() is not None:
                return None
            params = {
                "node": node,
                "job_id": job_id,
                "granted_by": granted_by,
                "reason": reason,
                "now": now,
            }
            self._run(conn, "insert_grant", params)
            row = self._run(conn, "open_grant_of_node", {"node": node}).fetchone()
            assert row is not None
            self._event(
                conn,
                Event(
                    ts=now,
                    kind="grant",
                    job_id=job_id,
                    detail={"node": node, "by": granted_by, "reason": reason},
                ),
            )
            return self._grant(row)

    def open_grant(self, node: str) -> Grant | None:
        found = self._read("open_grant_of_node", node=node)
        return self._grant(found[0]) if found else None

    def open_grants(self) -> list[Grant]:
        return [self._grant(r) for r in self._read("open_grants")]

    def grants_of_job(self, job_id: str) -> list[Grant]:
        return [self._grant(r) for r in self._read("grants_of_job", job_id=job_id)]

    def granted_used_on(self, node: str) -> set[str]:
        return {r["job_id"] for r in self._read("used_grant_jobs", node=node)}

    def start_granted(
        self, job_id: str, *, node: str, gpu_uuid: str | None, now: float
    ) -> tuple[Job, Attempt]:
        with self._write() as conn:
            job, attempt = self._start_in(conn, job_id, node=node, gpu_uuid=gpu_uuid, now=now)
            params = {"node": node, "job_id": job_id, "now": now, "attempt": attempt.number}
            if self._run(conn, "use_grant", params).rowcount != 1:
                # rolled back with the start: the grant was used or revoked meanwhile
                raise TransitionError(
                    f"job {job_id} holds no open diagnostic grant on node {node}; "
                    "it was not started"
                )
            return job, attempt

    def request_cancel(self, job_id: str, *, now: float) -> Job:
        """A cancel also revokes the job's open diagnostic grants (it never starts)."""
        job = super().request_cancel(job_id, now=now)
        self.revoke_grants(now=now, reason="the job was cancelled", job_id=job_id)
        return job

    def revoke_grants(
        self, *, now: float, reason: str, job_id: str | None = None, node: str | None = None
    ) -> int:
        if job_id is not None:
            return self._write_one(
                "revoke_grants_of_job", {"job_id": job_id, "now": now, "reason": reason}
            )
        assert node is not None
        return self._write_one("revoke_grant_of_node", {"node": node, "now": now, "reason": reason})

    # -- service routes -----------------------------------------------------------

    def put_service_routes(self, node: str, routes: Sequence[ServiceRoute], now: float) -> int:
        written = 0
        with self._write() as conn:
            for r in routes:
                params = {
                    "name": r.name,
                    "job_id": r.job_id,
                    "node": node,
                    "owner": r.owner,
                    "share": json.dumps(list(r.share)),
                    "state": r.state,
                    "upstream": r.upstream,
                    "credential": r.credential,
                    "since": r.since,
                    "last_ok": r.last_ok,
                    "now": now,
                }
                written += int(self._run(conn, "put_service_route", params).rowcount)
            names = self._ids([r.name for r in routes])
            self._run(conn, "drop_node_routes_but", {"node": node, "names": names})
        return written

    def drop_service_route(self, job_id: str) -> bool:
        return self._write_one("drop_service_route", {"job_id": job_id}) > 0

    def stop_service_route(self, job_id: str, now: float) -> bool:
        return self._write_one("stop_service_route", {"job_id": job_id, "now": now}) > 0

    def drop_stopped_routes(self, before: float) -> int:
        return self._write_one("drop_stopped_routes", {"before": before})

    def service_routes(self) -> list[RouteRecord]:
        return [rows.route(r) for r in self._read("service_routes")]
