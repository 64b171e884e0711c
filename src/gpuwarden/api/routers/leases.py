"""VRAM leases over HTTP (SPEC.md section 11, "VRAM leases", and section 15):
ask for one (``?wait=S`` long-polls its grant), renew it, end it, name the
processes whose device memory is its, read one, list them.

A lease is a job of the built-in ``lease`` type, so a submitter sees and holds
only the leases its own token asked for (another's is a 404, as for jobs);
operators and owners any. The files a granted lease is held by are in the
node's state directory: these routes serve on the node itself (``serve --api``),
not on a coordinator."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool

from gpuwarden.api import waiting
from gpuwarden.api.auth import Principal, Scope, check_priority_bound
from gpuwarden.api.context import ApiContext, action, audit_ok, get_ctx, get_principal, get_scope
from gpuwarden.api.errors import HttpError
from gpuwarden.api.leasedesk import LeaseDesk
from gpuwarden.api.models import ErrorOut, LeaseIn, LeaseOut, PidsIn, RenewIn
from gpuwarden.api.redact import Redactor
from gpuwarden.api.routers.jobs import WaitParam, own_prefix, visible_job
from gpuwarden.api.routers.nodes import is_coordinator
from gpuwarden.cluster import report
from gpuwarden.core.fairshare import hide_owners
from gpuwarden.core.lease import ENDED_BY_HOLDER, is_lease
from gpuwarden.core.model import Job
from gpuwarden.core.states import JobState
from gpuwarden.intake.jobs import new_job_id

router = APIRouter(tags=["leases"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]
Access = Annotated[Scope, Depends(get_scope)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 422, 429)
}
#: how often a ``wait`` looks whether the lease was granted
GRANT_POLL_S = 0.1


def _desk(request: Request, ctx: ApiContext) -> LeaseDesk:
    if is_coordinator(request):
        raise HttpError(
            409,
            "leases are held on a node, not through a coordinator: ask the node's own API "
            "(its `serve --api`)",
        )
    return LeaseDesk(ctx.store, ctx.registry, ctx.config)


def _lease(ctx: ApiContext, who: Principal, access: Scope, lease_id: str) -> Job:
    job = visible_job(ctx, who, access, lease_id)
    if not is_lease(job.type):
        raise HttpError(404, f"no lease with id {lease_id!r} (GET /v1/leases lists yours)")
    return job


def _out(ctx: ApiContext, desk: LeaseDesk, job: Job, who: Principal, access: Scope) -> LeaseOut:
    out = LeaseOut(**desk.info(job))
    if job.state is JobState.QUEUED:
        lines = report.explain(
            job, ctx.store, ctx.registry, ctx.config.broker.cpu_slots, time.time()
        )
        keep = [ln for ln in lines[1:] if not ln.startswith(("footprint ", "(as seen by"))]
        out.waiting = "; ".join(keep) or None
        if access is Scope.OWN and out.waiting:
            out.waiting = hide_owners(
                Redactor(ctx.store, who.token_id).text(out.waiting), who.token_id
            )
    return out


@router.post("/v1/leases", status_code=201, response_model=LeaseOut, responses=_ERRORS)
@action("lease.create")
async def create_lease(
    body: LeaseIn, request: Request, *, ctx: Ctx, who: Who, access: Access, wait: WaitParam = None
) -> LeaseOut:
    """Ask for a lease of ``vram_bytes`` on one GPU (``gpu``: that one). It waits for
    admission like a job. With ``wait``, the answer comes once it is granted (``granted``
    true, ``gpu`` and ``until`` set) or has ended, or after that many seconds (still
    queued, ``waiting`` says why). Renew it within its ``ttl_s``, or it ends."""
    seconds = waiting.parse_wait(wait)
    job = await run_in_threadpool(_create, body, request, ctx, who, access)
    if ctx.wake is not None:
        ctx.wake()
    if seconds:
        job = await _until_granted(ctx, _desk(request, ctx), job, seconds)
    return await run_in_threadpool(_out, ctx, _desk(request, ctx), job, who, access)


def _create(body: LeaseIn, request: Request, ctx: ApiContext, who: Principal, access: Scope) -> Job:
    check_priority_bound(ctx.config.api.max_priority, who, body.priority, "lease")
    desk = _desk(request, ctx)
    job_id = new_job_id("lease")
    if access is Scope.OWN:
        job_id = own_prefix(who) + job_id
    with ctx.store.batch():
        job = desk.ask(
            body.vram_bytes,
            ttl_s=body.ttl_s,
            gpu=body.gpu,
            priority=body.priority,
            owner=who.token_id,
            holder=body.holder or who.name,
            job_id=job_id,
        )
        detail = {"vram_bytes": body.vram_bytes, "gpu": body.gpu, "ttl_s": body.ttl_s}
        audit_ok(request, detail, target=job.id, status=201)
    return job


async def _until_granted(ctx: ApiContext, desk: LeaseDesk, job: Job, seconds: float) -> Job:
    """The lease once it is granted (its deadline written) or ended, or as it is
    after ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        now = await run_in_threadpool(ctx.store.get_job, job.id)
        if now is None:
            return job
        job = now
        if job.state.terminal:
            return job
        if (
            job.state is JobState.RUNNING
            and await run_in_threadpool(desk.attempt_dir, job) is not None
        ):
            return job
        left = deadline - loop.time()
        if left <= 0:
            return job
        await asyncio.sleep(min(GRANT_POLL_S, left))


