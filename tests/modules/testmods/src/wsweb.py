"""testmods.wsweb: a service that speaks HTTP and WebSocket (the ``websockets``
library) for the service tests. It listens on ``GPUWARDEN_SERVICE_PORT`` on
127.0.0.1: ``/healthz`` (200) and ``/echo`` (its request line and headers back,
as JSON) are plain HTTP, answered by ``process_request``; a WebSocket on any
other path (``/ws``) sends each message back, text as text and bytes as bytes.
``start_delay_s``: how long it waits before it listens (it is ``starting`` that
long)."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from websockets.asyncio.server import Request, Response, ServerConnection, serve
from websockets.datastructures import Headers

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
port = int(os.environ["GPUWARDEN_SERVICE_PORT"])


def _answer(code: int, reason: str, body: bytes, kind: str) -> Response:
    headers = Headers([("Content-Type", kind), ("Content-Length", str(len(body)))])
    return Response(code, reason, headers, body)


def process_request(connection: ServerConnection, request: Request) -> Response | None:
    """Plain HTTP for ``/healthz`` and ``/echo``; a WebSocket handshake goes on."""
    path = request.path
    if path == "/healthz":
        return _answer(200, "OK", b"ok\n", "text/plain")
    if path.startswith("/echo"):
        body = json.dumps(
            {"path": path, "headers": dict(request.headers.raw_items()), "pid": os.getpid()}
        ).encode()
        return _answer(200, "OK", body, "application/json")
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return _answer(404, "Not Found", b"no\n", "text/plain")
    return None


async def echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def main() -> None:
    async with serve(echo, "127.0.0.1", port, process_request=process_request) as server:
        print(f"pid {os.getpid()}: listening on 127.0.0.1:{port} (HTTP and WebSocket)", flush=True)
        await server.serve_forever()


if __name__ == "__main__":
    time.sleep(float(params["start_delay_s"]))
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
