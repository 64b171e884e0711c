"""The rules of job control (core/jobcontrol.py) and the requeue's own way back in
the transition table (core/states.py)."""

from __future__ import annotations

import pytest

from gpuwarden.core import jobcontrol, states
from gpuwarden.core.model import Job, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import JobControlError, TransitionError, ValidationError


def job(state: JobState = JobState.QUEUED, **kw: object) -> Job:
    base: dict[str, object] = {
        "id": "j1",
        "type": "echo.echo",
        "state": state,
        "priority": 5,
        "params": {},
        "inputs": (),
        "outputs": (),
        "vram_bytes": None,
        "submitted_at": 1.0,
        "updated_at": 1.0,
    }
    return Job(**(base | kw))  # type: ignore[arg-type]


def test_requeue_is_not_in_the_ordinary_table() -> None:
    for ended in (JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.QUARANTINED):
        assert not states.allowed(ended, JobState.QUEUED)
        with pytest.raises(TransitionError):
            states.check(ended, JobState.QUEUED)
    assert {JobState.DONE, JobState.FAILED, JobState.CANCELLED} == states.REQUEUE


def test_hold_takes_only_a_queued_job_nobody_holds() -> None:
    jobcontrol.check_hold(job())
    jobcontrol.check_hold(job(held=True))  # waiting for its dependencies: a hold adds to it
    with pytest.raises(JobControlError, match="already held by ann: release with"):
        jobcontrol.check_hold(job(hold_by="ann"))
    with pytest.raises(JobControlError, match="is running: only a queued job can be held"):
        jobcontrol.check_hold(job(JobState.RUNNING))
    with pytest.raises(JobControlError, match="gpuwarden requeue j1"):
        jobcontrol.check_hold(job(JobState.DONE))


def test_release_takes_only_a_job_a_person_holds() -> None:
    jobcontrol.check_release(job(hold_by="ann"))
    with pytest.raises(JobControlError, match="not held by anyone: nothing to release"):
        jobcontrol.check_release(job())
    with pytest.raises(JobControlError, match="waits for its dependencies"):
        jobcontrol.check_release(job(held=True))


@pytest.mark.parametrize("state", [JobState.DONE, JobState.FAILED, JobState.CANCELLED])
def test_requeue_takes_an_ended_job(state: JobState) -> None:
    jobcontrol.check_requeue(job(state))


@pytest.mark.parametrize(
    ("state", "says"),
    [
        (JobState.QUEUED, "has not ended"),
        (JobState.RUNNING, "has not ended"),
        (JobState.QUARANTINED, "set aside"),
    ],
)
def test_requeue_refuses_a_job_that_has_not_ended(state: JobState, says: str) -> None:
    with pytest.raises(JobControlError, match=says):
        jobcontrol.check_requeue(job(state))


def test_requeue_refuses_a_job_with_staged_inputs() -> None:
    with pytest.raises(JobControlError, match="input files"):
        jobcontrol.check_requeue(job(JobState.DONE, inputs=("in.txt",)))


def test_priority_rules() -> None:
    assert jobcontrol.may_raise_priority(Role.OWNER)
    assert jobcontrol.may_raise_priority(Role.OPERATOR)
    assert not jobcontrol.may_raise_priority(Role.SUBMITTER)
    jobcontrol.check_priority(job(), 100, may_raise=True)
    jobcontrol.check_priority(job(), 4, may_raise=False)
    jobcontrol.check_priority(job(), 5, may_raise=False)  # the same: not a raise
    with pytest.raises(JobControlError, match="may only lower the priority of its own jobs"):
        jobcontrol.check_priority(job(), 6, may_raise=False)
    with pytest.raises(JobControlError, match="only a queued job's priority"):
        jobcontrol.check_priority(job(JobState.RUNNING), 1, may_raise=True)
    with pytest.raises(ValidationError, match="out of range"):
        jobcontrol.check_priority(job(), 2**63, may_raise=True)


@pytest.mark.parametrize("text", ["high", "1.5", "", "0x10", "1e3"])
def test_a_priority_must_be_an_integer(text: str) -> None:
    with pytest.raises(ValidationError, match="priority must be an integer"):
        jobcontrol.parse_priority(text)


def test_a_priority_as_typed() -> None:
    assert jobcontrol.parse_priority("-3") == -3
    assert jobcontrol.parse_priority(" 12 ") == 12
    with pytest.raises(ValidationError, match="out of range"):
        jobcontrol.parse_priority(str(2**64))


def test_held_line_names_who_and_the_command() -> None:
    line = jobcontrol.held_line(job(hold_by="ann (on the host)"))
    assert line == "held by ann (on the host): release with `gpuwarden release j1`"


def test_retries_count_from_the_last_requeue() -> None:
    assert jobcontrol.attempt_in_round(3, 0) == 3
    assert jobcontrol.attempt_in_round(4, 3) == 1
    numbered = [(1, "interrupted"), (2, "failed"), (3, "interrupted"), (4, "interrupted")]
    assert jobcontrol.round_attempts(numbered, 2, before=4) == ["interrupted"]
    assert jobcontrol.round_attempts(numbered, 0, before=3) == ["interrupted", "failed"]
