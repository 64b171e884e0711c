"""The Store port: the one durable truth of jobs, attempts, events and bundles.

Every method that writes takes ``now`` (seconds since the epoch) from its caller,
so tests inject time. Every job state change goes through the transition table
in :mod:`gpuwarden.core.states`, is written as a guarded update (``WHERE state IN
(allowed sources)`` plus a row-count check) and writes an event row in the same
transaction. Implemented once in SQL by :class:`~gpuwarden.store.sql.SqlStore`,
with two adapters, :mod:`gpuwarden.store.sqlite` and :mod:`gpuwarden.store.postgres`;
both pass the same contract suite, ``tests/integration/test_store_contract.py``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.dependencies import Dependency
from gpuwarden.core.model import Attempt, Event, Job, JobSpec, Role
from gpuwarden.core.ramadmit import NO_RAM, RamNeed
from gpuwarden.core.states import JobState
from gpuwarden.errors import UserError


class DuplicateJobError(UserError):
    """A job with that id was already accepted."""

    def __init__(self, ids: Sequence[str], message: str | None = None) -> None:
        self.ids = tuple(ids)
        super().__init__(
            message
            or f"job id {', '.join(self.ids)} was already accepted; "
            "a job id is used once (submit with a new id to run it again)"
        )


class DuplicateBundleError(UserError):
    """A bundle with that name was already received."""


class IdempotencyConflict(UserError):
    """That idempotency key was already used by this token for a different request."""


class DuplicateTokenError(UserError):
    """A token with that id exists already."""


@dataclass(frozen=True, slots=True)
class BundleRecord:
    queue_root: str
    name: str
    job_ids: tuple[str, ...]
    received_at: float
    finished_at: float | None = None
    outcome: str | None = None
    result_path: str | None = None


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A queued job as the broker loop's queue index keeps it (the rest of the job
    is read when it starts)."""

    id: str
    type: str
    priority: int
    seq: int
    vram_bytes: int | None
    cancel_requested: bool
    #: the run time its submitter declared (None: none)
    est_s: float | None = None
    #: who submitted it (the token's id; None: the local CLI or a bundle)
    owner: str | None = None
    #: how many GPUs it asked for itself (None: its type's count)
    gpus: int | None = None
    #: what it asks of the host's RAM (``gpuwarden.core.ramadmit``)
    ram: RamNeed = NO_RAM
    #: the one GPU it may run on (its ``gpu`` constraint); "": any
    gpu: str = ""


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node: str
    pid: int | None
    updated_at: float
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MeasuredFootprint:
    """The largest VRAM peak measured for a job type (by a job alone on its GPU)."""

    type: str
    bytes: int
    job_id: str | None
    updated_at: float


@dataclass(frozen=True, slots=True)
class GpuClear:
    """An operator's request to clear a GPU's fault (``gpuwarden gpu clear``)."""

    gpu_uuid: str
    #: who asked: ``local:USER`` on the host's CLI, ``token:ID (NAME)`` through the API
    by: str = ""
    #: why, in the operator's words
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GpuFault:
    """A GPU's hardware fault latched by a critical Xid; open until cleared."""

    node: str
    gpu_uuid: str
    xid: int
    reason: str
    latched_at: float
    cleared_at: float | None = None
    cleared_by: str | None = None
    clear_reason: str | None = None
    id: int | None = None


@dataclass(frozen=True, slots=True)
class TypeProfile:
    """The largest RAM peak measured for a job type (by any of its attempts)."""

    type: str
    ram_peak_bytes: int
    job_id: str | None
    updated_at: float


@dataclass(frozen=True, slots=True)
class AttemptSpan:
    """When one attempt ran, with what its job says of who and when (the dashboard's
    GPU-hours and queue waits)."""

    job_id: str
    number: int
    type: str
    owner: str | None
    gpu_uuid: str | None
    submitted_at: float
    started_at: float
    ended_at: float | None
    outcome: str | None


