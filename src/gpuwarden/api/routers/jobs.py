"""Clients' jobs: submit, list, read, cancel, job control (hold, release, requeue,
priority), explain, result, outputs.

A submitter sees only the jobs its own token submitted: another's job is a 404,
as if it did not exist. Operators and owners see every job."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from gpuwarden.api import files, waiting
from gpuwarden.api.auth import Principal, Scope, check_priority_bound
from gpuwarden.api.context import (
    ApiContext,
    action,
    audit_ok,
    get_ctx,
    get_principal,
    get_scope,
    set_target,
)
from gpuwarden.api.errors import HttpError
from gpuwarden.api.models import (
    ErrorOut,
    Explanation,
    JobDetail,
    JobIn,
    JobOut,
    PreviewOut,
    PriorityIn,
    SubmitOut,
    WaitOut,
)
from gpuwarden.api.redact import Redactor
from gpuwarden.cluster import coordinator, report
from gpuwarden.core import command, jobcontrol, policy
from gpuwarden.core.command import CommandOptions, CommandSpec
from gpuwarden.core.dependencies import DependencyError, parse_all
from gpuwarden.core.fairshare import hide_owners
from gpuwarden.core.model import GIB, Job, JobSpec, JobType, Lane, ParamType, gpu_count
from gpuwarden.core.service import SERVICE_NAME
from gpuwarden.core.sources import JobSource
from gpuwarden.core.states import JobState
from gpuwarden.errors import ValidationError
from gpuwarden.intake.jobs import JOB_ID, new_job_id, prepare
from gpuwarden.node import explain, servicestate
from gpuwarden.node.status import BrokerStatus
from gpuwarden.store.base import DuplicateJobError, Submission
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


def own_prefix(who: Principal) -> str:
    """What every job id of a submitter's token begins with: its token id and '-'."""
    return f"{who.token_id}-"


def visible_job(ctx: ApiContext, who: Principal, access: Scope, job_id: str) -> Job:
    """The job, if this principal may see it; else 404, the same answer for a job
    that does not exist and for another's. A submitter may name its own job with
    or without its prefix (:func:`own_prefix`)."""
    job = ctx.store.get_job(job_id) if JOB_ID.fullmatch(job_id) else None
    if access is Scope.OWN and (job is None or job.owner != who.token_id):
        job = None
        prefix = own_prefix(who)
        if not job_id.startswith(prefix) and JOB_ID.fullmatch(prefix + job_id):
            mine = ctx.store.get_job(prefix + job_id)
            job = mine if mine is not None and mine.owner == who.token_id else None
    if job is None:
        raise HttpError(404, f"no job with id {job_id!r} (GET /v1/jobs lists yours)")
    return job


