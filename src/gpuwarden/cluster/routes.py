"""Services across hosts on the coordinator (SPEC.md section 16, "Services across
hosts"): the routes of the running services, as the nodes report them at each
heartbeat, kept in the store (``service_routes``) and read back by the API's
proxy at ``/run/<name>/``.

* :func:`record_routes` (at each heartbeat): the routes the node reports
  (:func:`gpuwarden.cluster.nodeview.reported_routes` checks each field), each
  kept only for a job that runs on a live lease of that node under that service
  name; owner and share are the job row's. The node's routes it no longer
  reports go.
* :func:`route_refusal`: where a route may point. It is bound to the address
  the heartbeat came from; one on the coordinator's own host must prove it is
  the node's forwarder (:func:`prove`, asked once per upstream and credential:
  :class:`Proofs`); with no known address (a proxy) loopback, link-local,
  unspecified, multicast and this host's own addresses are refused. A refused
  route is left out, and the heartbeat's answer says why.
* :class:`RouteBook` (the API's ``service_routes``): every route by name, read
  from the store at most once a second; a route whose node is not active, or
  that its node has not reported within its heartbeat window, is answered
  ``unavailable`` (``NAME is unavailable, last seen N s ago``), never forwarded.
  A coordinator that restarts reads the same rows: no route is lost.
* A route whose job's attempt ended (its finish, or the sweep taking back an
  expired lease) is kept as ``stopped`` for :data:`STOPPED_KEEP_S`
  (``ClusterStore.stop_service_route``): those who may reach it get the
  unavailable page (``NAME is unavailable, last seen N s ago (it is stopped)``),
  everyone else the same 404 as before; a new service of that name replaces it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hmac
import ipaddress
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gpuwarden.cluster.nodeview import heartbeat_window_s, reported_routes
from gpuwarden.core.serviceroute import (
    NONCE_HEADER,
    PROOF_HEADER,
    PROOF_METHOD,
    STOPPED,
    STOPPED_KEEP_S,
    UNAVAILABLE,
    ServiceRoute,
    route_proof,
)
from gpuwarden.core.states import JobState
from gpuwarden.store.cluster import ClusterStore, Lease, NodeRecord, NodeState

log = logging.getLogger(__name__)

#: how long the API keeps the routes it read (seconds)
CACHE_S = 1.0
#: the header that carries a route's credential to the node's forwarder
ROUTE_HEADER = "X-Gpuwarden-Route"
#: how long the host's own addresses are kept before they are read again (seconds)
OWN_ADDRESSES_S = 60.0
#: how long a forwarder has to answer a route proof (seconds: it is on this host)
PROOF_TIMEOUT_S = 1.0
#: the most routes one heartbeat has proven (each may take PROOF_TIMEOUT_S): more
#: are refused for now, and proven at a later heartbeat
PROOFS_PER_HEARTBEAT = 16
#: how many proven (upstream, credential) pairs a process remembers
PROVEN_MAX = 4096

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
#: proves a route (upstream, credential): None when it is a forwarder, else why not
Prover = Callable[[str, str], str | None]


def ip_of(text: str | None) -> Address | None:
    """The address ``text`` names (an IPv4-mapped IPv6 address as IPv4), else None."""
    if text is None:
        return None
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class OwnAddresses:
    """The addresses of this host (every interface's, and its name's), read again
    after :data:`OWN_ADDRESSES_S`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_at = -1e18
        self._found: frozenset[Address] = frozenset()

    def __call__(self) -> frozenset[Address]:
        now = time.monotonic()
        with self._lock:
            if now - self._read_at > OWN_ADDRESSES_S:
                self._found, self._read_at = frozenset(_read_own_addresses()), now
            return self._found


def _read_own_addresses() -> set[Address]:
    found: set[Address] = set()
    with contextlib.suppress(OSError, UnicodeError):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            if (ip := ip_of(str(info[4][0]))) is not None:
                found.add(ip)
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                found.add(ipaddress.IPv4Address(got[20:24]))
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            found.add(ipaddress.IPv6Address(bytes.fromhex(line.split()[0])))
    return found


#: this host's addresses (this process's view)
own_addresses = OwnAddresses()


