"""The Store port: the one durable truth of jobs, attempts, events and bundles.

Every method that writes takes ``now`` (seconds since the epoch) from its caller,
so tests inject time. Every job state change goes through the transition table
in :mod:`gpuwarden.core.states`, is written as a guarded update (``WHERE state IN
(allowed sources)`` plus a row-count check) and writes an event row in the same
transaction. Adapters: :mod:`gpuwarden.store.sqlite` (PostgreSQL comes later and
must pass the same contract suite, ``tests/integration/test_store_contract.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.model import Attempt, Event, Job, JobSpec
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
class Submission:
    """Where a group of jobs came from: a bundle in a queue root, or a direct submit."""

    input_dir: str | None = None
    queue_root: str | None = None
    bundle: str | None = None


#: a job submitted straight into the store, with no bundle and no input files
DIRECT = Submission()


class Store(abc.ABC):
    """The storage contract. See each method for what it promises."""

    # -- jobs ---------------------------------------------------------------

    @abc.abstractmethod
    def submit(
        self, specs: Sequence[JobSpec], *, now: float, origin: Submission = DIRECT
    ) -> list[Job]:
        """Insert ``specs`` as queued jobs, all or none, with a ``submitted`` event
        each. If ``origin.bundle`` is set, also record the bundle (its name must be
        new in that queue root, else :class:`DuplicateBundleError`). If any job id
        exists already, insert nothing and raise :class:`DuplicateJobError`."""

    @abc.abstractmethod
    def get_job(self, job_id: str) -> Job | None:
        """The job, or None."""

    @abc.abstractmethod
    def list_jobs(
        self, *, states: frozenset[JobState] | None = None, limit: int = 100
    ) -> list[Job]:
        """Newest first."""

    @abc.abstractmethod
    def queued_jobs(self, *, limit: int = 1000) -> list[Job]:
        """Queued jobs, highest priority first, then arrival order."""

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
    ) -> Job:
        """End attempt ``number`` and move its job from running to ``target``
        (``queued`` for a retry) in one transaction. Only the current attempt of a
        running job can be finished, once: a stale or repeated report raises
        ``TransitionError`` and changes nothing."""

    @abc.abstractmethod
    def attempts(self, job_id: str) -> list[Attempt]:
        """The job's attempts, oldest first."""

    @abc.abstractmethod
    def request_cancel(self, job_id: str, *, now: float) -> Job:
        """Cancel a queued job at once; mark a running one for the broker to stop.
        Raise ``UserError`` for a job that has already ended."""

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
    def raise_footprint(self, type_name: str, nbytes: int, *, now: float, job_id: str) -> bool:
        """Record ``nbytes`` as the type's measured footprint if it is larger than the
        one stored (never lower it), with a ``footprint_raised`` event. Return whether
        it was raised."""

    # -- operator requests ----------------------------------------------------

    @abc.abstractmethod
    def request_gpu_clear(self, gpu_uuid: str, *, now: float) -> None:
        """Ask the broker owning that GPU to clear its fault (``gpuwarden gpu clear``)."""

    @abc.abstractmethod
    def take_gpu_clears(self, *, now: float) -> list[str]:
        """The GPU UUIDs asked to be cleared since the last call; each is returned once."""

    # -- node status --------------------------------------------------------

    @abc.abstractmethod
    def put_node_status(self, status: NodeStatus) -> None: ...

    @abc.abstractmethod
    def node_statuses(self) -> list[NodeStatus]: ...

    # -- lifecycle ----------------------------------------------------------

    @abc.abstractmethod
    def close(self) -> None: ...
