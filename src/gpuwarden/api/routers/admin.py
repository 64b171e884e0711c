"""Tokens (the owner's) and the audit log (owner and operator)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from gpuwarden.api.auth import Principal, issue_token
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
from gpuwarden.api.models import AuditOut, ErrorOut, NewToken, TokenIn, TokenOut

# defence in depth: a route the gate did not grant a scope to is refused (403)
router = APIRouter(tags=["admin"], dependencies=[Depends(get_scope)])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 404, 409, 413, 422, 429)
}
_TOKEN_ID = re.compile(r"^[0-9a-f]{12}$")


@router.post("/v1/tokens", status_code=201, response_model=NewToken, responses=_ERRORS)
@action("token.create")
def create_token(body: TokenIn, request: Request, ctx: Ctx, who: Who) -> NewToken:
    """Make a token. The response holds it, once: it is never shown again."""
    now = ctx.clock()
    expires_at = now + body.expires_in_s if body.expires_in_s is not None else None
    record, token = issue_token(
        ctx.store,
        name=body.name,
        role=body.role,
        by=who,
        now=now,
        expires_at=expires_at,
        node=body.node,
    )
    # issue_token wrote the audit row (the CLI makes tokens the same way)
    request.scope.setdefault("state", {})["gw_audited"] = True
    set_target(request, record.id)
    return NewToken(**TokenOut.of(record, now).model_dump(), token=token)


@router.get("/v1/tokens", response_model=list[TokenOut], responses=_ERRORS)
@action("token.list")
def list_tokens(ctx: Ctx) -> list[TokenOut]:
    """Every token, revoked and expired ones too; never a secret."""
    now = ctx.clock()
    return [TokenOut.of(t, now) for t in ctx.store.list_tokens()]


@router.delete("/v1/tokens/{token_id}", response_model=TokenOut, responses=_ERRORS)
@action("token.revoke")
def revoke_token(token_id: str, request: Request, ctx: Ctx) -> TokenOut:
    """Revoke a token: every request with it is refused (401) from now on."""
    set_target(request, token_id)
    record = ctx.store.get_token(token_id) if _TOKEN_ID.fullmatch(token_id) else None
    if record is None:
        raise HttpError(404, f"no token with id {token_id!r} (GET /v1/tokens lists them)")
    now = ctx.clock()
    if not ctx.store.revoke_token(record.id, now=now):
        raise HttpError(409, f"token {record.id} ({record.name}) was revoked already")

    audit_ok(request, {"name": record.name, "role": record.role.value})
    revoked = ctx.store.get_token(record.id)
    assert revoked is not None
    return TokenOut.of(revoked, now)


@router.get("/v1/audit", response_model=list[AuditOut], responses=_ERRORS)
@action("audit.read")
def audit_log(
    ctx: Ctx,
    after_id: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[AuditOut]:
    """Audit rows after ``after_id``, oldest first."""
    return [AuditOut.of(r) for r in ctx.store.audit_rows(after_id=after_id, limit=limit)]