def _special(ip: Address) -> str | None:
    """Why a route may not point at ``ip`` from a node whose address is not known
    (None: it may)."""
    for test, words in (
        (ip.is_loopback, "a loopback address (this coordinator's own)"),
        (ip.is_link_local, "a link-local address"),
        (ip.is_unspecified, "the unspecified address"),
        (ip.is_multicast, "a multicast address"),
    ):
        if test:
            return words
    if ip in own_addresses():
        return "an address of this coordinator's own host"
    return None


def prove(upstream: str, credential: str, timeout_s: float = PROOF_TIMEOUT_S) -> str | None:
    """Ask ``upstream`` for the route proof of ``credential`` (``core/serviceroute.py``):
    None when it gave it, else what it did instead."""
    parts = urlsplit(upstream)
    host, port = parts.hostname or "", parts.port or 80
    nonce = secrets.token_hex(16)
    request = (
        f"{PROOF_METHOD} / HTTP/1.1\r\nHost: gpuwarden\r\n{ROUTE_HEADER}: {credential}\r\n"
        f"{NONCE_HEADER}: {nonce}\r\nConnection: close\r\n\r\n"
    ).encode()
    data = b""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(request)
            while b"\r\n\r\n" not in data and len(data) < 8192:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        return f"it did not answer ({exc.strerror or type(exc).__name__})"
    lines = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    wanted = route_proof(credential, nonce).encode()
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        proof = name.strip().lower() == PROOF_HEADER.lower().encode()
        if proof and hmac.compare_digest(value.strip(), wanted):
            return None
    status = lines[0].decode("latin-1")[:60]
    shown = "".join(c if c.isprintable() else "?" for c in status) or "nothing"
    return f"it answered {shown!r}, not a forwarder's proof"


class Proofs:
    """:func:`prove`, asked once for each (upstream, credential) pair that passes
    (this process's memory, at most :data:`PROVEN_MAX` pairs)."""

    def __init__(self, ask: Prover = prove) -> None:
        self.ask = ask
        self._lock = threading.Lock()
        self._proven: set[tuple[str, str]] = set()

    def known(self, upstream: str, credential: str) -> bool:
        """Whether this pair proved itself already (asking again costs nothing)."""
        with self._lock:
            return (upstream, credential) in self._proven

    def __call__(self, upstream: str, credential: str) -> str | None:
        if self.known(upstream, credential):
            return None
        key = (upstream, credential)
        why = self.ask(upstream, credential)
        if why is None:
            with self._lock:
                if len(self._proven) >= PROVEN_MAX:
                    self._proven.clear()
                self._proven.add(key)
        return why


#: the coordinator's proofs (this process's)
proofs = Proofs()


def route_refusal(route: ServiceRoute, peer: str | None, prove_at: Prover) -> str | None:
    """Why the coordinator does not take ``route`` from a heartbeat that came from
    ``peer`` (the request's client address; None when it is not known, or when the
    request came through a proxy), or None to take it.

    With a known peer the route is bound to it: its upstream's address must be the
    address the heartbeat came from. One that points at this coordinator's own
    host (loopback, or an address of this host: a node on this host) must also
    prove that it is a forwarder holding the route's credential (``prove_at``):
    no other server of this host is ever reached through it. With no known peer,
    an upstream on a loopback, link-local, unspecified or multicast address or on
    one of this host's own is refused."""
    host = ip_of(urlsplit(route.upstream).hostname)
    if host is None:  # pragma: no cover - reported_routes checked it
        return f"its upstream {route.upstream} names no address"
    where = ip_of(peer)
    if where is None:
        special = _special(host)
        if special is None:
            return None
        return (
            f"its upstream {route.upstream} is {special}, and the address this heartbeat "
            "came from is not known (a proxy, or no address): refused"
        )
    if host != where:
        return (
            f"its upstream {route.upstream} is not on the address this heartbeat came from "
            f"({where}): a node's [cluster] service_address must be the address it reaches "
            "the coordinator from"
        )
    if host.is_loopback or host in own_addresses():
        why = prove_at(route.upstream, route.credential)
        if why is not None:
            return (
                f"its upstream {route.upstream} is on this coordinator's own host and did "
                f"not prove it is the node's service forwarder: {why}"
            )
    return None


