"""What people are shown of the cluster, over the coordinator's store.

The node list (:func:`node_json`: ``GET /v1/nodes``, ``gpuwarden node list``),
``gpuwarden status`` over a coordinator (:func:`cluster_status`), and why a
queued job is not taken or where a running one runs (:func:`explain_placement`,
:func:`explain_running`), added to the node's own explanation by :func:`explain`
(``gpuwarden explain``, ``GET /v1/jobs/{id}/explain``, ``submit --wait``). Read
only: nothing here changes the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from gpuwarden.cluster.claimorder import fair_share_wait, owners_use
from gpuwarden.cluster.nodeview import (
    Silence,
    Timing,
    footprint_of,
    heard_s_ago,
    held_by,
    is_fresh,
    judged_views,
    live_counts,
    node_view,
    offerable,
    silence,
)
from gpuwarden.core import placement
from gpuwarden.core.fairshare import DEFAULT_HALF_LIFE_S
from gpuwarden.core.model import Job, JobType, Lane, format_bytes
from gpuwarden.core.placement import NodeView, Offerable
from gpuwarden.core.sources import reported_ability
from gpuwarden.core.states import JobState
from gpuwarden.node.explain import (
    PREVIEW_ID,
    explain_job,
    latest_status,
    view_from_status,
)
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore, Grant, Lease, NodeRecord, NodeState


def explain(
    job: Job,
    store: Store,
    registry: Registry,
    cpu_slots: int,
    now: float,
    *,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
) -> list[str]:
    """Where a job stands and, if it waits, why: as the broker last published its
    view, and, over a coordinator's store, what the enrolled nodes say."""
    status = latest_status(store, now)
    view = view_from_status(status, cpu_slots) if status else None
    if not isinstance(store, ClusterStore):
        return explain_job(job, store, registry, view, half_life_s=half_life_s)
    lines = explain_job(
        job,
        store,
        registry,
        view,
        half_life_s=half_life_s,
        placement=lambda j: explain_waiting(store, registry, j, now, half_life_s),
        running=lambda j: explain_running(store, j, now),
    )
    return lines + grant_lines(store, job.id)


def grant_lines(store: ClusterStore, job_id: str) -> list[str]:
    """What ``explain`` says of the job's diagnostic grants."""
    out = []
    for g in store.grants_of_job(job_id):
        if g.open:
            out.append(
                f"it has a diagnostic grant on node {g.node}: {g.reason} (it runs there "
                "alone, once the node's other jobs have ended)"
            )
        elif g.used_at is not None:
            out.append(
                f"it ran once on node {g.node} under a diagnostic grant (attempt {g.attempt}); "
                "never retried there"
            )
        else:
            out.append(f"its diagnostic grant on node {g.node} was revoked: {g.revoked_reason}")
    return out


# -- the node list and status ------------------------------------------------------


def node_json(
    record: NodeRecord,
    leases: list[Lease],
    now: float,
    grants: Mapping[str, Grant] | None = None,
) -> dict[str, Any]:
    """What ``GET /v1/nodes`` and ``gpuwarden node list`` show of a node (``grants``:
    the open diagnostic grants by node, shown as ``grant``)."""
    mine = [lease for lease in leases if lease.node == record.name]
    rep = record.report
    quiet = silence(record, mine, now)
    return {
        "name": record.name,
        "state": record.state.value,
        "enrolled_at": record.enrolled_at,
        "last_seen": record.last_seen,
        "seen_s_ago": round(now - record.last_seen, 1) if record.last_seen is not None else None,
        "silent_s": round(quiet.seconds, 1) if quiet is not None else None,
        "lease_ends_in_s": (
            round(quiet.lease_ends_in, 1)
            if quiet is not None and quiet.lease_ends_in is not None
            else None
        ),
        "condition": quiet.text() if quiet is not None else "",
        "leases": len([lease for lease in mine if lease.live(now)]),
        "running": len([lease for lease in mine if lease.live(now) and lease.started]),
        "gpus": rep.get("gpus", record.capabilities.get("gpus", [])),
        "warm": rep.get("warm", []),
        "max_jobs": rep.get("max_jobs"),
        "labels": rep.get("labels", record.capabilities.get("labels", {})),
        "capabilities": record.capabilities,
        # jobs from a pinned commit: as placement reads the node's report (None: none)
        "sources": _sources_json(rep.get("sources", record.capabilities.get("sources"))),
        "grant": grant_json(grants[record.name]) if grants and record.name in grants else None,
    }


