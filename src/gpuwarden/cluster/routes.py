"""Services across hosts on the coordinator (SPEC.md section 16, "Services across
hosts"): the routes of the running services, as the nodes report them at each
heartbeat, kept in the store (``service_routes``) and read back by the API's
proxy at ``/run/<name>/``.

* :func:`record_routes` (at each heartbeat): the routes the node reports
  (:func:`gpuwarden.cluster.nodeview.reported_routes` checks each field), each
  kept only for a job that runs on a live lease of that node under that service
  name; owner and share are the job row's. The node's routes it no longer
  reports go.
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

import dataclasses
import ipaddress
import threading
import time
from collections.abc import Callable, Mapping

from gpuwarden.cluster.nodeview import heartbeat_window_s, reported_routes
from gpuwarden.core.serviceroute import STOPPED, STOPPED_KEEP_S, UNAVAILABLE, ServiceRoute
from gpuwarden.core.states import JobState
from gpuwarden.store.cluster import ClusterStore, Lease, NodeRecord, NodeState

#: how long the API keeps the routes it read (seconds)
CACHE_S = 1.0


def _loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def record_routes(
    store: ClusterStore,
    node: str,
    report: Mapping[str, object],
    now: float,
    *,
    leases: Mapping[str, Lease],
    peer: str | None = None,
) -> int:
    """Keep the routes of the node's heartbeat ``report`` (see the module's
    docstring); ``leases``: the node's leases by job id; ``peer``: the address the
    heartbeat came from (a node that is not on this host may not name a loopback
    address: that would be this host's own). How many were kept."""
    reported = reported_routes(report, now)
    if reported and _loopback(_address(report)) and peer is not None and not _loopback(peer):
        reported = []
    jobs = {j.id: j for j in store.jobs_by_ids([r.job_id for r in reported])}
    kept = []
    for r in reported:
        job, lease = jobs.get(r.job_id), leases.get(r.job_id)
        if job is None or lease is None or not lease.live(now) or lease.node != node:
            continue
        if job.state is not JobState.RUNNING or job.service_name != r.name:
            continue
        if r.state == STOPPED:  # only the job's end here makes a route stopped
            continue
        kept.append(dataclasses.replace(r, owner=job.owner, share=tuple(job.share)))
    return store.put_service_routes(node, kept, now)


def _address(report: Mapping[str, object]) -> str | None:
    services = report.get("services")
    address = services.get("address") if isinstance(services, Mapping) else None
    return address if isinstance(address, str) else None


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
