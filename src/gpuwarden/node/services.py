"""Service jobs on one node: their health, their forwarders, their routes.

A service attempt (``launch = "service"``) is started like a container attempt
and runs until it is stopped. :class:`Services` keeps one entry per running
service (loop-owned; a lock guards what other threads read): a health thread
that checks it every ``health_every_s`` and posts a :class:`ServiceNote` (never
on the loop's thread), and a :class:`Forwarder`, a TCP listener on the host's
``127.0.0.1`` that relays each connection that presents the service's route
credential to the service (the route header removed from every request head),
opened inside its sandbox's network namespace (:mod:`gpuwarden.launch.netns`).
The in-process API reaches the services through :meth:`Services.routes`
(``Broker.service_routes()``); an agent reports them to its coordinator at each
heartbeat.

A forwarder listens on ``[cluster] service_address`` (127.0.0.1 unless set: the
address the coordinator reaches the node at). Route credentials are short-lived:
:meth:`Services.rotate` gives a service a new one (an agent does so once a lease
has passed and its last heartbeat, which carried the current one, got an answer),
and its forwarder accepts the current credential and the one before it, so a
request the coordinator sends with the credential it holds is never refused.

A service an earlier run of the broker started is taken back
(:meth:`Services.adopt`): a forwarder and a health thread of its own again,
with a new credential.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import re
import secrets
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.model import JobType
from gpuwarden.core.service import Health, HealthCheck, ServiceState, overdue, parse_health
from gpuwarden.core.serviceroute import (
    NONCE_HEADER,
    PROOF_HEADER,
    PROOF_METHOD,
    STOPPED_KEEP_S,
    ServiceRoute,
    route_proof,
)
from gpuwarden.launch import netns
from gpuwarden.node import requestheads
from gpuwarden.node.running import Emit, Mailbox, RunningAttempt, ServiceNote

log = logging.getLogger("gpuwarden.node.loop")

__all__ = ["STOPPED_KEEP_S", "Forwarder", "ServiceRoute", "Services", "check_once"]

#: the header a connection to a forwarder presents first, with the route credential
#: (removed from every request head it relays: ``node/requestheads.py``)
ROUTE_HEADER = requestheads.ROUTE_HEADER
#: the most a connection's first request head may hold
HEAD_MAX = requestheads.HEAD_MAX
#: how long a connection has to send its first request head
HEAD_TIMEOUT_S = 10.0
#: how long a connection to a service (or a health check) may take to be made
CONNECT_TIMEOUT_S = 5.0
_CHUNK = 65536
#: a coordinator's nonce for a route proof
_NONCE = re.compile(r"[0-9a-f]{32,128}")
_FORBIDDEN = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: 38\r\n"
    b"Connection: close\r\n\r\nno route credential for this service\r\n"
)


def _presents(head: bytes, credentials: tuple[str, ...]) -> bool:
    """Whether ``head`` (a request head, up to its blank line) carries one of the
    route ``credentials``."""
    wanted = [c.encode() for c in credentials if c]
    ok = False
    for line in head.split(b"\r\n")[1:]:
        if requestheads.route_header_line(line):
            given = line.partition(b":")[2].strip()
            ok = ok or any([hmac.compare_digest(given, w) for w in wanted])
    return ok


def _bad_request(why: str) -> bytes:
    body = f"not relayed: {why}\r\n".encode()
    return (
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )


def _proof(head: bytes, credentials: tuple[str, ...]) -> bytes:
    """The forwarder's own answer to a coordinator's ``GPUWARDEN-PROOF`` request
    (``core/serviceroute.py``): the proof for the credential the head presented,
    never a request to the service."""
    nonce = given = ""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == NONCE_HEADER.lower().encode():
            nonce = value.strip().decode("latin-1")
        elif key == ROUTE_HEADER.lower().encode():
            given = value.strip().decode("latin-1")
    held = [c for c in credentials if c and hmac.compare_digest(given.encode(), c.encode())]
    if not held or not _NONCE.fullmatch(nonce):
        return _FORBIDDEN
    proof = route_proof(held[0], nonce)
    return (
        f"HTTP/1.1 204 No Content\r\n{PROOF_HEADER}: {proof}\r\nConnection: close\r\n\r\n"
    ).encode()


def _read_head(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """The first request head (through its blank line) and what followed it;
    None when it does not end within :data:`HEAD_MAX` bytes or in time."""
    conn.settimeout(HEAD_TIMEOUT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_MAX:
            return None
        chunk = conn.recv(_CHUNK)
        if not chunk:
            return None
        data += chunk
    end = data.index(b"\r\n\r\n")
    if end > HEAD_MAX:
        return None
    return data[:end], data[end + 4 :]


def _relay(
    a: socket.socket, b: socket.socket, a_to_b: Callable[[bytes], bytes] | None = None
) -> None:
    """Copy bytes both ways until both directions are closed; what ``a`` sends
    passes through ``a_to_b`` first (it may hold bytes back, or raise to end it all)."""
    a.setblocking(False)
    b.setblocking(False)
    peer = {a: b, b: a}
    with selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ)
        sel.register(b, selectors.EVENT_READ)
        open_reads = 2
        while open_reads:
            for key, _ in sel.select(timeout=60):
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = src.recv(_CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(src)
                    open_reads -= 1
                    with contextlib.suppress(OSError):
                        peer[src].shutdown(socket.SHUT_WR)
                    continue
                if src is a and a_to_b is not None:
                    data = a_to_b(data)
                    if not data:
                        continue
                peer[src].setblocking(True)
                peer[src].sendall(data)
                peer[src].setblocking(False)


class Forwarder:
    """A TCP listener on ``address`` (an ephemeral port) that relays each
    accepted connection to one service once its first request head has presented
    the route credential, the current one or the one before it; one without it is
    answered ``403`` and closed. Every request head of the connection is read and
    its route header removed (:class:`~gpuwarden.node.requestheads.RequestHeads`:
    bodies, the answers and what follows a switch of protocols pass byte for
    byte); a connection that cannot be framed so is closed. A coordinator's
    ``GPUWARDEN-PROOF`` request is answered here (:func:`_proof`)."""

    def __init__(
        self,
        name: str,
        credential: str,
        connect: Callable[[], socket.socket],
        address: str = "127.0.0.1",
    ) -> None:
        self.name = name
        #: the credentials accepted: the current one, and the one before it
        self.credentials: tuple[str, ...] = (credential,)
        self._connect = connect
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.create_server((address, 0), family=family)
        self.address = address
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"forward-{name}", daemon=True)
        self._thread.start()

    @property
    def upstream(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    def rotate(self, credential: str) -> None:
        """Accept ``credential`` from now on, and the current one still (only it)."""
        self.credentials = (credential, self.credentials[0])

    def close(self) -> None:
        """Stop listening and close every connection it relays."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            self._conns.clear()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._keep(conn):
                return
            threading.Thread(
                target=self._serve, args=(conn,), name=f"forward-{self.name}-conn", daemon=True
            ).start()

    def _keep(self, conn: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                conn.close()
                return False
            self._conns.add(conn)
            return True

    def _serve(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            got = _read_head(conn)
            ok = _presents(got[0], self.credentials) if got else False
            if got is None or not ok:
                conn.sendall(_FORBIDDEN)
                return
            if got[0].split(b" ", 1)[0] == PROOF_METHOD.encode():
                conn.sendall(_proof(got[0], self.credentials))
                return
            # every request of the connection is read, and its route header removed
            heads = requestheads.RequestHeads()
            try:
                first = heads.feed(got[0] + b"\r\n\r\n" + got[1])
            except requestheads.BadRequest as exc:
                conn.sendall(_bad_request(str(exc)))
                return
            try:
                upstream = self._connect()
            except OSError as exc:
                body = f"the service cannot be reached: {exc}\r\n".encode()
                conn.sendall(
                    b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\nConnection: close\r\n\r\n"
                    + body
                )
                return
            with self._lock:
                self._conns.add(upstream)
            upstream.settimeout(None)
            conn.settimeout(None)
            upstream.sendall(first)
            _relay(conn, upstream, heads.feed)
        except (OSError, requestheads.BadRequest):
            pass  # a connection that fails, or stops being HTTP, is closed
        finally:
            for s in (conn, upstream):
                if s is not None:
                    with self._lock:
                        self._conns.discard(s)
                    s.close()


def check_once(target: Callable[[], socket.socket], check: HealthCheck) -> str | None:
    """One health check: None when it passed, else what failed."""
    try:
        sock = target()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    with sock:
        if check.path is None:
            return None
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            request = f"GET {check.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            sock.sendall(request.encode())
            data = b""
            while b"\r\n" not in data and len(data) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            return exc.strerror or str(exc) or type(exc).__name__
    status = data.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status.split(" ")
    if len(parts) >= 2 and parts[0].startswith("HTTP/") and parts[1].startswith("2"):
        return None
    return f"answered {status[:80]!r}" if status else "no answer"


@dataclass
class _Service:
    """One running service (loop-owned; ``health`` read under the book's lock)."""

    run: RunningAttempt
    check: HealthCheck
    health: Health
    credential: str
    sandboxed: bool
    #: when ``credential`` was made (the broker's clock)
    credential_at: float = 0.0
    forwarder: Forwarder | None = None
    pid: int | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return self.run.job.service_name


class Services:
    """The node's running services, by job id."""

    def __init__(
        self,
        mailbox: Mailbox,
        emit: Emit,
        clock: Callable[[], float],
        sandboxed: Callable[[JobType], bool],
        address: str = "127.0.0.1",
    ) -> None:
        self.mailbox = mailbox
        self.emit = emit
        self.clock = clock
        self.sandboxed = sandboxed
        #: where the forwarders listen (``[cluster] service_address``)
        self.address = address
        self._by_job: dict[str, _Service] = {}
        #: the services that ended in the last :data:`STOPPED_KEEP_S`, by name:
        #: their last route (state ``stopped``) and their last published status
        self._gone: dict[str, tuple[ServiceRoute, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def taken(self, name: str, owner: str | None = None) -> str | None:
        """Why a service named ``name`` may not start now (one of that name runs), or
        None. The job that holds the name is named only when ``owner`` (the API token
        of the job that asks) submitted it too: never another's job id."""
        with self._lock:
            other = next((s for s in self._by_job.values() if s.name == name), None)
        if other is None:
            return None
        mine = owner is not None and other.run.job.owner == owner
        holder = f"your job {other.run.job.id}" if mine else "another job"
        return (
            f"a service named {name!r} already runs on this node ({holder}); stop it "
            "first (`gpuwarden stop JOB`) or choose another name (--service)"
        )

    def add(self, run: RunningAttempt, now: float) -> None:
        """A service attempt has begun: it is ``starting``."""
        entry = _Service(
            run=run,
            check=parse_health(run.jobtype.health),
            health=Health(ServiceState.STARTING, now),
            credential=secrets.token_urlsafe(32),
            sandboxed=self.sandboxed(run.jobtype),
            credential_at=now,
        )
        with self._lock:
            self._by_job[run.job.id] = entry
            self._gone.pop(entry.name, None)  # the name is served by this one now

    def started(self, job_id: str, attempt: int, pid: int) -> None:
        """Its main process runs: its forwarder listens and its health thread starts.
        A later ``pid`` of the same attempt is the container's own main process
        (podman, docker: the first is the runtime's client, whose tree never holds
        the container): its network namespace is the one connections go into."""
        entry = self._by_job.get(job_id)
        if entry is None or entry.run.attempt.number != attempt:
            return
        if entry.pid is not None:
            entry.pid = pid
            return
        entry.pid = pid
        forwarder = Forwarder(
            entry.name, entry.credential, lambda: self._connect(entry), self.address
        )
        with self._lock:
            entry.forwarder = forwarder
        threading.Thread(
            target=self._watch, args=(entry,), name=f"health-{job_id}", daemon=True
        ).start()
        self.emit(
            "service_started", job=job_id, service=entry.name, upstream=forwarder.upstream, pid=pid
        )

    def adopt(self, run: RunningAttempt, pid: int, now: float) -> str | None:
        """Take back a service an earlier run of this broker started (its main
        process ``pid`` still runs): it must answer its health check now. None
        when it is this broker's again (a forwarder, a health thread, a new
        credential; ``healthy``), else why not (it is not added)."""
        self.add(run, now)
        entry = self._by_job[run.job.id]
        entry.pid = pid
        error = check_once(lambda: self._connect(entry), entry.check)
        if error is not None:
            with self._lock:
                self._by_job.pop(run.job.id, None)
            return error
        entry.pid = None
        with self._lock:
            entry.health = Health(ServiceState.HEALTHY, now, last_ok=now)
        self.started(run.job.id, run.attempt.number, pid)
        return None

    def rotate(self, older_than: float, now: float) -> int:
        """Give every service whose credential was made before ``older_than`` a new
        one (its forwarder still takes the one before); how many."""
        with self._lock:
            due = [e for e in self._by_job.values() if e.credential_at < older_than]
            for e in due:
                e.credential, e.credential_at = secrets.token_urlsafe(32), now
                if e.forwarder is not None:
                    e.forwarder.rotate(e.credential)
        return len(due)

    def _connect(self, entry: _Service) -> socket.socket:
        """A connection to the service's port, inside its sandbox's namespace."""
        port = entry.run.jobtype.port or 0
        if entry.pid is None:
            raise ConnectionRefusedError("the service's process has not started")
        if not entry.sandboxed:
            return netns.connect(None, port, CONNECT_TIMEOUT_S)
        inside = netns.namespace_pid(entry.pid)
        if inside is None:
            raise ConnectionRefusedError("its sandbox's network namespace is not there")
        return netns.connect(inside, port, CONNECT_TIMEOUT_S)

    def _watch(self, entry: _Service) -> None:
        """Health thread: check every ``health_every_s`` until the service ends."""
        every = entry.run.jobtype.health_every_s
        delay = min(0.2, every)
        while not entry.done.wait(delay):
            error = check_once(lambda: self._connect(entry), entry.check)
            if entry.done.is_set():
                return
            run = entry.run
            self.mailbox.post(
                ServiceNote(
                    run.job.id, run.attempt.number, error is None, error or "", self.clock()
                )
            )
            delay = every

    def on_note(self, note: ServiceNote) -> str | None:
        """Take a health check in; why the service must be stopped now, or None."""
        entry = self._by_job.get(note.job_id)
        if entry is None or entry.run.attempt.number != note.attempt:
            return None
        before = entry.health
        after = before.after_check(note.ok, note.error, note.at)
        with self._lock:
            entry.health = after
        if after.state is not before.state:
            self.emit(
                "service_state",
                job=note.job_id,
                service=entry.name,
                state=after.state.value,
                **({"error": after.error} if after.error else {}),
            )
        return self.overdue(note.job_id, note.at)

    def overdue(self, job_id: str, now: float) -> str | None:
        """Why the service must be stopped for its health now, or None."""
        entry = self._by_job.get(job_id)
        if entry is None:
            return None
        return overdue(entry.health, entry.check, entry.run.jobtype.health_grace_s, now)

    def overdue_all(self, now: float) -> list[tuple[str, str]]:
        """Every running service past its grace now (looked at on each tick, so a
        service whose checks hang is stopped on time too)."""
        out = []
        for job_id in list(self._by_job):
            if (why := self.overdue(job_id, now)) is not None:
                out.append((job_id, why))
        return out

    def end(self, job_id: str) -> None:
        """Its attempt has ended: its health thread and its forwarder stop; its
        route is kept as ``stopped`` for :data:`STOPPED_KEEP_S`."""
        now = self.clock()
        with self._lock:
            entry = self._by_job.pop(job_id, None)
            if entry is not None:
                route = dataclasses.replace(
                    _route(entry), state=ServiceState.STOPPED.value, upstream="", since=now
                )
                status = _status(entry) | {"state": route.state, "since": now, "upstream": ""}
                self._gone[entry.name] = (route, status)
        if entry is None:
            return
        entry.done.set()
        if entry.forwarder is not None:
            entry.forwarder.close()

    def close(self) -> None:
        for job_id in list(self._by_job):
            self.end(job_id)

    def state_of(self, job_id: str) -> str | None:
        with self._lock:
            entry = self._by_job.get(job_id)
            return None if entry is None else entry.health.state.value

    def _kept(self) -> list[tuple[ServiceRoute, dict[str, Any]]]:
        """The ended services still kept (under the lock): those past
        :data:`STOPPED_KEEP_S` are dropped here."""
        now = self.clock()
        for name, (route, _) in list(self._gone.items()):
            if now - route.since > STOPPED_KEEP_S:
                del self._gone[name]
        return list(self._gone.values())

    def routes(self) -> list[ServiceRoute]:
        """A snapshot of every running service, and of each that ended in the last
        :data:`STOPPED_KEEP_S` (state ``stopped``; any thread)."""
        with self._lock:
            return [_route(e) for e in self._by_job.values()] + [r for r, _ in self._kept()]

    def statuses(self) -> list[dict[str, Any]]:
        """What the node status publishes of each service (no credential): the
        running ones, then those that ended in the last :data:`STOPPED_KEEP_S`."""
        with self._lock:
            return [_status(e) for e in self._by_job.values()] + [dict(d) for _, d in self._kept()]


def _route(e: _Service) -> ServiceRoute:
    return ServiceRoute(
        name=e.name,
        job_id=e.run.job.id,
        owner=e.run.job.owner,
        share=e.run.job.share,
        state=e.health.state.value,
        upstream=e.forwarder.upstream if e.forwarder is not None else "",
        credential=e.credential,
        since=e.health.since,
        last_ok=e.health.last_ok,
    )


def _status(e: _Service) -> dict[str, Any]:
    return {
        "name": e.name,
        "job": e.run.job.id,
        "state": e.health.state.value,
        "since": e.health.since,
        "last_ok": e.health.last_ok,
        "error": e.health.error,
        "port": e.run.jobtype.port,
        "gpu": e.run.attempt.gpu_uuid,
        "owner": e.run.job.owner,
        "share": list(e.run.job.share),
        "upstream": e.forwarder.upstream if e.forwarder is not None else "",
    }
