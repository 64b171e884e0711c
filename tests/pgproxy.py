"""A TCP forwarder to PostgreSQL that a test can cut and restore: the store is made
unreachable without touching the server that other work shares.

``Proxy(("127.0.0.1", 5432))`` listens on a free local port (``port``); each
connection it accepts is piped to the target by two threads. ``cut()`` closes
every connection it carries and from then on closes each new one at once (the
client sees "server closed the connection unexpectedly"); ``restore()`` forwards
again. The listening port stays the same throughout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class Proxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        #: connections refused while cut (a test asserts the cut was felt)
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="pgproxy", daemon=True)
        self._thread.start()

    def url(self, pg_url: str) -> str:
        """``pg_url`` with its host and port replaced by this proxy's."""
        head, _, rest = pg_url.partition("://")
        auth_host, slash, path = rest.partition("/")
        auth, at, _ = auth_host.rpartition("@")
        return f"{head}://{auth}{at}127.0.0.1:{self.port}{slash}{path}"

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            conns = list(self._open)
            self._open.clear()
        for conn in conns:
            _close(conn)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
            if cut:
                self.refused += 1
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@contextlib.contextmanager
def proxy_to(pg_url: str) -> Iterator[Proxy]:
    """A :class:`Proxy` to the server of ``pg_url`` for the length of a ``with``."""
    rest = pg_url.partition("://")[2].partition("/")[0].rpartition("@")[2]
    host, _, port = rest.partition(":")
    p = Proxy((host or "127.0.0.1", int(port or 5432)))
    try:
        yield p
    finally:
        p.close()
