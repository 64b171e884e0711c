"""PostgreSQL's own part of :class:`~gpuwarden.store.cluster.ClusterStore`: the
maintenance lock. The rest of the cluster store (nodes, leases, claims) is the
SQL both databases share, :mod:`gpuwarden.store.sql_cluster`.

Several coordinators share one database. The maintenance lock is a session-level
``pg_try_advisory_lock`` held on a connection of its own, outside the pool: the
coordinator holding it runs the sweeps, and when its process dies the server
ends the session and the lock passes to the next one that asks.
"""

from __future__ import annotations

import contextlib
import threading

import psycopg
from psycopg import sql
from psycopg.rows import DictRow, dict_row

from gpuwarden.store.queries import load_queries

_C = load_queries("postgres", "cluster")


class MaintenanceLock:
    """The session-level advisory lock ``key`` of the database at ``url``; tables
    in ``schema`` when it is given (only so that its connection looks like the
    store's)."""

    def __init__(self, url: str, *, schema: str | None, key: int) -> None:
        self.url = url
        self.schema = schema
        self.key = key
        self._conn: psycopg.Connection[DictRow] | None = None
        self._guard = threading.Lock()

    def try_acquire(self) -> bool:
        """Take the lock if no other session holds it; True when this one holds it
        (again)."""
        with self._guard:
            conn = self._conn
            if conn is not None:
                try:  # held already, as long as the session lives
                    conn.execute("SELECT 1")
                    return True
                except psycopg.Error:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                    self._conn = None
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
                row = conn.execute(_C["try_lock"], {"key": self.key}).fetchone()
            except psycopg.Error:
                conn.close()
                return False
            if row is None or not row["got"]:
                conn.close()
                return False
            self._conn = conn
            return True

    def release(self) -> None:
        """Let the lock go, and its session; harmless when it is not held."""
        with self._guard:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            with contextlib.suppress(psycopg.Error):
                conn.execute(_C["unlock"], {"key": self.key})
            with contextlib.suppress(psycopg.Error):
                conn.close()
