"""Several hosts: enrolment, the agents' endpoints, and the operators' node actions.

* ``POST /v1/nodes/invite`` (owner): a one-time enrolment token for a node name,
  valid 15 minutes.
* ``POST /v1/nodes/enroll`` (that enrolment token): the agent sends its host's
  capabilities and gets its node credential; the enrolment token is used up.
* ``POST /v1/node/heartbeat``, ``/v1/node/claim``, ``/v1/node/jobs/{id}/start``,
  ``/v1/node/jobs/{id}/finish``, ``PUT /v1/node/jobs/{id}/outputs/{path}``,
  ``GET /v1/node/jobs/{id}/inputs/{name}`` (a node token): the node is the one
  the token is bound to, never a name in the body.
* ``GET /v1/nodes`` (operator, owner), ``POST /v1/nodes/{name}/drain`` and
  ``POST /v1/nodes/{name}/resume`` (operator, owner), ``POST /v1/nodes/{name}/revoke``
  (owner).

The rules are in :mod:`gpuwarden.cluster.coordinator`. Every mutating call is
audited, refusals too, except a heartbeat or a claim that succeeds with nothing
to say (they come every few seconds from every agent): a claim that leased jobs
is audited with their ids.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.concurrency import run_in_threadpool

from gpuwarden.api import files
from gpuwarden.api.auth import NodeHeld, Principal, issue_invite, issue_token
from gpuwarden.api.context import (
    ApiContext,
    action,
    audit_ok,
    get_ctx,
    get_principal,
    get_scope,
    run_while_serving,
    set_target,
)
from gpuwarden.api.errors import HttpError
from gpuwarden.api.models import ErrorOut
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster import invites, logcopy
from gpuwarden.cluster.nodeview import Timing, node_view
from gpuwarden.cluster.report import grant_json, node_json
from gpuwarden.cluster.routes import route_peer, without_routes
from gpuwarden.cluster.sweeper import LogCopies, Sweeper
from gpuwarden.core.model import MIB, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError
from gpuwarden.intake.jobs import JOB_ID
from gpuwarden.store.base import AuditRow, Store
from gpuwarden.store.cluster import ClusterStore, NodeState

#: the upload route, whose bodies may be as large as ``api.max_output_mib``
UPLOAD_PATH = re.compile(r"/v1/node/jobs/[^/]+/outputs/.+")

router = APIRouter(tags=["nodes"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 413, 422, 429)
}


# -- bodies -----------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


#: the most entries each list of a node's report or capabilities may have: a
#: report is read by every placement, ``/metrics`` and the dashboard, so a forged
#: one must not make them slow or large
REPORT_CAPS = {
    "gpus": 64,
    "warm": 4096,
    "warm_servers": 4096,
    "running": 10_000,
    "victims": 10_000,
    "types": 10_000,
    "modules": 10_000,
    "labels": 256,
}


def _capped(value: dict[str, Any], where: str) -> None:
    """Each list (or table) of REPORT_CAPS within its bound, naming it when not."""
    for key, cap in REPORT_CAPS.items():
        got = value.get(key)
        if isinstance(got, list | dict) and len(got) > cap:
            raise ValueError(f"{where}.{key} has {len(got)} entries: at most {cap} are taken")


def _json_ok(value: Any, where: str, depth: int = 0) -> None:
    """Finite numbers and encodable text without NUL all the way down, not too deep."""
    if depth > 16:
        raise ValueError(f"{where}: nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: numbers must be finite")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: text must be valid Unicode") from None
        if "\x00" in value:  # no store keeps it (PostgreSQL refuses it in text)
            raise ValueError(f"{where}: text must not contain NUL")
    elif isinstance(value, dict):
        for k, v in value.items():
            _json_ok(str(k), where, depth + 1)
            _json_ok(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _json_ok(v, f"{where}[{i}]", depth + 1)


class InviteIn(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        description="the node's name: 1-64 letters, digits, '.', '_', '-'"
    )
    replace: StrictBool = Field(
        default=False,
        description="the invite may enrol a host in the place of a node of that name that "
        "is enrolled and not revoked (its credential is revoked then, its jobs go back to "
        "the queue); without it, such an invite is refused (409)",
    )


class EnrollIn(_Body):
    capabilities: dict[str, Any] = Field(
        default_factory=dict,
        description="the host: GPUs (uuid, name, total_bytes), driver and CUDA versions, "
        "container runtime, labels",
    )

    @field_validator("capabilities", mode="after")
    @classmethod
    def _ok(cls, value: dict[str, Any]) -> dict[str, Any]:
        _capped(value, "capabilities")
        _json_ok(value, "capabilities")
        return value


JobIds = Annotated[
    list[Annotated[str, Field(max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")]],
    Field(max_length=10_000),
]


class HeartbeatIn(_Body):
    report: dict[str, Any] = Field(
        default_factory=dict,
        description="GPUs (uuid, name, total_bytes, free_bytes, usable_bytes), warm types, "
        "busy, max_jobs, labels, types, accepting",
    )
    jobs: JobIds = Field(default_factory=list, description="the job ids the node holds")

    @field_validator("report", mode="after")
    @classmethod
    def _ok(cls, value: dict[str, Any]) -> dict[str, Any]:
        _capped(value, "report")
        _json_ok(value, "report")
        return value


class ClaimIn(HeartbeatIn):
    want: Annotated[int, Field(ge=0, le=10_000)] = Field(
        default=1, description="the most jobs the node asks for"
    )


class StartIn(_Body):
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    gpu: Annotated[str, Field(max_length=256)] | None = None


#: the most VRAM a finish report may say an attempt held (1 PiB): past it, refused
MAX_HELD_BYTES = 2**50


class ImageIn(_Body):
    """The image an attempt of a job from a pinned commit ran in (SPEC.md section
    20, "Events"): its id (null when none was built) and whether it was reused."""

    id: Annotated[str, Field(pattern=r"^(sha256:)?[0-9a-f]{12,64}$")] | None = None
    reused: StrictBool | None = None


class FinishIn(_Body):
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    state: JobState
    outcome: Annotated[str, Field(max_length=64)] = ""
    reason: Annotated[str, Field(max_length=100_000)] = ""
    exit_code: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    result: dict[str, Any] = Field(default_factory=dict)
    stdout: Annotated[str, Field(max_length=10_000_000)] = ""
    stderr: Annotated[str, Field(max_length=10_000_000)] = ""
    release: bool = Field(
        default=False, description="with state queued: give the job back (the node stops)"
    )
    held_bytes: Annotated[StrictInt, Field(ge=0, le=MAX_HELD_BYTES)] | None = Field(
        default=None,
        description="the VRAM the attempt held on the node (fair share: its owner is "
        "charged this, at most all the node's GPUs, times its run time)",
    )
    image: ImageIn | None = Field(
        default=None,
        description="a job from a pinned commit: the image its attempt ran in (its end "
        "event records it with the node)",
    )

    @field_validator("result", mode="after")
    @classmethod
    def _ok(cls, value: dict[str, Any]) -> dict[str, Any]:
        _json_ok(value, "result")
        return value


class StartReport(StartIn):
    kind: Literal["start"]
    job: Annotated[str, Field(min_length=1, max_length=128)]


class FinishReport(FinishIn):
    kind: Literal["finish"]
    job: Annotated[str, Field(min_length=1, max_length=128)]


#: the most reports one ``POST /v1/node/reports`` carries
MAX_REPORTS = 256


class ReportsIn(_Body):
    reports: Annotated[
        list[Annotated[StartReport | FinishReport, Field(discriminator="kind")]],
        Field(min_length=1, max_length=MAX_REPORTS),
    ]


# -- helpers ----------------------------------------------------------------------


def cluster_store(ctx: ApiContext) -> ClusterStore:
    store = ctx.store
    if not isinstance(store, ClusterStore):  # pragma: no cover - both stores are
        raise HttpError(501, "this store keeps no nodes")
    return store


def timing(ctx: ApiContext) -> Timing:
    c = ctx.config.cluster
    return Timing(
        lease_s=c.lease_s,
        offline_after_s=c.offline_after_s,
        affinity_wait_s=c.affinity_wait_s,
        fence_grace_s=c.fence_grace_s,
    )


def node_of(ctx: ApiContext, who: Principal) -> str:
    """The node this node token belongs to; 401 when it is not that node's any more."""
    store = cluster_store(ctx)
    token = store.get_token(who.token_id)
    if token is None or token.node is None:
        raise HttpError(403, f"token {who.token_id} is bound to no node")
    node = store.get_node(token.node)
    if node is None or node.token_id != who.token_id:
        raise HttpError(
            401,
            f"token {who.token_id} is no longer the credential of node {token.node} "
            "(it was enrolled again): use the newer credential",
        )
    if node.state is NodeState.REVOKED:
        raise HttpError(401, f"node {token.node} was revoked: enrol it again to use it")
    return token.node


