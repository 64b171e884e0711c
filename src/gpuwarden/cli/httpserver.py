"""The HTTP API on a thread of its own (uvicorn), as ``serve --api`` and
``coordinator`` run it beside their main loop."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

#: how long a server may take to listen before its command gives up
START_TIMEOUT_S = 30.0


class ApiThread:
    """An ASGI app served by uvicorn on a daemon thread. Made first, started with
    :meth:`start`, so that a signal handler can reach :attr:`server` before then."""

    def __init__(self, app: Any, host: str, port: int, *, name: str) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)
        #: the address listened on once started (port 0 is then the port it got)
        self.bound: tuple[str, int] = (host, port)

    def start(self) -> bool:
        """Start the thread and wait until the server listens; False (the server
        told to exit) when it cannot, e.g. the port is in use."""
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                return False
            time.sleep(0.02)
        sockname = self.server.servers[0].sockets[0].getsockname()
        self.bound = (sockname[0], sockname[1])
        return True

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the address listened on (an IPv6 host in brackets)."""
        host, port = self.bound
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    @property
    def loopback(self) -> bool:
        """Whether only this host can reach it."""
        return self.bound[0] in ("127.0.0.1", "::1", "localhost")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