@dataclass(frozen=True, slots=True)
class Submission:
    """Where a group of jobs came from: a bundle in a queue root, or a direct submit."""

    input_dir: str | None = None
    queue_root: str | None = None
    bundle: str | None = None
    #: the API token that submitted the jobs (None: the CLI on the host, a bundle)
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """An API token as stored: never the secret, only its SHA-256 (hex)."""

    id: str  # 12 hex digits, the lookup part of ``gw_<id>_<secret>``
    name: str
    role: Role
    secret_hash: str
    created_at: float
    created_by: str  # a token id, or "local" (the CLI on the host)
    expires_at: float | None = None
    revoked_at: float | None = None
    node: str | None = None  # the node a node or enroll token is bound to
    #: an enroll token (``node invite NAME --replace``) that may enrol a host in the
    #: place of a node of that name that is enrolled and not revoked
    replace: bool = False

    def active(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


@dataclass(frozen=True, slots=True)
class AuditRow:
    """Who did what through the API or the CLI, and how it ended."""

    ts: float
    actor: str  # a token id, or "local"
    actor_name: str
    role: str  # the actor's role, "local" for the CLI on the host, "-" when unknown
    action: str  # "job.submit", "job.cancel", "token.create", "token.revoke", ...
    target: str = ""  # a job id, a token id, ...
    outcome: str = "ok"  # "ok", "refused: <why>" or "error: <what>"
    detail: dict[str, Any] = field(default_factory=dict)
    id: int | None = None


@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    """A submission made with an ``Idempotency-Key``, kept to answer its retries."""

    token_id: str
    key: str
    body_hash: str
    job_ids: tuple[str, ...]
    created_at: float


#: a job submitted straight into the store, with no bundle and no input files
DIRECT = Submission()


class Store(abc.ABC):
    """The storage contract. See each method for what it promises."""

    # -- jobs ---------------------------------------------------------------

    @abc.abstractmethod
    def submit(
        self,
        specs: Sequence[JobSpec],
        *,
        now: float,
        origin: Submission = DIRECT,
        idempotency: tuple[str, str, str] | None = None,
    ) -> list[Job]:
        """Insert ``specs`` as queued jobs, all or none, with a ``submitted`` event
        each, owned by ``origin.owner``. If ``origin.bundle`` is set, also record the
        bundle (its name must be new in that queue root, else
        :class:`DuplicateBundleError`). If any job id exists already, insert nothing
        and raise :class:`DuplicateJobError`.

        ``idempotency`` is ``(token_id, key, body_hash)``. It is looked up first, in
        the same transaction: when that token used that key before with the same
        ``body_hash``, nothing is inserted and the jobs of that first submission are
        returned (in its order); with another ``body_hash``, nothing is inserted and
        :class:`IdempotencyConflict` is raised. Otherwise the jobs are inserted and
        the key is recorded with their ids in the same transaction.

        A spec's ``after`` (already parsed by :func:`gpuwarden.core.dependencies.parse_all`)
        may name stored jobs and jobs of the same submission; one that names neither,
        or a cycle, raises :class:`~gpuwarden.core.dependencies.DependencyError` and
        nothing is inserted. A job whose dependencies do not hold yet is stored held
        (queued, but neither planned nor claimed: not in :meth:`queue_entries`); one
        whose dependencies can never hold is stored and failed at once, with the
        reason. Whenever a job ends, in the same transaction, each held job that
        names it is released (event ``dependencies_held``) or failed, down the chain."""

    @abc.abstractmethod
    def idempotency_record(self, token_id: str, key: str) -> IdempotencyRecord | None:
        """The submission ``token_id`` made with ``key``, or None."""

    @abc.abstractmethod
    def get_job(self, job_id: str) -> Job | None:
        """The job, or None."""

    @abc.abstractmethod
    def list_jobs(
        self,
        *,
        states: frozenset[JobState] | None = None,
        limit: int = 100,
        owner: str | None = None,
    ) -> list[Job]:
        """Newest first; only the jobs of ``owner`` (a token id) when it is given."""

    @abc.abstractmethod
    def live_jobs_of_type(self, type_name: str) -> list[Job]:
        """Every queued or running job of one type, newest first (an index read,
        however many other jobs are live): the VRAM leases."""

    @abc.abstractmethod
    def queued_jobs(self, *, limit: int = 1000) -> list[Job]:
        """Queued jobs, highest priority first, then arrival order."""

    @abc.abstractmethod
    def queue_entries(self, ids: Sequence[str] | None = None) -> list[QueueEntry]:
        """Every queued job that is not held (or those of ``ids``), in no order."""

    @abc.abstractmethod
    def queued_count(self) -> int:
        """How many jobs are queued and not held (an index count: cheap beside a long
        history): what :meth:`queue_entries` returns."""

    @abc.abstractmethod
    def running_jobs(self) -> list[Job]:
        """Jobs in state running, arrival order."""

    @abc.abstractmethod
    def count_by_state(self) -> dict[JobState, int]:
        """How many jobs are in each state (states with none are absent)."""

    @abc.abstractmethod
    def transition(
        self,
        job_id: str,
        target: JobState,
        *,
        now: float,
        reason: str = "",
        detail: Mapping[str, Any] | None = None,
        exit_code: int | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> Job:
        """Move the job to ``target`` if the transition table allows it from its
        current state. Raise ``TransitionError`` when the job is not in an allowed
        source state (also when another writer changed it first) and
        ``UnknownJobError`` when there is no such job."""

    @abc.abstractmethod
    def start_attempt(
        self, job_id: str, *, node: str, gpu_uuid: str | None, now: float
    ) -> tuple[Job, Attempt]:
        """queued -> running, with a new attempt numbered one past the last."""

    @abc.abstractmethod
    def set_attempt_pid(self, job_id: str, number: int, pid: int) -> None:
        """Remember the process id of a running attempt (for diagnostics)."""

    @abc.abstractmethod
    def finish_attempt(
        self,
        job_id: str,
        number: int,
        *,
        target: JobState,
        now: float,
        outcome: str,
        reason: str,
        exit_code: int | None = None,
        stdout: str = "",
        stderr: str = "",
        result: Mapping[str, Any] | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Job:
        """End attempt ``number`` and move its job from running to ``target``
        (``queued`` for a retry) in one transaction. Only the current attempt of a
        running job can be finished, once: a stale or repeated report raises
        ``TransitionError`` and changes nothing. ``detail`` is added to the event
        (a job from a commit: its image and node); the job's source is always."""

    @abc.abstractmethod
    def dependencies(self, job_id: str) -> list[tuple[Dependency, JobState]]:
        """The job's dependencies (``after``), each with its job's current state."""

    @abc.abstractmethod
    def settle_dependencies(self, *, now: float) -> int:
        """Judge every held job again (a restart's recovery): release those whose
        dependencies hold, fail those whose can never hold (and so on down their
        dependents). Return how many changed. A job's end does this for its own
        dependents in its own transaction; this is the net under it."""

    @abc.abstractmethod
    def attempts(self, job_id: str) -> list[Attempt]:
        """The job's attempts, oldest first."""

    @abc.abstractmethod
    def request_cancel(self, job_id: str, *, now: float) -> Job:
        """Cancel a queued job at once; mark a running one for the broker to stop.
        Raise ``UserError`` for a job that has already ended."""

    @abc.abstractmethod
    def request_stop(self, job_id: str, *, by: str, now: float) -> Job:
        """Mark a running job for the broker to stop as done (a service job:
        ``gpuwarden stop``), naming who asked. Raise ``UserError`` for a job
        that is not running."""

    # -- job control (SPEC.md section 1, "Job control"; the rules: core/jobcontrol.py)

    @abc.abstractmethod
    def hold(self, job_id: str, *, by: str, now: float) -> Job:
        """Hold a queued job for ``by`` (event ``held``): it stays queued but is
        neither planned nor claimed until :meth:`release`. Apart from the
        dependencies' hold: neither releases the other. Raise ``JobControlError``
        for a job that is not queued, is held already, or has a live lease."""

    @abc.abstractmethod
    def release(self, job_id: str, *, by: str, now: float) -> Job:
        """End a person's hold (event ``released``). Raise ``JobControlError`` for a
        job nobody holds."""

    @abc.abstractmethod
    def requeue(self, job_id: str, *, by: str, now: float) -> Job:
        """Put an ended job (done, failed, cancelled) back in the queue, same id and
        spec (event ``requeued``, from its end to queued, with what its end had
        recorded). Its attempt numbers go on and its retries count afresh
        (``requeued_after``); held for its dependencies if one waits again. Raise
        ``JobControlError`` for a job that has not ended, or one that can never run
        (a dependency that can never hold, staged input files)."""

    @abc.abstractmethod
    def set_priority(
        self, job_id: str, priority: int, *, by: str, now: float, may_raise: bool = True
    ) -> Job:
        """Set a queued job's priority (event ``priority_changed``); above the current
        one only where ``may_raise``. Raise ``JobControlError`` otherwise."""

    # -- events -------------------------------------------------------------

    @abc.abstractmethod
    def add_event(self, event: Event) -> Event:
        """Append an event that is not a transition (intake refusals, loop errors)."""

    @abc.abstractmethod
    def last_event_id(self) -> int:
        """The id of the newest event (0 when there is none)."""

    @abc.abstractmethod
    def events(
        self, *, job_id: str | None = None, after_id: int = 0, limit: int = 1000
    ) -> list[Event]:
        """Events in the order they were written."""

    # -- bundles ------------------------------------------------------------

    @abc.abstractmethod
    def get_bundle(self, queue_root: str, name: str) -> BundleRecord | None: ...

    def terminal_count(self, job_ids: Sequence[str]) -> int:
        """How many of these jobs exist and have ended (a bundle's result waits
        until this is all of them): one query, not a read per job."""
        return sum(1 for i in job_ids if (j := self.get_job(i)) is not None and j.state.terminal)

    # -- group commit and wakes --------------------------------------------

    def batch(self) -> AbstractContextManager[None]:
        """The writes this thread makes in the block share one commit, made when
        the block ends (or at :meth:`commit`); each write still takes effect as a
        whole or not at all, and one that raises undoes only itself. A store that
        cannot group writes commits each one as it comes (this default)."""
        return contextlib.nullcontext()

    def commit(self) -> None:
        """Commit what the open :meth:`batch` of this thread wrote so far (nothing
        outside a batch): the point before anything acts on those writes."""
        return None

    def on_submit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on any thread) soon after jobs are submitted or a
        cancel is asked, by this process or another: the broker's wake, so that
        no submission waits for the loop's poll. Best effort; a store that cannot
        tell does nothing (the loop's poll still finds the jobs)."""
        return None

    @abc.abstractmethod
    def open_bundles(self) -> list[BundleRecord]:
        """Bundles whose result has not been written yet, oldest first."""

    @abc.abstractmethod
    def finish_bundle(
        self, queue_root: str, name: str, *, now: float, outcome: str, result_path: str
    ) -> None:
        """Record that the bundle's result was written."""

    @abc.abstractmethod
    def record_rejected_bundle(
        self, queue_root: str, name: str, *, now: float, reason: str, result_path: str
    ) -> None:
        """Record a bundle refused before any of its jobs was accepted."""

    # -- footprints -----------------------------------------------------------

    @abc.abstractmethod
    def footprints(self) -> dict[str, MeasuredFootprint]:
        """Every measured footprint, by job type."""

    @abc.abstractmethod
    def recent_run_times(self, *, limit: int = 5000) -> list[tuple[str, float]]:
        """``(job type, seconds)`` of the latest succeeded attempts, newest first."""

    @abc.abstractmethod
    def type_profiles(self) -> dict[str, TypeProfile]:
        """Every type's measured RAM peak, by job type."""

    @abc.abstractmethod
    def record_ram_peak(
        self, job_id: str, number: int, type_name: str, nbytes: int, *, now: float
    ) -> None:
        """Attempt ``number`` of the job (of ``type_name``) was seen to use ``nbytes``
        of RAM at most: keep it on the attempt, and as the type's RAM peak if it is
        larger than the one stored (never lower that)."""

    @abc.abstractmethod
    def attempt_spans(self, *, since: float, limit: int = 50_000) -> list[AttemptSpan]:
        """The attempts still running or ended at ``since`` or later, the latest
        started first (at most ``limit``)."""

    @abc.abstractmethod
    def fair_share(self) -> list[tuple[str, float, float]]:
        """Each owner's stored use: ``(owner, GiB-hours, as of)`` (owner "" is local),
        not decayed since ``as of`` (:mod:`gpuwarden.core.fairshare`)."""

    @abc.abstractmethod
    def owner_counts(self) -> dict[str | None, tuple[int, int]]:
        """Each owner's ``(queued, running)`` jobs (owners with neither are absent)."""

    @abc.abstractmethod
    def add_fair_share(
        self, owner: str | None, gib_h: float, *, now: float, half_life_s: float
    ) -> None:
        """Add ``gib_h`` GiB-hours to ``owner``'s use at ``now``, the stored use
        decayed to ``now`` first (in the open batch, if any)."""

    @abc.abstractmethod
    def raise_footprint(self, type_name: str, nbytes: int, *, now: float, job_id: str) -> bool:
        """Record ``nbytes`` as the type's measured footprint if it is larger than the
        one stored (never lower it), with a ``footprint_raised`` event. Return whether
        it was raised."""

    # -- operator requests ----------------------------------------------------

    @abc.abstractmethod
    def request_gpu_clear(
        self, gpu_uuid: str, *, now: float, by: str = "", reason: str = ""
    ) -> None:
        """Ask the broker owning that GPU to clear its fault (``gpuwarden gpu clear``),
        saying who asks (``by``) and why."""

    @abc.abstractmethod
    def take_gpu_clears(self, *, now: float) -> list[GpuClear]:
        """The requests to clear a GPU made since the last call; each is returned once
        (in the open batch, if any)."""

    @abc.abstractmethod
    def latch_gpu_fault(
        self, *, node: str, gpu_uuid: str, xid: int, reason: str, now: float
    ) -> bool:
        """Latch a hardware fault on ``node``'s GPU (in the open batch, if any).
        False, and nothing written, when that GPU already has an open latch there."""

    @abc.abstractmethod
    def clear_gpu_fault(
        self, *, node: str, gpu_uuid: str, now: float, by: str, reason: str
    ) -> bool:
        """Close the open latch of ``node``'s GPU, saying who cleared it and why (in
        the open batch, if any). False when it had none open."""

    @abc.abstractmethod
    def gpu_faults(
        self, *, node: str | None = None, gpu_uuid: str | None = None, open_only: bool = False
    ) -> list[GpuFault]:
        """The latched faults, oldest first (closed ones too, unless ``open_only``),
        of one node and GPU when named."""

    # -- API tokens -----------------------------------------------------------

    @abc.abstractmethod
    def create_token(
        self,
        *,
        token_id: str,
        name: str,
        role: Role,
        secret_hash: str,
        now: float,
        created_by: str,
        expires_at: float | None = None,
        node: str | None = None,
        replace: bool = False,
    ) -> TokenRecord:
        """Store a new token (its secret's hash only). Raise
        :class:`DuplicateTokenError` if ``token_id`` exists (revoked ones too). An
        enroll token bound to a node revokes that node's other enroll tokens in the
        same transaction: a node has one live invite, the newest. ``replace``: the
        enroll token may enrol a host in the place of a live node of its name."""

    @abc.abstractmethod
    def get_token(self, token_id: str) -> TokenRecord | None:
        """The token, revoked or expired ones too, or None."""

    @abc.abstractmethod
    def list_tokens(self) -> list[TokenRecord]:
        """Every token, revoked and expired ones too, oldest first."""

    @abc.abstractmethod
    def revoke_token(self, token_id: str, *, now: float) -> bool:
        """Mark the token revoked at ``now``. Return False (and change nothing)
        when there is no such token or it was revoked already."""

    # -- audit --------------------------------------------------------------

    @abc.abstractmethod
    def add_audit(self, row: AuditRow) -> AuditRow:
        """Append an audit row; return it with its id (ids only grow)."""

    @abc.abstractmethod
    def audit_rows(self, *, after_id: int = 0, limit: int = 1000) -> list[AuditRow]:
        """Audit rows with an id above ``after_id``, oldest first, at most ``limit``."""

    # -- node status --------------------------------------------------------

    @abc.abstractmethod
    def put_node_status(self, status: NodeStatus) -> None: ...

    @abc.abstractmethod
    def node_statuses(self) -> list[NodeStatus]: ...

    # -- lifecycle ----------------------------------------------------------

    def unavailable(self, exc: BaseException) -> bool:
        """True when ``exc``, raised by one of this store's methods, means the
        database could not take the request now (busy or locked, unreachable, out
        of space or memory), so the same request may succeed later. False for
        anything else: a value it refused, a transition the table forbids, a bug."""
        return False

    @abc.abstractmethod
    def close(self) -> None: ...
