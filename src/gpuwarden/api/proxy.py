"""The mechanics of the service proxy at ``/run/<name>/`` (SPEC.md, section 15,
"Services at /run/"): which headers go to a service and which come back, an
HTTP request streamed there and its answer streamed back, and a WebSocket
relayed both ways. Who may reach which service is decided before any of this
runs (``api/routers/services.py`` over ``core/serviceroute.py``).

Nothing a client sends reaches the service unfiltered: its ``Authorization``,
the dashboard's cookies (``gw_session``, ``gw_csrf``), a service pass
(``gw_run``), every ``X-Gpuwarden-*`` and ``X-Forwarded-*`` header and the
hop-by-hop headers are dropped; the route's credential (``X-Gpuwarden-Route``)
and the proxy's own ``X-Forwarded-*`` are added. Bodies are streamed both ways,
never read whole; the time to connect, to the first byte and between bytes is
bounded."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from gpuwarden.api.runsite import RUN_COOKIE
from gpuwarden.api.session import CSRF_COOKIE, SESSION_COOKIE

log = logging.getLogger(__name__)

#: the header that carries a route's credential to the node's forwarder
ROUTE_HEADER = "x-gpuwarden-route"
#: headers of one connection, never forwarded (RFC 9110, 7.6.1), both ways
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
#: headers of the client that the service never sees (the proxy sets its own X-Forwarded-*)
DROPPED_PREFIXES = ("proxy-", "x-gpuwarden-", "x-forwarded-")
DROPPED = frozenset(
    # the client's own claims of its address: the proxy says it (X-Forwarded-For)
    {"authorization", "host", "forwarded", "x-real-ip", "true-client-ip", "x-client-ip"}
)
#: the dashboard's cookies: never sent to a service, never set by one
PRIVATE_COOKIES = frozenset({SESSION_COOKIE, CSRF_COOKIE, RUN_COOKIE})
#: how long to wait for the service to take the connection, and for each read
#: (the first byte of the answer, and every byte after it)
CONNECT_S = 5.0
READ_S = 120.0
WRITE_S = 60.0
TIMEOUT = httpx.Timeout(connect=CONNECT_S, read=READ_S, write=WRITE_S, pool=CONNECT_S)
#: the largest WebSocket message relayed from a service (bytes)
MAX_MESSAGE = 16 * 1024 * 1024
#: how a client's socket is closed when the service's connection dropped
GONE_CODE = 1011
GONE_REASON = "the service went away"


@dataclass(frozen=True, slots=True)
class Forwarding:
    """What the proxy tells a service about a request: the client's address, the
    scheme and host it addressed, the prefix the service is served under, and the
    route's credential."""

    client: str
    scheme: str
    host: str
    prefix: str
    credential: str


def _name_of(raw: bytes) -> str:
    return raw.decode("latin-1").lower()


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[str]:
    """The headers a ``Connection`` header names: of that connection only."""
    named: set[str] = set()
    for key, value in headers:
        if _name_of(key) == "connection":
            named |= {t.strip().lower() for t in value.decode("latin-1").split(",")}
    return named


def _hop(name: str, named: set[str]) -> bool:
    return name in HOP_BY_HOP or name in named or name.startswith("proxy-")


def strip_cookies(value: str) -> str | None:
    """A ``Cookie`` header without the dashboard's cookies (None: nothing left)."""
    kept = [
        part.strip()
        for part in value.split(";")
        if part.strip() and part.split("=", 1)[0].strip() not in PRIVATE_COOKIES
    ]
    return "; ".join(kept) or None


def request_headers(
    raw: Iterable[tuple[bytes, bytes]], forwarding: Forwarding
) -> list[tuple[str, str]]:
    """The headers sent to the service for a client's ``raw`` headers."""
    raw = list(raw)
    named = _connection_tokens(raw)
    out: list[tuple[str, str]] = []
    for key, value in raw:
        name = _name_of(key)
        if _hop(name, named) or name in DROPPED or name.startswith(DROPPED_PREFIXES):
            continue
        text = value.decode("latin-1")
        if name == "cookie":
            kept = strip_cookies(text)
            if kept is None:
                continue
            text = kept
        out.append((name, text))
    out += [
        (ROUTE_HEADER, forwarding.credential),
        ("x-forwarded-for", forwarding.client),
        ("x-forwarded-proto", forwarding.scheme),
        ("x-forwarded-host", forwarding.host),
        ("x-forwarded-prefix", forwarding.prefix),
    ]
    return out