def _service_for(who: Principal, access: Scope, body: JobIn) -> str | None:
    """The service name of a new job. A submitter's names are its own, as its job
    ids are: ``<token id>-<the name it chose>`` (a name with that prefix already is
    kept), so no submitter can take a name another's service needs, and a refusal
    never names another's job. Without a name, the service is served under its job
    id (already its own). Operators and owners choose freely, but not a name of
    that form (``prepare``)."""
    name = body.service
    if name is None or access is not Scope.OWN:
        return name
    prefix = own_prefix(who)
    if name.startswith(prefix):
        return name
    if not SERVICE_NAME.fullmatch(prefix + name):
        room = 128 - len(prefix)
        raise ValidationError(
            f"service name {name!r}: a submitter's service names are kept as "
            f"'{prefix}<name>', so the name may have at most {room} characters, "
            "letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return prefix + name


def _job_id_for(who: Principal, access: Scope, body: JobIn, type_name: str) -> str:
    """The store id of a new job. A submitter's ids are its own: every one begins
    with its token id (``<token id>-<the id it chose, or a generated one>``), so an
    id another token holds can never be in its way, and a submit tells nothing of
    another's jobs. Operators and owners (who see every job) choose freely, but not
    an id of that form."""
    chosen = body.id
    if chosen is not None and not JOB_ID.fullmatch(chosen):
        raise ValidationError(
            f"job id {chosen!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if access is not Scope.OWN:
        return chosen or new_job_id(type_name)  # prepare() keeps others' prefixes out
    prefix = own_prefix(who)
    if chosen is None:
        return prefix + new_job_id(type_name)
    if chosen.startswith(prefix):
        return chosen
    if not JOB_ID.fullmatch(prefix + chosen):
        room = 128 - len(prefix)
        raise ValidationError(
            f"job id {chosen!r} is too long: a submitter's job ids are kept as "
            f"'{prefix}<id>', so the id may have at most {room} characters"
        )
    return prefix + chosen


#: the ``wait`` query parameter of a submit and of a result (a long poll)
WaitParam = Annotated[
    str | None,
    Query(
        description="seconds (a number from 0 to 60) to wait for the job to end before "
        "answering; the answer then carries how the wait went (and the result)",
        examples=["5"],
    ),
]


@router.post("/v1/jobs", status_code=201, response_model=SubmitOut, responses=_ERRORS)
@action("job.submit")
async def submit_job(
    body: JobIn,
    *,
    request: Request,
    response: Response,
    ctx: Ctx,
    who: Who,
    access: Access,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="retry-safe submission: the same key and body return the same job",
        ),
    ] = None,
    wait: WaitParam = None,
) -> SubmitOut:
    """Submit a job. It is checked like a bundle's job (type, parameters, this
    node's launch rules, a VRAM footprint no GPU can ever hold) before it is stored.
    A submitter's job ids begin with its token id (SPEC.md, section 15). With
    ``wait``, the answer comes once the job has ended (its result in ``result``)
    or after that many seconds (``wait.ended`` false, the job queued or running)."""
    seconds = waiting.parse_wait(wait)  # refused before anything is stored
    job = await run_in_threadpool(
        _submit, body, request, response, ctx, who, access, idempotency_key
    )
    if ctx.wake is not None:  # the broker runs in this process: it takes it now
        ctx.wake()
    if seconds is None:
        return SubmitOut.of(job)
    return await _waited(ctx, job, seconds)


async def _waited(ctx: ApiContext, job: Job, seconds: float) -> SubmitOut:
    """The job after waiting up to ``seconds`` for its end, and how the wait went."""
    started = time.monotonic()
    now, result = await waiting.until_ended(ctx, job.id, seconds)
    waited = time.monotonic() - started
    out = SubmitOut.of(now or job)
    out.wait = WaitOut(asked_s=seconds, waited_s=round(waited, 6), ended=result is not None)
    out.result = result
    return out


def _submit(  # noqa: PLR0917 - the route's own arguments, handed to a worker thread
    body: JobIn,
    request: Request,
    response: Response,
    ctx: ApiContext,
    who: Principal,
    access: Scope,
    idempotency_key: str | None,
) -> Job:
    """The submission (on a worker thread: it reads and writes the store). The job
    and the audit row of its success share one commit (the store's batch)."""
    with ctx.store.batch():
        return _submit_in_batch(body, request, response, ctx, who, access, idempotency_key)


