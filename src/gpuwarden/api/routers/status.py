"""Node status, job types, and health (the one route that needs no token).

On a coordinator (``gpuwarden coordinator``), ``GET /v1/status`` also lists every
enrolled node as its agent last reported it (``cluster``), and ``GET /v1/types``
says a type runs when an enrolled node's types and launch rules allow it: the
coordinator runs nothing itself.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gpuwarden import __version__
from gpuwarden.api.auth import Principal, Scope, allowed
from gpuwarden.api.context import ApiContext, action, get_ctx, get_principal, get_scope
from gpuwarden.api.models import ErrorOut, Health, ParamOut, ShareOut, StatusOut, TypeOut
from gpuwarden.api.redact import Redactor
from gpuwarden.api.routers.nodes import is_coordinator
from gpuwarden.cluster import coordinator as co
from gpuwarden.cluster.report import cluster_status
from gpuwarden.node.fairuse import LOCAL_NAME, share_report
from gpuwarden.node.measured import type_profiles
from gpuwarden.store.cluster import ClusterStore

router = APIRouter(tags=["status"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorOut} for code in (401, 403, 429)}


@router.get("/v1/health", response_model=Health, responses={429: {"model": ErrorOut}})
@action("health.read")
def health() -> Health:
    """The API answers (no token needed). Says nothing about the broker: see /v1/status."""
    return Health(ok=True, version=__version__)


@router.get(
    "/v1/status",
    response_model=StatusOut,
    response_model_exclude_unset=True,  # ``cluster`` only on a coordinator
    responses=_ERRORS,
    dependencies=[Depends(get_scope)],
)
@action("status.read")
def status(
    request: Request, ctx: Ctx, who: Annotated[Principal, Depends(get_principal)]
) -> StatusOut:
    """What each node's broker last published (as `gpuwarden status --json`); on a
    coordinator also ``cluster``: every enrolled node as its agent last reported it
    (state, the first problem, GPUs, warm servers, running jobs, how long since it
    was heard from). A submitter is shown no id of another token's job (``null``, or
    ``another job`` in text)."""
    nodes = [
        {"node": s.node, "pid": s.pid, "updated_at": s.updated_at, **s.payload}
        for s in ctx.store.node_statuses()
    ]
    cluster: list[dict[str, Any]] | None = None
    if is_coordinator(request) and isinstance(ctx.store, ClusterStore):
        cluster = cluster_status(
            ctx.store, ctx.clock(), offline_after_s=ctx.config.cluster.offline_after_s
        )
    if allowed(who.role, "job.read") is Scope.OWN:
        redactor = Redactor(ctx.store, who.token_id)
        nodes = [redactor.value(_services_of(n, who)) for n in nodes]
        if cluster is not None:
            cluster = [redactor.value(n) for n in cluster]
    counts = {k.value: v for k, v in ctx.store.count_by_state().items()}
    if cluster is None:
        return StatusOut(nodes=nodes, jobs=counts)
    return StatusOut(nodes=nodes, jobs=counts, cluster=cluster)


def _services_of(node: dict[str, Any], who: Principal) -> dict[str, Any]:
    """A node's status with only the services ``who`` may reach (its own, or
    shared with its token or role): no other service's name is shown to it, as
    ``/run/`` tells none (SPEC.md section 15, "Services at /run/")."""
    services = node.get("services")
    if not isinstance(services, list):
        return node
    mine = [
        s
        for s in services
        if isinstance(s, dict)
        and (
            s.get("owner") == who.token_id
            or who.token_id in (s.get("share") or ())
            or who.role.value in (s.get("share") or ())
        )
    ]
    return node | {"services": mine}


@router.get(
    "/v1/share",
    response_model=list[ShareOut],
    responses=_ERRORS,
)
@action("share.read")
def share(
    ctx: Ctx,
    who: Annotated[Principal, Depends(get_principal)],
    scope: Annotated[Scope, Depends(get_scope)],
) -> list[ShareOut]:
    """Each owner's fair share: VRAM GiB-hours used (decayed), jobs queued and
    running, and standing among owners (1 goes first at equal priority). A
    submitter sees only its own row (its standing still among all owners)."""

    def name_of(owner: str) -> str:
        token = ctx.store.get_token(owner) if owner else None
        return LOCAL_NAME if not owner else token.name if token else owner

    rows = share_report(ctx.store, ctx.config.broker.fair_share_half_life_s, ctx.clock(), name_of)
    if scope is Scope.OWN:
        rows = [r for r in rows if r["owner"] == who.token_id]
    return [ShareOut(**r) for r in rows]


@router.get(
    "/v1/types",
    response_model=list[TypeOut],
    responses=_ERRORS,
    dependencies=[Depends(get_scope)],
)
@action("types.read")
def types(request: Request, ctx: Ctx) -> list[TypeOut]:
    """The job types this API accepts, with their parameters, and whether they run
    here (on a coordinator: on an enrolled node, or no node is enrolled yet)."""
    rules = ctx.registry.rules
    store = ctx.store
    cluster = is_coordinator(request) and isinstance(store, ClusterStore)

    def runs(t: Any) -> bool:
        if cluster:
            assert isinstance(store, ClusterStore)
            return co.type_refusal(store, ctx.registry, t) is None
        return rules.refusal(t) is None

    described = {d["type"]: d for d in ctx.registry.describe()}
    profiles = type_profiles(store, ctx.registry.types.values())
    out = []
    for t in sorted(ctx.registry.types.values(), key=lambda t: t.name):
        d = described[t.name]
        runs_here = runs(t)
        out.append(
            TypeOut(
                type=t.name,
                module=t.module,
                lane=t.lane.value,
                launch=t.launch.value,
                vram_bytes=t.vram_bytes,
                coresident=t.coresident,
                timeout_s=t.timeout_s,
                max_retries=t.max_retries,
                gpus=t.gpus,
                preemptible=t.preemptible,
                preemption=d["preemption"],
                runs_here=runs_here,
                # a coordinator runs nothing: how a type runs is each node's business
                refused=None if cluster else d["refused"],
                runs_as=("on an enrolled node" if runs_here else None) if cluster else d["runs_as"],
                unsandboxed=None if cluster else d["unsandboxed"],
                source=d["source"],
                description=t.description,
                profile=profiles.get(t.name),
                params=[
                    ParamOut(
                        name=p.name,
                        type=p.type.value,
                        required=p.required,
                        default=p.default,
                        choices=list(p.choices),
                        description=p.description,
                    )
                    for p in t.params
                ],
            )
        )
    return out
