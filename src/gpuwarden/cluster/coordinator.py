"""The coordinator's service functions: what the node endpoints do, over a store.

Each function takes the store, the time and what the node said, and returns
plain data for the HTTP layer (``gpuwarden.api.routers.nodes``) to send. No HTTP
and no clock reads here, so every rule is testable on SQLite in one process. A
node's placement view is read from its report in :mod:`gpuwarden.cluster.nodeview`;
what people are shown (the node list, status, why a job waits) is in
:mod:`gpuwarden.cluster.report`.

The rules:

* A node is offered (:func:`claim`) only queued jobs without a live lease, of
  types its registry has, that fit one of its GPUs by the room its own ledger
  reported, chosen by :func:`gpuwarden.core.placement.offers_for`. What it is
  offered is leased to it for ``lease_s`` seconds.
* Every report about a leased job (:func:`start`, :func:`finish`) names the lease
  id; it is refused (:class:`LeaseRefused`) unless the lease is still that
  node's, and a start unless it is live too (a finish is taken from a lapsed
  lease that nothing replaced: no later attempt has started). The store's
  guarded updates make the rest exact: an attempt can be finished once, by its
  node or by the sweep, never both; a start or finish repeated after a
  coordinator died between its two writes completes it.
* A lease is kept in the store for ``[cluster] fence_grace_s`` past the end the
  node is told (:meth:`Timing.held_until`): a silent node's supervisors stop its
  jobs at the lease's end, before another node may have them.
* :func:`heartbeat` renews the leases of the jobs the node says it holds, and
  answers which of them it must stop: the ones whose lease it lost, and the ones
  a client cancelled.
* Preemption across hosts happens at the lease boundary (:func:`heartbeat`): when
  a queued job no node has room for would fit on the node were some of its
  running jobs of preemptible types and lower priority gone
  (:func:`gpuwarden.core.placement.preemptions_for`), their leases are marked
  for it (not renewed from then on), a ``preemption_requested`` event names the
  job that caused it, the waiting job is leased to that node at once (its room
  goes to it), and every heartbeat answers ``preempts`` for the node to signal
  until its report of the attempt's end clears the mark. A node that never
  reacts loses the lease, and the sweep takes the job back as for any node.
* :func:`sweep` (one coordinator at a time, under the store's maintenance lock;
  a coordinator that starts first gives every lease a full period,
  :class:`gpuwarden.cluster.sweeper.Sweeper`): an expired lease of a job that
  never started is dropped, and the job is offered again; an expired lease of a
  running job ends its attempt as an infrastructure failure (the reason says
  what the coordinator knows: :func:`lapse_reason`), so the job is queued again
  (or quarantined past its type's ``max_retries``) and placement prefers another
  node for it. A node not heard from for ``offline_after_s`` is marked offline.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from collections.abc import Callable, Collection, Mapping
from functools import partial
from typing import Any

from gpuwarden.cluster.claimorder import ClaimQueue, owners_use
from gpuwarden.cluster.nodeview import (
    Timing,
    heard_s_ago,
    heartbeat_window_s,
    held_by,
    is_fresh,
    judged_view,
    judged_views,
    node_view,
    offerable,
)
from gpuwarden.cluster.routes import record_routes, without_routes
from gpuwarden.core import jobcontrol, placement
from gpuwarden.core.classify import Outcome, retry_or_quarantine
from gpuwarden.core.fairshare import DEFAULT_HALF_LIFE_S, gib_hours, reported_held
from gpuwarden.core.model import Event, Job, JobSpec, JobType
from gpuwarden.core.placement import CrossPreempt, NodeView, Offerable
from gpuwarden.core.preempt import Victim
from gpuwarden.core.serviceroute import STOPPED_KEEP_S
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError, UserError
from gpuwarden.registry import Registry
from gpuwarden.store.cluster import Claimable, ClusterStore, Grant, Lease, NodeRecord, NodeState

#: a node's name: what lists, attempts and the audit log call it
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

#: the states an agent may report a job's attempt ended in
END_STATES = frozenset(
    {JobState.QUEUED, JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.QUARANTINED}
)

#: a start that finds its job's row locked by a claim tries this often
_START_TRIES = 5

#: outcomes of a node's retry that its own rule judged (a checkpoint spends nothing;
#: a preemption counts against its ``max_interruptions`` there): no retry spent here
NODE_JUDGED = frozenset({Outcome.CHECKPOINTED.value, Outcome.PREEMPTED.value})

#: used when a job's type is not known here (the coordinator's modules lack it)
DEFAULT_MAX_RETRIES = 2

#: a claim reads the queue this many jobs at a time (at least four per free slot)
CLAIM_PAGE = 64
#: and at most this many jobs in all (placement looks no further down the queue)
CLAIM_SCAN = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Image:
    """The image an attempt of a job from a pinned commit ran in, as its node said:
    its id (None: none was built) and whether it was reused."""

    id: str | None
    reused: bool | None


class LeaseRefused(UserError):
    """A node reported on a job it holds no live lease for: the report is refused."""


class UnknownNode(UserError):
    """No node with that name."""


# -- submissions ------------------------------------------------------------------


def submission_refusal(
    store: ClusterStore, registry: Registry, spec: JobSpec, now: float
) -> str | None:
    """Why no enrolled node (active, draining or offline: not revoked) could ever run
    the job ``spec`` asks for, by each node's job types, launch rules, GPUs and the
    job's constraints; None when one could, or when none is enrolled (it waits)."""
    views = judged_views(store)
    if not views:
        return None
    draft = Claimable(
        id=spec.id,
        type=spec.type,
        priority=spec.priority,
        seq=0,
        submitted_at=now,
        vram_bytes=spec.vram_bytes,
        attempts=0,
        constraints=spec.constraints,
        gpus=spec.gpus,
        source=spec.source,
    )
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    off = offerable(draft, registry, footprints)
    if off is None:
        return None
    # a job from a commit waits for a node that runs jobs from commits of its
    # repository: a node's [sources] allow is a config edit away (explain says why)
    return placement.never_placeable(off, views, sources=False)


