"""The store's records besides jobs, in SQL, for SQLite and PostgreSQL alike:
measured footprints, operator requests (GPU clears), latched GPU faults, API tokens, the audit log
and node statuses, on the hooks of :class:`~gpuwarden.store.sql.SqlStore`.

Taking GPU clears is a claim: ``pending_gpu_clears`` locks the requests it reads
with ``FOR UPDATE SKIP LOCKED`` in PostgreSQL, so two brokers taking them at once
each take a request at most once between them, and neither waits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpuwarden.core.fairshare import decayed
from gpuwarden.core.model import Event, Role
from gpuwarden.store import rows
from gpuwarden.store.base import (
    AttemptSpan,
    AuditRow,
    GpuClear,
    GpuFault,
    MeasuredFootprint,
    NodeStatus,
    TokenRecord,
    TypeProfile,
)
from gpuwarden.store.sql import C, SqlStore, duplicate_token

#: how often an invite is tried when another invite of its node was made at once
_INVITE_TRIES = 3


class SqlRecordStore(SqlStore[C]):
    """:class:`SqlStore` with the records besides jobs."""

    # -- footprints -----------------------------------------------------------

    def footprints(self) -> dict[str, MeasuredFootprint]:
        return {r["type"]: rows.footprint(r) for r in self._read("footprints")}

    def recent_run_times(self, *, limit: int = 5000) -> list[tuple[str, float]]:
        return [
            (r["type"], float(r["seconds"])) for r in self._read("recent_run_times", limit=limit)
        ]

    def type_profiles(self) -> dict[str, TypeProfile]:
        return {r["type"]: rows.type_profile(r) for r in self._read("type_profiles")}

    def record_ram_peak(
        self, job_id: str, number: int, type_name: str, nbytes: int, *, now: float
    ) -> None:
        with self._write() as conn:
            self._run(
                conn,
                "set_attempt_ram_peak",
                {"job_id": job_id, "number": number, "bytes": nbytes},
            )
            self._run(
                conn,
                "raise_ram_peak",
                {"type": type_name, "bytes": nbytes, "job_id": job_id, "now": now},
            )

    def attempt_spans(self, *, since: float, limit: int = 50_000) -> list[AttemptSpan]:
        return [
            AttemptSpan(
                job_id=r["job_id"],
                number=int(r["number"]),
                type=r["type"],
                owner=r["owner"],
                gpu_uuid=r["gpu_uuid"],
                submitted_at=float(r["submitted_at"]),
                started_at=float(r["started_at"]),
                ended_at=None if r["ended_at"] is None else float(r["ended_at"]),
                outcome=r["outcome"],
            )
            for r in self._read("attempt_spans", since=since, limit=limit)
        ]

    def fair_share(self) -> list[tuple[str, float, float]]:
        return [
            (str(r["owner"]), float(r["gib_h"]), float(r["as_of"]))
            for r in self._read("fair_share")
        ]

    def owner_counts(self) -> dict[str | None, tuple[int, int]]:
        out: dict[str | None, tuple[int, int]] = {}
        for r in self._read("owner_counts"):
            queued, running = out.get(r["owner"], (0, 0))
            if r["state"] == "queued":
                queued = int(r["n"])
            else:
                running = int(r["n"])
            out[r["owner"]] = (queued, running)
        return out

    def add_fair_share(
        self, owner: str | None, gib_h: float, *, now: float, half_life_s: float
    ) -> None:
        key = owner or ""
        with self._write() as conn:
            row = self._run(conn, "lock_fair_share", {"owner": key}).fetchone()
            value, as_of = gib_h, now
            if row is not None:
                old, old_as_of = float(row["gib_h"]), float(row["as_of"])
                if now >= old_as_of:
                    value = decayed(old, old_as_of, now, half_life_s) + gib_h
                else:  # an end older than the last one counted
                    value, as_of = old + decayed(gib_h, now, old_as_of, half_life_s), old_as_of
            self._run(conn, "put_fair_share", {"owner": key, "gib_h": value, "as_of": as_of})

    def raise_footprint(self, type_name: str, nbytes: int, *, now: float, job_id: str) -> bool:
        with self._write() as conn:
            row = self._run(conn, "lock_footprint", {"type": type_name}).fetchone()
            old = int(row["bytes"]) if row else None
            cur = self._run(
                conn,
                "raise_footprint",
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

    def request_gpu_clear(
        self, gpu_uuid: str, *, now: float, by: str = "", reason: str = ""
    ) -> None:
        with self._write() as conn:
            self._run(
                conn,
                "request_gpu_clear",
                {"gpu_uuid": gpu_uuid, "now": now, "by": by, "reason": reason},
            )
            detail = {"gpu": gpu_uuid, "by": by, "reason": reason}
            self._event(conn, Event(ts=now, kind="gpu_clear_requested", detail=detail))

    def take_gpu_clears(self, *, now: float) -> list[GpuClear]:
        with self._write() as conn:
            taken = []
            for row in self._run(conn, "pending_gpu_clears", {}).fetchall():
                if self._run(conn, "take_gpu_clear", {"id": row["id"], "now": now}).rowcount:
                    taken.append(GpuClear(row["gpu_uuid"], row["requested_by"], row["reason"]))
            return taken

    # -- latched GPU faults -----------------------------------------------------

    def latch_gpu_fault(
        self, *, node: str, gpu_uuid: str, xid: int, reason: str, now: float
    ) -> bool:
        params = {"node": node, "gpu_uuid": gpu_uuid, "xid": xid, "reason": reason, "now": now}
        with self._write() as conn:
            return bool(self._run(conn, "latch_gpu_fault", params).rowcount)

    def clear_gpu_fault(
        self, *, node: str, gpu_uuid: str, now: float, by: str, reason: str
    ) -> bool:
        params = {"node": node, "gpu_uuid": gpu_uuid, "now": now, "by": by, "reason": reason}
        with self._write() as conn:
            return bool(self._run(conn, "clear_gpu_fault", params).rowcount)

    def gpu_faults(
        self, *, node: str | None = None, gpu_uuid: str | None = None, open_only: bool = False
    ) -> list[GpuFault]:
        found = self._read("gpu_faults", node=node, gpu_uuid=gpu_uuid, open_only=int(open_only))
        return [rows.gpu_fault(r) for r in found]

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
        replace: bool = False,
    ) -> TokenRecord:
        invite = Role(role) is Role.ENROLL and node is not None
        for tries_left in range(_INVITE_TRIES - 1, -1, -1):
            try:
                with self._write() as conn:
                    if self._run(conn, "get_token", {"id": token_id}).fetchone() is not None:
                        raise duplicate_token(token_id)
                    if invite:  # one live invite a node: the new one stands
                        self._run(conn, "lock_invites", {"node": node})
                        self._run(conn, "revoke_invites", {"node": node, "now": now})
                    row = self._returning(
                        conn,
                        "insert_token",
                        {
                            "id": token_id,
                            "name": name,
                            "role": Role(role).value,
                            "secret_hash": secret_hash,
                            "now": now,
                            "created_by": created_by,
                            "expires_at": expires_at,
                            "node": node,
                            "replace_node": bool(replace),
                        },
                        reread="get_token",
                    )
                    assert row is not None
                    return rows.token(row)
            except self.unique_violation:
                # created by another writer since the check: this id, or an invite
                # of the same node that committed first (lock_invites keeps them
                # apart; the unique index tokens_one_live_invite is the last guard):
                # tried again, this one revokes it and stands
                if not invite or tries_left == 0:
                    raise duplicate_token(token_id) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def get_token(self, token_id: str) -> TokenRecord | None:
        found = self._read("get_token", id=token_id)
        return rows.token(found[0]) if found else None

    def list_tokens(self) -> list[TokenRecord]:
        return [rows.token(r) for r in self._read("list_tokens")]

    def revoke_token(self, token_id: str, *, now: float) -> bool:
        with self._write() as conn:
            return self._run(conn, "revoke_token", {"id": token_id, "now": now}).rowcount == 1

    # -- audit --------------------------------------------------------------

    def audit_values(self, row: AuditRow) -> dict[str, Any]:
        """An audit row as the ``audit`` insert takes it."""
        return {
            "ts": row.ts,
            "actor": self._text(row.actor),
            "actor_name": self._text(row.actor_name),
            "role": self._text(row.role),
            "action": self._text(row.action),
            "target": self._text(row.target),
            "outcome": self._text(row.outcome),
            "detail": self._json(row.detail),
        }

    def add_audit(self, row: AuditRow) -> AuditRow:
        with self._write() as conn:
            new_id = self._append(conn, "audit", self.audit_values(row))
            return dataclasses.replace(row, detail=dict(row.detail), id=new_id)

    def audit_rows(self, *, after_id: int = 0, limit: int = 1000) -> list[AuditRow]:
        found = self._read("audit_rows", after_id=after_id, limit=limit)
        return [rows.audit(r, self._decode) for r in found]

    # -- node status --------------------------------------------------------

    def put_node_status(self, status: NodeStatus) -> None:
        with self._write() as conn:
            self._run(
                conn,
                "put_node_status",
                {
                    "node": status.node,
                    "pid": status.pid,
                    "updated_at": status.updated_at,
                    "payload": self._json(status.payload),
                },
            )

    def node_statuses(self) -> list[NodeStatus]:
        return [rows.node_status(r, self._decode) for r in self._read("node_statuses")]
