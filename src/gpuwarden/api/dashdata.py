"""What the dashboard shows, as JSON documents built from the store and what each
node's broker last published (``routers/dashboard.py`` serves them).

:func:`overview` is read on every refresh of the page: the nodes' GPUs with their
ledger holdings, degraded and fault reasons, warm servers, queued jobs with their
published wait reasons, running jobs with their progress in time, recent
failures, the VRAM leases, and in a cluster the enrolled nodes. :class:`Stats` is
the heavier part (queue waits, GPU-hours by owner, footprints), computed at most
once a minute.

A submitter sees only its own jobs: job ids of others are hidden in the nodes'
documents (``api/redact.py``), and lists of jobs hold only its own.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.api.auth import Principal, Scope, allowed
from gpuwarden.api.context import ApiContext
from gpuwarden.api.leasedesk import LeaseDesk, tally
from gpuwarden.api.redact import Redactor
from gpuwarden.cluster.report import node_json
from gpuwarden.core.model import Job, Lane
from gpuwarden.core.states import JobState
from gpuwarden.gpu.base import GpuSensors
from gpuwarden.node import explain
from gpuwarden.store.base import AttemptSpan
from gpuwarden.store.cluster import ClusterStore, NodeState

#: how many jobs each list of the page holds at most
MAX_LISTED = 100
#: how many recent failures the page shows
MAX_FAILURES = 15
#: what a degraded reason begins with when the GPU reported a hardware fault
FAULT_PREFIX = "hardware fault"
#: the edges (seconds) of the queue-wait histogram's bins; the last bin is open
WAIT_EDGES_S = (0.0, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)
#: the windows of GPU-hours by owner
WINDOWS_S = {"day": 86400.0, "week": 7 * 86400.0}
#: how long a computed :class:`Stats` answer is served again
STATS_TTL_S = 60.0
#: an owner that is no API token: the CLI on the host, or a bundle
LOCAL_OWNER = "(local: CLI and bundles)"


def _num(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _gpu_doc(gpu: dict[str, Any], degraded: str, now: float) -> dict[str, Any]:
    holdings = []
    for h in gpu.get("holdings") or []:
        holder = str(h.get("holder", ""))
        holdings.append(
            {
                "holder": holder,
                "job": h.get("job_id"),
                "type": h.get("type", ""),
                "bytes": h.get("bytes", 0),
                "state": h.get("state", ""),
                "kind": "job" if h.get("job_id") or "/" in holder else "warm",
                "since": h.get("since"),
                "expected_end": h.get("expected_end"),
            }
        )
    return {
        "uuid": gpu.get("uuid"),
        "name": gpu.get("name", ""),
        "total_bytes": gpu.get("total_bytes", 0),
        "used_bytes": gpu.get("used_bytes", 0),
        "reserve_bytes": gpu.get("reserve_bytes", 0),
        "foreign_bytes": gpu.get("foreign_bytes", 0),
        "free_bytes": gpu.get("free_bytes", 0),
        "ledger_bytes": sum(int(h["bytes"] or 0) for h in holdings),
        "holdings": holdings,
        "runtimes": gpu.get("runtimes") or [],
        "degraded": degraded,
        "fault": degraded.startswith(FAULT_PREFIX),
        "sensors": _sensors(gpu.get("sensors")),
    }


def _sensors(raw: Any) -> dict[str, float | None] | None:
    """A GPU's published utilisation, temperature and power, checked (None: none)."""
    got = GpuSensors.from_json(raw)
    return None if got is None else got.to_json()


def _warm_doc(payload: dict[str, Any]) -> list[dict[str, Any]]:
    views = {str(v.get("type")): v for v in payload.get("warm_views") or []}
    out = []
    for w in payload.get("warm") or []:
        view = views.get(str(w.get("type")), {})
        grace = _num(view.get("idle_grace_s"))
        idle = _num(w.get("idle_s"))
        left = None
        if idle is not None and grace is not None and not w.get("keep_warm"):
            left = max(0.0, grace - idle)
        out.append({**w, "idle_grace_s": grace, "grace_left_s": left})
    return out


