"""Node status, job types, and health (the one route that needs no token)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from gpuwarden import __version__
from gpuwarden.api.auth import Principal, Scope, allowed
from gpuwarden.api.context import ApiContext, action, get_ctx, get_principal, get_scope
from gpuwarden.api.models import ErrorOut, Health, ParamOut, StatusOut, TypeOut
from gpuwarden.api.redact import Redactor

router = APIRouter(tags=["status"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorOut} for code in (401, 403, 429)}


@router.get("/v1/health", response_model=Health, responses={429: {"model": ErrorOut}})
@action("health.read")
def health() -> Health:
    """The API answers (no token needed). Says nothing about the broker: see /v1/status."""
    return Health(ok=True, version=__version__)


@router.get(
    "/v1/status", response_model=StatusOut, responses=_ERRORS, dependencies=[Depends(get_scope)]
)
@action("status.read")
def status(ctx: Ctx, who: Annotated[Principal, Depends(get_principal)]) -> StatusOut:
    """What each node's broker last published (as `gpuwarden status --json`). A
    submitter is shown no id of another token's job (``null``, or ``another job``
    in text)."""
    nodes = [
        {"node": s.node, "pid": s.pid, "updated_at": s.updated_at, **s.payload}
        for s in ctx.store.node_statuses()
    ]
    if allowed(who.role, "job.read") is Scope.OWN:
        redactor = Redactor(ctx.store, who.token_id)
        nodes = [redactor.value(n) for n in nodes]
    counts = {k.value: v for k, v in ctx.store.count_by_state().items()}
    return StatusOut(nodes=nodes, jobs=counts)


@router.get(
    "/v1/types",
    response_model=list[TypeOut],
    responses=_ERRORS,
    dependencies=[Depends(get_scope)],
)
@action("types.read")
def types(ctx: Ctx) -> list[TypeOut]:
    """The job types this API accepts, with their parameters."""
    rules = ctx.registry.rules
    return [
        TypeOut(
            type=t.name,
            lane=t.lane.value,
            launch=t.launch.value,
            vram_bytes=t.vram_bytes,
            coresident=t.coresident,
            timeout_s=t.timeout_s,
            max_retries=t.max_retries,
            runs_here=rules.refusal(t) is None,
            description=t.description,
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
        for t in sorted(ctx.registry.types.values(), key=lambda t: t.name)
    ]
