"""What every API route works with: the store, the registry, the config, the clock;
and the request's principal, the scope it was granted, and its audit row."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.datastructures import Headers

from gpuwarden.api.auth import AuthFailed, Principal, Scope, authenticate, authenticate_session
from gpuwarden.api.errors import HttpError
from gpuwarden.api.runsite import RUN_COOKIE, RunPasses, on_services_host
from gpuwarden.api.session import SESSION_COOKIE, Session, Sessions, cookie_value
from gpuwarden.config import Config
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.node.jobends import JobEnds
from gpuwarden.registry import Registry
from gpuwarden.store.base import AuditRow, Store

log = logging.getLogger(__name__)

#: the running services of the broker in this process, by name (``/run/<name>/``)
ServiceRoutes = Callable[[], Mapping[str, ServiceRoute]]


@dataclass
class ApiContext:
    store: Store
    registry: Registry
    config: Config
    clock: Callable[[], float] = time.time
    #: the API's start, for /v1/health
    started_at: float = field(default_factory=time.time)
    #: in the broker's process (``serve --api``): make its loop look at the store
    #: now (a job was submitted), and where its loop says that jobs ended
    wake: Callable[[], None] | None = None
    ends: JobEnds | None = None
    #: the dashboard's browser sessions, in this process only (api/session.py)
    sessions: Sessions = field(default_factory=Sessions)
    #: the services this process serves at ``/run/<name>/`` (api/routers/services.py);
    #: None: none (every name is 404). Asked on every request: never cached.
    routes: ServiceRoutes | None = None
    #: the handoffs and passes of browsers on the services host (api/runsite.py)
    passes: RunPasses = field(default_factory=RunPasses)


def identify(
    ctx: ApiContext, headers: Headers, client: str, *, service: str | None = None
) -> tuple[Principal, Session | None]:
    """Who makes a request: the bearer header's principal; without that header, the
    session cookie's (and the session), from the address it was signed in from; on
    the services host (a request for service ``service``), its pass's
    (api/runsite.py), never the dashboard's session. Raises :class:`AuthFailed`.
    Reads the store: call it on a worker thread."""
    now = ctx.clock()
    authorization = headers.get("authorization")
    services_host = ctx.config.api.services_host
    if not authorization and on_services_host(services_host, headers, service):
        pass_id = cookie_value(headers.get("cookie"), RUN_COOKIE)
        holder = None if pass_id is None else ctx.passes.holder(pass_id, service or "", client)
        if holder is None:
            raise AuthFailed(
                "no pass for this service in this browser: open it from the API's own "
                "host (its dashboard, or /run/NAME/ there), which sends you here with one"
            )
        return authenticate_session(ctx.store, holder, now=now), None
    sid = None if authorization else cookie_value(headers.get("cookie"), SESSION_COOKIE)
    if sid is None:
        return authenticate(ctx.store, authorization, now=now), None
    session = ctx.sessions.get(sid)
    if session is None:
        raise AuthFailed(
            "this browser's session has ended (signed out, expired, or the API was "
            "restarted): sign in again at /"
        )
    if session.client and session.client != client:
        raise AuthFailed(
            "this session was signed in from another address: sign in again at / "
            "(a session cookie is taken only from where it was made)"
        )
    try:
        return authenticate_session(ctx.store, session.token_id, now=now), session
    except AuthFailed:
        ctx.sessions.end(sid)  # its token is revoked or expired: so is the session
        raise


# the three below are async: they only read the request's state, and a plain
# function would be run on a worker thread (a hop on every request)
async def get_ctx(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.gw
    return ctx


async def get_principal(request: Request) -> Principal:
    principal = request.scope.get("state", {}).get("gw_principal")
    if not isinstance(principal, Principal):  # the gate lets no such request through
        raise HttpError(401, "no token", {"WWW-Authenticate": "Bearer"})
    return principal


async def get_scope(request: Request) -> Scope:
    scope = request.scope.get("state", {}).get("gw_scope")
    if not isinstance(scope, Scope):  # the gate grants one to every request it lets by
        raise HttpError(403, "this endpoint is in no row of the permission matrix")
    return scope


def set_target(request: Request, target: str) -> None:
    """What the request's audit row names as its target (a job id, a token id)."""
    request.scope.setdefault("state", {})["gw_target"] = target


def audit_ok(
    request: Request, detail: dict[str, Any] | None = None, target: str = "", status: int = 200
) -> None:
    """Write the audit row of a mutating call that succeeded."""
    state = request.scope.setdefault("state", {})
    if target:
        state["gw_target"] = target
    hook = state.get("gw_audit")
    if hook is None or state.get("gw_audited"):
        return
    state["gw_audited"] = True
    try:
        hook("ok", status, detail or {})
    except Exception:  # the change is made; refusing it now would lie to the client
        log.exception("could not write the audit row of a request that succeeded")


class AuditHook:
    """Writes one request's audit row; the gate puts it in the request's state."""

    def __init__(
        self,
        ctx: ApiContext,
        state: dict[str, Any],
        action: str,
        principal: Principal | None,
        *,
        target: str = "",
        claimed: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.state = state
        self.action = action
        self.principal = principal
        self.target = target
        self.claimed = claimed

    def __call__(self, outcome: str, status: int, detail: dict[str, Any] | None = None) -> None:
        target = str(self.state.get("gw_target") or self.target)
        more: dict[str, Any] = {"status": status, **(detail or {})}
        now = self.ctx.clock()
        if self.principal is not None:
            row = self.principal.audit(
                self.action, now=now, target=target, outcome=outcome, detail=more
            )
        else:
            if self.claimed:
                more["claimed_token"] = self.claimed
            row = AuditRow(
                ts=now,
                actor="-",
                actor_name="(not authenticated)",
                role="-",
                action=self.action,
                target=target,
                outcome=outcome,
                detail=more,
            )
        self.ctx.store.add_audit(row)


F = Any

#: the attribute :func:`action` sets on a route's function
ACTION_ATTRIBUTE = "gpuwarden_action"


def action(name: str) -> Callable[[F], F]:
    """Name the permission-matrix action of a route (``gpuwarden.api.auth.MATRIX``).
    The gate checks it before the route runs; every route must have one."""

    def mark(fn: F) -> F:
        setattr(fn, ACTION_ATTRIBUTE, name)
        return fn

    return mark


def action_of(endpoint: Any) -> str | None:
    name = getattr(endpoint, ACTION_ATTRIBUTE, None)
    return name if isinstance(name, str) else None


def run_while_serving(app: FastAPI, start: Callable[[], None], stop: Callable[[], None]) -> None:
    """Call ``start`` when the app's lifespan begins and ``stop`` when it ends (a
    background thread of the API: the dashboard's sampler, the coordinator's
    sweeper), around whatever lifespan the app had."""
    inner = app.router.lifespan_context
    lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        with lock:
            start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            stop()

    app.router.lifespan_context = lifespan