def node_doc(payload: dict[str, Any], node: str, updated_at: float, now: float) -> dict[str, Any]:
    """One node's published status as the page draws it."""
    degraded = {str(k): str(v) for k, v in (payload.get("degraded") or {}).items()}
    gpus = [
        _gpu_doc(g, degraded.get(str(g.get("uuid")), str(g.get("degraded") or "")), now)
        for g in payload.get("gpus") or []
        if isinstance(g, dict)
    ]
    return {
        "node": node,
        "updated_at": updated_at,
        "age_s": round(max(0.0, now - updated_at), 1),
        "stopped": bool(payload.get("stopped")),
        "accepting": bool(payload.get("accepting", True)),
        "probe": payload.get("probe", ""),
        "probe_error": payload.get("probe_error", ""),
        "gpus": gpus,
        "warm": _warm_doc(payload),
        "last_error": payload.get("last_error"),
    }


def report_node_doc(
    name: str, report: dict[str, Any], last_seen: float | None, now: float
) -> dict[str, Any]:
    """An enrolled node as its agent last reported it, in :func:`node_doc`'s shape:
    its GPUs carry the ledger's total (an agent reports no holdings one by one)."""
    gpus = []
    for g in report.get("gpus") or []:
        if not isinstance(g, dict):
            continue
        ledger = int(_num(g.get("ledger_bytes")) or 0)
        degraded = str(g.get("degraded") or "")
        doc = _gpu_doc({**g, "holdings": [], "runtimes": []}, degraded, now)
        doc["ledger_bytes"] = ledger
        doc["holdings"] = (
            [
                {
                    "holder": "ledger",
                    "job": None,
                    "type": "",
                    "bytes": ledger,
                    "state": "",
                    "kind": "ledger",
                    "since": None,
                    "expected_end": None,
                }
            ]
            if ledger
            else []
        )
        gpus.append(doc)
    warm = [
        {
            "type": str(t),
            "gpu": "",
            "state": "loaded",
            "footprint_bytes": None,
            "jobs_served": None,
            "idle_s": None,
            "idle_grace_s": None,
            "grace_left_s": None,
            "keep_warm": False,
        }
        for t in report.get("warm") or []
    ]
    seen = last_seen if last_seen is not None else now
    return {
        "node": name,
        "updated_at": seen,
        "age_s": round(max(0.0, now - seen), 1),
        "stopped": False,
        "accepting": True,
        "probe": "agent report",
        "probe_error": "",
        "gpus": gpus,
        "warm": warm,
        "last_error": None,
    }


def _reported(ctx: ApiContext, known: set[str], now: float) -> list[dict[str, Any]]:
    """The enrolled nodes (a coordinator's agents) that publish no status here."""
    store = ctx.store
    if not isinstance(store, ClusterStore):
        return []
    return [
        report_node_doc(r.name, r.report, r.last_seen, now)
        for r in store.list_nodes()
        if r.name not in known and r.state is not NodeState.REVOKED and r.report
    ]


def _visible_jobs(ctx: ApiContext, who: Principal, scope: Scope, state: JobState) -> list[Job]:
    owner = who.token_id if scope is Scope.OWN else None
    if state is JobState.QUEUED and owner is None:
        return ctx.store.queued_jobs(limit=MAX_LISTED)
    jobs = ctx.store.list_jobs(states=frozenset({state}), limit=MAX_LISTED, owner=owner)
    if state is JobState.QUEUED:  # queue order: priority, then arrival
        jobs.sort(key=lambda j: (-j.priority, j.seq))
    return jobs