def _sources_json(raw: Any) -> dict[str, Any] | None:
    """A node's ``sources`` as placement reads it (None: it runs no job from a commit,
    or said it in a shape not taken)."""
    ability = reported_ability(raw)
    return None if ability is None else ability.to_json()


def grant_json(grant: Grant) -> dict[str, Any]:
    """A diagnostic grant as ``node list``, ``status`` and the API show it."""
    return {
        "node": grant.node,
        "job": grant.job_id,
        "granted_by": grant.granted_by,
        "reason": grant.reason,
        "granted_at": grant.granted_at,
        "used_at": grant.used_at,
        "attempt": grant.attempt,
        "revoked_at": grant.revoked_at,
        "revoked_reason": grant.revoked_reason,
    }


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _gpu_status(g: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "uuid": str(g.get("uuid", "")),
        "name": str(g.get("name", "")),
        "total_bytes": _int(g.get("total_bytes")) or 0,
        "used_bytes": _int(g.get("used_bytes")),
        "ledger_bytes": _int(g.get("ledger_bytes")),
        "free_bytes": _int(g.get("free_bytes")),
        # what jobs leased to the node and not started yet will take here
        "waiting_bytes": _int(g.get("waiting_bytes")) or 0,
        "degraded": str(g.get("degraded") or ""),
    }


def cluster_status(
    store: ClusterStore, now: float, *, offline_after_s: float = 120.0
) -> list[dict[str, Any]]:
    """What ``gpuwarden status`` shows of each enrolled node over a coordinator: its
    state and the first problem found (``problem``: offline, silent, a degraded GPU,
    a failing probe; "" when none, and for a revoked node), its GPUs (total, used by
    the probe, the ledger, free for a new job, degraded), its warm servers, the jobs
    running there and how long since it was heard from."""
    leases = store.leases()
    out: list[dict[str, Any]] = []
    for record in store.list_nodes():
        mine = [lease for lease in leases if lease.node == record.name]
        rep = record.report
        raw_gpus = rep.get("gpus") if isinstance(rep.get("gpus"), list) else None
        if raw_gpus is None:
            raw_gpus = record.capabilities.get("gpus") or []
        gpus = [_gpu_status(g) for g in raw_gpus if isinstance(g, Mapping)]
        quiet = silence(record, mine, now)
        heard = heard_s_ago(record, now)
        out.append(
            {
                "node": record.name,
                "state": record.state.value,
                "problem": _problem(record, gpus, quiet, heard, offline_after_s),
                "heard_s_ago": round(heard, 1),
                "last_seen": record.last_seen,
                "silent": quiet.text() if quiet is not None else "",
                "probe": str(rep.get("probe") or record.capabilities.get("probe") or ""),
                "probe_error": str(rep.get("probe_error") or ""),
                "gpus": gpus,
                "warm": _warm_status(rep),
                "running": _running_status(store, mine, now),
                "leased": len([lease for lease in mine if not lease.started]),
                "max_jobs": _int(rep.get("max_jobs")),
            }
        )
    return out


def _problem(
    record: NodeRecord,
    gpus: list[dict[str, Any]],
    quiet: Silence | None,
    heard: float,
    offline_after_s: float,
) -> str:
    """The first problem of a node that ``gpuwarden status`` shows ("" when none,
    and for a revoked node)."""
    degraded = [g for g in gpus if g["degraded"]]
    if record.state is NodeState.REVOKED:
        return ""
    if record.state is NodeState.OFFLINE or heard > offline_after_s:
        return f"offline: not heard from for {heard:.0f} s"
    if quiet is not None:
        return quiet.text()
    if degraded:
        return f"{len(degraded)} GPU(s) degraded: VRAM admission paused there"
    if record.report.get("probe_error"):
        return "the GPU probe fails: VRAM admission paused"
    return ""


def _running_status(store: ClusterStore, mine: list[Lease], now: float) -> list[dict[str, Any]]:
    """The jobs running under a node's leases ``mine``."""
    running = []
    for lease in mine:
        if not lease.started or lease.attempt is None:
            continue
        attempt = next((a for a in store.attempts(lease.job_id) if a.number == lease.attempt), None)
        job = store.get_job(lease.job_id)
        running.append(
            {
                "job": lease.job_id,
                "type": job.type if job is not None else "",
                "attempt": lease.attempt,
                "gpu": attempt.gpu_uuid if attempt is not None else None,
                "started_at": attempt.started_at if attempt is not None else None,
                "lease_ends_in_s": round(lease.expires_at - now, 1),
            }
        )
    return running