def type_refusal(store: ClusterStore, registry: Registry, jobtype: JobType) -> str | None:
    """Why no enrolled node could run a job of ``jobtype`` (as it is declared, with no
    constraints), or None when one could or none is enrolled."""
    views = judged_views(store)
    if not views:
        return None
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    draft = Claimable(
        id="(type)",
        type=jobtype.name,
        priority=0,
        seq=0,
        submitted_at=0.0,
        vram_bytes=None,
        attempts=0,
    )
    off = offerable(draft, registry, footprints)
    return None if off is None else placement.never_placeable(off, views)


def _others(
    store: ClusterStore, name: str, counts: Mapping[str, int], now: float, timing: Timing
) -> list[NodeView]:
    return [
        node_view(r, busy=counts.get(r.name, 0))
        for r in store.list_nodes()
        if r.name != name and r.state is NodeState.ACTIVE and is_fresh(r, now, timing)
    ]


def _offerable(
    store: ClusterStore,
    registry: Registry,
    found: list[Claimable],
    *,
    footprints: Mapping[str, int],
    types: Collection[str] | None,
    inputs_here: Callable[[str], bool] | None,
    queue: ClaimQueue,
) -> list[Offerable]:
    out = []
    for job in found:
        if types is not None and job.type not in types:
            continue
        if job.input_dir is not None and (inputs_here is None or not inputs_here(job.input_dir)):
            continue  # its input files are not on this coordinator: it cannot pass them on
        lost = store.lost_nodes(job.id) if job.attempts else ()  # never ran: never lost
        off = offerable(job, registry, footprints, lost, usage=queue.usage(job.owner))
        if off is not None:
            out.append(off)
    return out


def _offers(
    store: ClusterStore,
    registry: Registry,
    view: NodeView,
    *,
    others: Callable[[], list[NodeView]],
    now: float,
    timing: Timing,
    types: Collection[str] | None,
    inputs_here: Callable[[str], bool] | None,
    half_life_s: float,
) -> list[str]:
    """What placement offers the node, reading the queue a page at a time in the
    order placement takes it (priority, the owner's fair-share use, arrival:
    :class:`~gpuwarden.cluster.claimorder.ClaimQueue`): the first
    :data:`CLAIM_PAGE` jobs (at least four per free slot), the next page only
    while the node still has room and the page was full, up to
    :data:`CLAIM_SCAN` jobs in all. Placement takes jobs in that order and stops
    when the slots are full, so a page that fills them gives what the whole
    queue would."""
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    use = owners_use(store, now, half_life_s, held_of=partial(held_by, registry, footprints))
    queue = ClaimQueue(store, now=now, use=use)
    page = max(CLAIM_PAGE, 4 * view.slots)
    queued: list[Offerable] = []
    nodes: list[NodeView] | None = None
    read = 0
    while True:
        want = min(page, CLAIM_SCAN - read)
        found = queue.take(want)
        read += len(found)
        queued += _offerable(
            store,
            registry,
            found,
            footprints=footprints,
            types=types,
            inputs_here=inputs_here,
            queue=queue,
        )
        if queued:
            nodes = others() if nodes is None else nodes
            ids = placement.offers_for(
                view, queued, nodes, now=now, affinity_wait_s=timing.affinity_wait_s
            )
        else:
            ids = []
        if len(ids) >= view.slots or len(found) < want or read >= CLAIM_SCAN:
            return ids
        page *= 4


# -- the node endpoints ---------------------------------------------------------


def enroll(
    store: ClusterStore, name: str, *, token_id: str, capabilities: dict[str, Any], now: float
) -> NodeRecord:
    """Record the node with its new credential; a credential it had before is
    revoked (enrolling again replaces it)."""
    before = store.get_node(name)
    if before is not None and before.token_id and before.token_id != token_id:
        store.revoke_token(before.token_id, now=now)
    return store.upsert_node(name, token_id=token_id, capabilities=capabilities, now=now)


def claim(
    store: ClusterStore,
    registry: Registry,
    node_name: str,
    view: NodeView,
    now: float,
    *,
    lease_s: float = 90.0,
    timing: Timing | None = None,
    types: Collection[str] | None = None,
    want: int | None = None,
    inputs_here: Callable[[str], bool] | None = None,
    record: NodeRecord | None = None,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
) -> list[dict[str, Any]]:
    """Lease to the node the jobs placement offers it now; return their payloads
    (with the lease id). ``half_life_s``: fair share's (``[broker]
    fair_share_half_life_s``; 0: off). ``types``: the job types the node can run (None: any);
    ``want``: the most jobs it asks for; ``inputs_here``: whether a job's staged
    input folder is on this coordinator (None: no job with input files is offered;
    the node fetches the files with ``GET /v1/node/jobs/{id}/inputs/{name}``);
    ``record``: the node as the caller just read or wrote it (else it is read)."""
    timing = timing or Timing(lease_s=lease_s)
    record = record or store.get_node(node_name)
    if record is not None and record.state is NodeState.DRAINING:
        return _granted_claim(store, registry, record, view, now, lease_s=lease_s, timing=timing)
    if record is None or record.state is not NodeState.ACTIVE:
        return []
    counts = store.live_lease_counts(now)
    mine = counts.get(node_name, 0)
    view = dataclasses.replace(view, busy=max(view.busy, mine))
    if want is not None:
        view = dataclasses.replace(view, max_jobs=min(view.max_jobs, view.busy + max(0, want)))
    if view.slots == 0:
        return []

    def others() -> list[NodeView]:
        return _others(store, node_name, counts, now, timing)

    ids = _offers(
        store,
        registry,
        view,
        others=others,
        now=now,
        timing=timing,
        types=types,
        inputs_here=inputs_here,
        half_life_s=half_life_s,
    )
    used = store.granted_used_on(node_name) if ids else set()
    ids = [i for i in ids if i not in used]  # ran here once under a grant: never again
    if not ids:
        return []
    lease_id = secrets.token_hex(8)
    held = timing.held_until(now, lease_s)
    got = store.lease_jobs(node_name, ids, lease_id=lease_id, expires_at=held, now=now)
    return _payloads(store, got, lease_id, now + lease_s)