def _submit_in_batch(  # noqa: PLR0917 - as _submit
    body: JobIn,
    request: Request,
    response: Response,
    ctx: ApiContext,
    who: Principal,
    access: Scope,
    idempotency_key: str | None,
) -> Job:
    if body.id is not None:
        set_target(request, body.id)
    if idempotency_key is not None and not _KEY.fullmatch(idempotency_key):
        raise HttpError(422, "the Idempotency-Key header must be 1 to 255 visible ASCII characters")
    check_priority_bound(ctx.config.api.max_priority, who, body.priority, "job")
    source = None if body.source is None else body.source.spec()
    cmd = command_of(ctx, who, body)
    jobtype = _body_type(ctx, body, source) if cmd is None else ctx.registry.get(cmd[0])
    _refuse_file_inputs(jobtype, body)
    vram = math.ceil(body.vram_gib * GIB) if body.vram_gib is not None else None
    id_base = jobtype.name if cmd is None else cmd[1]
    spec = prepare(
        ctx.registry,
        JobSpec(
            id=_job_id_for(who, access, body, id_base),
            type=jobtype.name if source is None else str(body.type),
            command=None if cmd is None else cmd[2],
            params=dict(body.params),
            outputs=tuple(body.outputs),
            priority=body.priority,
            vram_bytes=vram,
            constraints=dict(body.constraints),
            after=_visible_after(ctx, who, access, body.after),
            est_s=body.est_s,
            gpus=body.gpus,
            ram=body.ram(),
            service=_service_for(who, access, body),
            share=tuple(body.share),
            source=source,
        ),
        owner=who.token_id,
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
    for tries in range(3):
        try:
            [job] = ctx.store.submit(
                [spec],
                now=ctx.clock(),
                origin=Submission(owner=who.token_id),
                idempotency=idempotency,
            )
            break
        except DuplicateJobError:
            if body.id is not None or tries == 2:
                raise
            # a generated id that is taken (32 random bits): another one
            spec = replace(spec, id=_job_id_for(who, access, body, id_base))
            set_target(request, spec.id)
    detail: dict[str, Any] = {"type": job.type}
    if idempotency_key is not None:
        detail["idempotency_key"] = idempotency_key
        detail["replay"] = replay
    audit_ok(request, detail, target=job.id, status=200 if replay else 201)
    if replay:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return job


def _visible_after(
    ctx: ApiContext, who: Principal, access: Scope, after: list[str]
) -> tuple[str, ...]:
    """The job's dependencies, each naming a job this principal may see (a submitter
    its own, with or without its prefix) by its stored id; a 422 that names the
    dependency otherwise, the same for a job that does not exist and for another's."""
    out: list[str] = []
    for dep in parse_all(after):
        try:
            job = visible_job(ctx, who, access, dep.job_id)
        except HttpError:
            raise DependencyError(
                f"dependency {dep}: no job with id {dep.job_id!r} that this token can see "
                "(GET /v1/jobs lists them)"
            ) from None
        out.append(f"{dep.kind.value}:{job.id}")
    return tuple(out)


def command_of(ctx: ApiContext, who: Principal, body: JobIn) -> tuple[str, str, CommandSpec] | None:
    """A command job's type, name and command (SPEC.md, "Command jobs over HTTP,
    bundles and agents"): always sandboxed, in its output folder, as the sandbox's
    user; only for a token whose role ``[commands] roles`` names (403 otherwise,
    naming the rule). None for a job of a module's type. A type ``command:...``
    is refused: over HTTP a command is given as ``command``, and a host command
    never comes this way."""
    if body.command is None:
        if body.type is not None and command.is_command_type(body.type):
            raise ValidationError(
                f"type {body.type!r} is a command job's type: over HTTP give the command "
                'line as "command": [...] (it runs sandboxed); a host command comes only '
                "through the node's local socket (`gpuwarden run -- CMD` on the host)"
            )
        return None
    if body.source is not None:
        raise ValidationError("a command job has no source: give a command or a type, not both")
    roles = ctx.config.commands.roles
    if who.role.value not in roles:
        raise HttpError(
            403,
            f"this node runs no command jobs for the {who.role.value} role: [commands] roles "
            f"= {list(roles)} in its config does not name it; its operator may add "
            f'"{who.role.value}" there (command jobs then run sandboxed)',
        )
    try:
        argv, env, _cwd = command.check_command(body.command, body.env, "", sandboxed=True)
        name = command.check_name(body.name) if body.name else command.default_name(argv)
        options = CommandOptions(
            share=body.share_gpu,
            preempt=_signal(body.preempt),
            timeout_s=body.timeout_s,
            sandbox=True,
        )
        type_name = command.type_name(name, options)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    return type_name, name, CommandSpec(argv, "", env)


def _signal(value: str | None) -> str | None:
    if value is not None and value not in command.SIGNALS:
        raise ValueError(f"preempt {value!r}: the signal is one of {', '.join(command.SIGNALS)}")
    return value


def _body_type(ctx: ApiContext, body: JobIn, source: JobSource | None) -> JobType:
    """The job's type: a module this broker has, or the type of the module at its
    source's commit (fetched now unless cached; SPEC.md, "Jobs from a pinned commit")."""
    assert body.type is not None  # a job without one is a command (command_of)
    if source is None:
        return ctx.registry.get(body.type)
    try:
        return ctx.registry.from_source(source, body.type)
    except ValidationError as exc:
        raise ValidationError(f"job {body.id or '(new)'}: {exc}") from None


def _refuse_file_inputs(jobtype: JobType, body: JobIn) -> None:
    inputs = [p for p in jobtype.params if p.type is ParamType.INPUT]
    if any(p.name in body.params or p.required for p in inputs):
        raise ValidationError(
            f"{jobtype.name} takes input files ({', '.join(p.name for p in inputs)}), and "
            "file inputs are not accepted over HTTP yet: submit it as a bundle "
            "(`gpuwarden submit --queue DIR --input FILE`)"
        )


def _refuse_if_it_never_fits(ctx: ApiContext, spec: JobSpec, jobtype: JobType) -> None:
    """Against the GPUs and RAM every live node last published (no check when none
    runs)."""
    now = ctx.clock()
    live = [
        st
        for s in ctx.store.node_statuses()
        if now - s.updated_at <= explain.FRESH_S
        and not (st := BrokerStatus.from_json(s.payload)).stopped
    ]
    rams = [explain.never_admitted(st.ram, jobtype, spec.ram) for st in live]
    if rams and all(rams):
        raise ValidationError(f"job {spec.id} ({spec.type}) {rams[0]}")
    if jobtype.lane is not Lane.VRAM:
        return
    nodes = [st.gpu_views() for st in live]
    need = explain.effective_footprint(jobtype, spec.vram_bytes, ctx.store)
    count = gpu_count(jobtype, spec.gpus)
    if count > 1:  # its GPUs must all be on one node
        whys = [policy.never_fits(need, gpus, count) for gpus in nodes]
        if whys and all(whys):
            raise ValidationError(f"job {spec.id} ({spec.type}) {whys[0]}")
        return
    if (why := policy.never_fits(need, [g for gpus in nodes for g in gpus])) is not None:
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
    services = servicestate.views(jobs, ctx.store, ctx.registry, ctx.clock())
    out = [JobOut.of(j).with_service(services.get(j.id)) for j in jobs]
    for o, j in zip(out, jobs, strict=True):
        if j.held or j.hold_by is not None:  # why it waits, as it stands now
            o.reason = explain.shown_reason(j, ctx.store)
    return out


@router.get("/v1/jobs/{job_id}", response_model=JobDetail, responses=_ERRORS)
@action("job.read")
def get_job(job_id: str, ctx: Ctx, who: Who, access: Access) -> JobDetail:
    """One job with its attempts and events."""
    job = visible_job(ctx, who, access, job_id)
    detail = JobDetail.full(job, ctx.store.attempts(job.id), ctx.store.events(job_id=job.id))
    detail.reason = explain.shown_reason(job, ctx.store)
    detail.with_service(servicestate.views([job], ctx.store, ctx.registry, ctx.clock()).get(job.id))
    if access is Scope.OWN:  # reasons may name the jobs it waited for: not another's
        r = Redactor(ctx.store, who.token_id)
        detail.reason = r.text(detail.reason)
        for a in detail.attempts_detail:
            a.reason = r.text(a.reason)
        detail.events = [r.value(e) for e in detail.events]
    return detail


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobOut, responses=_ERRORS)
@action("job.cancel")
def cancel_job(job_id: str, request: Request, ctx: Ctx, who: Who, access: Access) -> JobOut:
    """Cancel a queued job at once, or ask the broker to stop a running one."""
    job = visible_job(ctx, who, access, job_id)
    if job.state.terminal:
        raise HttpError(
            409, f"job {job.id} has already ended ({job.state.value}); nothing to cancel"
        )
    now = ctx.clock()
    job = ctx.store.request_cancel(job.id, now=now)
    detail: dict[str, object] = {"state": job.state.value}
    if isinstance(ctx.store, ClusterStore):  # a cancel revokes its diagnostic grants
        revoked = [g.node for g in ctx.store.grants_of_job(job.id) if g.revoked_at == now]
        if revoked:
            detail["grants_revoked"] = revoked
    audit_ok(request, detail, target=job.id)
    return JobOut.of(job)


