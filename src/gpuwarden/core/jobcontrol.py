"""Job control people reach for: hold, release, requeue, a new priority. Pure.

The rules of SPEC.md section 1, "Job control", each a check of a job as it is
stored now that raises :class:`JobControlError` with what to do instead; the store
runs them under the job's row lock, the API and the CLI only show the message.

* ``hold`` takes a queued job out of planning and claims until it is released; a
  person's hold (``hold_by``) is not the dependencies' ``held``: neither releases
  the other.
* ``release`` ends a person's hold, whoever holds it.
* ``requeue`` puts an ended job (done, failed, cancelled: :data:`states.REQUEUE`)
  back in the queue with the same id and spec; its attempt numbers go on, its
  retries count afresh (:func:`attempt_in_round`).
* ``priority`` sets a job's priority; a role that may not raise it (a submitter:
  :func:`may_raise_priority`) may only lower it.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuwarden.core import states
from gpuwarden.core.model import Job, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import JobControlError, ValidationError

__all__ = [
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "attempt_in_round",
    "check_hold",
    "check_priority",
    "check_release",
    "check_requeue",
    "held_line",
    "may_raise_priority",
    "parse_priority",
    "round_attempts",
]

#: a priority's bounds: a 64-bit signed integer, as a submission's
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def held_line(job: Job) -> str:
    """What ``explain`` and ``show`` say of a job a person holds."""
    return f"held by {job.hold_by}: release with `gpuwarden release {job.id}`"


def check_hold(job: Job) -> None:
    """A hold takes only a queued job that nobody holds yet."""
    if job.state is not JobState.QUEUED:
        what = "it has ended" if job.state.terminal else "it has started"
        raise JobControlError(
            f"job {job.id} is {job.state.value}: only a queued job can be held ({what}; "
            + (
                f"`gpuwarden requeue {job.id}` queues it again)"
                if job.state in states.REQUEUE
                else f"`gpuwarden cancel {job.id}` stops it)"
                if job.state is JobState.RUNNING
                else "nothing to hold)"
            )
        )
    if job.hold_by is not None:
        raise JobControlError(f"job {job.id} is already {held_line(job)}")


def check_release(job: Job) -> None:
    """A release takes a queued job a person holds (not one that waits only for its
    dependencies: those release it themselves)."""
    if job.hold_by is None:
        waits = " (it waits for its dependencies, which release it)" if job.held else ""
        raise JobControlError(
            f"job {job.id} is {job.state.value} and not held by anyone{waits}: nothing to release"
        )


def check_requeue(job: Job) -> None:
    """A requeue takes an ended job (done, failed or cancelled) whose inputs are not
    files staged for its first run."""
    if job.state not in states.REQUEUE:
        if job.state is JobState.QUARANTINED:
            why = "it was set aside after repeated infrastructure failures; submit it again"
        else:
            why = f"it has not ended (`gpuwarden cancel {job.id}` ends it)"
        raise JobControlError(
            f"job {job.id} is {job.state.value}: only a done, failed or cancelled job "
            f"can be requeued ({why})"
        )
    if job.inputs:
        raise JobControlError(
            f"job {job.id} has input files, staged for the run it had: it cannot be "
            "requeued; submit it again with its inputs"
        )


def may_raise_priority(role: Role) -> bool:
    """Owners and operators set any priority; a submitter may only lower its own."""
    return role in (Role.OWNER, Role.OPERATOR)


def check_priority(job: Job, priority: int, *, may_raise: bool) -> None:
    """A new priority for a queued job, within bounds; above its current one only
    where ``may_raise``."""
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValidationError(
            f"priority {priority} is out of range ({PRIORITY_MIN} to {PRIORITY_MAX})"
        )
    if job.state is not JobState.QUEUED:
        later = (
            f"`gpuwarden requeue {job.id}` first, if it should run again"
            if job.state in states.REQUEUE
            else "a started attempt keeps the priority it started with"
        )
        raise JobControlError(
            f"job {job.id} is {job.state.value}: only a queued job's priority can be "
            f"changed ({later})"
        )
    if priority > job.priority and not may_raise:
        raise JobControlError(
            f"job {job.id}'s priority is {job.priority}: a submitter may only lower the "
            f"priority of its own jobs, not raise it to {priority} (an operator or the "
            "owner may)"
        )


def parse_priority(text: str) -> int:
    """A priority as a person types it: an integer, else a :class:`ValidationError`."""
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise ValidationError(f"priority must be an integer (e.g. 5 or -2), got {text!r}") from None
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValidationError(
            f"priority {value} is out of range ({PRIORITY_MIN} to {PRIORITY_MAX})"
        )
    return value


def attempt_in_round(number: int, requeued_after: int) -> int:
    """Attempt ``number`` of a job counted from its last requeue (1: the first since):
    what its retries are judged by."""
    return number - requeued_after


def round_attempts(
    numbered: Iterable[tuple[int, str | None]], requeued_after: int, *, before: int
) -> list[str | None]:
    """The outcomes of the attempts since the last requeue and before attempt
    ``before``, from ``(number, outcome)``: the earlier attempts its retries count."""
    return [o for number, o in numbered if requeued_after < number < before]
