"""The HTTP API on a thread of its own (uvicorn), as ``serve --api`` and
``coordinator`` run it beside their main loop.

The one module of the CLI that loads the web stack: fastapi and uvicorn take
about 1.2 s of CPU to import, so they are imported when an API is made, not
when ``gpuwarden`` starts (every other command would pay for them)."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Mapping

from gpuwarden.config import Config
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.node.loop import Broker
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store

#: how long a server may take to listen before its command gives up
START_TIMEOUT_S = 30.0


class ApiThread:
    """An ASGI app served by uvicorn on a daemon thread. Made first, started with
    :meth:`start`, so that a signal handler can reach :attr:`server` before then."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        config: Config,
        host: str,
        port: int,
        *,
        name: str,
        coordinator: bool = False,
        broker: Broker | None = None,
        sock: socket.socket | None = None,
        service_routes: Callable[[], Mapping[str, ServiceRoute]] | None = None,
    ) -> None:
        """``broker``: the broker running in this process, if any: a submit wakes
        its loop, and a ``wait`` is told by it when the job ended. ``sock``: a
        socket listening already (shared by several worker processes,
        ``coordinator --workers``); ``host`` and ``port`` are then what it was
        bound to. ``service_routes``: the running services of the broker in this
        process, served at ``/run/<name>/``."""
        # the web stack, only here (the module docstring says why)
        import uvicorn  # noqa: PLC0415

        from gpuwarden.api.app import create_app  # noqa: PLC0415
        from gpuwarden.api.routers import events, nodes  # noqa: PLC0415

        self.app = create_app(
            store,
            registry,
            config,
            wake=broker.wake if broker is not None else None,
            ends=broker.ends if broker is not None else None,
            service_routes=service_routes,
        )
        if coordinator:
            nodes.install_coordinator(self.app)
        self._advertise = nodes.set_coordinator_url
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=host,
                port=port,
                log_level="warning",
                lifespan="on",
                # httptools (a dependency) parses HTTP/1.1 in C where it is installed,
                # else h11; no access log line is formatted per request (the audit
                # log records what was done); keep-alive connections stay open 30 s
                # between requests (agents and clients send one every few seconds)
                http="auto",
                # WebSockets (a service's at /run/<name>/) with the websockets library
                ws="auto",
                access_log=False,
                timeout_keep_alive=30,
                # X-Forwarded-For is believed from [api] trusted_proxies only (uvicorn
                # would take it from 127.0.0.1 by default: any local process, or a
                # service's forwarder, could then pose as any client)
                proxy_headers=bool(config.api.trusted_proxies),
                forwarded_allow_ips=list(config.api.trusted_proxies) or [],
            )
        )
        # event streams end when the server stops (it waits for open answers)
        events.stop_when(self.app, lambda: self.server.should_exit)
        run = self.server.run if sock is None else functools.partial(self.server.run, [sock])
        self.thread = threading.Thread(target=run, name=name, daemon=True)
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

    def advertise(self, url: str) -> None:
        """The URL a coordinator names to its agents (``node invite``)."""
        self._advertise(self.app, url)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` with ``SO_REUSEPORT``: several
    processes each bind one to the same address (``coordinator --workers``), and
    the kernel spreads new connections across them (one socket accepted on by all
    would hand most to whichever process wakes first). ``TCP_NODELAY`` is set on
    it, and so on the connections it accepts: without it a response written in two
    parts waited for the client's delayed ACK (40 ms). Raises :class:`OSError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
