"""SQLite part of :class:`~gpuwarden.store.cluster.ClusterStore`, mixed into
:class:`~gpuwarden.store.sqlite.SqliteStore`: nodes, leases and lost jobs for a
coordinator on one host. Writers hold SQLite's one write lock (``BEGIN
IMMEDIATE``), so a lease is taken atomically; the maintenance lock is always
this process's (one coordinator per SQLite file)."""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpuwarden.core.model import Event
from gpuwarden.store import rows
from gpuwarden.store.cluster import Claimable, ClusterStore, Lease, NodeRecord, NodeState
from gpuwarden.store.queries import load_queries

_C = load_queries("sqlite", "cluster")


class SqliteCluster(ClusterStore):
    if TYPE_CHECKING:  # provided by SqliteStore
        _lock: threading.RLock
        _db: sqlite3.Connection

        def _write(self) -> contextlib.AbstractContextManager[sqlite3.Connection]: ...

        @staticmethod
        def _event(db: sqlite3.Connection, event: Event) -> Event: ...

    def _cread(self, query: str, **params: Any) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(_C[query], params).fetchall()

    # -- nodes --------------------------------------------------------------

    def upsert_node(
        self, name: str, *, token_id: str, capabilities: dict[str, Any], now: float
    ) -> NodeRecord:
        with self._write() as db:
            db.execute(
                _C["upsert_node"],
                {
                    "name": name,
                    "token_id": token_id,
                    "capabilities": json.dumps(capabilities, sort_keys=True),
                    "now": now,
                },
            )
            self._event(
                db, Event(ts=now, kind="node_enrolled", detail={"node": name, "token": token_id})
            )
            return _node(db.execute(_C["get_node"], {"name": name}).fetchone())

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
        sources = json.dumps(sorted(s.value for s in only_from)) if only_from is not None else None
        with self._write() as db:
            before = db.execute(_C["get_node"], {"name": name}).fetchone()
            cur = db.execute(
                _C["set_node_state"],
                {"name": name, "state": NodeState(state).value, "sources": sources},
            )
            if cur.rowcount != 1:
                return False
            self._event(
                db,
                Event(
                    ts=now,
                    kind="node_state",
                    detail={"node": name, "from": before["state"], "to": state.value},
                ),
            )
            return True

    def touch_node(self, name: str, report: dict[str, Any], now: float) -> NodeRecord | None:
        with self._write() as db:
            cur = db.execute(
                _C["touch_node"],
                {"name": name, "report": json.dumps(report, sort_keys=True), "now": now},
            )
            if cur.rowcount != 1:
                return None
            return _node(db.execute(_C["get_node"], {"name": name}).fetchone())

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
        with self._write() as db:
            free = {
                r[0]
                for r in db.execute(
                    _C["leasable_jobs"], {"ids": json.dumps(list(job_ids)), "now": now}
                )
            }
            leased = [i for i in dict.fromkeys(job_ids) if i in free]
            for job_id in leased:
                db.execute(
                    _C["put_lease"],
                    {
                        "job_id": job_id,
                        "node": node,
                        "lease_id": lease_id,
                        "expires_at": expires_at,
                        "now": now,
                    },
                )
                self._event(
                    db,
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
                constraints=json.loads(r["constraints"]),
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
        with self._write() as db:
            if job_ids is None:
                cur = db.execute(
                    _C["renew_leases"], {"node": node, "expires_at": expires_at, "now": now}
                )
            else:
                cur = db.execute(
                    _C["renew_leases_of"],
                    {
                        "node": node,
                        "expires_at": expires_at,
                        "now": now,
                        "ids": json.dumps(list(job_ids)),
                    },
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
        with self._write() as db:
            cur = db.execute(_C["drop_lease"], {"job_id": job_id, "lease_id": lease_id})
            return cur.rowcount == 1

    def mark_lease_started(
        self, job_id: str, attempt: int | None, *, lease_id: str | None = None
    ) -> bool:
        with self._write() as db:
            cur = db.execute(
                _C["mark_lease_started"],
                {
                    "job_id": job_id,
                    "lease_id": lease_id,
                    "started": 1 if attempt is not None else 0,
                    "attempt": attempt,
                },
            )
            return cur.rowcount == 1

    # -- where jobs were lost -------------------------------------------------

    def add_lost(self, job_id: str, node: str, *, now: float) -> None:
        with self._write() as db:
            db.execute(_C["add_lost"], {"job_id": job_id, "node": node, "now": now})

    def lost_nodes(self, job_id: str) -> list[str]:
        return [r["node"] for r in self._cread("lost_nodes", job_id=job_id)]

    # -- maintenance --------------------------------------------------------

    def try_maintenance_lock(self) -> bool:
        return True

    def release_maintenance_lock(self) -> None:
        return None


_node = functools.partial(rows.node, decode=json.loads)
_lease = rows.lease
