"""A job spec's fingerprint, and turning a row into a value, for both SQL
dialects. A row is anything indexable by column name (``sqlite3.Row``, a psycopg
``dict_row``); ``decode`` turns a JSON column into Python values: SQLite keeps
JSON as text (``json.loads``), PostgreSQL's JSONB arrives decoded."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from gpuwarden.core.command import CommandSpec
from gpuwarden.core.model import Attempt, Event, Job, JobSpec, Role
from gpuwarden.core.ramadmit import RamNeed
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.core.sources import JobSource
from gpuwarden.core.states import JobState
from gpuwarden.store.base import (
    AuditRow,
    BundleRecord,
    GpuFault,
    IdempotencyRecord,
    MeasuredFootprint,
    NodeStatus,
    TokenRecord,
    TypeProfile,
)
from gpuwarden.store.cluster import Claimable, Lease, NodeRecord, NodeState, RouteRecord

Row = Any  # sqlite3.Row or psycopg's DictRow: both index by column name
Decode = Callable[[Any], Any]


def spec_hash(spec: JobSpec) -> str:
    """A stable fingerprint of what a job asks for (to tell a resubmission from a clash)."""
    body = json.dumps(
        {
            "type": spec.type,
            "params": spec.params,
            "inputs": list(spec.inputs),
            "outputs": list(spec.outputs),
            "priority": spec.priority,
            "vram_bytes": spec.vram_bytes,
            # only when given: the fingerprints of jobs without constraints are unchanged
            **({"constraints": spec.constraints} if spec.constraints else {}),
            **({"after": list(spec.after)} if spec.after else {}),
            **({"est_s": spec.est_s} if spec.est_s is not None else {}),
            **({"gpus": spec.gpus} if spec.gpus is not None else {}),
            **spec.ram.to_json(),
            **({"service": spec.service} if spec.service is not None else {}),
            **({"share": list(spec.share)} if spec.share else {}),
            **({"source": spec.source.to_json()} if spec.source is not None else {}),
            **({"command": spec.command.to_json()} if spec.command is not None else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()


def job(row: Row, decode: Decode) -> Job:
    return Job(
        id=row["id"],
        type=row["type"],
        state=JobState(row["state"]),
        priority=row["priority"],
        params=decode(row["params"]),
        inputs=tuple(decode(row["inputs"])),
        outputs=tuple(decode(row["outputs"])),
        vram_bytes=row["vram_bytes"],
        submitted_at=row["submitted_at"],
        updated_at=row["updated_at"],
        seq=row["seq"],
        attempts=row["attempts"],
        reason=row["reason"],
        exit_code=row["exit_code"],
        bundle=row["bundle"],
        queue_root=row["queue_root"],
        input_dir=row["input_dir"],
        cancel_requested=bool(row["cancel_requested"]),
        result=decode(row["result"]),
        owner=row["owner"],
        constraints=decode(row["constraints"]),
        after=tuple(decode(row["depends_on"])),
        held=bool(row["held"]),
        est_s=row["est_s"],
        gpus=row["gpus"],
        ram=ram_need(row),
        service=row["service"],
        share=tuple(json.loads(row["share"] or "[]")),
        stop_requested_by=row["stop_requested_by"],
        source=(
            JobSource(row["source_repo"], row["source_commit"])
            if row["source_commit"] is not None
            else None
        ),
        command=command(row, decode),
        hold_by=row["hold_by"],
        requeued_after=row["requeued_after"],
    )


def command(row: Row, decode: Decode) -> CommandSpec | None:
    """A command job's command (migration 0019; None: a job of a module's type)."""
    body = row["command"]
    return None if body is None else CommandSpec.from_json(decode(body))


def source_detail(job: Job) -> dict[str, str]:
    """What every attempt event of a job from a commit says of its source."""
    if job.source is None:
        return {}
    return {"source_repo": job.source.repo, "source_commit": job.source.commit}


def ram_need(row: Row) -> RamNeed:
    """A job row's RAM keys (migration 0015), in bytes."""
    return RamNeed(
        int(row["ram_cap_bytes"]), int(row["ram_floor_bytes"]), int(row["ram_start_min_bytes"])
    )


def type_profile(row: Row) -> TypeProfile:
    return TypeProfile(
        type=row["type"],
        ram_peak_bytes=int(row["ram_peak_bytes"]),
        job_id=row["job_id"],
        updated_at=row["updated_at"],
    )


def token(row: Row) -> TokenRecord:
    return TokenRecord(
        id=row["id"],
        name=row["name"],
        role=Role(row["role"]),
        secret_hash=row["secret_hash"],
        created_at=row["created_at"],
        created_by=row["created_by"],
        expires_at=row["expires_at"],
        revoked_at=row["revoked_at"],
        node=row["node"],
        replace=bool(row["replace_node"]),
    )