def _granted_claim(
    store: ClusterStore,
    registry: Registry,
    record: NodeRecord,
    view: NodeView,
    now: float,
    *,
    lease_s: float,
    timing: Timing,
) -> list[dict[str, Any]]:
    """A draining node is offered nothing, but the job of its open diagnostic grant
    when that job is queued, claimable and fits the node now, and nothing else is
    leased to the node: a diagnostic runs alone (the node has no other allocation),
    once what the drain let finish has ended."""
    grant = store.open_grant(record.name)
    if grant is None:
        return []
    job = store.get_job(grant.job_id)
    if (
        job is None
        or job.state is not JobState.QUEUED
        or job.cancel_requested
        or job.held
        or job.hold_by is not None
    ):
        return []
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    off = offerable(job, registry, footprints)
    if off is None:
        return []
    busy = max(view.busy, store.live_lease_counts(now).get(record.name, 0))
    if busy:  # its other jobs first: the diagnostic must not run beside them
        return []
    # closed to all else, open to this one job (a draining agent claims only then)
    view = dataclasses.replace(view, busy=busy, accepting=True)
    if not placement.offers_for(view, [off], [], now=now, affinity_wait_s=timing.affinity_wait_s):
        return []
    lease_id = secrets.token_hex(8)
    held = timing.held_until(now, lease_s)
    got = store.lease_jobs(record.name, [job.id], lease_id=lease_id, expires_at=held, now=now)
    return _payloads(store, got, lease_id, now + lease_s)


def _payloads(
    store: ClusterStore, got: list[str], lease_id: str, expires_at: float
) -> list[dict[str, Any]]:
    """What a node is sent of each job just leased to it."""
    jobs = {job.id: job for job in store.jobs_by_ids(got)}
    return [
        {
            "id": job.id,
            "type": job.type,
            "params": job.params,
            "outputs": list(job.outputs),
            "inputs": list(job.inputs),
            "priority": job.priority,
            "vram_bytes": job.vram_bytes,
            "constraints": job.constraints,
            "est_s": job.est_s,
            "gpus": job.gpus,
            **job.ram.to_json(),
            "attempts": job.attempts,
            # a service's name in URLs (the coordinator serves it under that name)
            **({"service": job.service} if job.service else {}),
            # a job from a commit: the agent fetches and builds it as on one host
            **({"source": job.source.to_json()} if job.source is not None else {}),
            # a (sandboxed) command job: its command, which the agent checks again
            **({"command": job.command.to_json()} if job.command is not None else {}),
            "lease_id": lease_id,
            "expires_at": expires_at,
        }
        for job in (jobs.get(i) for i in got)
        if job is not None
    ]


def _held_lease(
    store: ClusterStore,
    node_name: str,
    job_id: str,
    lease_id: str,
    now: float,
    *,
    lapsed_ok: bool = False,
) -> Lease:
    """The node's lease ``lease_id`` on the job, or :class:`LeaseRefused`. With
    ``lapsed_ok`` (an attempt's end and its outputs) a lease past its expiry is
    taken while it is still there: nothing replaced it (a claim replaces a lapsed
    lease, the sweep removes it when it ends the attempt), so no later attempt of
    the job has started."""
    lease = store.lease_of(job_id)
    if lease is None or lease.node != node_name or lease.lease_id != lease_id:
        raise LeaseRefused(
            f"job {job_id} is not leased to node {node_name} under lease {lease_id} any more "
            "(the attempt was superseded: its lease expired and the job was taken back, or "
            "the job ended): the report is refused"
        )
    if not lease.live(now) and not lapsed_ok:
        raise LeaseRefused(
            f"the lease of node {node_name} on job {job_id} expired "
            f"{now - lease.expires_at:.1f} s ago: the report is refused"
        )
    return lease


def check_upload(
    store: ClusterStore, node_name: str, job_id: str, *, lease_id: str, now: float
) -> int:
    """May the node upload an output of the leased job now? Its attempt number, or
    :class:`LeaseRefused` (the lease is not live and its, or it never started)."""
    attempt = upload_lease(store, node_name, job_id, lease_id=lease_id, now=now).attempt
    assert attempt is not None  # upload_lease refuses a lease of no attempt
    return attempt


def upload_lease(
    store: ClusterStore, node_name: str, job_id: str, *, lease_id: str, now: float
) -> Lease:
    """:func:`check_upload`, answering with the lease itself (for :func:`finish`).
    A lapsed lease still there is taken (:func:`_held_lease`)."""
    lease = _held_lease(store, node_name, job_id, lease_id, now, lapsed_ok=True)
    if not lease.started or lease.attempt is None:
        raise LeaseRefused(f"job {job_id} was never reported started by node {node_name}")
    return lease