@router.get("/v1/leases", response_model=list[LeaseOut], responses=_ERRORS)
@action("lease.list")
def list_leases(request: Request, ctx: Ctx, who: Who, access: Access) -> list[LeaseOut]:
    """The queued and granted leases: a submitter's own, or all for operators and owners."""
    desk = _desk(request, ctx)
    jobs = desk.listed(who.token_id, every_owner=access is not Scope.OWN)
    return [_out(ctx, desk, j, who, access) for j in jobs]


@router.get("/v1/leases/{lease_id}", response_model=LeaseOut, responses=_ERRORS)
@action("lease.read")
async def get_lease(
    lease_id: str, request: Request, *, ctx: Ctx, who: Who, access: Access, wait: WaitParam = None
) -> LeaseOut:
    """One lease: its state, GPU, deadline (``until``), PIDs; why it waits while
    queued. With ``wait``, a lease not granted yet is waited for up to that many
    seconds (as ``POST /v1/leases?wait=S``)."""
    seconds = waiting.parse_wait(wait)
    desk = _desk(request, ctx)
    job = await run_in_threadpool(_lease, ctx, who, access, lease_id)
    if seconds:
        job = await _until_granted(ctx, desk, job, seconds)
    return await run_in_threadpool(_out, ctx, desk, job, who, access)


@router.post("/v1/leases/{lease_id}/renew", response_model=LeaseOut, responses=_ERRORS)
@action("lease.renew")
def renew_lease(
    lease_id: str,
    request: Request,
    *,
    ctx: Ctx,
    who: Who,
    access: Access,
    body: RenewIn | None = None,
) -> LeaseOut:
    """Move a granted lease's deadline to now + its ttl (or this renewal's ``ttl_s``).
    409 while it is not granted yet, or once it has ended. Not audited: a holder
    renews every third of its ttl (the grant and the end are)."""
    desk = _desk(request, ctx)
    job = _lease(ctx, who, access, lease_id)
    desk.renew(job, None if body is None else body.ttl_s)
    return _out(ctx, desk, job, who, access)


@router.delete("/v1/leases/{lease_id}", response_model=LeaseOut, responses=_ERRORS)
@action("lease.end")
def end_lease(
    lease_id: str,
    request: Request,
    *,
    ctx: Ctx,
    who: Who,
    access: Access,
    reason: Annotated[str | None, Query(max_length=300)] = None,
) -> LeaseOut:
    """End a lease: a granted one is stopped by its supervisor within a second (it
    ends ``done``, "ended by its holder", with ``reason`` after it when given), one
    not granted yet is cancelled."""
    desk = _desk(request, ctx)
    job = _lease(ctx, who, access, lease_id)
    if job.state.terminal:
        raise HttpError(409, f"lease {job.id} has already ended ({job.state.value}: {job.reason})")
    why = f"{ENDED_BY_HOLDER}: {reason}" if reason else f"{ENDED_BY_HOLDER} (DELETE by {who.name})"
    job = desk.end(job, why)
    audit_ok(request, {"state": job.state.value}, target=job.id)
    return _out(ctx, desk, job, who, access)


@router.post("/v1/leases/{lease_id}/pids", response_model=LeaseOut, responses=_ERRORS)
@action("lease.pids")
def lease_pids(
    lease_id: str, body: PidsIn, request: Request, *, ctx: Ctx, who: Who, access: Access
) -> LeaseOut:
    """Name processes of the node's host whose memory on the lease's GPU is the
    lease's (an app started outside the CLI). 409 while it is not granted."""
    desk = _desk(request, ctx)
    job = _lease(ctx, who, access, lease_id)
    pids = desk.register_pids(job, list(body.pids))
    audit_ok(request, {"pids": pids}, target=job.id)
    return _out(ctx, desk, job, who, access)
