"""Running services at ``/run/<name>/`` (SPEC.md, section 15, "Services at /run/"):
every HTTP method and WebSocket, forwarded to the node's forwarder of that
service with the route's credential (``api/proxy.py`` does the forwarding).

Access (action ``service.use``; the rule is ``core/serviceroute.py:
may_reach``): a token, or the dashboard's session cookie, as for any request;
then the job's owner, a token or a role in the service's ``share``, or an owner
token. Every other caller, and every name that is not a running service, gets
the same 404, so an answer never tells whether a service exists. A service that
is not healthy, or whose forwarder does not answer, gets the unavailable page
(503: ``NAME is unavailable, last seen N s ago``), never a stale answer.

The services are asked for on every request (``ApiContext.routes``; none on an
API without a broker in its process): a service or node that went away is
unavailable at once."""

from __future__ import annotations

import html
import json
import logging
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.responses import RedirectResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import HTMLResponse, Response
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from gpuwarden.api import proxy
from gpuwarden.api.auth import AuthFailed, Principal, allowed
from gpuwarden.api.context import ApiContext, action, get_ctx, get_principal, identify
from gpuwarden.api.errors import HttpError
from gpuwarden.core.serviceroute import ServiceRoute, Unavailable, availability, may_reach
from gpuwarden.core.serviceroute import unreachable as unreachable_page

log = logging.getLogger(__name__)

router = APIRouter(tags=["services"], include_in_schema=False)

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Who = Annotated[Principal, Depends(get_principal)]

ACTION = "service.use"
PREFIX = "/run"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


#: the one 404 of ``/run/``: the same for a name no service has and for a service
#: this caller may not use (it names neither, so no two answers differ)
NOT_FOUND = "no such service here, or not one this token may use"


def not_found() -> HttpError:
    return HttpError(404, NOT_FOUND)


def reachable(ctx: ApiContext, name: str, who: Principal) -> ServiceRoute | None:
    """The service ``name`` if it exists and ``who`` may use it, else None."""
    routes = ctx.routes() if ctx.routes is not None else {}
    route = routes.get(name)
    if route is None or not may_reach(route, token_id=who.token_id, role=who.role):
        return None
    return route


def unavailable(request_accept: str, why: Unavailable, status: int = 503) -> Response:
    """The unavailable page: HTML for a browser, JSON when asked for JSON."""
    headers = {"Cache-Control": "no-store"}
    if why.retry_after_s is not None:
        headers["Retry-After"] = str(why.retry_after_s)
    accept = request_accept.lower()
    if "application/json" in accept and "text/html" not in accept:
        body = {"error": why.message, "state": why.state, "last_seen_s": why.last_seen_s}
        return Response(
            json.dumps(body), status_code=status, headers=headers, media_type="application/json"
        )
    text = html.escape(why.message)
    page = (
        "<!doctype html><html><head><meta charset=utf-8><title>unavailable</title></head>"
        f"<body><h1>{text}</h1><p>gpuwarden will serve it again here once it is "
        "healthy.</p></body></html>"
    )
    return HTMLResponse(page, status_code=status, headers=headers)


def _tail(raw_path: bytes) -> str:
    """The part of ``/run/<name>/<tail>`` after the name, as the client wrote it
    (percent escapes kept), with its leading slash."""
    parts = raw_path.split(b"/", 3)
    return "/" + (parts[3].decode("latin-1") if len(parts) > 3 else "")


def _upstream_url(route: ServiceRoute, scope: MutableMapping[str, Any], scheme: str) -> str:
    raw_path = scope.get("raw_path") or scope["path"].encode()
    url = route.upstream.rstrip("/") + _tail(raw_path)
    if scheme == "ws":
        url = "ws" + url.removeprefix("http")
    query = scope.get("query_string") or b""
    return url + ("?" + query.decode("latin-1") if query else "")


def _forwarding(
    scope: MutableMapping[str, Any], host: str | None, route: ServiceRoute
) -> proxy.Forwarding:
    scheme = str(scope.get("scheme") or "http")
    return proxy.Forwarding(
        client=(scope.get("client") or ("unknown",))[0],
        scheme={"ws": "http", "wss": "https"}.get(scheme, scheme),
        host=host or "",
        prefix=f"{PREFIX}/{quote(route.name, safe='')}",
        credential=route.credential,
    )


@router.api_route(f"{PREFIX}/{{name}}", methods=METHODS)
@action(ACTION)
async def service_root(request: Request, name: str) -> RedirectResponse:
    """``/run/<name>`` is ``/run/<name>/`` (the service's relative links need the slash)."""
    query = request.scope.get("query_string") or b""
    target = f"{PREFIX}/{quote(name, safe='')}/" + ("?" + query.decode("latin-1") if query else "")
    return RedirectResponse(target, status_code=308)