def check_fetch(
    store: ClusterStore, node_name: str, job_id: str, *, lease_id: str, now: float
) -> Job:
    """May the node fetch the input files of the leased job now? The job, or
    :class:`LeaseRefused` (the lease is not live and its)."""
    _held_lease(store, node_name, job_id, lease_id, now)
    job = store.get_job(job_id)
    if job is None:  # pragma: no cover - a leased job exists
        raise LeaseRefused(f"no job {job_id}")
    return job


def start(
    store: ClusterStore,
    node_name: str,
    job_id: str,
    *,
    lease_id: str,
    gpu_uuid: str | None,
    now: float,
) -> dict[str, Any]:
    """The node started the leased job: a new attempt on that node. A repeated
    report (the first answer was lost) gets the same attempt."""
    lease = _held_lease(store, node_name, job_id, lease_id, now)
    if lease.started and lease.attempt is not None:
        return {"attempt": lease.attempt}
    if (begun := _begun_here(store, node_name, job_id)) is not None:
        # the attempt was recorded but not the lease's start (the coordinator died
        # between the two): the repeated report finds it
        store.mark_lease_started(job_id, begun, lease_id=lease_id)
        return {"attempt": begun}
    starter = _starter(store, node_name, job_id)
    for tries in range(_START_TRIES):
        try:
            _, attempt = starter(job_id, node=node_name, gpu_uuid=gpu_uuid, now=now)
            break
        except TransitionError as exc:
            job = store.get_job(job_id)
            busy = job is not None and job.state is JobState.QUEUED and not job.cancel_requested
            if not busy or tries == _START_TRIES - 1:
                raise LeaseRefused(f"job {job_id} cannot start: {exc.message}") from None
            # its row was locked for a moment by a claim that looked at it: again
            time.sleep(0.01 * (tries + 1))
    store.mark_lease_started(job_id, attempt.number, lease_id=lease_id)
    return {"attempt": attempt.number}


def _begun_here(store: ClusterStore, node_name: str, job_id: str) -> int | None:
    """The number of the job's attempt running on ``node_name`` when it is running
    there (its lease is that node's: no other attempt of it can be open)."""
    job = store.get_job(job_id)
    if job is None or job.state is not JobState.RUNNING:
        return None
    attempts = store.attempts(job_id)
    last = attempts[-1] if attempts else None
    if last is None or last.node != node_name or last.ended_at is not None:
        return None
    return last.number


def _starter(store: ClusterStore, node_name: str, job_id: str) -> Callable[..., Any]:
    """How the job starts on the node: consuming its open diagnostic grant there
    (:meth:`ClusterStore.start_granted`), plainly, or not at all
    (:class:`LeaseRefused`: it ran there once under a grant, or the node is closed and
    its grant there was revoked)."""
    grants = [g for g in store.grants_of_job(job_id) if g.node == node_name]
    if any(g.used_at is not None for g in grants):
        raise LeaseRefused(
            f"job {job_id} ran once on node {node_name} under a diagnostic grant; "
            "it is never retried there"
        )
    if any(g.open for g in grants):
        return store.start_granted
    record = store.get_node(node_name)
    if grants and (record is None or record.state is not NodeState.ACTIVE):
        raise LeaseRefused(
            f"the diagnostic grant of job {job_id} on node {node_name} was revoked "
            f"({grants[-1].revoked_reason}); it does not start there"
        )
    return store.start_attempt


def diagnostic(
    store: ClusterStore, name: str, job_id: str, *, by: str | None, reason: str, now: float
) -> Grant:
    """Let one exact queued job start on a draining node, once (an Owner's grant)."""
    record = store.get_node(name)
    if record is None:
        raise UnknownNode(f"no node named {name!r} (`gpuwarden node list`)")
    if record.state is not NodeState.DRAINING:
        raise UserError(
            f"node {name} is {record.state.value}: a diagnostic grant is for a draining "
            f"node (`gpuwarden node drain {name}` first)"
        )
    if not reason.strip():
        raise UserError("a diagnostic grant needs a reason (--reason)")
    job = store.get_job(job_id)
    if job is None or job.state is not JobState.QUEUED or job.cancel_requested:
        state = "unknown" if job is None else job.state.value
        raise UserError(f"job {job_id} is {state}: only a queued job may be granted")
    if any(g.node == name and g.used_at is not None for g in store.grants_of_job(job_id)):
        raise UserError(f"job {job_id} ran once on node {name} under a grant: never again")
    got = store.add_grant(name, job_id, granted_by=by, reason=reason.strip(), now=now)
    if got is None:
        held = store.open_grant(name)
        other = held.job_id if held is not None else "another job"
        raise UserError(f"node {name} has an open diagnostic grant already (job {other})")
    return got


def _diagnostic(store: ClusterStore, node_name: str, job_id: str, attempt: int) -> bool:
    """Was attempt ``attempt`` of the job started on the node under a grant?"""
    return any(g.node == node_name and g.attempt == attempt for g in store.grants_of_job(job_id))


def revoke_grants_of(store: ClusterStore, job_id: str, *, reason: str, now: float) -> int:
    """A cancelled job's open grants end (how many)."""
    return store.revoke_grants(now=now, reason=reason, job_id=job_id)