def _warm_status(rep: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A node's warm servers from its report (only their types, from an agent that
    reports no ``warm_servers``)."""
    servers = rep.get("warm_servers")
    if not isinstance(servers, list):
        return [
            {"type": str(t), "gpu": None, "state": "", "jobs_served": None}
            for t in rep.get("warm", []) or []
        ]
    return [
        {
            "type": str(w.get("type", "")),
            "gpu": w.get("gpu"),
            "state": str(w.get("state", "")),
            "jobs_served": _int(w.get("jobs_served")),
        }
        for w in servers
        if isinstance(w, Mapping)
    ]


# -- explain ----------------------------------------------------------------------


def explain_placement(
    store: ClusterStore, registry: Registry, job: Job, now: float, timing: Timing | None = None
) -> list[str]:
    """Why no node has taken a queued job (empty when there are no nodes at all):
    one line per node heard from lately, ``node NAME REASON``."""
    timing = timing or Timing()
    records = store.list_nodes()
    if not records or job.state is not JobState.QUEUED:
        return []
    leases = store.leases()
    lease = next((lease for lease in leases if lease.job_id == job.id), None)
    yielding = [y for y in leases if y.preempt_for == job.id and y.live(now)]
    if lease is not None and lease.live(now) and yielding:
        names = ", ".join(y.job_id for y in yielding)
        return [
            f"it is leased to node {lease.node} and waits for job {names} to checkpoint on "
            f"node {lease.node} (preempted for it: a lower-priority job of a preemptible type)"
        ]
    if lease is not None and lease.live(now):
        holder = next((r for r in records if r.name == lease.node), None)
        quiet = silence(holder, [lease], now) if holder is not None else None
        if quiet is not None:
            return [
                f"it is leased to node {lease.node}, {quiet.text()}: it waits in that node's "
                "own queue; if the node stays silent, the lease ends and it is offered again"
            ]
        return [
            f"it is leased to node {lease.node} (lease ends in {lease.expires_at - now:.0f} s "
            "unless renewed): it waits in that node's own queue"
        ]
    if job.inputs and not job.input_dir:
        return ["it has input files on the host it was submitted on: no agent is offered it"]
    lost = store.lost_nodes(job.id)
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    off = offerable(job, registry, footprints, lost)
    if off is None:
        return [f"its type {job.type} is not known to the coordinator: no node is offered it"]
    if (why := placement.never_placeable(off, judged_views(store))) is not None:
        return [why]
    counts = live_counts(leases, now)
    live = [r for r in records if is_fresh(r, now, timing)]
    if not live:
        return ["no agent is online: none has sent a heartbeat lately (`gpuwarden node list`)"]
    views = [node_view(r, busy=counts.get(r.name, 0)) for r in live]
    return [
        f"node {record.name} " + _why_not(record, view, off, views, leases, now=now, timing=timing)
        for record, view in zip(live, views, strict=True)
    ]


def has_nodes(store: Store | None) -> bool:
    """Whether ``store`` is a coordinator's: one with an enrolled node that is not
    revoked (a one-host broker's store has the same tables, and no node)."""
    return isinstance(store, ClusterStore) and any(
        n.state is not NodeState.REVOKED for n in store.list_nodes()
    )


def preview(
    store: ClusterStore,
    registry: Registry,
    jobtype: JobType,
    *,
    override: int | None,
    priority: int,
    now: float,
) -> list[str]:
    """``preview`` on a coordinator: what its nodes would do with one more job of
    ``jobtype`` (``override``: its own footprint), node by node, as ``explain``
    says of a queued job no node has taken yet (a coordinator's own launch rules
    run nothing: each node's are in its answer). Submits nothing."""
    job = Job(
        id=PREVIEW_ID,
        type=jobtype.name,
        state=JobState.QUEUED,
        priority=priority,
        params={},
        inputs=(),
        outputs=(),
        vram_bytes=override,
        submitted_at=now,
        updated_at=now,
    )
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    head = []
    if jobtype.lane is Lane.VRAM:
        need = footprint_of(registry, footprints, jobtype.name, override)
        head.append(f"{jobtype.name}: footprint {format_bytes(need)}")
    lines = explain_placement(store, registry, job, now)
    if not lines:
        lines = ["no node is enrolled with this coordinator: it would wait for one"]
    return [*head, *lines, f"(as the coordinator sees its {len(store.list_nodes())} node(s))"]


def explain_waiting(
    store: ClusterStore, registry: Registry, job: Job, now: float, half_life_s: float
) -> list[str]:
    """:func:`explain_placement`, and, for a job not leased to a node yet that is
    offered after another owner's job of the same priority because that owner used
    less (fair share), ``it waits behind another owner's jobs: fair share: ...``."""
    lines = explain_placement(store, registry, job, now)
    if not lines or half_life_s <= 0:
        return lines
    lease = store.lease_of(job.id)
    if lease is not None and lease.live(now):
        return lines  # it waits in that node's own queue
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    held_of = partial(held_by, registry, footprints)
    use = owners_use(store, now, half_life_s, held_of=held_of)
    why = fair_share_wait(store, job, now=now, use=use)
    return lines if why is None else [*lines, f"it waits behind another owner's jobs: {why}"]


def explain_running(store: ClusterStore, job: Job, now: float) -> list[str]:
    """For a running job leased to a node: which node, and, when that node is silent,
    for how long and when its lease ends (empty for a job that holds no lease)."""
    if job.state is not JobState.RUNNING:
        return []
    lease = store.lease_of(job.id)
    if lease is None:
        return []
    record = store.get_node(lease.node)
    if record is None:
        return []
    quiet = silence(record, [lease], now)
    if quiet is None and lease.preempt_for is not None:
        return [
            f"on node {lease.node}, asked to checkpoint for job {lease.preempt_for} (its lease "
            f"is not renewed: it ends in {lease.expires_at - now:.0f} s)"
        ]
    if quiet is None:
        return [
            f"on node {lease.node}, heard from {heard_s_ago(record, now):.0f} s ago (lease "
            f"ends in {lease.expires_at - now:.0f} s unless renewed)"
        ]
    return [
        f"its node {lease.node} is {quiet.text()}: it may still run there, but if the node "
        "stays silent, the attempt ends as interrupted when the lease ends and the job runs "
        "again elsewhere"
    ]


def _why_not(
    record: NodeRecord,
    view: NodeView,
    job: Offerable,
    views: list[NodeView],
    leases: list[Lease],
    *,
    now: float,
    timing: Timing,
) -> str:
    """Why ``record`` does not take ``job`` now, as a phrase about the node."""
    if record.state is NodeState.DRAINING:
        return (
            "is draining: it takes no new work "
            f"(`gpuwarden node resume {record.name}` gives it work again)"
        )
    if record.state is not NodeState.ACTIVE:
        return f"is {record.state.value}: it takes no new work"
    if (why := placement.type_refusal(job, view)) is not None:
        return why
    if (why := job.constraints.refusal(view)) is not None:
        return f"does not meet its constraints: {why}"
    if (quiet := silence(record, leases, now)) is not None:
        return f"is {quiet.text()}: it takes no work until it is heard from again"
    if view.slots == 0:
        return f"is busy ({view.busy} of its {view.max_jobs} jobs)"
    if placement.offers_for(view, [job], views, now=now, affinity_wait_s=timing.affinity_wait_s):
        return "could take it at its next claim"
    if job.lane is Lane.VRAM:
        biggest = max((g.usable_bytes for g in job.constraints.gpus(view)), default=0)
        if biggest < job.vram_bytes:
            return (
                f"can never hold it: it needs {format_bytes(job.vram_bytes)} on one GPU, its "
                f"largest has {format_bytes(biggest)}"
            )
        room = max((g.free_bytes for g in job.constraints.gpus(view)), default=0)
        if room < job.vram_bytes and job.type not in view.warm:
            return (
                f"has no GPU with room for it now: it needs {format_bytes(job.vram_bytes)} "
                f"on one GPU, the most room it reported is {format_bytes(room)}"
            )
    warm = [v.name for v in views if v.name != view.name and job.type in v.warm]
    if warm:
        return (
            f"leaves it for {', '.join(warm)}, where its model is warm "
            f"(for up to {timing.affinity_wait_s:g} s after it was submitted)"
        )
    if view.name in job.avoid:
        return "lost an earlier attempt of it: another node is preferred"
    return "is not offered it now"