@router.post("/v1/jobs/{job_id}/stop", response_model=JobOut, responses=_ERRORS)
@action("job.stop")
def stop_job(job_id: str, request: Request, ctx: Ctx, who: Who, access: Access) -> JobOut:
    """Stop a running service job: the broker stops its processes and records it
    done, "stopped by" the caller (SPEC.md, "Service jobs")."""
    job = visible_job(ctx, who, access, job_id)
    if job.state is not JobState.RUNNING:
        raise HttpError(409, f"job {job.id} is {job.state.value}, not running: nothing to stop")
    job = ctx.store.request_stop(job.id, by=who.name, now=ctx.clock())
    audit_ok(request, {"state": job.state.value}, target=job.id)
    return JobOut.of(job)


# -- job control (SPEC.md section 1, "Job control"; the rules: core/jobcontrol.py) ------


@router.post("/v1/jobs/{job_id}/hold", response_model=JobOut, responses=_ERRORS)
@action("job.hold")
def hold_job(job_id: str, request: Request, ctx: Ctx, who: Who, access: Access) -> JobOut:
    """Hold a queued job: it stays queued, neither planned nor offered to a node, until
    it is released."""
    job = visible_job(ctx, who, access, job_id)
    set_target(request, job.id)
    job = ctx.store.hold(job.id, by=who.name, now=ctx.clock())
    audit_ok(request, {"hold_by": job.hold_by}, target=job.id)
    return JobOut.of(job)