def finish(
    store: ClusterStore,
    registry: Registry,
    node_name: str,
    job_id: str,
    *,
    lease_id: str,
    state: JobState,
    outcome: str,
    reason: str,
    now: float,
    exit_code: int | None = None,
    result: Mapping[str, Any] | None = None,
    stdout: str = "",
    stderr: str = "",
    release: bool = False,
    output_dir: str | None = None,
    lease: Lease | None = None,
    held_bytes: int | None = None,
    half_life_s: float = DEFAULT_HALF_LIFE_S,
    image: Image | None = None,
) -> dict[str, Any]:
    """The node's attempt of the leased job ended in ``state`` (``queued``: the
    node retries it itself, and keeps the lease; with ``release``, the node gives
    it back, and it is offered again). Past the type's ``max_retries`` counted
    over every node, a retry becomes quarantine. ``lease``: the lease as
    :func:`upload_lease` just checked it for this node, lease id and time (else
    it is read and checked here). ``held_bytes``: the VRAM the node says the
    attempt held; its owner is charged that (at most all the node's GPUs) times
    the attempt's run time as recorded here, once the end is recorded (fair
    share, with ``half_life_s``). ``image``: a job from a commit's (its end event
    records it with the node, beside the repository and commit)."""
    if state not in END_STATES:
        raise UserError(
            f"an attempt ends in one of {', '.join(sorted(s.value for s in END_STATES))}, "
            f"not {state.value}"
        )
    if lease is None or lease.lease_id != lease_id or lease.node != node_name:
        lease = upload_lease(store, node_name, job_id, lease_id=lease_id, now=now)
    assert lease.attempt is not None  # upload_lease refuses a lease of no attempt
    if state is JobState.QUEUED and outcome not in NODE_JUDGED:
        current = store.get_job(job_id)
        target, why = retry_or_quarantine(
            reason,
            attempt=jobcontrol.attempt_in_round(
                lease.attempt, current.requeued_after if current is not None else 0
            ),
            max_retries=_max_retries(registry, current.type if current is not None else None),
            where=" on all nodes",
        )
        if target is JobState.QUARANTINED:  # a retry keeps the node's own reason
            state, reason = target, why
    body = _result_body(result, node_name, state, output_dir)
    try:
        job = store.finish_attempt(
            job_id,
            lease.attempt,
            target=state,
            now=now,
            outcome=outcome,
            reason=reason,
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            result=body,
            detail=_image_detail(node_name, image),
        )
    except TransitionError as exc:
        repeat = _ended_alike(store, job_id, lease.attempt, outcome)
        if repeat is None:
            raise LeaseRefused(f"the end of job {job_id} is refused: {exc.message}") from None
        # the same end again (its answer was lost, or the coordinator died before it
        # dealt with the lease): what is left of it is done now
        return _keep_or_drop(store, node_name, repeat, lease, release=release, now=now)
    store.stop_service_route(job_id, now)  # a service's attempt ended: kept as stopped
    if held_bytes and half_life_s > 0:
        charge(store, node_name, job, lease.attempt, held_bytes, now=now, half_life_s=half_life_s)
    return _keep_or_drop(store, node_name, job, lease, release=release, now=now)


def _ended_alike(store: ClusterStore, job_id: str, number: int, outcome: str) -> Job | None:
    """The job when its attempt ``number`` has ended already with ``outcome`` (a
    finish report repeated), else None."""
    ended = next((a for a in store.attempts(job_id) if a.number == number), None)
    if ended is None or ended.ended_at is None or ended.outcome != outcome:
        return None
    return store.get_job(job_id)


def _keep_or_drop(
    store: ClusterStore, node_name: str, job: Job, lease: Lease, *, release: bool, now: float
) -> dict[str, Any]:
    """After an attempt's end: a job the node retries keeps its lease, unless it gives
    it back, it ran under a diagnostic grant, or it was cancelled meanwhile."""
    kept = False
    assert lease.attempt is not None
    if job.state is JobState.QUEUED and _diagnostic(store, node_name, job.id, lease.attempt):
        release = True  # a diagnostic attempt: never retried on that node
    if job.state is JobState.QUEUED and job.cancel_requested:
        store.drop_lease(job.id, lease_id=lease.lease_id)
        job = store.transition(
            job.id, JobState.CANCELLED, now=now, reason="cancelled before it ran again"
        )
    elif job.state is JobState.QUEUED and not release:
        kept = store.mark_lease_started(job.id, None, lease_id=lease.lease_id)
    else:
        store.drop_lease(job.id, lease_id=lease.lease_id)
    return {"state": job.state.value, "lease_kept": kept}


def _image_detail(node_name: str, image: Image | None) -> dict[str, Any] | None:
    """What the end event of a job from a commit adds to its source: the node and
    the image (SPEC.md section 20, "Events")."""
    if image is None:
        return None
    return {"node": node_name, "image_id": image.id, "image_reused": image.reused}


def _result_body(
    result: Mapping[str, Any] | None, node_name: str, state: JobState, output_dir: str | None
) -> dict[str, Any]:
    """The result a node reported, as the coordinator keeps it."""
    body = dict(result or {})
    body["node"] = node_name
    if output_dir is not None and state in (JobState.DONE, JobState.FAILED):
        # the coordinator's own copy of what the node uploaded (SPEC.md, section 16)
        if "output_dir" in body:
            body["node_output_dir"] = body["output_dir"]
        body["output_dir"] = output_dir
    return body