def route_peer(client_host: str | None, headers: Mapping[str, str]) -> str | None:
    """The address a node's heartbeat came from, for :func:`route_refusal`: the
    request's client, unless a proxy forwarded it (``Forwarded``,
    ``X-Forwarded-For``, ``X-Real-IP``: the client is then the proxy, and the
    node's own address is not known)."""
    if any(h in headers for h in ("forwarded", "x-forwarded-for", "x-real-ip")):
        return None
    return client_host


@dataclass(frozen=True, slots=True)
class Recorded:
    """What :func:`record_routes` did: how many routes it kept, and the ones it
    refused (``{"name", "job", "why"}``)."""

    kept: int
    refused: list[dict[str, str]]


def record_routes(
    store: ClusterStore,
    node: str,
    report: Mapping[str, object],
    now: float,
    *,
    leases: Mapping[str, Lease],
    peer: str | None = None,
    prove_at: Prover | None = None,
) -> Recorded:
    """Keep the routes of the node's heartbeat ``report`` (see the module's
    docstring); ``leases``: the node's leases by job id; ``peer``: the address the
    heartbeat came from, None when not known (:func:`route_refusal` says which
    routes are refused, and why); ``prove_at``: how a route to this host proves
    it is a forwarder (default :data:`proofs`)."""
    reported = reported_routes(report, now)
    jobs = {j.id: j for j in store.jobs_by_ids([r.job_id for r in reported])}
    kept, refused = [], []
    asked = 0
    ask = prove_at or proofs

    def prove_some(upstream: str, credential: str) -> str | None:
        nonlocal asked
        if isinstance(ask, Proofs) and ask.known(upstream, credential):
            return None
        asked += 1
        if asked > PROOFS_PER_HEARTBEAT:
            return (
                f"more than {PROOFS_PER_HEARTBEAT} routes of this host to prove in one "
                "heartbeat: the others are proven at the next ones"
            )
        return ask(upstream, credential)

    for r in reported:
        job, lease = jobs.get(r.job_id), leases.get(r.job_id)
        if job is None or lease is None or not lease.live(now) or lease.node != node:
            continue
        if job.state is not JobState.RUNNING or job.service_name != r.name:
            continue
        if r.state == STOPPED:  # only the job's end here makes a route stopped
            continue
        why = route_refusal(r, peer, prove_some)
        if why is not None:
            refused.append({"name": r.name, "job": r.job_id, "why": why})
            continue
        kept.append(dataclasses.replace(r, owner=job.owner, share=tuple(job.share)))
    if refused:
        log.warning("node %s: service routes refused: %s", node, refused)
    return Recorded(store.put_service_routes(node, kept, now), refused)


def without_routes(report: Mapping[str, object]) -> dict[str, object]:
    """The report as the node's record keeps it: without its services' routes
    (their credentials are kept in ``service_routes`` alone)."""
    return {k: v for k, v in report.items() if k != "services"}


class RouteBook:
    """The API's ``service_routes`` on a coordinator: every route by name, from the
    store, read again once :data:`CACHE_S` has passed (any thread)."""

    def __init__(
        self,
        store: ClusterStore,
        clock: Callable[[], float] = time.time,
        cache_s: float = CACHE_S,
    ) -> None:
        self.store = store
        self.clock = clock
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._read_at = -1e18
        self._routes: dict[str, ServiceRoute] = {}

    def __call__(self) -> dict[str, ServiceRoute]:
        now = self.clock()
        with self._lock:
            if now - self._read_at < self.cache_s:
                return self._routes
            nodes = {n.name: n for n in self.store.list_nodes()}
            routes = {}
            for rec in self.store.service_routes():
                node = nodes.get(rec.node)
                route = rec.route
                if route.state == STOPPED:
                    if now - route.since > STOPPED_KEEP_S:
                        continue  # kept long enough: a name nobody has
                elif node is None or _gone(node, rec.updated_at, now):
                    route = dataclasses.replace(route, state=UNAVAILABLE)
                routes[route.name] = route
            self._routes, self._read_at = routes, now
            return routes


def _gone(node: NodeRecord, updated_at: float, now: float) -> bool:
    """Whether a route its node wrote at ``updated_at`` is too old to be used."""
    if node.state not in (NodeState.ACTIVE, NodeState.DRAINING):
        return True
    return now - updated_at > heartbeat_window_s(node)
