"""A node as the coordinator sees it, read from its enrolment and its latest report.

The cluster's durations (:class:`Timing`), whether a node is heard from on time
(:func:`silence`), and its placement view (:func:`node_view`, :func:`judged_view`)
beside a queued job's (:func:`offerable`): what :mod:`gpuwarden.cluster.coordinator`
offers jobs by and :mod:`gpuwarden.cluster.report` explains with. Nothing here
writes to the store.
"""

from __future__ import annotations

import ipaddress
import math
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from gpuwarden.core.launchrules import LaunchRules
from gpuwarden.core.model import Job, JobType, Lane, gpu_count
from gpuwarden.core.placement import NO_COMMANDS, Constraints, GpuRoom, NodeView, Offerable
from gpuwarden.core.preempt import DEFAULT_GRACE_S, DEFAULT_MIN_RUN_S, DEFAULT_SIGNAL, Victim
from gpuwarden.core.service import SERVICE_NAME
from gpuwarden.core.serviceroute import STATES, ServiceRoute
from gpuwarden.core.sources import reported_ability, split_type
from gpuwarden.errors import ValidationError
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import Claimable, ClusterStore, Lease, NodeRecord, NodeState


@dataclass(frozen=True, slots=True)
class Timing:
    """The cluster's durations (config ``[cluster]``)."""

    lease_s: float = 90.0
    offline_after_s: float = 120.0
    affinity_wait_s: float = 30.0
    #: after a lease's end, how long the coordinator waits before another node may
    #: have its job (``[cluster] fence_grace_s``): the time a silent agent's
    #: supervisors take to stop their jobs on their own (self-fencing)
    fence_grace_s: float = 0.0

    def held_until(self, now: float, lease_s: float | None = None) -> float:
        """The expiry the store keeps for a lease given or renewed at ``now``: the
        lease the node is told (``lease_s``, default :attr:`lease_s`) and the grace."""
        return now + (self.lease_s if lease_s is None else lease_s) + self.fence_grace_s


def heartbeat_every_s(lease_s: float) -> float:
    """How often an agent sends a heartbeat under leases of ``lease_s`` seconds."""
    return max(0.2, min(15.0, lease_s / 6))


#: a heartbeat is overdue once this many of the node's heartbeat intervals passed
#: (and a second more) without a word from it
OVERDUE_BEATS = 2.0


@dataclass(frozen=True, slots=True)
class Silence:
    """A node whose heartbeat is overdue: for how long, and when the soonest of its
    leases ends (negative: it ended; None: it holds none)."""

    seconds: float
    lease_ends_in: float | None

    def text(self) -> str:
        said = f"silent for {self.seconds:.0f} s"
        if self.lease_ends_in is None:
            return said
        if self.lease_ends_in > 0:
            return f"{said} (lease ends in {self.lease_ends_in:.0f} s)"
        return f"{said} (its lease ended {-self.lease_ends_in:.0f} s ago)"


def heard_s_ago(record: NodeRecord, now: float) -> float:
    """Seconds since the node was last heard from (since it enrolled, if never)."""
    heard = record.last_seen if record.last_seen is not None else record.enrolled_at
    return max(0.0, now - heard)


def heartbeat_window_s(record: NodeRecord) -> float:
    """How long the node may be silent before its heartbeat is overdue: by the
    interval it reported, else the default lease's."""
    every = record.report.get("heartbeat_every_s")
    if not isinstance(every, int | float) or isinstance(every, bool) or not 0 < every <= 3600:
        every = heartbeat_every_s(Timing().lease_s)
    return OVERDUE_BEATS * float(every) + 1.0


def silence(record: NodeRecord, leases: Collection[Lease], now: float) -> Silence | None:
    """The node's silence when its heartbeat is overdue (by the interval it reported,
    else the default lease's), or None while it is heard from on time. ``leases``:
    its leases (the soonest end is shown). A revoked node is never silent."""
    if record.state is NodeState.REVOKED:
        return None
    quiet = heard_s_ago(record, now)
    if quiet <= heartbeat_window_s(record):
        return None
    mine = [lease.expires_at for lease in leases if lease.node == record.name]
    return Silence(quiet, min(mine) - now if mine else None)


# -- the services a node reports -------------------------------------------------

#: the most services one heartbeat may report
MAX_ROUTES = 256
#: a route credential: what :func:`secrets.token_urlsafe` makes
CREDENTIAL = re.compile(r"[A-Za-z0-9_-]{16,256}")
_UPSTREAM = re.compile(r"http://(\[[0-9A-Fa-f:.]{2,45}\]|[0-9.]{7,15}):([0-9]{1,5})")