def charge(
    store: ClusterStore,
    node_name: str,
    job: Job,
    number: int,
    held_bytes: int,
    *,
    now: float,
    half_life_s: float,
) -> float:
    """Count attempt ``number`` of ``job``, just ended on ``node_name``, for its
    owner's fair share: the bytes the node says it held, at most all its GPUs'
    memory, times the attempt's run time by this store's clock (its start as the
    node reported it, to ``now``). Returns the GiB-hours counted."""
    record = store.get_node(node_name)
    total = sum(g.total_bytes for g in judged_view(record).gpus) if record is not None else 0
    held = reported_held(held_bytes, total)
    attempt = next((a for a in store.attempts(job.id) if a.number == number), None)
    if attempt is None or held <= 0:
        return 0.0
    used = gib_hours(held, attempt.started_at, now)
    if used > 0:
        store.add_fair_share(job.owner, used, now=now, half_life_s=half_life_s)
    return used


def heartbeat(
    store: ClusterStore,
    node_name: str,
    report: dict[str, Any],
    now: float,
    lease_s: float = 90.0,
    *,
    held: Collection[str] = (),
    registry: Registry | None = None,
    timing: Timing | None = None,
    inputs_here: Callable[[str], bool] | None = None,
    peer: str | None = None,
) -> dict[str, Any]:
    """Keep the node's report, renew the leases of the jobs it holds, and say which
    of them it must stop (``lost``: it has no lease any more, never report it).
    With ``registry``: preemption across hosts (:func:`preempt`): ``preempts``, the
    running jobs to ask to checkpoint, and ``jobs``, the waiting jobs leased to the
    node for the room they make (each only when there is one). The routes of its
    running services are kept apart (:func:`gpuwarden.cluster.routes.record_routes`;
    ``peer``: the address the heartbeat came from, None when not known); the ones
    refused are in ``routes_refused`` (``{"name", "job", "why"}``)."""
    record = store.touch_node(node_name, without_routes(report), now)
    if record is None:
        raise UnknownNode(f"no node named {node_name!r}: enrol it again")
    if record.state is NodeState.REVOKED:
        return {"state": record.state.value, "lease_s": lease_s, "renewed": 0, "cancels": []}
    held = list(dict.fromkeys(held))
    timing = timing or Timing(lease_s=lease_s)
    renewed = store.renew_leases(node_name, timing.held_until(now, lease_s), now=now, job_ids=held)
    mine = {lease.job_id: lease for lease in store.leases(node_name)}
    routes = record_routes(store, node_name, report, now, leases=mine, peer=peer)
    cancels: list[dict[str, Any]] = []
    stops: list[dict[str, Any]] = []
    for job_id in held:
        lease = mine.get(job_id)
        if lease is None or not lease.live(now):
            cancels.append({"id": job_id, "reason": "lost its lease", "lost": True})
            continue
        job = store.get_job(job_id)
        if job is None or job.state.terminal:
            state = job.state.value if job else "gone"
            cancels.append(
                {"id": job_id, "reason": f"the job is {state} on the coordinator", "lost": True}
            )
            store.drop_lease(job_id, lease_id=lease.lease_id)
        elif job.cancel_requested:
            cancels.append({"id": job_id, "reason": "cancelled by a client", "lost": False})
        elif job.stop_requested_by is not None:  # `gpuwarden stop`: it ends done there
            stops.append({"id": job_id, "by": job.stop_requested_by})
    stopping = {c["id"] for c in cancels}
    answer: dict[str, Any] = {
        "state": record.state.value,
        "lease_s": lease_s,
        "renewed": renewed,
        "cancels": cancels,
    }
    if stops:  # a key of its own: an agent from before it ignores it (never a cancel)
        answer["stops"] = stops
    # per held job, the seconds its lease has left (its grace not counted): the agent
    # tells each job's supervisor when to stop it on its own (self-fencing)
    if held:
        answer["leases"] = {
            i: round(max(0.0, lease.expires_at - timing.fence_grace_s - now), 3)
            for i, lease in mine.items()
            if i in set(held) - stopping and lease.live(now)
        }
    if record.state is NodeState.DRAINING and (grant := store.open_grant(node_name)):
        answer["grant"] = grant.job_id  # a draining node claims for this job alone
    if routes.refused:
        answer["routes_refused"] = routes.refused
    if registry is not None:
        live = {i: lease for i, lease in mine.items() if lease.live(now) and i not in stopping}
        jobs = preempt(store, registry, record, live, now, timing=timing, inputs_here=inputs_here)
        if asks := preempts_of(record, store.leases(node_name), now, held):
            answer["preempts"] = asks
        if jobs:
            answer["jobs"] = jobs
    return answer


def _victims(record: NodeRecord, mine: Mapping[str, Lease]) -> tuple[Victim, ...]:
    """The node's reported preemptible running jobs that hold a live started lease
    here, each with the store's word on what it yields to."""
    out = []
    for v in node_view(record).victims:
        lease = mine.get(v.job_id)
        if lease is not None and lease.started:
            out.append(dataclasses.replace(v, preempting_for=lease.preempt_for or v.preempting_for))
    return tuple(out)