def _queued(
    ctx: ApiContext, who: Principal, scope: Scope, reasons: dict[str, str], now: float
) -> list[dict[str, Any]]:
    out = []
    for job in _visible_jobs(ctx, who, scope, JobState.QUEUED):
        reason = reasons.get(job.id) or (
            explain.shown_reason(job, ctx.store)  # held: by a person, or for its dependencies
            if job.held or job.hold_by is not None
            else "no wait reason published for it yet (the broker names the first queued "
            f"jobs'); `gpuwarden explain {job.id}` works it out"
        )
        out.append(
            {
                "id": job.id,
                "type": job.type,
                "priority": job.priority,
                "submitted_at": job.submitted_at,
                "waited_s": round(max(0.0, now - job.submitted_at), 1),
                "attempts": job.attempts,
                "reason": reason,
            }
        )
    return out


def _running(
    ctx: ApiContext, who: Principal, scope: Scope, published: dict[str, dict[str, Any]], now: float
) -> list[dict[str, Any]]:
    """Running jobs with their progress in time: elapsed against the run time the
    broker expects (its type's estimate), else against the type's timeout."""
    out = []
    for job in _visible_jobs(ctx, who, scope, JobState.RUNNING):
        run = published.get(job.id)
        if run is None:  # run by an agent, or not published yet: its attempt row
            attempts = ctx.store.attempts(job.id)
            last = attempts[-1] if attempts else None
            run = {
                "gpu": last.gpu_uuid if last else None,
                "started_at": last.started_at if last else None,
                "attempt": last.number if last else job.attempts,
                "node": last.node if last else None,
            }
        started = _num(run.get("started_at"))
        elapsed = max(0.0, now - started) if started is not None else None
        expected = _num(run.get("expected_s"))
        jobtype = ctx.registry.types.get(job.type)
        timeout = float(jobtype.timeout_s) if jobtype and jobtype.timeout_s else None
        of = expected or timeout
        out.append(
            {
                "id": job.id,
                "type": job.type,
                "node": run.get("node"),
                "gpu": run.get("gpu"),
                "attempt": run.get("attempt"),
                "started_at": started,
                "elapsed_s": None if elapsed is None else round(elapsed, 1),
                "expected_s": expected,
                "timeout_s": timeout,
                "progress": None if elapsed is None or not of else min(1.0, elapsed / of),
                "progress_of": "expected" if expected else ("timeout" if timeout else None),
                "cancel_requested": job.cancel_requested,
            }
        )
    return out


def _failures(ctx: ApiContext, who: Principal, scope: Scope) -> list[dict[str, Any]]:
    """The latest failed jobs and why (a submitter's own, with any other job named
    in a reason hidden, as ``GET /v1/jobs/{id}`` does)."""
    owner = who.token_id if scope is Scope.OWN else None
    jobs = ctx.store.list_jobs(states=frozenset({JobState.FAILED}), limit=MAX_FAILURES, owner=owner)
    redactor = Redactor(ctx.store, who.token_id) if owner is not None else None
    return [
        {
            "id": j.id,
            "type": j.type,
            "ended_at": j.updated_at,
            "reason": redactor.text(j.reason) if redactor is not None else j.reason,
        }
        for j in jobs
    ]


