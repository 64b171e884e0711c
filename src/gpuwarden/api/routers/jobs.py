"""Clients' jobs: submit, list, read, cancel, explain, result, outputs.

A submitter sees only the jobs its own token submitted: another's job is a 404,
as if it did not exist. Operators and owners see every job."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse

from gpuwarden import explain
from gpuwarden.api.auth import Principal, Scope
from gpuwarden.api.context import (
    ApiContext,
    action,
    audit_ok,
    get_ctx,
    get_principal,
    get_scope,
    set_target,
)
from gpuwarden.api.errors import ApiError
from gpuwarden.api.models import ErrorOut, Explanation, JobDetail, JobIn, JobOut
from gpuwarden.broker import result_json
from gpuwarden.cluster import coordinator
from gpuwarden.core import policy
from gpuwarden.core.model import GIB, Job, JobSpec, JobType, Lane, ParamType
from gpuwarden.core.states import JobState
from gpuwarden.errors import ValidationError
from gpuwarden.intake.jobs import JOB_ID, new_job_id, prepare, safe_relpath
from gpuwarden.store.base import Submission
from gpuwarden.store.cluster import ClusterStore

# defence in depth: a route the gate did not grant a scope to is refused (403)
router = APIRouter(tags=["jobs"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]
Access = Annotated[Scope, Depends(get_scope)]

#: an Idempotency-Key: 1 to 255 visible ASCII characters
_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 413, 422, 429)
}


def visible_job(ctx: ApiContext, who: Principal, access: Scope, job_id: str) -> Job:
    """The job, if this principal may see it; else 404 (also for another's job)."""
    job = ctx.store.get_job(job_id) if JOB_ID.fullmatch(job_id) else None
    if job is None or (access is Scope.OWN and job.owner != who.token_id):
        raise ApiError(404, f"no job with id {job_id!r} (GET /v1/jobs lists yours)")
    return job


@router.post("/v1/jobs", status_code=201, response_model=JobOut, responses=_ERRORS)
@action("job.submit")
def submit_job(
    body: JobIn,
    *,
    request: Request,
    response: Response,
    ctx: Ctx,
    who: Who,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="retry-safe submission: the same key and body return the same job",
        ),
    ] = None,
) -> JobOut:
    """Submit a job. It is checked like a bundle's job (type, parameters, this
    node's launch rules, a VRAM footprint no GPU can ever hold) before it is stored."""
    if body.id is not None:
        set_target(request, body.id)
    if idempotency_key is not None and not _KEY.fullmatch(idempotency_key):
        raise ApiError(422, "the Idempotency-Key header must be 1 to 255 visible ASCII characters")
    jobtype = ctx.registry.get(body.type)
    _refuse_file_inputs(jobtype, body)
    vram = math.ceil(body.vram_gib * GIB) if body.vram_gib is not None else None
    spec = prepare(
        ctx.registry,
        JobSpec(
            id=body.id or new_job_id(jobtype.name),
            type=jobtype.name,
            params=dict(body.params),
            outputs=tuple(body.outputs),
            priority=body.priority,
            vram_bytes=vram,
            constraints=dict(body.constraints),
        ),
    )
    set_target(request, spec.id)
    _refuse_if_it_never_fits(ctx, spec, jobtype)
    _refuse_if_no_node_ever_could(ctx, spec)
    idempotency = None
    replay = False
    if idempotency_key is not None:
        canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True)
        body_hash = hashlib.sha256(canonical.encode()).hexdigest()
        idempotency = (who.token_id, idempotency_key, body_hash)
        replay = ctx.store.idempotency_record(who.token_id, idempotency_key) is not None
    [job] = ctx.store.submit(
        [spec],
        now=ctx.clock(),
        origin=Submission(owner=who.token_id),
        idempotency=idempotency,
    )
    detail: dict[str, Any] = {"type": job.type}
    if idempotency_key is not None:
        detail["idempotency_key"] = idempotency_key
        detail["replay"] = replay
    audit_ok(request, detail, target=job.id, status=200 if replay else 201)
    if replay:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return JobOut.of(job)


def _refuse_file_inputs(jobtype: JobType, body: JobIn) -> None:
    inputs = [p for p in jobtype.params if p.type is ParamType.INPUT]
    if any(p.name in body.params or p.required for p in inputs):
        raise ValidationError(
            f"{jobtype.name} takes input files ({', '.join(p.name for p in inputs)}), and "
            "file inputs are not accepted over HTTP yet: submit it as a bundle "
            "(`gpuwarden submit --queue DIR --input FILE`)"
        )


def _refuse_if_it_never_fits(ctx: ApiContext, spec: JobSpec, jobtype: JobType) -> None:
    """Against the GPUs every live node last published (no check when none runs)."""
    if jobtype.lane is not Lane.VRAM:
        return
    now = ctx.clock()
    gpus = [
        policy.GpuView.from_json(g)
        for s in ctx.store.node_statuses()
        if not s.payload.get("stopped") and now - s.updated_at <= explain.FRESH_S
        for g in s.payload.get("gpus", [])
        if "holdings" in g
    ]
    need = explain.effective_footprint(jobtype, spec.vram_bytes, ctx.store)
    if (why := policy.never_fits(need, gpus)) is not None:
        raise ValidationError(f"job {spec.id} ({spec.type}) {why}")