def rewrite_location(value: str, upstream: str, prefix: str) -> str:
    """A ``Location`` that points at the service's own root, under ``prefix``: the
    upstream's absolute URL, or a path from its root; any other is kept."""
    base = upstream.rstrip("/")
    if value == base or value.startswith(base + "/"):
        return prefix + (value[len(base) :] or "/")
    if value.startswith("/") and not value.startswith("//"):
        return prefix + value
    return value


def _sets_private_cookie(value: str) -> bool:
    return value.split("=", 1)[0].strip() in PRIVATE_COOKIES


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], upstream: str, prefix: str
) -> list[tuple[bytes, bytes]]:
    """The headers of a service's answer as the client gets them."""
    raw = list(raw)
    named = _connection_tokens(raw)
    out: list[tuple[bytes, bytes]] = []
    for key, value in raw:
        name = _name_of(key)
        if _hop(name, named):
            continue
        text = value.decode("latin-1")
        if name == "set-cookie" and _sets_private_cookie(text):
            continue
        if name == "location":
            text = rewrite_location(text, upstream, prefix)
        out.append((name.encode("latin-1"), text.encode("latin-1")))
    return out


class Clients:
    """One HTTP client per event loop (the loop of the server that runs the app):
    its pooled connections belong to that loop."""

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]
        self._by_loop = weakref.WeakKeyDictionary()

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._by_loop.get(loop)
        if client is None:
            client = httpx.AsyncClient(
                timeout=TIMEOUT,
                follow_redirects=False,
                trust_env=False,  # a proxy from the environment never sits between us and a node
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            )
            self._by_loop[loop] = client
        return client

    async def aclose(self) -> None:
        """Close the client of the running loop (the server is stopping)."""
        client = self._by_loop.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()


class Unreachable(Exception):
    """The service's forwarder did not take the connection."""


class NoAnswer(Exception):
    """The service took the request but gave no answer in time, or broke it off."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request says it has a body (a length other than 0, or chunks)."""
    for key, value in headers:
        name = _name_of(key)
        if name == "transfer-encoding" or (name == "content-length" and value.strip() != b"0"):
            return True
    return False


async def forward(
    client: httpx.AsyncClient,
    *,
    method: str,
    url: str,
    headers: list[tuple[str, str]],
    body: AsyncIterator[bytes] | None,
    upstream: str,
    prefix: str,
) -> Response:
    """Send a request to the service and answer with its response, streamed.
    Raises :class:`Unreachable` or :class:`NoAnswer` before any of it is sent;
    a failure while the body streams ends the client's connection (the client sees
    a broken answer, never a complete-looking one)."""
    request = client.build_request(method, url, headers=headers, content=body)
    try:
        answer = await client.send(request, stream=True)
    except httpx.ConnectError as exc:
        raise Unreachable(str(exc)) from exc
    except httpx.TimeoutException as exc:
        raise NoAnswer(504, f"the service gave no answer within {READ_S:g} s") from exc
    except httpx.TransportError as exc:
        raise NoAnswer(502, "the service broke the connection before it answered") from exc

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        finally:
            await answer.aclose()

    response = StreamingResponse(
        stream(), status_code=answer.status_code, background=BackgroundTask(answer.aclose)
    )
    response.raw_headers = response_headers(answer.headers.raw, upstream, prefix)
    return response


async def relay(client: WebSocket, service: ClientConnection) -> None:
    """Pass frames both ways until one side goes: when the client goes, the
    service's connection is closed; when the service's ends, the client's socket is
    closed with the service's code if it closed cleanly, else with
    :data:`GONE_CODE` and :data:`GONE_REASON`."""
    up = asyncio.create_task(_client_to_service(client, service))
    down = asyncio.create_task(_service_to_client(client, service))
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
    if down in done or service.close_code is not None:  # the service's side ended
        code, reason = GONE_CODE, GONE_REASON
        received = service.protocol.close_rcvd
        if received is not None and received.code in (1000, 1001):
            code, reason = received.code, received.reason
        try:
            await client.close(code, reason)
        except (RuntimeError, OSError, WebSocketDisconnect):  # the client went just now
            log.debug("the client's socket was gone before it could be closed")
    await service.close()


async def _client_to_service(client: WebSocket, service: ClientConnection) -> None:
    try:
        while True:
            message = await client.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is not None:
                await service.send(message["text"])
            elif message.get("bytes") is not None:
                await service.send(message["bytes"])
    except (WebSocketDisconnect, ConnectionClosed):
        return


async def _service_to_client(client: WebSocket, service: ClientConnection) -> None:
    try:
        async for message in service:
            if isinstance(message, str):
                await client.send_text(message)
            else:
                await client.send_bytes(message)
    except ConnectionClosed:
        return