@router.post("/v1/jobs/{job_id}/release", response_model=JobOut, responses=_ERRORS)
@action("job.release")
def release_job(job_id: str, request: Request, ctx: Ctx, who: Who, access: Access) -> JobOut:
    """Release a job that a person holds (whoever held it)."""
    job = visible_job(ctx, who, access, job_id)
    set_target(request, job.id)
    held_by = job.hold_by
    job = ctx.store.release(job.id, by=who.name, now=ctx.clock())
    audit_ok(request, {"held_by": held_by}, target=job.id)
    return JobOut.of(job)


@router.post("/v1/jobs/{job_id}/requeue", response_model=JobOut, responses=_ERRORS)
@action("job.requeue")
def requeue_job(job_id: str, request: Request, ctx: Ctx, who: Who, access: Access) -> JobOut:
    """Queue an ended job (done, failed, cancelled) again: same id and spec, its
    attempts numbered on, its retries counted afresh; its earlier run stays in its
    attempts and its ``requeued`` event."""
    job = visible_job(ctx, who, access, job_id)
    set_target(request, job.id)
    ended = job.state.value
    job = ctx.store.requeue(job.id, by=who.name, now=ctx.clock())
    audit_ok(request, {"from": ended, "attempts": job.attempts}, target=job.id)
    return JobOut.of(job)


@router.post("/v1/jobs/{job_id}/priority", response_model=JobOut, responses=_ERRORS)
@action("job.priority")
def set_job_priority(
    job_id: str, body: PriorityIn, request: Request, *, ctx: Ctx, who: Who, access: Access
) -> JobOut:
    """Set a queued job's priority: owners and operators up to their role's
    ``[api.max_priority]``, a submitter only lower than it is."""
    job = visible_job(ctx, who, access, job_id)
    set_target(request, job.id)
    before = job.priority
    if body.priority > before:
        check_priority_bound(ctx.config.api.max_priority, who, body.priority, "job")
    job = ctx.store.set_priority(
        job.id,
        body.priority,
        by=who.name,
        now=ctx.clock(),
        may_raise=jobcontrol.may_raise_priority(who.role),
    )
    audit_ok(request, {"from": before, "to": job.priority}, target=job.id)
    return JobOut.of(job)


@router.get("/v1/jobs/{job_id}/explain", response_model=Explanation, responses=_ERRORS)
@action("job.read")
def explain_job(job_id: str, ctx: Ctx, who: Who, access: Access) -> Explanation:
    """Where the job stands and, if it waits, why (as `gpuwarden explain`)."""
    job = visible_job(ctx, who, access, job_id)
    broker = ctx.config.broker
    lines = report.explain(
        job,
        ctx.store,
        ctx.registry,
        broker.cpu_slots,
        time.time(),
        half_life_s=broker.fair_share_half_life_s,
    )
    if access is Scope.OWN:  # wait reasons name other jobs: not another token's
        redactor = Redactor(ctx.store, who.token_id)
        lines = [hide_owners(redactor.text(line), who.token_id) for line in lines]
    return Explanation(job=job.id, lines=lines)


