"""A stand-in for a service behind the node's forwarder (``/run/<name>/``): a small
Starlette app served by uvicorn, refusing every request and WebSocket that lacks
``X-Gpuwarden-Route: <credential>``.

Run as ``python -m tests.standins.serviceapp CREDENTIAL``: it listens on a free
port of 127.0.0.1, prints that port on one line, and serves until killed.

- ``/echo/...`` (every method): JSON ``{method, path, raw_path, query, headers, body}``
- ``/stream``: ``part-1``, then waits (at most 10 s) until ``/release`` was
  called, then ``part-2`` (a proxy that buffers never lets ``part-1`` through first)
- ``/release``: lets ``/stream`` go on
- ``/redirect``: 302 to ``/echo/here?x=1``; ``/redirect-abs``: 302 to this
  server's own absolute URL of ``/echo/abs``
- ``/ws`` (WebSocket): echoes text and binary frames; first sends the text
  ``route:<credential it saw>``; ``/ws-open``: how many of them are open
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

ROUTE_HEADER = "x-gpuwarden-route"


def make_app(credential: str) -> Starlette:
    released = asyncio.Event()
    open_sockets = [0]

    def refused(headers: list[tuple[bytes, bytes]]) -> bool:
        seen = [v.decode() for k, v in headers if k.decode().lower() == ROUTE_HEADER]
        return seen != [credential]

    async def echo(request: Request) -> Response:
        if refused(request.scope["headers"]):
            return PlainTextResponse("no route credential", status_code=403)
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "raw_path": request.scope.get("raw_path", b"").decode("latin-1"),
                "query": request.scope["query_string"].decode("latin-1"),
                "headers": [[k.decode(), v.decode()] for k, v in request.scope["headers"]],
                "body": body.decode("latin-1"),
            }
        )

    async def stream(request: Request) -> Response:
        if refused(request.scope["headers"]):
            return PlainTextResponse("no route credential", status_code=403)

        async def parts() -> AsyncIterator[bytes]:
            yield b"part-1;"
            try:
                await asyncio.wait_for(released.wait(), 10)
            except TimeoutError:
                yield b"never-released;"
                return
            yield b"part-2;"

        return StreamingResponse(parts(), media_type="text/plain")

    async def release(request: Request) -> Response:
        released.set()
        return PlainTextResponse("released")

    async def redirect(request: Request) -> Response:
        if refused(request.scope["headers"]):
            return PlainTextResponse("no route credential", status_code=403)
        return Response(status_code=302, headers={"Location": "/echo/here?x=1"})

    async def redirect_abs(request: Request) -> Response:
        host, port = request.scope["server"]
        location = f"http://{host}:{port}/echo/abs"
        return Response(status_code=302, headers={"Location": location})

    async def ws(websocket: WebSocket) -> None:
        if refused(websocket.scope["headers"]):
            await websocket.close(4403)
            return
        await websocket.accept()
        open_sockets[0] += 1
        try:
            await websocket.send_text(f"route:{websocket.headers.get(ROUTE_HEADER)}")
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    await websocket.send_text(message["text"])
                elif message.get("bytes") is not None:
                    await websocket.send_bytes(message["bytes"])
        finally:
            open_sockets[0] -= 1

    async def ws_open(request: Request) -> Response:
        return PlainTextResponse(str(open_sockets[0]))

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(
        routes=[
            Route("/echo/{rest:path}", echo, methods=methods),
            Route("/stream", stream),
            Route("/release", release, methods=["POST"]),
            Route("/redirect", redirect),
            Route("/redirect-abs", redirect_abs),
            Route("/ws-open", ws_open),
            WebSocketRoute("/ws", ws),
        ]
    )


def main() -> None:
    credential = sys.argv[1]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(make_app(credential), log_level="warning", ws="auto", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