def reported_routes(report: Mapping[str, Any], now: float) -> list[ServiceRoute]:
    """The running services a heartbeat reports (``report["services"]``), each
    checked as hostile input: a malformed entry is left out, never an error. Its
    upstream must be ``http://HOST:PORT`` with HOST the ``address`` the node
    declares its forwarders listen on; its times are moved onto this clock
    (``now``) from the node's (``clock``). Owner and share are not the node's to
    say (empty here: the job row's are used)."""
    raw = report.get("services")
    if not isinstance(raw, Mapping):
        return []
    address, clock, routes = raw.get("address"), raw.get("clock"), raw.get("routes")
    if not isinstance(address, str) or not _number(clock) or not isinstance(routes, list):
        return []
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return []
    skew = now - float(clock)
    out = [r for e in routes[:MAX_ROUTES] if (r := _route(e, ip, skew, now)) is not None]
    names = [r.name for r in out]
    return [r for r in out if names.count(r.name) == 1]  # a name twice: neither


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _route(
    e: Any, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, skew: float, now: float
) -> ServiceRoute | None:
    """One reported route, or None when any of its fields is not what it must be."""
    if not isinstance(e, Mapping):
        return None
    name, job, state, upstream, cred = (
        e.get(k) for k in ("name", "job", "state", "upstream", "credential")
    )
    since, last_ok = e.get("since"), e.get("last_ok")
    texts = (name, job, state, upstream, cred)
    if not all(isinstance(t, str) for t in texts) or not _number(since):
        return None
    if last_ok is not None and not _number(last_ok):
        return None
    assert isinstance(name, str) and isinstance(job, str) and isinstance(upstream, str)
    assert isinstance(state, str) and isinstance(cred, str)
    m = _UPSTREAM.fullmatch(upstream)
    if m is None or not SERVICE_NAME.fullmatch(name) or not SERVICE_NAME.fullmatch(job):
        return None
    try:
        host = ipaddress.ip_address(m.group(1).strip("[]"))
    except ValueError:
        return None
    if host != ip or not 0 < int(m.group(2)) < 65536 or state not in STATES:
        return None
    if not CREDENTIAL.fullmatch(cred):
        return None
    return ServiceRoute(
        name=name,
        job_id=job,
        owner=None,
        share=(),
        state=state,
        upstream=upstream,
        credential=cred,
        since=min(now, float(since) + skew),
        last_ok=None if last_ok is None else min(now, float(last_ok) + skew),
    )


# -- what a node looks like to placement ------------------------------------------


def node_view(
    record: NodeRecord, *, busy: int = 0, report: Mapping[str, Any] | None = None
) -> NodeView:
    """Placement's view of a node from its latest report (``report`` overrides the
    stored one). ``busy`` is the number of live leases it holds (it counts when the
    report says less)."""
    rep = dict(record.report if report is None else report)
    gpus = tuple(
        GpuRoom(
            uuid=str(g["uuid"]),
            name=str(g.get("name", "")),
            total_bytes=int(g.get("total_bytes", 0)),
            free_bytes=max(0, int(g.get("free_bytes", 0))),
            usable_bytes=int(g.get("usable_bytes", g.get("total_bytes", 0))),
        )
        for g in rep.get("gpus", [])
        if isinstance(g, Mapping) and "uuid" in g
    )
    labels = rep.get("labels") or record.capabilities.get("labels") or {}
    rules = rep.get("launch_rules", record.capabilities.get("launch_rules"))
    sources = rep.get("sources", record.capabilities.get("sources"))
    return NodeView(
        name=record.name,
        gpus=gpus,
        warm=frozenset(str(t) for t in rep.get("warm", [])),
        busy=max(busy, int(rep.get("busy", 0))),
        max_jobs=max(0, int(rep.get("max_jobs", 4))),
        labels={str(k): str(v) for k, v in dict(labels).items()},
        accepting=record.state is NodeState.ACTIVE and bool(rep.get("accepting", True)),
        types=_names(rep.get("types")),
        modules=_names(rep.get("modules")),
        rules=LaunchRules.from_json(rules),
        victims=_victims(rep.get("victims"), record),
        sources=reported_ability(sources),
        commands=_commands(rep.get("commands")),
    )


def _commands(raw: Any) -> str | None:
    """What a node reported of command jobs: "" when it runs sandboxed ones, else
    why not (in a few words, kept short); anything else: it did not say."""
    if raw == "":
        return None
    if isinstance(raw, str):
        return raw[:300]
    return NO_COMMANDS


def _victims(raw: Any, record: NodeRecord) -> tuple[Victim, ...]:
    """The node's reported running jobs of preemptible types (SPEC.md section 16,
    ``victims``), on this coordinator's clock: each one's ``run_s`` counted back from
    when the report came (its ``last_seen``)."""
    if not isinstance(raw, list):
        return ()
    seen = record.last_seen if record.last_seen is not None else record.enrolled_at
    out = []
    for v in raw:
        if not isinstance(v, Mapping) or not v.get("job") or not v.get("gpu"):
            continue
        try:
            out.append(
                Victim(
                    job_id=str(v["job"]),
                    holder=str(v["job"]),
                    gpu_uuid=str(v["gpu"]),
                    priority=int(v.get("priority", 0)),
                    since=seen - float(v.get("run_s", 0.0)),
                    min_run_s=float(v.get("min_run_s", DEFAULT_MIN_RUN_S)),
                    signal=str(v.get("signal", DEFAULT_SIGNAL)),
                    grace_s=float(v.get("grace_s", DEFAULT_GRACE_S)),
                    preempting_for=str(v["preempting_for"]) if v.get("preempting_for") else None,
                    bytes=max(0, int(v.get("bytes", 0))),
                )
            )
        except (TypeError, ValueError):
            continue  # a malformed entry is not a victim
    return tuple(out)