@router.get("/v1/preview", response_model=PreviewOut, responses=_ERRORS)
@action("job.preview")
def preview_job(
    *,
    ctx: Ctx,
    who: Who,
    access: Access,
    type: Annotated[str, Query(max_length=200, description="the job type, module.type")],
    vram_gib: Annotated[float | None, Query(gt=0, le=1_048_576)] = None,
    priority: Annotated[int, Query(ge=-(2**63), le=2**63 - 1)] = 0,
) -> PreviewOut:
    """What would become of one more job of ``type`` now (as `gpuwarden
    preview`): the broker's policy on what it last published, or, on a
    coordinator, what each node would do. Submits nothing."""
    jobtype = ctx.registry.get(type)
    override = math.ceil(vram_gib * GIB) if vram_gib is not None else None
    if override is not None and jobtype.lane is not Lane.VRAM:
        raise ValidationError(f"{jobtype.name} runs on the cpu lane; vram_gib does not apply")
    if isinstance(ctx.store, ClusterStore) and report.has_nodes(ctx.store):  # a coordinator
        lines = report.preview(
            ctx.store, ctx.registry, jobtype, override=override, priority=priority, now=ctx.clock()
        )
    else:
        lines = explain.preview(
            ctx.store,
            ctx.registry,
            jobtype,
            override=override,
            priority=priority,
            cpu_slots=ctx.config.broker.cpu_slots,
        )
    if access is Scope.OWN:  # wait reasons name other jobs: not another token's
        redactor = Redactor(ctx.store, who.token_id)
        lines = [hide_owners(redactor.text(line), who.token_id) for line in lines]
    return PreviewOut(type=jobtype.name, lines=lines)


@router.get("/v1/jobs/{job_id}/result", responses=_ERRORS)
@action("job.read")
async def job_result(
    job_id: str, ctx: Ctx, who: Who, access: Access, wait: WaitParam = None
) -> dict[str, Any]:
    """The job's result.json (SPEC.md section 5), once it has ended. With ``wait``,
    a job that has not ended yet is waited for up to that many seconds first."""
    seconds = waiting.parse_wait(wait)
    job = await run_in_threadpool(visible_job, ctx, who, access, job_id)
    now, result = await waiting.until_ended(ctx, job.id, seconds or 0.0)
    job = now or job
    if result is None:
        waited = f" (after waiting {seconds:g} s)" if seconds else ""
        raise HttpError(
            409,
            f"job {job.id} is {job.state.value}{waited}: its result exists once it has ended",
        )
    return result


@router.get(
    "/v1/jobs/{job_id}/outputs/{path:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **_ERRORS},
)
@action("job.read")
def job_output(
    job_id: str, path: str, request: Request, *, ctx: Ctx, who: Who, access: Access
) -> StreamingResponse:
    """One output file of a job that ended done (a path from its result's outputs)."""
    job = visible_job(ctx, who, access, job_id)
    rel = files.check_name(path, "output path", raw_path=request.scope.get("raw_path"))
    if job.state is not JobState.DONE:
        raise HttpError(
            409, f"job {job.id} is {job.state.value}: outputs are returned for done jobs only"
        )
    outputs = [str(p) for p in job.result.get("outputs", [])]
    if rel not in outputs:
        listed = ", ".join(outputs) if len(outputs) <= 20 else f"{len(outputs)} files"
        raise HttpError(
            404,
            f"job {job.id} has no output {files.shown(rel)} (its outputs: {listed or 'none'}; "
            f"GET /v1/jobs/{job.id}/result lists them)",
        )
    out_dir = job.result.get("output_dir")
    if not out_dir:
        raise HttpError(404, f"output {files.shown(rel)} of job {job.id} is not on this host")
    try:
        fd, st = files.open_below(Path(str(out_dir)), rel)
    except files.NotServed as exc:
        raise HttpError(
            404,
            f"output {files.shown(rel)} of job {job.id} is not served: it {exc.why} (only "
            "regular files reached through no link are)",
        ) from None
    return files.fd_response(fd, st, rel.rpartition("/")[2])
