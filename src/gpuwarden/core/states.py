"""Job states and the one transition table that every state change goes through."""

from __future__ import annotations

from enum import StrEnum

from gpuwarden.errors import TransitionError


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: infrastructure kept failing it (launch errors, dead workers, GPU faults) past
    #: its type's max_retries: it is set aside with its attempt history
    QUARANTINED = "quarantined"
    # leased and waiting arrive with the issues that need them.

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL: frozenset[JobState] = frozenset(
    {JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.QUARANTINED}
)

#: target state -> the states a job may be in to move there.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # back to the queue: a retry, or an attempt interrupted by a broker restart
    JobState.QUEUED: frozenset({JobState.RUNNING}),
    JobState.RUNNING: frozenset({JobState.QUEUED}),
    JobState.DONE: frozenset({JobState.RUNNING}),
    # a job can fail before it ever runs (unreadable input, refused at start)
    JobState.FAILED: frozenset({JobState.QUEUED, JobState.RUNNING}),
    JobState.CANCELLED: frozenset({JobState.QUEUED, JobState.RUNNING}),
    JobState.QUARANTINED: frozenset({JobState.RUNNING}),
}


#: the one way back from an end, kept out of :data:`TRANSITIONS` so that no state
#: change but a person's requeue (``Store.requeue``, SPEC.md section 1, "Job
#: control") can take it: :func:`allowed` and :func:`check` never grant it, and a
#: stale report that names ``queued`` for an ended job is still refused. Quarantine
#: is not among the sources: infrastructure set that job aside.
REQUEUE: frozenset[JobState] = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})


def sources(target: JobState) -> frozenset[JobState]:
    """The states from which a job may move to ``target``."""
    return TRANSITIONS[target]


def allowed(source: JobState, target: JobState) -> bool:
    return source in TRANSITIONS[target]


def check(source: JobState, target: JobState) -> None:
    """Raise :class:`TransitionError` unless ``source -> target`` is allowed."""
    if not allowed(source, target):
        raise TransitionError(
            f"a job cannot go from {source.value} to {target.value}; "
            f"it can go to {target.value} only from "
            f"{', '.join(sorted(s.value for s in TRANSITIONS[target])) or 'nowhere'}"
        )