def preempt(
    store: ClusterStore,
    registry: Registry,
    record: NodeRecord,
    mine: Mapping[str, Lease],
    now: float,
    *,
    timing: Timing,
    inputs_here: Callable[[str], bool] | None = None,
) -> list[dict[str, Any]]:
    """Preemption across hosts at the lease boundary, for one node: choose its
    victims (:func:`gpuwarden.core.placement.preemptions_for` over the top of the
    queue), lease each waiting job to the node, mark its victims' leases (not renewed
    from then on) and record a ``preemption_requested`` event per victim. Returns the
    payloads of the jobs leased. ``mine``: the node's live leases."""
    victims = _victims(record, mine)
    if record.state is not NodeState.ACTIVE or not any(v.preempting_for is None for v in victims):
        return []
    counts = store.live_lease_counts(now)
    view = dataclasses.replace(node_view(record, busy=counts.get(record.name, 0)), victims=victims)
    footprints = {t: f.bytes for t, f in store.footprints().items()}
    # in priority, then arrival order: only a job of higher priority preempts, so
    # fair share (which orders equal priorities) does not change the choice
    queue = ClaimQueue(store, now=now, use={})
    queued = _offerable(
        store,
        registry,
        queue.take(CLAIM_PAGE),
        footprints=footprints,
        types=None,
        inputs_here=inputs_here,
        queue=queue,
    )
    others = _others(store, record.name, counts, now, timing)
    payloads: list[dict[str, Any]] = []
    for chosen in placement.preemptions_for(view, queued, others, now=now):
        payloads += _carry_out(store, record.name, chosen, mine=mine, now=now, timing=timing)
    return payloads


def _carry_out(
    store: ClusterStore,
    node: str,
    chosen: CrossPreempt,
    *,
    mine: Mapping[str, Lease],
    now: float,
    timing: Timing,
) -> list[dict[str, Any]]:
    """Lease the waiting job to the node, then mark its victims' leases."""
    lease_id = secrets.token_hex(8)
    lease_s = timing.lease_s
    got = store.lease_jobs(
        node, [chosen.for_job], lease_id=lease_id, expires_at=timing.held_until(now), now=now
    )
    if not got:
        return []  # another node took it meanwhile: nothing is asked
    for v in chosen.choice.victims:
        lease = mine[v.job_id]
        # not renewed from now on, but it lasts through the victim's grace and one
        # more lease to report its end: using its grace is never a lost lease
        if not store.mark_lease_preempt(
            v.job_id,
            lease_id=lease.lease_id,
            for_job=chosen.for_job,
            now=now,
            expires_at=timing.held_until(now, v.grace_s + lease_s),
        ):
            continue
        reason = (
            f"job {chosen.for_job}, of higher priority, needs its memory on {v.gpu_uuid} "
            f"of node {node}"
        )
        store.add_event(
            Event(
                ts=now,
                kind="preemption_requested",
                job_id=v.job_id,
                detail={
                    "job": v.job_id,
                    "attempt": lease.attempt,
                    "for_job": chosen.for_job,
                    "signal": v.signal,
                    "gpu": v.gpu_uuid,
                    "grace_s": v.grace_s,
                    "reason": reason,
                    "node": node,
                },
            )
        )
    return _payloads(store, got, lease_id, now + lease_s)


def preempts_of(
    record: NodeRecord, leases: Collection[Lease], now: float, held: Collection[str]
) -> list[dict[str, Any]]:
    """What the node is asked to signal: each job it holds whose live lease is marked
    for preemption, with its type's signal and grace as it reported them (sent at
    every heartbeat until its end clears the mark: the agent asks once)."""
    reported = {v.job_id: v for v in node_view(record).victims}
    out = []
    for lease in leases:
        v = reported.get(lease.job_id)
        if lease.preempt_for is None or not lease.live(now) or lease.job_id not in held:
            continue
        if v is None:
            continue  # not running there (any more): its end is on its way
        out.append(
            {
                "id": lease.job_id,
                "for_job": lease.preempt_for,
                "signal": v.signal,
                "grace_s": v.grace_s,
                "gpu": v.gpu_uuid,
                "reason": f"job {lease.preempt_for}, of higher priority, needs its memory on "
                f"{v.gpu_uuid} of node {record.name}",
            }
        )
    return out


# -- operators ------------------------------------------------------------------


def drain(store: ClusterStore, name: str, *, now: float) -> NodeRecord:
    """No new work for the node; what it runs finishes. The jobs leased to it that
    have not started there go back to the queue (event ``lease_given_back``), for
    another node: its agent's start of one, if it comes, is refused and stopped."""
    record = store.get_node(name)
    if record is None:
        raise UnknownNode(f"no node named {name!r} (`gpuwarden node list`)")
    if record.state is NodeState.REVOKED:
        raise UserError(f"node {name} was revoked; enrol it again to use it")
    store.set_node_state(name, NodeState.DRAINING, now=now)
    if record.state is not NodeState.DRAINING:  # once: a grant's lease comes later
        for lease in store.leases(name):
            if not lease.started and store.drop_lease(lease.job_id, lease_id=lease.lease_id):
                store.add_event(
                    Event(
                        ts=now,
                        kind="lease_given_back",
                        job_id=lease.job_id,
                        detail={
                            "node": name,
                            "reason": f"its node {name} was drained before it started there",
                        },
                    )
                )
    got = store.get_node(name)
    assert got is not None
    return got


def revoke(
    store: ClusterStore,
    registry: Registry | None,
    name: str,
    *,
    now: float,
    why: str | None = None,
) -> dict[str, Any]:
    """Refuse the node's credential from now on; its leased jobs go back to the
    queue, and its running attempts end as infrastructure failures, with ``why``
    as their reason (default: the node was revoked)."""
    record = store.get_node(name)
    if record is None:
        raise UnknownNode(f"no node named {name!r} (`gpuwarden node list`)")
    if record.token_id:
        store.revoke_token(record.token_id, now=now)
    store.set_node_state(name, NodeState.REVOKED, now=now)
    requeued = interrupted = 0
    for lease in store.leases(name):
        if _reclaim(store, registry, lease, now, why or f"its node {name} was revoked"):
            interrupted += 1
        else:
            requeued += 1
    return {"node": name, "requeued": requeued, "interrupted": interrupted}