@router.api_route(f"{PREFIX}/{{name}}/{{path:path}}", methods=METHODS)
@action(ACTION)
async def service_http(request: Request, name: str, path: str, ctx: Ctx, who: Who) -> Response:
    """Forward one request to the service ``name``, or answer why not."""
    route = reachable(ctx, name, who)
    if route is None:
        raise not_found()
    accept = request.headers.get("accept", "")
    why = availability(route, ctx.clock())
    if why is not None:
        return unavailable(accept, why)
    scope = request.scope
    raw = scope["headers"]
    forwarding = _forwarding(scope, request.headers.get("host"), route)
    try:
        return await proxy.forward(
            request.app.state.gw_proxy.get(),
            method=request.method,
            url=_upstream_url(route, scope, "http"),
            headers=proxy.request_headers(raw, forwarding),
            body=request.stream() if proxy.has_body(raw) else None,
            upstream=route.upstream,
            prefix=forwarding.prefix,
        )
    except proxy.Unreachable:
        return unavailable(accept, unreachable_page(route, ctx.clock(), "not answering"))
    except proxy.NoAnswer as exc:
        why = Unavailable(f"{route.name}: {exc}", route.state, None)
        return unavailable(accept, why, exc.status)


async def _deny(websocket: WebSocket, status: int, message: str) -> None:
    """Refuse a WebSocket before it is accepted: an HTTP answer where the server
    can send one (uvicorn can), else a close (which the client sees as 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = json.dumps({"error": message})
        await websocket.send_denial_response(
            Response(body, status_code=status, media_type="application/json")
        )
    else:
        await websocket.close(1008, message[:120])


async def _ws_route(websocket: WebSocket, ctx: ApiContext, name: str) -> ServiceRoute | None:
    """The service a WebSocket may reach, or None after refusing it: the gate's
    checks (it sees no WebSocket) are made here: the token or the cookie, a
    cookie's origin (a page of another site may open a WebSocket with it), the
    role, then the service's access rule."""
    headers = websocket.headers
    client = (websocket.scope.get("client") or ("unknown",))[0]
    try:
        who, session = await run_in_threadpool(
            partial(identify, service=name), ctx, headers, client
        )
    except AuthFailed as exc:
        await _deny(websocket, 401, str(exc))
        return None
    if session is not None:  # the dashboard's cookie, on the API's host
        await _deny(
            websocket,
            403,
            "a browser reaches services only at their own host ([api] services_host), "
            "never with the dashboard's session",
        )
        return None
    if not headers.get("authorization") and not _origin_is(headers, headers.get("host")):
        await _deny(websocket, 403, "a service's pass is taken only from its own pages")
        return None
    if allowed(who.role, ACTION) is None:
        await _deny(websocket, 403, f"{ACTION} needs another role than {who.role.value}")
        return None
    route = reachable(ctx, name, who)
    if route is None:
        await _deny(websocket, 404, NOT_FOUND)
    return route


def _origin_is(headers: Headers, host: str | None) -> bool:
    """Whether a browser's WebSocket comes from a page of the host it asks (a pass
    cookie must not be usable from another site's or another host's page)."""
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser
    return host is not None and urlsplit(origin).netloc.lower() == host.lower()


async def _open(websocket: WebSocket, route: ServiceRoute) -> ClientConnection:
    """The WebSocket to the service, with the route's credential. Raises
    :class:`proxy.Unreachable` or :class:`proxy.NoAnswer`."""
    forwarding = _forwarding(websocket.scope, websocket.headers.get("host"), route)
    headers = [
        (k, v)
        for k, v in proxy.request_headers(websocket.scope["headers"], forwarding)
        if not k.startswith("sec-websocket-")
    ]
    try:
        return await connect(
            _upstream_url(route, websocket.scope, "ws"),
            additional_headers=headers,
            subprotocols=[Subprotocol(p) for p in websocket.scope.get("subprotocols", [])] or None,
            open_timeout=proxy.CONNECT_S,
            max_size=proxy.MAX_MESSAGE,
            proxy=None,  # the node's forwarder is reached directly
        )
    except InvalidStatus as exc:
        raise proxy.NoAnswer(502, f"the service refused the WebSocket ({exc})") from exc
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        raise proxy.Unreachable(str(exc)) from exc


@router.websocket(f"{PREFIX}/{{name}}/{{path:path}}")
@action(ACTION)
async def service_ws(websocket: WebSocket, name: str, path: str) -> None:
    """Relay a WebSocket to the service ``name``, frames both ways; accepted only
    once access is checked and the service took the connection."""
    ctx: ApiContext = websocket.app.state.gw
    route = await _ws_route(websocket, ctx, name)
    if route is None:
        return
    why = availability(route, ctx.clock())
    if why is not None:
        await _deny(websocket, 503, why.message)
        return
    try:
        service = await _open(websocket, route)
    except proxy.Unreachable:
        await _deny(websocket, 503, unreachable_page(route, ctx.clock(), "not answering").message)
        return
    except proxy.NoAnswer as exc:
        await _deny(websocket, exc.status, str(exc))
        return
    await websocket.accept(subprotocol=service.subprotocol)
    await proxy.relay(websocket, service)


def install(app: FastAPI) -> None:
    """Keep the proxy's HTTP clients on ``app``, closed when the app stops."""
    clients = proxy.Clients()
    app.state.gw_proxy = clients
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        try:
            async with inner(a) as state:
                yield state
        finally:
            await clients.aclose()

    app.router.lifespan_context = lifespan
