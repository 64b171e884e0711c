"""The HTTP API for clients: ``create_app(store, registry, config)``.

Every request passes the gate first (plain ASGI, before its body is read): the
route's action (``context.action``) is looked up in the permission matrix
(``auth.MATRIX``); the token is checked (401), then the role (403), then the
token's rate (429); then the body-size limit applies (413). Only then does
FastAPI parse the body (422) and run the route. Each refusal of a mutating
action is written to the audit log, and so is each success.

A request without an ``Authorization`` header may instead carry the dashboard's
session cookie (``api/session.py``); a mutating action by cookie must then come
from the API's own origin and carry the session's CSRF header, or it is refused
(403, audited). Bearer-token requests are unchanged.

Routers, one per concern (``routers/``): ``jobs``, ``admin`` (tokens, audit),
``status`` (status, types, health). Node and agent endpoints come as a router
of their own: add it to :data:`ROUTERS` (the gate knows the routes from there,
so a router included any other way is not guarded) and give each of its routes
an action that has a row in ``auth.MATRIX`` (``create_app`` refuses to build an
app with a route that has none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.routing import Match

from gpuwarden import __version__
from gpuwarden.api import docs, errors
from gpuwarden.api.auth import (
    MATRIX,
    MUTATING,
    PUBLIC,
    AuthFailed,
    Principal,
    allowed,
    needed_roles,
)
from gpuwarden.api.context import ApiContext, AuditHook, ServiceRoutes, action_of, identify
from gpuwarden.api.limits import (
    ASGIApp,
    BodyLimitMiddleware,
    RateLimiter,
    Receive,
    Scope,
    Send,
    retry_after,
    send_error,
    send_redirect,
)
from gpuwarden.api.routers import (
    admin,
    dashboard,
    events,
    gpus,
    jobs,
    leases,
    logs,
    metrics,
    nodes,
    services,
    status,
)
from gpuwarden.api.routers import session as session_routes
from gpuwarden.api.runsite import (
    on_services_host,
    run_cookie,
    services_url,
    with_handoff,
    without_handoff,
)
from gpuwarden.api.session import (
    CSRF_HEADER,
    Session,
    Sessions,
    csrf_refusal,
    same_origin,
)
from gpuwarden.config import Config
from gpuwarden.core.model import MIB
from gpuwarden.errors import StoreUnavailable
from gpuwarden.node.jobends import JobEnds
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store

#: every router of the API, one per concern; the gate guards the routes of these
ROUTERS: tuple[APIRouter, ...] = (
    jobs.router,
    leases.router,
    logs.router,
    admin.router,
    status.router,
    nodes.router,
    gpus.router,
    metrics.router,
    events.router,
    session_routes.router,
    dashboard.router,
    services.router,
)


def create_app(
    store: Store,
    registry: Registry,
    config: Config,
    *,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    wake: Callable[[], None] | None = None,
    ends: JobEnds | None = None,
    service_routes: ServiceRoutes | None = None,
) -> FastAPI:
    """The API on ``store``. ``clock`` stamps jobs, tokens and audit rows;
    ``monotonic`` drives the rate limiter (both injectable for tests). In the
    broker's process: ``wake`` makes its loop look at the store at once (after a
    submit), ``ends`` is where the loop says that jobs ended (a ``wait``), and
    ``service_routes`` gives its running services, served at ``/run/<name>/``."""
    app = FastAPI(
        title="gpuwarden",
        version=__version__,
        description="The HTTP API of the gpuwarden GPU job broker (SPEC.md, section 15).",
        default_response_class=errors.AsciiJSONResponse,
        docs_url=None,  # served by docs.install, from files on this host
        redoc_url=None,
    )
    ctx = ApiContext(
        store=store,
        registry=registry,
        config=config,
        clock=clock,
        wake=wake,
        ends=ends,
        sessions=Sessions(clock=clock),
        routes=service_routes,
    )
    app.state.gw = ctx
    errors.install(app)
    docs.install(app)
    routes: list[APIRoute] = []
    for router in ROUTERS:
        app.include_router(router)
        routes += [r for r in router.routes if isinstance(r, APIRoute)]
    _check_actions(routes)
    limiter = RateLimiter(config.api.rate_per_s, config.api.burst, clock=monotonic)

    async def body_refused(scope: Scope, message: str) -> None:
        await errors.audit_refusal(Request(scope), 413, message)

    max_body = int(config.api.max_body_mib * MIB)
    max_output = max(max_body, int(config.api.max_output_mib * MIB))

    def limit_for(scope: Scope) -> tuple[int, str] | None:
        if scope.get("method") == "PUT" and nodes.UPLOAD_PATH.fullmatch(scope.get("path", "")):
            return max_output, "api.max_output_mib"
        return None

    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=max_body,
        on_refused=body_refused,
        limit_for=limit_for,
    )
    app.add_middleware(Gate, ctx=ctx, routes=routes, limiter=limiter)
    dashboard.install(app)
    services.install(app)
    if type(store).__name__ == "PostgresStore":  # several coordinators may share it
        nodes.install_sweeper(app)
    return app


def _check_actions(routes: list[APIRoute]) -> None:
    for route in routes:
        name = action_of(route.endpoint)
        if name is None or (name not in MATRIX and name not in PUBLIC):
            raise AssertionError(
                f"route {route.path} has no action in the permission matrix (auth.MATRIX)"
            )


class Gate:
    """Authentication, authorization and the rate limit, before a body is read."""

    def __init__(
        self, app: ASGIApp, *, ctx: ApiContext, routes: list[APIRoute], limiter: RateLimiter
    ) -> None:
        self.app = app
        self.ctx = ctx
        self.routes = routes
        self.limiter = limiter
        #: the actions answered without a token: ``[api] metrics_public`` adds /metrics
        self.public = PUBLIC | (
            {metrics.METRICS_ACTION} if ctx.config.api.metrics_public else set()
        )

    def _match(self, scope: Scope) -> tuple[APIRoute | None, dict[str, Any]]:
        for route in self.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return route, dict(child.get("path_params", {}))
        return None, {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, params = self._match(scope)
        if route is None:  # the router answers: /openapi.json, /docs, 404, 405, a redirect
            await self.app(scope, receive, send)
            return
        name = action_of(route.endpoint)
        if name is None:  # never: create_app checks every route
            await send_error(send, 403, "this endpoint is in no row of the permission matrix")
            return
        client = (scope.get("client") or ("unknown",))[0]
        headers = Headers(scope=scope)
        service = str(params.get("name")) if name == services.ACTION else None
        if await self._services_host(scope, send, headers, service, client):
            return
        if name in self.public:
            wait = self.limiter.take(f"addr:{client}")
            if wait:
                await self._too_many(send, wait)
                return
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        target = str(params.get("job_id") or params.get("token_id") or "")
        try:
            principal, session = await run_in_threadpool(
                partial(identify, service=service), self.ctx, headers, client
            )
        except StoreUnavailable as exc:  # the token could not be read: try again later
            return await errors.send_unavailable(send, exc, str(scope.get("path")))
        except AuthFailed as exc:
            # failed authentication counts against the client's address
            wait = self.limiter.take(f"addr:{client}")
            if wait:
                await self._too_many(send, wait)
                return
            if name in MUTATING:
                hook = AuditHook(self.ctx, state, name, None, target=target, claimed=exc.token_id)
                state["gw_audit"] = hook
                await errors.audit_refusal(Request(scope), 401, exc.message)
            challenge = 'Bearer realm="gpuwarden"'
            if headers.get("authorization"):
                challenge += ', error="invalid_token"'
            await send_error(send, 401, exc.message, {"WWW-Authenticate": challenge})
            return
        state["gw_principal"] = principal
        if service is not None and session is not None:  # a browser on the API's host
            await self._hand_off(scope, send, headers, principal, service=service, client=client)
            return
        if name in MUTATING:
            state["gw_audit"] = AuditHook(self.ctx, state, name, principal, target=target)
        if session is not None:
            state["gw_session"] = session
            why = cross_site(scope, headers, session) if name in MUTATING else None
            if why is not None:
                message = f"{name} refused for a browser session: {why}"
                await errors.audit_refusal(Request(scope), 403, message)
                await send_error(send, 403, message)
                return
        access = allowed(principal.role, name)
        if access is None:
            roles = needed_roles(name)
            need = " or ".join(r.value for r in roles) if roles else "a role no token has"
            message = (
                f"{name} needs the role {need}; this token ({principal.name}) has the "
                f"role {principal.role.value}"
            )
            await errors.audit_refusal(Request(scope), 403, message)
            await send_error(send, 403, message)
            return
        state["gw_scope"] = access
        wait = self.limiter.take(f"token:{principal.token_id}")
        if wait:
            message = self._too_many_message(wait)
            await errors.audit_refusal(Request(scope), 429, message)
            await send_error(send, 429, message, {"Retry-After": retry_after(wait)})
            return
        await self.app(scope, receive, send)

    async def _services_host(
        self, scope: Scope, send: Send, headers: Headers, service: str | None, client: str
    ) -> bool:
        """On the services host (api/runsite.py): nothing but ``/run/`` is served,
        and a handoff in the query is turned into a pass. True when answered."""
        services_host = self.ctx.config.api.services_host
        if not on_services_host(services_host, headers, service):
            if service is None and on_services_host(services_host, headers, None):
                await send_error(send, 404, "this host serves only the services at /run/NAME/")
                return True
            return False
        if service is None:
            await send_error(send, 404, "this host serves only the services at /run/NAME/")
            return True
        code, query = without_handoff((scope.get("query_string") or b"").decode("latin-1"))
        if code is None:
            return False
        redeemed = self.ctx.passes.redeem(code, service, client)
        if redeemed is None:
            await send_error(
                send,
                401,
                "this link's handoff is used up or expired: open the service again from "
                "the API's own host",
            )
            return True
        _, pass_id = redeemed
        secure = scope.get("scheme") == "https"
        location = str(scope.get("root_path", "")) + scope["path"] + (f"?{query}" if query else "")
        await send_redirect(
            send, location, {"Set-Cookie": run_cookie(pass_id, service, secure=secure)}
        )
        return True

    async def _hand_off(
        self,
        scope: Scope,
        send: Send,
        headers: Headers,
        principal: Principal,
        *,
        service: str,
        client: str,
    ) -> None:
        """A browser session asked for a service on the API's host: send it to the
        services host with a one-time handoff, or say why it cannot be served."""
        services_host = self.ctx.config.api.services_host
        if not services_host:
            await send_error(
                send,
                403,
                "a browser is served services only at a host of their own, apart from the "
                "API's (a service's pages could otherwise act as you here): set "
                "[api] services_host (SPEC section 15, 'Services at /run/'); a token "
                "(Authorization: Bearer) reaches it here",
            )
            return
        code = self.ctx.passes.handoff(principal.token_id, service, client)
        query = (scope.get("query_string") or b"").decode("latin-1")
        location = services_url(
            services_host,
            service,
            scheme=str(scope.get("scheme") or "http"),
            headers=headers,
            path=scope["path"],
            query=with_handoff(query, code),
        )
        await send_redirect(send, location)

    def _too_many_message(self, wait: float) -> str:
        return (
            f"too many requests: at most {self.limiter.rate:g} per second "
            f"(bursts of {self.limiter.burst:g}); try again in {retry_after(wait)} s"
        )

    async def _too_many(self, send: Send, wait: float) -> None:
        await send_error(
            send, 429, self._too_many_message(wait), {"Retry-After": retry_after(wait)}
        )


def cross_site(scope: Scope, headers: Headers, session: Session) -> str | None:
    """Why a mutating request by a browser session is refused, or None: it must come
    from the API's own origin and carry the session's CSRF header (api/session.py)."""
    why = same_origin(
        scheme=str(scope.get("scheme") or "http"),
        host=headers.get("host"),
        origin=headers.get("origin"),
        fetch_site=headers.get("sec-fetch-site"),
        referer=headers.get("referer"),
    )
    if why is not None:
        return f"it does not come from this API's own page ({why})"
    return csrf_refusal(session, headers.get(CSRF_HEADER))
