"""Signing a browser in and out of the dashboard (api/session.py says how the
session cookie and its CSRF secret work).

``POST /v1/session`` takes a token (JSON ``{"token": ...}`` or a form field
``token``), checks it as the bearer path does, and sets the cookies; it is
refused from another site's page (login CSRF) and for a node's credential.
``GET /v1/session`` says who is signed in and what the page may offer them;
``DELETE /v1/session`` signs out (by cookie: from the API's own page, with the
CSRF header, like every other mutating call)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from gpuwarden.api.auth import (
    SESSION_ROLES,
    AuthFailed,
    Principal,
    Scope,
    allowed,
    authenticate,
)
from gpuwarden.api.context import (
    ApiContext,
    AuditHook,
    action,
    audit_ok,
    get_ctx,
    get_principal,
    get_scope,
)
from gpuwarden.api.errors import HttpError
from gpuwarden.api.models import ErrorOut
from gpuwarden.api.session import (
    SESSION_COOKIE,
    Session,
    clear_cookie_headers,
    cookie_value,
    same_origin,
    set_cookie_headers,
)

router = APIRouter(tags=["session"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 413, 422, 429)
}
#: what the page may offer, by the action it calls
_OFFERS = (
    "job.cancel",
    "lease.end",
    "node.list",
    "node.drain",
    "node.resume",
    "gpu.clear",
    "audit.read",
)


def _token_of(request: Request, body: bytes) -> tuple[str, bool]:
    """The token a sign-in carries, and whether it came as a form (not JSON)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    text = body.decode("utf-8", "replace")
    if ctype == "application/x-www-form-urlencoded":
        try:
            values = urllib.parse.parse_qs(text, max_num_fields=10).get("token", [])
        except ValueError:  # more fields than a sign-in form has
            raise HttpError(
                422, "a sign-in form has one field, token: this one has more than 10"
            ) from None
        return (values[0] if values else ""), True
    try:
        doc = json.loads(text) if text.strip() else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("token"), str):
        raise HttpError(
            422,
            'sign in with a JSON body {"token": "gw_..."} or a form field token '
            "(Content-Type: application/x-www-form-urlencoded)",
        )
    return str(doc["token"]), False


def _client(request: Request) -> str:
    """The client's address as the gate sees it (the ASGI scope's)."""
    return str((request.scope.get("client") or ("unknown",))[0])


def describe(ctx: ApiContext, who: Principal, session: Session | None) -> dict[str, Any]:
    """Who is signed in, how, and what the page may offer them."""
    return {
        "token_id": who.token_id,
        "name": who.name,
        "role": who.role.value,
        "via": "cookie" if session is not None else "bearer",
        "csrf": session.csrf if session is not None else None,
        "expires_at": session.expires_at if session is not None else None,
        "own_jobs_only": allowed(who.role, "job.read") is Scope.OWN,
        "can": {a: allowed(who.role, a) is not None for a in _OFFERS},
        "events": "/v1/events",
    }


@router.post("/v1/session", responses=_ERRORS)
@action("session.create")
async def sign_in(request: Request, ctx: Ctx) -> Response:
    """Sign a browser in with a token: sets the session cookie (HttpOnly,
    SameSite=Strict; Secure over https) and the CSRF cookie. A JSON sign-in is
    answered with what ``GET /v1/session`` says; a form's with a redirect to ``/``."""
    state = request.scope.setdefault("state", {})
    state["gw_audit"] = AuditHook(ctx, state, "session.create", None)
    why = same_origin(
        scheme=request.url.scheme,
        host=request.headers.get("host"),
        origin=request.headers.get("origin"),
        fetch_site=request.headers.get("sec-fetch-site"),
        referer=request.headers.get("referer"),
    )
    if why is not None:
        raise HttpError(403, f"sign in from this API's own page: {why}")
    token, form = _token_of(request, await request.body())
    try:
        who = await run_in_threadpool(
            authenticate, ctx.store, f"Bearer {token.strip()}", now=ctx.clock()
        )
    except AuthFailed as exc:
        state["gw_audit"] = AuditHook(ctx, state, "session.create", None, claimed=exc.token_id)
        raise HttpError(401, exc.message) from None
    state["gw_audit"] = AuditHook(ctx, state, "session.create", who, target=who.token_id)
    if who.role not in SESSION_ROLES:
        raise HttpError(
            403, f"a {who.role.value} token cannot sign in to the dashboard: use a person's token"
        )
    session = ctx.sessions.create(who.token_id, client=_client(request))
    await run_in_threadpool(audit_ok, request, {"expires_at": session.expires_at})
    response: Response = (
        RedirectResponse("/", status_code=303)
        if form
        else JSONResponse(describe(ctx, who, session))
    )
    for value in set_cookie_headers(session, secure=request.url.scheme == "https"):
        response.headers.append("set-cookie", value)
    response.headers["cache-control"] = "no-store"
    return response


@router.get("/v1/session", responses=_ERRORS, dependencies=[Depends(get_scope)])
@action("session.read")
def whoami(request: Request, ctx: Ctx, who: Who) -> JSONResponse:
    """Who this request is (by cookie or bearer token), its role and what the page
    may offer it; by cookie also the session's CSRF secret and expiry."""
    session = request.scope.get("state", {}).get("gw_session")
    doc = describe(ctx, who, session if isinstance(session, Session) else None)
    return JSONResponse(doc, headers={"cache-control": "no-store"})


@router.delete("/v1/session", responses=_ERRORS, dependencies=[Depends(get_scope)])
@action("session.delete")
def sign_out(request: Request, ctx: Ctx) -> JSONResponse:
    """End this browser's session (its cookie is refused from now on) and clear its
    cookies. With a bearer token there is no session: ``signed_out`` is false."""
    sid = cookie_value(request.headers.get("cookie"), SESSION_COOKIE)
    ended = bool(sid) and request.headers.get("authorization") is None
    ended = ended and ctx.sessions.end(str(sid))
    audit_ok(request, {"signed_out": ended})
    response = JSONResponse({"signed_out": ended}, headers={"cache-control": "no-store"})
    for value in clear_cookie_headers(secure=request.url.scheme == "https"):
        response.headers.append("set-cookie", value)
    return response