def _refuse_if_no_node_ever_could(ctx: ApiContext, spec: JobSpec) -> None:
    """Against the enrolled nodes (active or draining), by their last reports and
    the job's constraints; with no node enrolled the job is taken (it waits)."""
    if not isinstance(ctx.store, ClusterStore):
        return
    if (
        why := coordinator.submission_refusal(ctx.store, ctx.registry, spec, ctx.clock())
    ) is not None:
        raise ValidationError(f"job {spec.id} ({spec.type}): {why}")


@router.get("/v1/jobs", response_model=list[JobOut], responses=_ERRORS)
@action("job.list")
def list_jobs(
    ctx: Ctx,
    who: Who,
    access: Access,
    state: Annotated[list[JobState] | None, Query(description="repeatable")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> list[JobOut]:
    """Jobs, newest first: a submitter's own, or every job for operators and owners."""
    jobs = ctx.store.list_jobs(
        states=frozenset(state) if state else None,
        limit=limit,
        owner=who.token_id if access is Scope.OWN else None,
    )
    return [JobOut.of(j) for j in jobs]


@router.get("/v1/jobs/{job_id}", response_model=JobDetail, responses=_ERRORS)
@action("job.read")
def get_job(job_id: str, ctx: Ctx, who: Who, access: Access) -> JobDetail:
    """One job with its attempts and events."""
    job = visible_job(ctx, who, access, job_id)
    return JobDetail.full(job, ctx.store.attempts(job.id), ctx.store.events(job_id=job.id))


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobOut, responses=_ERRORS)
@action("job.cancel")
def cancel_job(job_id: str, request: Request, ctx: Ctx, who: Who, access: Access) -> JobOut:
    """Cancel a queued job at once, or ask the broker to stop a running one."""
    job = visible_job(ctx, who, access, job_id)
    if job.state.terminal:
        raise ApiError(
            409, f"job {job.id} has already ended ({job.state.value}); nothing to cancel"
        )
    job = ctx.store.request_cancel(job.id, now=ctx.clock())
    audit_ok(request, {"state": job.state.value}, target=job.id)
    return JobOut.of(job)


@router.get("/v1/jobs/{job_id}/explain", response_model=Explanation, responses=_ERRORS)
@action("job.read")
def explain_job(job_id: str, ctx: Ctx, who: Who, access: Access) -> Explanation:
    """Where the job stands and, if it waits, why (as `gpuwarden explain`)."""
    job = visible_job(ctx, who, access, job_id)
    status = explain.latest_status(ctx.store, time.time())
    view = explain.view_from_status(status, ctx.config.broker.cpu_slots) if status else None
    return Explanation(job=job.id, lines=explain.explain_job(job, ctx.store, ctx.registry, view))


@router.get("/v1/jobs/{job_id}/result", responses=_ERRORS)
@action("job.read")
def job_result(job_id: str, ctx: Ctx, who: Who, access: Access) -> dict[str, Any]:
    """The job's result.json (SPEC.md section 5), once it has ended."""
    job = visible_job(ctx, who, access, job_id)
    if not job.state.terminal:
        raise ApiError(
            409, f"job {job.id} is {job.state.value}: its result exists once it has ended"
        )
    return result_json(job, ctx.store.attempts(job.id))


@router.get(
    "/v1/jobs/{job_id}/outputs/{path:path}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **_ERRORS},
)
@action("job.read")
def job_output(job_id: str, path: str, ctx: Ctx, who: Who, access: Access) -> FileResponse:
    """One output file of a job that ended done (a path from its result's outputs)."""
    job = visible_job(ctx, who, access, job_id)
    try:
        rel = safe_relpath(path, "output path")
    except ValidationError as exc:
        raise ApiError(422, exc.message) from None
    if job.state is not JobState.DONE:
        raise ApiError(
            409, f"job {job.id} is {job.state.value}: outputs are returned for done jobs only"
        )
    outputs = [str(p) for p in job.result.get("outputs", [])]
    if rel not in outputs:
        listed = ", ".join(outputs) or "none"
        raise ApiError(404, f"job {job.id} has no output {rel!r} (its outputs: {listed})")
    out_dir = job.result.get("output_dir")
    target = _inside(Path(str(out_dir)), rel) if out_dir else None
    if target is None:
        raise ApiError(404, f"output {rel!r} of job {job.id} is no longer on this host")
    return FileResponse(target, media_type="application/octet-stream", filename=target.name)


def _inside(root: Path, rel: str) -> Path | None:
    """``root/rel`` if it is a regular file reached through no symbolic link."""
    current = root
    for part in Path(rel).parts:
        current = current / part
        if current.is_symlink():
            return None
    try:
        if not current.resolve().is_relative_to(root.resolve()) or not current.is_file():
            return None
    except OSError:
        return None
    return current