def attempt(row: Row) -> Attempt:
    return Attempt(
        job_id=row["job_id"],
        number=row["number"],
        node=row["node"],
        gpu_uuid=row["gpu_uuid"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        exit_code=row["exit_code"],
        outcome=row["outcome"],
        reason=row["reason"],
        stdout=row["stdout"],
        stderr=row["stderr"],
        pid=row["pid"],
        ram_peak_bytes=row["ram_peak_bytes"],
    )


def bundle(row: Row, decode: Decode) -> BundleRecord:
    return BundleRecord(
        queue_root=row["queue_root"],
        name=row["name"],
        job_ids=tuple(decode(row["job_ids"])),
        received_at=row["received_at"],
        finished_at=row["finished_at"],
        outcome=row["outcome"],
        result_path=row["result_path"],
    )


def node(row: Row, decode: Decode) -> NodeRecord:
    return NodeRecord(
        name=row["name"],
        token_id=row["token_id"],
        state=NodeState(row["state"]),
        capabilities=decode(row["capabilities"]),
        report=decode(row["report"]),
        enrolled_at=row["enrolled_at"],
        last_seen=row["last_seen"],
    )


def lease(row: Row) -> Lease:
    return Lease(
        job_id=row["job_id"],
        node=row["node"],
        lease_id=row["lease_id"],
        expires_at=row["expires_at"],
        leased_at=row["leased_at"],
        started=bool(row["started"]),
        attempt=row["attempt"],
        preempt_for=row["preempt_for"],
    )


def route(row: Row) -> RouteRecord:
    return RouteRecord(
        route=ServiceRoute(
            name=row["name"],
            job_id=row["job_id"],
            owner=row["owner"],
            share=tuple(str(x) for x in json.loads(row["share"] or "[]")),
            state=row["state"],
            upstream=row["upstream"],
            credential=row["credential"],
            since=float(row["since"]),
            last_ok=None if row["last_ok"] is None else float(row["last_ok"]),
        ),
        node=row["node"],
        updated_at=float(row["updated_at"]),
    )


def event(row: Row, decode: Decode) -> Event:
    return Event(
        id=int(row["id"]),
        ts=row["ts"],
        kind=row["kind"],
        job_id=row["job_id"],
        from_state=row["from_state"],
        to_state=row["to_state"],
        detail=decode(row["detail"]),
    )


def audit(row: Row, decode: Decode) -> AuditRow:
    return AuditRow(
        id=int(row["id"]),
        ts=row["ts"],
        actor=row["actor"],
        actor_name=row["actor_name"],
        role=row["role"],
        action=row["action"],
        target=row["target"],
        outcome=row["outcome"],
        detail=decode(row["detail"]),
    )


def idempotency(row: Row, decode: Decode) -> IdempotencyRecord:
    return IdempotencyRecord(
        token_id=row["token_id"],
        key=row["key"],
        body_hash=row["body_hash"],
        job_ids=tuple(decode(row["job_ids"])),
        created_at=row["created_at"],
    )


def footprint(row: Row) -> MeasuredFootprint:
    return MeasuredFootprint(
        type=row["type"], bytes=row["bytes"], job_id=row["job_id"], updated_at=row["updated_at"]
    )


def node_status(row: Row, decode: Decode) -> NodeStatus:
    return NodeStatus(
        node=row["node"],
        pid=row["pid"],
        updated_at=row["updated_at"],
        payload=decode(row["payload"]),
    )


def claimable(row: Row, decode: Decode) -> Claimable:
    return Claimable(
        id=row["id"],
        type=row["type"],
        priority=row["priority"],
        seq=row["seq"],
        submitted_at=row["submitted_at"],
        vram_bytes=row["vram_bytes"],
        attempts=row["attempts"],
        constraints=dict(decode(row["constraints"])),
        input_dir=row["input_dir"],
        gpus=row["gpus"],
        owner=row["owner"],
        source=(
            JobSource(row["source_repo"], row["source_commit"])
            if row["source_commit"] is not None
            else None
        ),
    )


def gpu_fault(row: Row) -> GpuFault:
    return GpuFault(
        node=row["node"],
        gpu_uuid=row["gpu_uuid"],
        xid=int(row["xid"]),
        reason=row["reason"],
        latched_at=float(row["latched_at"]),
        cleared_at=None if row["cleared_at"] is None else float(row["cleared_at"]),
        cleared_by=row["cleared_by"],
        clear_reason=row["clear_reason"],
        id=int(row["id"]),
    )
