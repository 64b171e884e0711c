"""Request limits: a body-size cap that reads no more than it allows, and a
per-token rate limiter (token bucket).

:class:`BodyLimitMiddleware` is plain ASGI. A request whose ``Content-Length``
is over the limit is answered 413 before a byte of its body is read. A request
without one (chunked) is counted while it streams: the moment the count passes
the limit, 413 is sent, and the application is told the client went away, so it
never holds more than the limit plus one chunk. Whatever the application then
tries to send is dropped.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: called with the request's scope and the refusal's message before the 413 goes out
OnRefused = Callable[[Scope, str], Awaitable[None]]
#: a request's own limit, bytes and the setting that sets it, or None for the default
LimitFor = Callable[[Scope], tuple[int, str] | None]


async def send_error(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """Send a whole ``{"error": message}`` JSON response."""
    body = json.dumps({"error": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_redirect(send: Send, location: str, headers: dict[str, str] | None = None) -> None:
    """Send a 303 to ``location`` (never cached)."""
    raw = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
    raw.append((b"cache-control", b"no-store"))
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": 303, "headers": raw})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        on_refused: OnRefused | None = None,
        limit_for: LimitFor | None = None,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused
        self.limit_for = limit_for

    def _limit(self, scope: Scope) -> tuple[int, str]:
        own = self.limit_for(scope) if self.limit_for is not None else None
        return own if own is not None else (self.max_bytes, "api.max_body_mib")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, setting = self._limit(scope)
        refusal = (
            f"the request body is larger than the API accepts ({max_bytes} bytes, "
            f"{setting} in the broker's config): send less"
        )
        length = _content_length(scope)
        if length is not None and length > max_bytes:
            await self._refuse(scope, send, refusal)
            return
        seen = 0
        refused = False
        started = False

        async def counting_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(scope, send, refusal)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; the application's answer is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, scope: Scope, send: Send, message: str) -> None:
        if self.on_refused is not None:
            await self.on_refused(scope, message)
        await send_error(send, 413, message, {"connection": "close"})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RateLimiter:
    """A token bucket per key: ``burst`` requests at once, refilled at ``rate_per_s``.

    ``take(key)`` returns 0 when the request may go, else the seconds until it
    may. Thread-safe. Full buckets are forgotten when there are many keys, so
    memory stays bounded."""

    MAX_KEYS = 10_000

    def __init__(
        self, rate_per_s: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        with self._lock:
            now = self.clock()
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                if len(self._buckets) > self.MAX_KEYS:
                    self._forget_full(now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate

    def _forget_full(self, now: float) -> None:
        for key, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self.rate >= self.burst:
                del self._buckets[key]


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
