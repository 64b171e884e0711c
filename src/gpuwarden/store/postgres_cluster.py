"""PostgreSQL part of :class:`~gpuwarden.store.cluster.ClusterStore`, mixed into
:class:`~gpuwarden.store.postgres.PostgresStore`.

Several coordinators share one database. A claim locks the queued jobs it wants
with ``FOR UPDATE SKIP LOCKED`` (a job another coordinator is leasing at that
moment is skipped, not waited for), then writes a lease per job that replaces
only an expired one. The maintenance lock is a session-level
``pg_try_advisory_lock`` held on a connection of its own, outside the pool: the
coordinator holding it runs the sweeps, and when its process dies the server
ends the session and the lock passes to the next one that asks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.rows import DictRow, dict_row

from gpuwarden.core.model import Event
from gpuwarden.store import rows
from gpuwarden.store.cluster import Claimable, ClusterStore, Lease, NodeRecord, NodeState
from gpuwarden.store.queries import load_queries

if TYPE_CHECKING:
    from psycopg.types.json import Jsonb
    from psycopg_pool import ConnectionPool

_C = load_queries("postgres", "cluster")

Conn = psycopg.Connection[DictRow]


def _jsonb(value: Any) -> Jsonb:
    from gpuwarden.store.postgres import _jsonb as to_jsonb  # imported by then

    return to_jsonb(value)


class PostgresCluster(ClusterStore):
    if TYPE_CHECKING:  # provided by PostgresStore
        url: str
        schema: str | None
        _pool: ConnectionPool[Conn]

        def _write(self) -> contextlib.AbstractContextManager[Conn]: ...

        def _event(self, conn: Conn, event: Event) -> Event: ...

        def _current_schema(self) -> str: ...

    _maint_conn: psycopg.Connection[DictRow] | None = None
    _maint_guard: threading.Lock | None = None

    def _cread(self, query: str, **params: Any) -> list[DictRow]:
        with self._pool.connection() as conn:
            return conn.execute(_C[query], params).fetchall()

    # -- nodes --------------------------------------------------------------

    def upsert_node(
        self, name: str, *, token_id: str, capabilities: dict[str, Any], now: float
    ) -> NodeRecord:
        with self._write() as conn:
            row = conn.execute(
                _C["upsert_node"],
                {
                    "name": name,
                    "token_id": token_id,
                    "capabilities": _jsonb(capabilities),
                    "now": now,
                },
            ).fetchone()
            assert row is not None
            self._event(
                conn,
                Event(ts=now, kind="node_enrolled", detail={"node": name, "token": token_id}),
            )
            return _node(row)

    def get_node(self, name: str) -> NodeRecord | None:
        rows = self._cread("get_node", name=name)
        return _node(rows[0]) if rows else None

    def list_nodes(self) -> list[NodeRecord]:
        return [_node(r) for r in self._cread("list_nodes")]

    def set_node_state(
        self,
        name: str,
        state: NodeState,
        *,
        now: float,
        only_from: frozenset[NodeState] | None = None,
    ) -> bool:
        sources = sorted(s.value for s in only_from) if only_from is not None else None
        with self._write() as conn:
            before = conn.execute(
                "SELECT state FROM nodes WHERE name = %(name)s FOR UPDATE", {"name": name}
            ).fetchone()
            if before is None:
                return False
            cur = conn.execute(
                _C["set_node_state"],
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
        with self._write() as conn:
            row = conn.execute(
                _C["touch_node"], {"name": name, "report": _jsonb(report), "now": now}
            ).fetchone()
            return _node(row) if row is not None else None

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
        with self._write() as conn:
            locked = {
                r["id"] for r in conn.execute(_C["lock_leasable_jobs"], {"ids": wanted, "now": now})
            }
            leased: list[str] = []
            for job_id in wanted:
                if job_id not in locked:
                    continue
                cur = conn.execute(
                    _C["put_lease"],
                    {
                        "job_id": job_id,
                        "node": node,
                        "lease_id": lease_id,
                        "expires_at": expires_at,
                        "now": now,
                    },
                )
                if cur.rowcount == 1:
                    leased.append(job_id)
            # the events last: the events lock is taken after every row lock
            for job_id in leased:
                self._event(
                    conn,
                    Event(
                        ts=now,
                        kind="leased",
                        job_id=job_id,
                        detail={"node": node, "lease": lease_id, "expires_at": expires_at},
                    ),
                )
            return leased

    def claimable_jobs(self, *, now: float, limit: int = 1000) -> list[Claimable]:
        return [
            Claimable(
                id=r["id"],
                type=r["type"],
                priority=r["priority"],
                seq=r["seq"],
                submitted_at=r["submitted_at"],
                vram_bytes=r["vram_bytes"],
                attempts=r["attempts"],
                constraints=dict(r["constraints"]),
                input_dir=r["input_dir"],
            )
            for r in self._cread("claimable_jobs", now=now, limit=limit)
        ]

    def renew_leases(
        self,
        node: str,
        expires_at: float,
        *,
        now: float,
        job_ids: Sequence[str] | None = None,
    ) -> int:
        with self._write() as conn:
            if job_ids is None:
                cur = conn.execute(
                    _C["renew_leases"], {"node": node, "expires_at": expires_at, "now": now}
                )
            else:
                cur = conn.execute(
                    _C["renew_leases_of"],
                    {"node": node, "expires_at": expires_at, "now": now, "ids": list(job_ids)},
                )
            return int(cur.rowcount)

    def leases(self, node: str | None = None) -> list[Lease]:
        rows = (
            self._cread("leases_all") if node is None else self._cread("leases_of_node", node=node)
        )
        return [_lease(r) for r in rows]

    def lease_of(self, job_id: str) -> Lease | None:
        rows = self._cread("lease_of", job_id=job_id)
        return _lease(rows[0]) if rows else None

    def drop_lease(self, job_id: str, *, lease_id: str | None = None) -> bool:
        with self._write() as conn:
            cur = conn.execute(_C["drop_lease"], {"job_id": job_id, "lease_id": lease_id})
            return cur.rowcount == 1

    def mark_lease_started(
        self, job_id: str, attempt: int | None, *, lease_id: str | None = None
    ) -> bool:
        with self._write() as conn:
            cur = conn.execute(
                _C["mark_lease_started"],
                {
                    "job_id": job_id,
                    "lease_id": lease_id,
                    "started": attempt is not None,
                    "attempt": attempt,
                },
            )
            return cur.rowcount == 1

    # -- where jobs were lost -------------------------------------------------

    def add_lost(self, job_id: str, node: str, *, now: float) -> None:
        with self._write() as conn:
            conn.execute(_C["add_lost"], {"job_id": job_id, "node": node, "now": now})

    def lost_nodes(self, job_id: str) -> list[str]:
        return [r["node"] for r in self._cread("lost_nodes", job_id=job_id)]

    # -- maintenance --------------------------------------------------------

    def _maintenance_key(self) -> int:
        from gpuwarden.store.postgres import _lock_key

        return _lock_key(f"gpuwarden.maintenance:{self.schema or self._current_schema()}")

    def try_maintenance_lock(self) -> bool:
        if self._maint_guard is None:
            self._maint_guard = threading.Lock()
        with self._maint_guard:
            conn = self._maint_conn
            if conn is not None:
                try:  # held already, as long as the session lives
                    conn.execute("SELECT 1")
                    return True
                except psycopg.Error:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                    self._maint_conn = None
            key = self._maintenance_key()
            try:
                conn = psycopg.connect(
                    self.url, autocommit=True, row_factory=dict_row, connect_timeout=10
                )
            except psycopg.Error:
                return False
            try:
                if self.schema is not None:
                    conn.execute(
                        sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema))
                    )
                row = conn.execute(_C["try_lock"], {"key": key}).fetchone()
            except psycopg.Error:
                conn.close()
                return False
            if row is None or not row["got"]:
                conn.close()
                return False
            self._maint_conn = conn
            return True

    def release_maintenance_lock(self) -> None:
        if self._maint_guard is None:
            return
        with self._maint_guard:
            conn, self._maint_conn = self._maint_conn, None
            if conn is None:
                return
            with contextlib.suppress(psycopg.Error):
                conn.execute(_C["unlock"], {"key": self._maintenance_key()})
            with contextlib.suppress(psycopg.Error):
                conn.close()


_node = functools.partial(rows.node, decode=rows.as_is)
_lease = rows.lease