def _names(raw: Any) -> frozenset[str] | None:
    """A reported list of job type names, or None when it was not reported."""
    if not isinstance(raw, list):
        return None
    return frozenset(str(x) for x in raw)


def offerable(
    job: Job | Claimable,
    registry: Registry,
    footprints: Mapping[str, int],
    lost: Collection[str] = (),
    *,
    usage: float = 0.0,
) -> Offerable | None:
    """Placement's view of a queued job; None when its type is not known here.
    ``usage``: its owner's fair-share use now."""
    jobtype = known_type(registry, job)
    if jobtype is None:
        return None
    need = footprint_of(registry, footprints, job.type, job.vram_bytes)
    return Offerable(
        id=job.id,
        type=job.type,
        lane=jobtype.lane,
        vram_bytes=need,
        priority=job.priority,
        seq=job.seq,
        submitted_at=job.submitted_at,
        constraints=Constraints.of(job.constraints),
        avoid=frozenset(lost),
        launch=jobtype.launch,
        runtime=jobtype.runtime is not None,
        gpus=gpu_count(jobtype, job.gpus),
        usage=usage,
        source_repo=None if job.source is None else job.source.repo,
    )


#: commits whose module could not be read here lately: (repo, commit, type) to
#: when it was tried (monotonic); tried again after :data:`UNREADABLE_S`
_unreadable: dict[tuple[str, str, str], float] = {}
UNREADABLE_S = 300.0
_MAX_UNREADABLE = 1024


def known_type(registry: Registry, job: Job | Claimable) -> JobType | None:
    """The job's type as this registry knows it. A job from a commit whose type
    (``m.t@<commit>``) it does not know yet (another process took it, or this one
    restarted) has its commit's ``module.toml`` read again, from the source cache
    (fetched if it is not there); None when that fails (tried again after
    :data:`UNREADABLE_S`) or the type is not known."""
    jobtype = registry.types.get(job.type)
    if jobtype is not None or job.source is None or registry.sources is None:
        return jobtype
    name, commit = split_type(job.type)
    if commit != job.source.commit:
        return None
    key = (job.source.repo, commit, name)
    tried = _unreadable.get(key)
    if tried is not None and time.monotonic() - tried < UNREADABLE_S:
        return None
    try:
        return registry.from_source(job.source, name)
    except ValidationError:
        if len(_unreadable) >= _MAX_UNREADABLE:
            _unreadable.clear()
        _unreadable[key] = time.monotonic()
        return None


def footprint_of(
    registry: Registry, footprints: Mapping[str, int], type_name: str, vram_bytes: int | None
) -> int:
    """The VRAM a job of ``type_name`` (asking ``vram_bytes``) needs on one GPU: its
    ask or its type's declaration, raised to the type's measured footprint; 0 on
    the cpu lane or for a type not known here."""
    jobtype = registry.types.get(type_name)
    if jobtype is None or jobtype.lane is not Lane.VRAM:
        return 0
    return max(vram_bytes or jobtype.vram_bytes, footprints.get(jobtype.name, 0))


def held_by(
    registry: Registry,
    footprints: Mapping[str, int],
    type_name: str,
    vram_bytes: int | None,
    gpus: int | None,
) -> int:
    """What a running job holds on all its GPUs (fair share counts it): its
    footprint on each of its own ``gpus``, else its type's count."""
    jobtype = registry.types.get(type_name)
    per_gpu = footprint_of(registry, footprints, type_name, vram_bytes)
    return per_gpu * (gpu_count(jobtype, gpus) if jobtype is not None else 1)


def judged_view(record: NodeRecord) -> NodeView:
    """A node as a submission is judged against: its last report, or before its
    first report what it enrolled with: its GPUs (all their memory usable), the job
    types its modules have and its launch rules."""
    if record.report.get("gpus") or "types" in record.report:
        return node_view(record)
    caps = record.capabilities
    gpus = [
        {**g, "free_bytes": g.get("total_bytes", 0)}
        for g in caps.get("gpus", [])
        if isinstance(g, Mapping)
    ]
    report = {**record.report, "gpus": gpus}
    if isinstance(caps.get("types"), list):
        report["modules"] = caps["types"]  # at enrolment: every type its modules have
    return node_view(record, report=report)


def judged_views(store: ClusterStore) -> list[NodeView]:
    """The nodes a job is judged against: every enrolled node that is not revoked."""
    return [
        judged_view(r)
        for r in store.list_nodes()
        if r.state in (NodeState.ACTIVE, NodeState.DRAINING, NodeState.OFFLINE)
    ]


def live_counts(leases: list[Lease], now: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    for lease in leases:
        if lease.live(now):
            counts[lease.node] = counts.get(lease.node, 0) + 1
    return counts


def is_fresh(record: NodeRecord, now: float, timing: Timing) -> bool:
    return record.last_seen is not None and now - record.last_seen <= timing.offline_after_s