def _job_id(job_id: str) -> str:
    if not JOB_ID.fullmatch(job_id):
        raise HttpError(404, f"no job with id {job_id!r}")
    return job_id


def _refused(exc: co.LeaseRefused) -> HttpError:
    return HttpError(409, exc.message)


def outputs_dir(ctx: ApiContext, job_id: str, attempt: int) -> Path:
    """Where the coordinator keeps the outputs an attempt's node uploaded."""
    return ctx.config.state_dir / "outputs" / job_id / f"attempt-{attempt}"


# -- enrolment --------------------------------------------------------------------


@router.post("/v1/nodes/invite", status_code=201, responses=_ERRORS)
@action("node.invite")
def invite(body: InviteIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """A one-time enrolment token for node ``name``, valid 15 minutes: give it to
    `gpuwarden agent --enroll-file FILE` (or ``--enroll -``, or GPUWARDEN_ENROLL_TOKEN)
    on that host, never on a command line. Shown once. The node's earlier invites
    stop working; 409 while a node of that name is enrolled and not revoked, unless
    ``replace``."""
    set_target(request, body.name)
    if not co.NODE_NAME.fullmatch(body.name):
        raise HttpError(
            422,
            f"node name {body.name!r}: use 1-64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit",
        )
    now = ctx.clock()
    try:
        made = issue_invite(cluster_store(ctx), body.name, by=who, now=now, replace=body.replace)
    except NodeHeld as exc:
        raise HttpError(409, exc.message) from None
    detail: dict[str, Any] = {"token": made.record.id, "superseded": made.superseded}
    if body.replace:
        detail["replace"] = True
        detail["replaces"] = made.replaces
    audit_ok(request, detail, target=body.name, status=201)
    return {
        "node": body.name,
        "token": made.token,
        "token_id": made.record.id,
        "expires_at": made.record.expires_at,
        "coordinator_url": coordinator_url(request),
        "replace": body.replace,
        "replaces": made.replaces,
        "superseded": made.superseded,
    }


@router.post("/v1/nodes/enroll", status_code=201, responses=_ERRORS)
@action("node.enroll")
def enroll(body: EnrollIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """Exchange an enrolment token for the node's credential (shown once); the
    enrolment token cannot be used again. 409 (and the token is revoked) when a
    node of that name is enrolled and not revoked and the invite was not made with
    ``replace``; with it, that node's credential is revoked and its jobs go back
    to the queue first."""
    store = cluster_store(ctx)
    token = store.get_token(who.token_id)
    if token is None or token.node is None:
        raise HttpError(403, f"enrolment token {who.token_id} is bound to no node")
    name = token.node
    set_target(request, name)
    now = ctx.clock()
    live = invites.live_node(store, name, now)
    if live is not None and not token.replace:
        store.revoke_token(token.id, now=now)
        raise HttpError(409, invites.enrol_refusal(live, now, token.id))
    if not store.revoke_token(token.id, now=now):
        raise HttpError(401, f"enrolment token {token.id} was used already")
    replaced: dict[str, Any] | None = None
    if live is not None:  # an invite made with replace: the live node goes first
        replaced = co.revoke(store, ctx.registry, name, now=now, why=invites.replaced_reason(name))
        replaced["credential"] = live.token_id
    record, credential = issue_token(store, name=name, role=Role.NODE, by=who, now=now, node=name)
    co.enroll(store, name, token_id=record.id, capabilities=body.capabilities, now=now)
    detail: dict[str, Any] = {"token": record.id}
    if replaced is not None:
        detail["replaced"] = replaced
    audit_ok(request, detail, target=name, status=201)
    c = ctx.config.cluster
    return {
        "node": name,
        "token": credential,
        "token_id": record.id,
        "lease_s": c.lease_s,
        "offline_after_s": c.offline_after_s,
    }


# -- the agents' endpoints -----------------------------------------------------------


@router.post("/v1/node/heartbeat", responses=_ERRORS)
@action("node.heartbeat")
def heartbeat(body: HeartbeatIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """Keep the node's report, renew the leases of the jobs it holds; answers its
    state (active, draining), the lease length, which jobs to stop, which to ask to
    checkpoint (``preempts``) and the waiting jobs leased to it for that room
    (``jobs``)."""
    name = node_of(ctx, who)
    set_target(request, name)
    t = timing(ctx)
    try:
        answer = co.heartbeat(
            cluster_store(ctx),
            name,
            body.report,
            ctx.clock(),
            t.lease_s,
            held=body.jobs,
            registry=ctx.registry,
            timing=t,
            inputs_here=_inputs_here,
            peer=route_peer(
                request.client.host if request.client is not None else None, request.headers
            ),
        )
    except co.UnknownNode as exc:
        raise HttpError(401, exc.message) from None
    if answer["cancels"] or answer.get("jobs") or answer.get("routes_refused"):
        detail: dict[str, Any] = {
            "cancels": answer["cancels"],
            "jobs": [j["id"] for j in answer.get("jobs", [])],
            "preempts": [p["id"] for p in answer.get("preempts", [])],
        }
        if answer.get("routes_refused"):
            detail["routes_refused"] = answer["routes_refused"]
        audit_ok(request, detail)
    return answer


@router.post("/v1/node/claim", responses=_ERRORS)
@action("node.claim")
def claim(body: ClaimIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """Lease to the node what placement offers it now (at most ``want`` jobs)."""
    name = node_of(ctx, who)
    set_target(request, name)
    store = cluster_store(ctx)
    now = ctx.clock()
    t = timing(ctx)
    record = store.touch_node(name, without_routes(body.report), now)
    if record is None:  # pragma: no cover - node_of found it
        raise HttpError(401, f"no node named {name!r}")
    jobs = co.claim(
        store,
        ctx.registry,
        name,
        node_view(record),  # the types it runs and its launch rules are in its report
        now,
        lease_s=t.lease_s,
        timing=t,
        want=body.want,
        inputs_here=_inputs_here,
        record=record,
        half_life_s=ctx.config.broker.fair_share_half_life_s,
    )
    if jobs:
        audit_ok(request, {"jobs": [j["id"] for j in jobs], "lease": jobs[0]["lease_id"]})
    return {"jobs": jobs, "lease_s": t.lease_s, "state": record.state.value}


def _start(ctx: ApiContext, name: str, job_id: str, body: StartIn) -> dict[str, Any]:
    """The start report of one leased job (:class:`co.LeaseRefused` when refused)."""
    return co.start(
        cluster_store(ctx),
        name,
        _job_id(job_id),
        lease_id=body.lease_id,
        gpu_uuid=body.gpu,
        now=ctx.clock(),
    )


def _finish(ctx: ApiContext, name: str, job_id: str, body: FinishIn) -> dict[str, Any]:
    """The finish report of one leased job (:class:`co.LeaseRefused` when refused)."""
    store = cluster_store(ctx)
    output_dir: str | None = None
    lease = None
    now = ctx.clock()
    if body.state in (JobState.DONE, JobState.FAILED):
        lease = co.upload_lease(store, name, _job_id(job_id), lease_id=body.lease_id, now=now)
        folder = outputs_dir(ctx, job_id, lease.attempt or 0)
        folder.mkdir(parents=True, exist_ok=True)
        output_dir = str(folder)
    return co.finish(
        store,
        ctx.registry,
        name,
        _job_id(job_id),
        lease_id=body.lease_id,
        state=body.state,
        outcome=body.outcome,
        reason=body.reason,
        now=now,
        exit_code=body.exit_code,
        result=body.result,
        stdout=body.stdout,
        stderr=body.stderr,
        release=body.release,
        output_dir=output_dir,
        lease=lease,
        held_bytes=body.held_bytes,
        half_life_s=ctx.config.broker.fair_share_half_life_s,
        image=None if body.image is None else co.Image(body.image.id, body.image.reused),
    )


@router.post("/v1/node/jobs/{job_id}/start", responses=_ERRORS)
@action("node.start")
def start(job_id: str, body: StartIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """The node started the leased job (409 when the lease is not its own)."""
    name = node_of(ctx, who)
    set_target(request, job_id)
    try:
        got = _start(ctx, name, job_id, body)
    except co.LeaseRefused as exc:
        raise _refused(exc) from None
    audit_ok(request, {"node": name, "lease": body.lease_id, **got})
    return got


@router.post("/v1/node/jobs/{job_id}/finish", responses=_ERRORS)
@action("node.finish")
def finish(job_id: str, body: FinishIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """The node's attempt of the leased job ended (409 when the lease is not its
    own any more: its result is not recorded)."""
    name = node_of(ctx, who)
    set_target(request, job_id)
    try:
        got = _finish(ctx, name, job_id, body)
    except co.LeaseRefused as exc:
        raise _refused(exc) from None
    audit_ok(request, {"node": name, "lease": body.lease_id, "outcome": body.outcome, **got})
    return got


@router.post("/v1/node/reports", responses=_ERRORS)
@action("node.report")
def reports(body: ReportsIn, request: Request, ctx: Ctx, who: Who) -> dict[str, Any]:
    """Several start and finish reports in one request, applied in order, each as
    its own route would (``POST /v1/node/jobs/{id}/start`` and ``.../finish``):
    ``results`` holds one answer per report, ``status`` 200 with that route's
    answer, or 409 (the lease is not the node's) or 422 with ``error``. Each report
    is audited as ``node.start`` or ``node.finish`` of its job, as by its route."""
    name = node_of(ctx, who)
    set_target(request, name)
    store = cluster_store(ctx)
    results: list[dict[str, Any]] = []
    audits = []
    for r in body.reports:
        head: dict[str, Any] = {"job": r.job, "kind": r.kind}
        try:
            if isinstance(r, StartReport):
                got = _start(ctx, name, r.job, r)
                more: dict[str, Any] = {}
            else:
                got = _finish(ctx, name, r.job, r)
                more = {"outcome": r.outcome}
        except co.LeaseRefused as exc:
            results.append({**head, "status": 409, "error": exc.message})
            audits.append(
                _report_audit(ctx, who, r, outcome="refused: " + exc.message, status=409, detail={})
            )
            continue
        except HttpError as exc:
            results.append({**head, "status": exc.status, "error": exc.message})
            continue
        except UserError as exc:
            results.append({**head, "status": 422, "error": exc.message})
            continue
        results.append({**head, "status": 200, **got})
        detail = {"node": name, "lease": r.lease_id, **more, **got}
        audits.append(_report_audit(ctx, who, r, outcome="ok", status=200, detail=detail))
    store.add_audits(audits)
    return {"results": results}


def _report_audit(
    ctx: ApiContext,
    who: Principal,
    r: StartReport | FinishReport,
    *,
    outcome: str,
    status: int,
    detail: dict[str, Any],
) -> AuditRow:
    action_name = "node.start" if isinstance(r, StartReport) else "node.finish"
    return who.audit(
        action_name,
        now=ctx.clock(),
        target=r.job,
        outcome=outcome,
        detail={"status": status, **detail},
    )


@router.put("/v1/node/jobs/{job_id}/outputs/{path:path}", responses=_ERRORS)
@action("node.upload")
async def upload_output(
    job_id: str,
    path: str,
    request: Request,
    *,
    ctx: Ctx,
    who: Who,
    lease_id: Annotated[str, Query(min_length=1, max_length=64)],
) -> dict[str, Any]:
    """One output file of the node's running attempt of the leased job (the body is
    the file), before it reports the end: kept on the coordinator, where
    ``GET /v1/jobs/{id}/outputs/{path}`` and result bundles find it. 409 when the
    lease is not its own; 413 past ``api.max_output_mib``; 422 for a path that
    cannot be a file there (SPEC.md, section 16)."""
    name = await run_in_threadpool(node_of, ctx, who)
    set_target(request, job_id)
    rel = files.check_name(path, "output path", raw_path=request.scope.get("raw_path"))
    try:
        attempt = await run_in_threadpool(
            co.check_upload,
            cluster_store(ctx),
            name,
            _job_id(job_id),
            lease_id=lease_id,
            now=ctx.clock(),
        )
    except co.LeaseRefused as exc:
        raise _refused(exc) from None
    root = outputs_dir(ctx, job_id, attempt)
    root.mkdir(parents=True, exist_ok=True)
    written = await files.receive(
        request,
        root=root,
        rel=rel,
        parts_dir=ctx.config.state_dir / "outputs" / files.PARTS,
        limit=int(ctx.config.api.max_output_mib * MIB),
    )
    audit_ok(request, {"node": name, "lease": lease_id, "path": rel, "bytes": written})
    return {"path": rel, "bytes": written}


#: header of a refused log chunk (416): the offset the coordinator's copy has
OFFSET_HEADER = "X-Gpuwarden-Offset"


def logs_root(ctx: ApiContext) -> Path:
    """Where the coordinator keeps the streams agents send of running attempts."""
    return ctx.config.state_dir / "logs"


@router.post(
    "/v1/node/jobs/{job_id}/logs/{stream}", responses={**_ERRORS, 416: {"model": ErrorOut}}
)
@action("node.logs")
async def append_log(
    job_id: str,
    stream: Literal["stdout", "stderr", "build"],
    request: Request,
    *,
    ctx: Ctx,
    who: Who,
    lease_id: Annotated[str, Query(min_length=1, max_length=64)],
    offset: Annotated[int, Query(ge=0, le=2**50)],
) -> dict[str, Any]:
    """New bytes of a stream of the node's running attempt (the body, at most
    64 KiB), starting at byte ``offset``: appended to the coordinator's copy once
    (bytes it has already are skipped); 416 when ``offset`` is past its copy
    (``X-Gpuwarden-Offset`` says where to send from); 409 when the lease is not its
    own (SPEC.md, section 16, "Streams while a job runs")."""
    name = await run_in_threadpool(node_of, ctx, who)
    try:
        attempt = await run_in_threadpool(
            co.check_upload, cluster_store(ctx), name, _job_id(job_id), lease_id=lease_id,
            now=ctx.clock(),
        )  # fmt: skip
    except co.LeaseRefused as exc:
        raise _refused(exc) from None
    data = await _small_body(request, logcopy.MAX_CHUNK)
    path = logcopy.log_path(logs_root(ctx), job_id, attempt, stream)
    bound = int(ctx.config.api.max_log_mib * MIB)
    try:
        have = await run_in_threadpool(logcopy.append, path, offset, data, bound=bound)
    except logcopy.Gap as gap:
        raise HttpError(
            416, f"{stream} of job {job_id}: {gap}", {OFFSET_HEADER: str(gap.offset)}
        ) from None
    return {"offset": have}


async def _small_body(request: Request, most: int) -> bytes:
    """The request's body; 413 past ``most`` bytes."""
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > most:
            raise HttpError(413, f"a log chunk is at most {most} bytes")
    return bytes(data)


def _inputs_here(input_dir: str) -> bool:
    return Path(input_dir).is_dir()


@router.get(
    "/v1/node/jobs/{job_id}/inputs/{name:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **_ERRORS},
)
@action("node.fetch")
def fetch_input(
    job_id: str,
    name: str,
    request: Request,
    *,
    ctx: Ctx,
    who: Who,
    lease_id: Annotated[str, Query(min_length=1, max_length=64)],
) -> StreamingResponse:
    """One input file of the leased job, as its bundle staged it on this
    coordinator (409 when the lease is not the node's)."""
    node = node_of(ctx, who)
    rel = files.check_name(name, "input name", raw_path=request.scope.get("raw_path"))
    try:
        job = co.check_fetch(
            cluster_store(ctx), node, _job_id(job_id), lease_id=lease_id, now=ctx.clock()
        )
    except co.LeaseRefused as exc:
        raise _refused(exc) from None
    if rel not in job.inputs:
        listed = ", ".join(job.inputs) or "none"
        raise HttpError(404, f"job {job.id} has no input {files.shown(rel)} (its inputs: {listed})")
    if not job.input_dir:
        raise HttpError(404, f"input {files.shown(rel)} of job {job.id} is not on this coordinator")
    try:
        fd, st = files.open_below(Path(job.input_dir), rel)
    except files.NotServed as exc:
        raise HttpError(
            404, f"input {files.shown(rel)} of job {job.id} is not served here: it {exc.why}"
        ) from None
    return files.fd_response(fd, st, rel.rpartition("/")[2])


# -- operators --------------------------------------------------------------------


@router.get("/v1/nodes", responses=_ERRORS)
@action("node.list")
def list_nodes(ctx: Ctx) -> list[dict[str, Any]]:
    """Every enrolled node: state, when it was last heard from, leases, GPUs."""
    store = cluster_store(ctx)
    now = ctx.clock()
    leases = store.leases()
    grants = {g.node: g for g in store.open_grants()}
    return [node_json(r, leases, now, grants) for r in store.list_nodes()]


def _name(name: str) -> str:
    if not co.NODE_NAME.fullmatch(name):
        raise HttpError(404, f"no node named {name!r} (GET /v1/nodes lists them)")
    return name


@router.post("/v1/nodes/{name}/drain", responses=_ERRORS)
@action("node.drain")
def drain(name: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    """No new work for the node; what it runs finishes."""
    set_target(request, name)
    store = cluster_store(ctx)
    try:
        record = co.drain(store, _name(name), now=ctx.clock())
    except co.UnknownNode as exc:
        raise HttpError(404, exc.message) from None
    except UserError as exc:
        raise HttpError(409, exc.message) from None
    audit_ok(request)
    return node_json(record, store.leases(), ctx.clock())


@router.post("/v1/nodes/{name}/resume", responses=_ERRORS)
@action("node.resume")
def resume(name: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    """A draining node takes new work again (``resumed``: false when it was not
    draining, and nothing changed)."""
    set_target(request, name)
    store = cluster_store(ctx)
    try:
        record, changed = co.resume(store, _name(name), now=ctx.clock())
    except co.UnknownNode as exc:
        raise HttpError(404, exc.message) from None
    except UserError as exc:
        raise HttpError(409, exc.message) from None
    audit_ok(request, {"resumed": changed})
    return {**node_json(record, store.leases(), ctx.clock()), "resumed": changed}


class DiagnosticIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=1000)


@router.post("/v1/nodes/{name}/diagnostic", responses=_ERRORS)
@action("node.diagnostic")
def diagnostic(
    name: str, body: DiagnosticIn, request: Request, ctx: Ctx, who: Who
) -> dict[str, Any]:
    """Let one exact queued job start on the draining node, once (Owner)."""
    set_target(request, name)
    try:
        grant = co.diagnostic(
            cluster_store(ctx),
            _name(name),
            body.job,
            by=who.token_id,
            reason=body.reason,
            now=ctx.clock(),
        )
    except co.UnknownNode as exc:
        raise HttpError(404, exc.message) from None
    except UserError as exc:
        raise HttpError(409, exc.message) from None
    out = grant_json(grant)
    audit_ok(request, {"job": grant.job_id, "reason": grant.reason})
    return out


@router.post("/v1/nodes/{name}/revoke", responses=_ERRORS)
@action("node.revoke")
def revoke(name: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    """Refuse the node's credential at once; its jobs go back to the queue (running
    ones end as infrastructure failures and run elsewhere)."""
    set_target(request, name)
    try:
        got = co.revoke(cluster_store(ctx), ctx.registry, _name(name), now=ctx.clock())
    except co.UnknownNode as exc:
        raise HttpError(404, exc.message) from None
    audit_ok(request, got)
    return got


# -- the coordinator -----------------------------------------------------------------


def install_coordinator(app: FastAPI, *, clock: Callable[[], float] | None = None) -> None:
    """Make ``app`` a coordinator's: it sweeps (:func:`install_sweeper`), and
    ``GET /v1/status`` shows every enrolled node (:func:`is_coordinator`)."""
    app.state.gw_coordinator = True
    install_sweeper(app, clock=clock)


def is_coordinator(request: Request) -> bool:
    return bool(getattr(request.app.state, "gw_coordinator", False))


def set_coordinator_url(app: FastAPI, url: str) -> None:
    """The URL agents reach this coordinator at (``[cluster] coordinator_url``, else
    the address it listens on): the answer to an invite names it."""
    app.state.gw_coordinator_url = url


def coordinator_url(request: Request) -> str | None:
    ctx: ApiContext = request.app.state.gw
    url = ctx.config.cluster.coordinator_url or getattr(
        request.app.state, "gw_coordinator_url", None
    )
    return str(url) if url else None


# -- the sweeper --------------------------------------------------------------------


def install_sweeper(app: FastAPI, *, clock: Callable[[], float] | None = None) -> None:
    """Run :func:`gpuwarden.cluster.coordinator.sweep` every ``[cluster]
    sweep_every_s`` while the app runs (its lifespan; once per app)."""
    if getattr(app.state, "gw_sweeper", None) is not None:
        return
    ctx: ApiContext = app.state.gw
    store: Store = ctx.store
    if not isinstance(store, ClusterStore):  # pragma: no cover - both stores are
        return
    logs = LogCopies(logs_root(ctx), ctx.config.api.log_keep_days * 86400.0)
    sweeper = Sweeper(store, ctx.registry, ctx.config.cluster, clock=clock or ctx.clock, logs=logs)
    app.state.gw_sweeper = sweeper
    run_while_serving(app, sweeper.start, sweeper.stop)