def _published(nodes: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """From the nodes' (redacted) documents: why each queued job waits, and each
    running job's attempt (with when its holding is expected to end)."""
    reasons: dict[str, str] = {}
    running: dict[str, dict[str, Any]] = {}
    for n in nodes:
        reasons.update({str(k): str(v) for k, v in (n.get("waiting") or {}).items()})
        ends = {
            h.get("job_id"): h
            for g in n.get("gpus") or []
            for h in g.get("holdings") or []
            if h.get("job_id")
        }
        for r in n.get("running") or []:
            if not r.get("job"):
                continue
            held = ends.get(r["job"]) or {}
            since, end = _num(held.get("since")), _num(held.get("expected_end"))
            expected = end - since if since is not None and end is not None else None
            running[str(r["job"])] = {**r, "node": n.get("node"), "expected_s": expected}
    return reasons, running


def owner_name(ctx: ApiContext, owner: str | None) -> str:
    """Who a job's ``owner`` is, as a person reads it: a token's name, a local
    user (``user:NAME``), or the CLI and bundles on the host (None)."""
    if owner is None:
        return LOCAL_OWNER
    token = None if owner.startswith("user:") else ctx.store.get_token(owner)
    return token.name if token is not None else owner


def _leases(
    ctx: ApiContext, who: Principal, scope: Scope, reasons: dict[str, str], now: float
) -> dict[str, Any]:
    """The VRAM leases beside the jobs (SPEC.md, "VRAM leases"), read as ``top``,
    ``status`` and ``GET /v1/leases`` read them (:class:`LeaseDesk`): a submitter's
    own. Each with who holds it, where, how much, whether it is granted, and the
    time left before its ttl runs out unrenewed; then their tally."""
    desk = LeaseDesk(ctx.store, ctx.registry, ctx.config)
    infos = [desk.info(j) for j in desk.listed(who.token_id, every_owner=scope is not Scope.OWN)]
    rows = []
    for x in infos:
        until = _num(x.get("until"))
        rows.append(
            {
                "id": x["id"],
                "holder": x.get("holder") or "",
                "owner": owner_name(ctx, x.get("owner")),
                "gpu": x.get("gpu") or x.get("pinned_gpu"),
                "pinned": x.get("pinned_gpu") is not None,
                "vram_bytes": x.get("vram_bytes"),
                "state": "granted" if x.get("granted") else "waiting",
                "ttl_s": x.get("ttl_s"),
                "until": until,
                "ttl_left_s": None if until is None else round(max(0.0, until - now), 1),
                "granted_at": x.get("granted_at"),
                "waited_s": round(max(0.0, now - float(x["submitted_at"])), 1),
                "reason": None if x.get("granted") else reasons.get(x["id"]),
            }
        )
    got = tally(infos)
    totals = {"granted": got.granted, "waiting": got.waiting, "held_bytes": got.held_bytes}
    return {"rows": rows, "totals": totals}


def _cluster(ctx: ApiContext, who: Principal, now: float) -> list[dict[str, Any]] | None:
    store = ctx.store
    if allowed(who.role, "node.list") is None or not isinstance(store, ClusterStore):
        return None
    records = store.list_nodes()
    if not records:
        return None
    leases = store.leases()
    return [node_json(r, leases, now) for r in records]


def overview(ctx: ApiContext, who: Principal, scope: Scope) -> dict[str, Any]:
    """The page's refresh: nodes and GPUs, warm servers, jobs, cluster."""
    now = ctx.clock()
    raw = [
        {"node": s.node, "updated_at": s.updated_at, **s.payload} for s in ctx.store.node_statuses()
    ]
    if scope is Scope.OWN:
        redactor = Redactor(ctx.store, who.token_id)
        raw = [redactor.value(n) for n in raw]
    reasons, running = _published(raw)
    nodes = [node_doc(n, str(n["node"]), float(n["updated_at"]), now) for n in raw]
    nodes += _reported(ctx, {n["node"] for n in nodes}, now)
    return {
        "now": now,
        "own_jobs_only": scope is Scope.OWN,
        "nodes": nodes,
        "queued": _queued(ctx, who, scope, reasons, now),
        "running": _running(ctx, who, scope, running, now),
        "failures": _failures(ctx, who, scope),
        "leases": _leases(ctx, who, scope, reasons, now),
        "cluster": _cluster(ctx, who, now),
        "counts": {k.value: v for k, v in ctx.store.count_by_state().items()},
    }


# -- stats ------------------------------------------------------------------------


def wait_histogram(spans: list[AttemptSpan]) -> dict[str, Any]:
    """How long the attempts waited in the queue: the first from the job's
    submission, a retry from the end of the attempt before it."""
    ended = {(s.job_id, s.number): s.ended_at for s in spans}
    counts = [0] * len(WAIT_EDGES_S)
    for s in spans:
        since = s.submitted_at if s.number <= 1 else ended.get((s.job_id, s.number - 1))
        if since is None:
            continue
        wait = max(0.0, s.started_at - since)
        counts[bisect.bisect_right(WAIT_EDGES_S, wait) - 1] += 1
    return {"edges_s": list(WAIT_EDGES_S), "counts": counts, "attempts": sum(counts)}


def gpu_hours(spans: list[AttemptSpan], now: float, window_s: float) -> dict[str | None, float]:
    """GPU-hours by job owner (a token id, None for local) in the last ``window_s``:
    each attempt that had a GPU, for the part of its run inside the window."""
    start = now - window_s
    out: dict[str | None, float] = {}
    for s in spans:
        if s.gpu_uuid is None:
            continue
        seconds = min(now, s.ended_at if s.ended_at is not None else now) - max(start, s.started_at)
        if seconds > 0:
            out[s.owner] = out.get(s.owner, 0.0) + seconds / 3600.0
    return out


def footprints(ctx: ApiContext, ran: set[str] | None = None) -> list[dict[str, Any]]:
    """Per vram-lane type: its declared peak against the measured one; the types
    measured first, then those that ran in the week (``ran``), then the rest."""
    measured = ctx.store.footprints()
    ran = ran or set()
    rows = []
    for t in ctx.registry.types.values():
        if t.lane is not Lane.VRAM:
            continue
        got = measured.get(t.name)
        rows.append(
            {
                "type": t.name,
                "declared_bytes": t.vram_bytes,
                "measured_bytes": got.bytes if got is not None else None,
                "measured_at": got.updated_at if got is not None else None,
                "ran_this_week": t.name in ran,
            }
        )
    rows.sort(key=lambda r: (r["measured_bytes"] is None, not r["ran_this_week"], r["type"]))
    return rows


@dataclass(frozen=True, slots=True)
class Computed:
    at: float
    waits: dict[str, Any]
    hours: dict[str, dict[str | None, float]]
    footprints: list[dict[str, Any]]
    spans: int


class Stats:
    """The stats part of the page, computed at most every :data:`STATS_TTL_S`."""

    def __init__(self, *, ttl_s: float = STATS_TTL_S, clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self.clock = clock
        self._got: Computed | None = None
        self._lock = threading.Lock()

    def computed(self, ctx: ApiContext) -> Computed:
        with self._lock:
            now = self.clock()
            got = self._got
            if got is None or now - got.at >= self.ttl_s or now < got.at:
                spans = ctx.store.attempt_spans(since=now - max(WINDOWS_S.values()))
                day = [s for s in spans if s.started_at >= now - WINDOWS_S["day"]]
                got = self._got = Computed(
                    at=now,
                    waits={**wait_histogram(day), "window_s": WINDOWS_S["day"]},
                    hours={w: gpu_hours(spans, now, secs) for w, secs in WINDOWS_S.items()},
                    footprints=footprints(ctx, {s.type for s in spans}),
                    spans=len(spans),
                )
            return got

    def to_json(self, ctx: ApiContext, who: Principal, scope: Scope) -> dict[str, Any]:
        got = self.computed(ctx)
        names: dict[str | None, str] = {}

        def name(owner: str | None) -> str:
            if owner not in names:
                names[owner] = owner_name(ctx, owner)
            return names[owner]

        hours: dict[str, list[dict[str, Any]]] = {}
        for window, by_owner in got.hours.items():
            rows = sorted(by_owner.items(), key=lambda kv: -kv[1])
            if scope is Scope.OWN:  # its own row, and everyone else's as one
                mine = sum(h for o, h in rows if o == who.token_id)
                others = sum(h for o, h in rows if o != who.token_id)
                hours[window] = [
                    {"owner": who.token_id, "name": who.name, "hours": round(mine, 4)},
                    {"owner": None, "name": "everyone else", "hours": round(others, 4)},
                ]
            else:
                hours[window] = [
                    {"owner": o, "name": name(o), "hours": round(h, 4)} for o, h in rows
                ]
        return {
            "computed_at": got.at,
            "ttl_s": self.ttl_s,
            "waits": got.waits,
            "gpu_hours": hours,
            "footprints": got.footprints,
        }
