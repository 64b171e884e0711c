"""The store's part for several hosts: enrolled nodes, job leases, and where a job
was lost.

A lease is a time-bounded claim of one queued job by one node, named by a random
``lease_id``. At most one lease per job exists (the job id is its key); a lease is
live while ``expires_at`` is in the future. Every report a node makes about a job
(its start, its end) names its lease id, and is refused when the lease is no
longer that node's: this is the fence that keeps a node that lost its lease from
recording a result. Implemented once in SQL by
:class:`~gpuwarden.store.sql_cluster.SqlClusterStore`, which both stores are; the
contract suite is ``tests/integration/test_cluster_store.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuwarden.core.model import Attempt, Job
from gpuwarden.core.serviceroute import ServiceRoute
from gpuwarden.core.sources import JobSource
from gpuwarden.store.base import AuditRow, Store


class NodeState(StrEnum):
    ACTIVE = "active"  # takes new work
    DRAINING = "draining"  # finishes what it runs, takes nothing new
    REVOKED = "revoked"  # its credential is refused; its jobs went back to the queue
    OFFLINE = "offline"  # not heard from for too long (back to active when it is again)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    token_id: str | None
    state: NodeState
    #: what the agent said of its host when it enrolled (GPUs, driver, runtime, labels)
    capabilities: dict[str, Any] = field(default_factory=dict)
    #: what the agent said at its latest heartbeat (GPU room, warm types, busy)
    report: dict[str, Any] = field(default_factory=dict)
    enrolled_at: float = 0.0
    last_seen: float | None = None


@dataclass(frozen=True, slots=True)
class Lease:
    job_id: str
    node: str
    lease_id: str
    expires_at: float
    leased_at: float
    #: the node reported the job's start; ``attempt`` is then the store's attempt number
    started: bool = False
    attempt: int | None = None
    #: the waiting job this running job was chosen to yield to (preemption across
    #: hosts): the lease is not renewed until the node reports the attempt's end
    preempt_for: str | None = None

    def live(self, now: float) -> bool:
        return now < self.expires_at


@dataclass(frozen=True, slots=True)
class Grant:
    """A diagnostic grant: one exact queued job may start on a draining node, once."""

    id: int
    node: str
    job_id: str
    granted_by: str | None
    reason: str
    granted_at: float
    used_at: float | None = None
    #: the attempt that used it
    attempt: int | None = None
    revoked_at: float | None = None
    revoked_reason: str | None = None

    @property
    def open(self) -> bool:
        return self.used_at is None and self.revoked_at is None


@dataclass(frozen=True, slots=True)
class Claimable:
    """A queued job a node may be offered: what placement needs of it."""

    id: str
    type: str
    priority: int
    seq: int
    submitted_at: float
    vram_bytes: int | None
    attempts: int
    constraints: dict[str, Any] = field(default_factory=dict)
    #: a job with input files: the folder they were staged in (on the host that
    #: took its bundle); None for a job without input files
    input_dir: str | None = None
    #: how many GPUs it asked for itself (None: its type's count)
    gpus: int | None = None
    #: the id of the API token that submitted it (None: the CLI on the host, a bundle)
    owner: str | None = None
    #: a job from a pinned commit: its repository and commit (None: a module's type)
    source: JobSource | None = None


@dataclass(frozen=True, slots=True)
class RunningUse:
    """A running job as fair share counts it before its end: its owner, its type and
    declared VRAM (its footprint), and when its current attempt started."""

    owner: str | None
    type: str
    vram_bytes: int | None
    started_at: float
    #: the GPUs it asked for itself (None: its type's count)
    gpus: int | None = None


@dataclass(frozen=True, slots=True)
class RouteRecord:
    """A running service's route as its node last reported it (``service_routes``):
    the route (owner and share from the job row; times on the coordinator's clock),
    the node that runs it, and when that node's heartbeat wrote it."""

    route: ServiceRoute
    node: str
    updated_at: float


class ClusterStore(Store):
    """What the coordinator needs of the store beyond the :class:`Store` contract."""

    # -- nodes --------------------------------------------------------------

    @abc.abstractmethod
    def upsert_node(
        self, name: str, *, token_id: str, capabilities: dict[str, Any], now: float
    ) -> NodeRecord:
        """Record an enrolment: a new node, or a node enrolled again (a new token,
        new capabilities, state active, its last report cleared)."""

    @abc.abstractmethod
    def get_node(self, name: str) -> NodeRecord | None: ...

    @abc.abstractmethod
    def list_nodes(self) -> list[NodeRecord]:
        """Every node, by name."""

    @abc.abstractmethod
    def set_node_state(
        self,
        name: str,
        state: NodeState,
        *,
        now: float,
        only_from: frozenset[NodeState] | None = None,
    ) -> bool:
        """Set the node's state (only when it is in ``only_from``, if given), with a
        ``node_state`` event. Return whether it changed."""

    @abc.abstractmethod
    def touch_node(self, name: str, report: dict[str, Any], now: float) -> NodeRecord | None:
        """Keep the node's latest report and when it was seen; an offline node is
        active again. None when there is no such node."""

    # -- leases -------------------------------------------------------------

    @abc.abstractmethod
    def lease_jobs(
        self,
        node: str,
        job_ids: Sequence[str],
        *,
        lease_id: str,
        expires_at: float,
        now: float,
    ) -> list[str]:
        """Lease to ``node`` those of ``job_ids`` that are queued, have no cancel
        request and no live lease (an expired one is replaced), atomically; return
        the ids leased, in the order given. A job that another writer is leasing at
        the same moment is skipped, never waited for."""

    @abc.abstractmethod
    def claimable_jobs(
        self, *, now: float, limit: int = 1000, after: tuple[int, int] | None = None
    ) -> list[Claimable]:
        """Queued jobs with no live lease, no cancel request, and no input files
        unless they were staged in a folder (``input_dir``), highest priority
        first, then arrival order; with ``after`` (a job's ``(priority, seq)``),
        only those that come after it in that order (the next page)."""

    @abc.abstractmethod
    def queued_owners(self) -> list[str]:
        """The owners of queued jobs (``""`` for the CLI on the host and bundles), by
        id: one index probe each, however many jobs they have queued."""

    @abc.abstractmethod
    def claimable_jobs_of(
        self, owner: str, *, now: float, limit: int = 1000, after: tuple[int, int] | None = None
    ) -> list[Claimable]:
        """:meth:`claimable_jobs` of one owner (``""``: jobs no API token submitted),
        in the same order and with the same ``after``."""

    @abc.abstractmethod
    def running_attempts(self) -> list[RunningUse]:
        """Every running job's current attempt, in arrival order."""

    def live_lease_counts(self, now: float) -> dict[str, int]:
        """How many live leases each node holds (nodes with none are left out)."""
        counts: dict[str, int] = {}
        for lease in self.leases():
            if lease.live(now):
                counts[lease.node] = counts.get(lease.node, 0) + 1
        return counts

    def expired_leases(self, now: float) -> list[Lease]:
        """The leases that are not live at ``now``, oldest first."""
        return [lease for lease in self.leases() if not lease.live(now)]

    def queued_cancel_requests(self, now: float, *, limit: int = 10_000) -> list[str]:
        """The ids of queued jobs with a cancel request and no live lease (a job
        cancelled while its node was retrying it), in arrival order."""
        live = {lease.job_id for lease in self.leases() if lease.live(now)}
        return [
            j.id for j in self.queued_jobs(limit=limit) if j.cancel_requested and j.id not in live
        ]

    def add_audits(self, rows: Sequence[AuditRow]) -> None:
        """Append several audit rows, in order (a batch of an agent's reports)."""
        for row in rows:
            self.add_audit(row)

    def jobs_by_ids(self, job_ids: Sequence[str]) -> list[Job]:
        """The jobs of those ids that exist, in submission order."""
        found = (self.get_job(i) for i in dict.fromkeys(job_ids))
        return sorted((j for j in found if j is not None), key=lambda j: j.seq)

    @abc.abstractmethod
    def renew_leases(
        self,
        node: str,
        expires_at: float,
        *,
        now: float,
        job_ids: Sequence[str] | None = None,
    ) -> int:
        """Move the expiry of the node's live leases (only of ``job_ids`` when given)
        to ``expires_at``; an expired lease is never brought back. Return how many."""

    @abc.abstractmethod
    def extend_leases(self, expires_at: float) -> int:
        """Move the expiry of every lease that ends before ``expires_at`` to
        ``expires_at`` (a coordinator that just started gives each lease a full
        period: none is swept for the time no coordinator ran). Return how many."""

    @abc.abstractmethod
    def leases(self, node: str | None = None) -> list[Lease]:
        """Every lease (of ``node``), live or expired, oldest first."""

    @abc.abstractmethod
    def lease_of(self, job_id: str) -> Lease | None: ...

    @abc.abstractmethod
    def drop_lease(self, job_id: str, *, lease_id: str | None = None) -> bool:
        """Remove the job's lease (only if it is still ``lease_id``, when given)."""

    @abc.abstractmethod
    def mark_lease_started(
        self, job_id: str, attempt: int | None, *, lease_id: str | None = None
    ) -> bool:
        """Record that the leased job started as ``attempt`` (None: it is back in the
        node's own queue, not started). Only if the lease is still ``lease_id``.
        Clears the lease's ``preempt_for``: it is renewed again."""

    @abc.abstractmethod
    def mark_lease_preempt(
        self, job_id: str, *, lease_id: str, for_job: str, now: float, expires_at: float = 0.0
    ) -> bool:
        """Mark the live lease ``lease_id`` of a started job as chosen to yield to
        ``for_job``: :meth:`renew_leases` leaves it alone from now on, and it lasts
        at least until ``expires_at`` (the victim's grace and the time to report its
        end: a job is not taken back for using the grace it was given). False when
        the lease is not that one, not live, not started, or marked already."""

    # -- where jobs were lost -------------------------------------------------

    @abc.abstractmethod
    def add_lost(self, job_id: str, node: str, *, now: float) -> None:
        """Remember that an attempt of the job was lost with ``node`` (placement
        prefers another node for it); once per node."""

    @abc.abstractmethod
    def lost_nodes(self, job_id: str) -> list[str]:
        """The nodes the job was lost on, in the order it was lost."""

    # -- diagnostic grants ------------------------------------------------------

    @abc.abstractmethod
    def add_grant(
        self, node: str, job_id: str, *, granted_by: str | None, reason: str, now: float
    ) -> Grant | None:
        """Record an open grant of ``job_id`` on ``node``; None (nothing written) when
        the node has an open grant already (at most one per node)."""

    @abc.abstractmethod
    def open_grant(self, node: str) -> Grant | None: ...

    @abc.abstractmethod
    def open_grants(self) -> list[Grant]:
        """Every open grant, by node."""

    @abc.abstractmethod
    def grants_of_job(self, job_id: str) -> list[Grant]:
        """Every grant of the job, oldest first."""

    @abc.abstractmethod
    def granted_used_on(self, node: str) -> set[str]:
        """The jobs that started on ``node`` under a grant (never offered it again)."""

    @abc.abstractmethod
    def start_granted(
        self, job_id: str, *, node: str, gpu_uuid: str | None, now: float
    ) -> tuple[Job, Attempt]:
        """:meth:`start_attempt` that consumes the job's open grant on ``node`` in the
        same transaction: :class:`~gpuwarden.errors.TransitionError` and nothing
        written when there is none (used by another start, or revoked)."""

    @abc.abstractmethod
    def revoke_grants(
        self, *, now: float, reason: str, job_id: str | None = None, node: str | None = None
    ) -> int:
        """Revoke the open grants of ``job_id`` (or of ``node``); how many."""

    # -- maintenance --------------------------------------------------------

    @abc.abstractmethod
    def try_maintenance_lock(self) -> bool:
        """Become the one process that runs maintenance sweeps, if no other is; keep
        it until :meth:`release_maintenance_lock` (or the process ends). True when
        this process holds it (again)."""

    @abc.abstractmethod
    def release_maintenance_lock(self) -> None: ...

    # -- service routes -----------------------------------------------------------

    @abc.abstractmethod
    def put_service_routes(self, node: str, routes: Sequence[ServiceRoute], now: float) -> int:
        """A heartbeat of ``node`` reported ``routes`` (checked by the caller): write
        each (a route of another job's name on another node is left alone), and drop
        the node's routes it did not report; how many were written."""

    @abc.abstractmethod
    def drop_service_route(self, job_id: str) -> bool:
        """The job's route goes at once, stopped or not (True when there was one)."""

    @abc.abstractmethod
    def stop_service_route(self, job_id: str, now: float) -> bool:
        """The job's attempt ended here: its route is kept as ``stopped`` since
        ``now``, without upstream or credential (never forwarded again), until
        :meth:`drop_stopped_routes` or a new route of its name replaces it (True
        when there was a running one)."""

    @abc.abstractmethod
    def drop_stopped_routes(self, before: float) -> int:
        """Drop the routes stopped before ``before``; how many."""

    @abc.abstractmethod
    def service_routes(self) -> list[RouteRecord]:
        """Every route, by name."""