def resume(store: ClusterStore, name: str, *, now: float) -> tuple[NodeRecord, bool]:
    """A draining node takes new work again. Returns the node and whether it changed
    (an active or offline node is left as it is: it is not draining)."""
    record = store.get_node(name)
    if record is None:
        raise UnknownNode(f"no node named {name!r} (`gpuwarden node list`)")
    if record.state is NodeState.REVOKED:
        raise UserError(
            f"node {name} was revoked; enrol it again to use it (`gpuwarden node invite {name}`)"
        )
    changed = store.set_node_state(
        name, NodeState.ACTIVE, now=now, only_from=frozenset({NodeState.DRAINING})
    )
    if changed:
        store.revoke_grants(now=now, reason=f"node {name} resumed", node=name)
    got = store.get_node(name)
    assert got is not None
    return got, changed


# -- maintenance ----------------------------------------------------------------


def _max_retries(registry: Registry | None, type_name: str | None) -> int:
    """The type's ``max_retries``; :data:`DEFAULT_MAX_RETRIES` when the type is not
    known here."""
    jobtype = registry.types.get(type_name) if registry is not None and type_name else None
    return jobtype.max_retries if jobtype is not None else DEFAULT_MAX_RETRIES


def _reclaim(
    store: ClusterStore, registry: Registry | None, lease: Lease, now: float, why: str
) -> bool:
    """Take a job back from a node: its running attempt there (if any) ends as an
    infrastructure failure; the lease goes. True when an attempt was ended."""
    ended = False
    job = store.get_job(lease.job_id)
    if job is not None and job.state is JobState.RUNNING:
        attempts = store.attempts(job.id)
        last = attempts[-1] if attempts else None
        if last is not None and last.node == lease.node and last.ended_at is None:
            if job.cancel_requested:
                target, reason = JobState.CANCELLED, f"{why}; it had been asked to stop"
            else:
                target, reason = retry_or_quarantine(
                    why,
                    attempt=jobcontrol.attempt_in_round(last.number, job.requeued_after),
                    max_retries=_max_retries(registry, job.type),
                )
            try:
                store.finish_attempt(
                    job.id,
                    last.number,
                    target=target,
                    now=now,
                    outcome="interrupted",
                    reason=reason,
                    result={"message": reason, "node": lease.node, "outcome": "interrupted"},
                )
                ended = True
            except TransitionError:
                pass  # its node's own report came first
            store.add_lost(job.id, lease.node, now=now)
    store.stop_service_route(lease.job_id, now)
    store.drop_lease(lease.job_id, lease_id=lease.lease_id)
    return ended


def _at(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def lapse_reason(
    store: ClusterStore,
    lease: Lease,
    now: float,
    timing: Timing | None,
    started_at: float | None,
) -> str:
    """Why the sweep takes back the job of an expired lease, from what the coordinator
    knows: when the lease was last given or renewed (``timing``: the lease and grace
    it was given with; None: not said), when the node was last heard from, and
    whether this coordinator started after that (``started_at``: the gap may then be
    its own: it was down, or the node could not reach it)."""
    why = f"its node {lease.node} stopped renewing its lease"
    renewed = None
    if timing is not None:
        renewed = lease.expires_at - timing.lease_s - timing.fence_grace_s
        why += f" at {_at(renewed)}"
    record = store.get_node(lease.node)
    if record is None or heard_s_ago(record, now) > heartbeat_window_s(record):
        heard = "never" if record is None or record.last_seen is None else _at(record.last_seen)
        why += (
            f" and has not been heard from since (last heard: {heard}): the node, its agent "
            "or the network to it is down"
        )
    else:
        why += (
            " though it still sends heartbeats: it no longer holds the job (its agent "
            "restarted, or stopped the job when it could not reach the coordinator)"
        )
    if started_at is not None and renewed is not None and renewed <= started_at + 1.0:
        why += (
            f"; the coordinator started, or reached its store again, at {_at(started_at)} "
            "(it or its store was down or unreachable before) and gave the lease a full "
            "period after that"
        )
    return why


def sweep(
    store: ClusterStore,
    now: float,
    offline_after_s: float = 120.0,
    *,
    registry: Registry | None = None,
    timing: Timing | None = None,
    started_at: float | None = None,
) -> dict[str, Any]:
    """One maintenance pass, if this process holds the maintenance lock (else
    ``{"leader": False}``): expired leases, jobs cancelled while queued, stale
    agents. Returns what it did. ``started_at``: when this coordinator started
    (the reason of a job taken back says whether the lease lapsed across it)."""
    if not store.try_maintenance_lock():
        return {"leader": False}
    dropped = interrupted = offline = cancelled = 0
    for lease in store.expired_leases(now):
        why = lapse_reason(store, lease, now, timing, started_at)
        if _reclaim(store, registry, lease, now, why):
            interrupted += 1
        else:
            dropped += 1
    for record in store.list_nodes():
        seen = record.last_seen if record.last_seen is not None else record.enrolled_at
        if (
            record.state is NodeState.ACTIVE
            and now - seen > offline_after_s
            and store.set_node_state(
                record.name, NodeState.OFFLINE, now=now, only_from=frozenset({NodeState.ACTIVE})
            )
        ):
            offline += 1
    for job_id in store.queued_cancel_requests(now):
        try:
            store.transition(
                job_id, JobState.CANCELLED, now=now, reason="cancelled before it ran again"
            )
            cancelled += 1
        except TransitionError:
            pass
    store.drop_stopped_routes(now - STOPPED_KEEP_S)
    return {
        "leader": True,
        "dropped": dropped,
        "interrupted": interrupted,
        "offline": offline,
        "cancelled": cancelled,
    }
