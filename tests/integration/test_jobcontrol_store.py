"""Job control in the store, on every backend (see conftest.store): a person's hold
apart from the dependencies' hold, out of planning, starts and claims; a requeue
that keeps the id and everything recorded of the earlier run; a new priority."""

from __future__ import annotations

import pytest

from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import JobControlError, TransitionError, UnknownJobError
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore


def spec(i: str, *after: str, priority: int = 0) -> JobSpec:
    return JobSpec(
        id=i, type="echo.echo", params={"text": i}, after=tuple(after), priority=priority
    )


def run_to(store: Store, job_id: str, target: JobState, *, now: float = 5.0) -> None:
    """Start the job's next attempt and end it as ``target``."""
    _, attempt = store.start_attempt(job_id, node="n", gpu_uuid=None, now=now)
    store.finish_attempt(
        job_id,
        attempt.number,
        target=target,
        now=now + 1,
        outcome="x",
        reason=f"attempt {attempt.number} {target.value}",
        exit_code=0 if target is JobState.DONE else 1,
        result={"message": f"run {attempt.number}"},
    )


def queued_ids(store: Store) -> set[str]:
    return {e.id for e in store.queue_entries()}


def test_a_held_job_is_neither_planned_started_nor_claimed_until_released(store: Store) -> None:
    assert isinstance(store, ClusterStore)
    store.submit([spec("a"), spec("b")], now=1.0)
    held = store.hold("a", by="ann", now=2.0)
    assert held.state is JobState.QUEUED and held.hold_by == "ann" and not held.held
    assert queued_ids(store) == {"b"} and store.queue_entries(["a"]) == []
    assert store.queued_count() == 1
    with pytest.raises(TransitionError, match="held by ann"):
        store.start_attempt("a", node="n", gpu_uuid=None, now=3.0)
    assert [c.id for c in store.claimable_jobs(now=3.0)] == ["b"]
    assert [c.id for c in store.claimable_jobs_of("", now=3.0)] == ["b"]
    assert store.lease_jobs("n1", ["a", "b"], lease_id="L1", expires_at=99.0, now=3.0) == ["b"]

    released = store.release("a", by="bob", now=4.0)
    assert released.hold_by is None
    assert queued_ids(store) == {"a", "b"} and store.queued_count() == 2
    assert store.lease_jobs("n1", ["a"], lease_id="L2", expires_at=99.0, now=5.0) == ["a"]
    kinds = [(e.kind, e.detail) for e in store.events(job_id="a") if e.kind != "submitted"]
    assert ("held", {"by": "ann"}) in kinds
    assert ("released", {"by": "bob", "held_by": "ann"}) in kinds


def test_a_dependency_release_does_not_release_a_hold(store: Store) -> None:
    store.submit([spec("a"), spec("b", "afterok:a")], now=1.0)
    store.hold("b", by="ann", now=2.0)
    run_to(store, "a", JobState.DONE)
    b = store.get_job("b")
    assert b is not None and not b.held and b.hold_by == "ann"  # dependencies hold now
    assert queued_ids(store) == set() and store.queued_count() == 0
    store.release("b", by="ann", now=9.0)
    assert queued_ids(store) == {"b"}


def test_a_release_does_not_release_a_dependency_hold(store: Store) -> None:
    store.submit([spec("a"), spec("b", "afterok:a")], now=1.0)
    store.hold("b", by="ann", now=2.0)
    b = store.release("b", by="ann", now=3.0)
    assert b.held and b.hold_by is None  # still waits for a
    assert queued_ids(store) == {"a"} and store.queued_count() == 1
    with pytest.raises(JobControlError, match="waits for its dependencies"):
        store.release("b", by="ann", now=4.0)


def test_hold_and_release_refusals(store: Store) -> None:
    store.submit([spec("q"), spec("r"), spec("d")], now=1.0)
    store.start_attempt("r", node="n", gpu_uuid=None, now=2.0)
    run_to(store, "d", JobState.DONE)
    with pytest.raises(UnknownJobError):
        store.hold("nope", by="ann", now=3.0)
    with pytest.raises(JobControlError, match="is running: only a queued job can be held"):
        store.hold("r", by="ann", now=3.0)
    with pytest.raises(JobControlError, match="is done: only a queued job can be held"):
        store.hold("d", by="ann", now=3.0)
    with pytest.raises(JobControlError, match="nothing to release"):
        store.release("q", by="ann", now=3.0)
    store.hold("q", by="ann", now=3.0)
    with pytest.raises(JobControlError, match="already held by ann"):
        store.hold("q", by="bob", now=4.0)


def test_a_leased_job_cannot_be_held(store: Store) -> None:
    assert isinstance(store, ClusterStore)
    store.submit([spec("a")], now=1.0)
    assert store.lease_jobs("n1", ["a"], lease_id="L1", expires_at=50.0, now=2.0) == ["a"]
    with pytest.raises(JobControlError, match="leased to node n1"):
        store.hold("a", by="ann", now=3.0)
    assert store.hold("a", by="ann", now=51.0).hold_by == "ann"  # its lease has lapsed


def test_a_cancel_ends_a_held_job_and_its_hold(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    store.hold("a", by="ann", now=2.0)
    job = store.request_cancel("a", now=3.0)
    assert job.state is JobState.CANCELLED and job.hold_by is None


def test_requeue_keeps_the_id_and_everything_recorded_of_the_earlier_run(store: Store) -> None:
    store.submit([spec("a", priority=3)], now=1.0)
    run_to(store, "a", JobState.FAILED)
    before = store.get_job("a")
    assert before is not None and before.exit_code == 1 and before.result

    job = store.requeue("a", by="ann", now=10.0)
    assert job.id == "a" and job.state is JobState.QUEUED and job.priority == 3
    assert job.reason == "requeued by ann" and job.exit_code is None and job.result == {}
    assert job.attempts == 1 and job.requeued_after == 1
    assert queued_ids(store) == {"a"}
    [ev] = [e for e in store.events(job_id="a") if e.kind == "requeued"]
    assert (ev.from_state, ev.to_state) == ("failed", "queued")
    assert ev.detail["by"] == "ann" and ev.detail["attempts"] == 1
    assert ev.detail["reason"] == before.reason and ev.detail["exit_code"] == 1
    assert ev.detail["result"] == before.result

    run_to(store, "a", JobState.DONE, now=20.0)  # attempt numbers go on
    attempts = store.attempts("a")
    assert [(a.number, a.reason) for a in attempts] == [
        (1, "attempt 1 failed"),
        (2, "attempt 2 done"),
    ]
    again = store.requeue("a", by="bob", now=30.0)
    assert again.requeued_after == 2
    kinds = [e.kind for e in store.events(job_id="a")]
    assert kinds.count("requeued") == 2 and kinds.count("submitted") == 1


def test_only_a_requeue_takes_an_ended_job_back_to_the_queue(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    run_to(store, "a", JobState.DONE)
    with pytest.raises(TransitionError):
        store.transition("a", JobState.QUEUED, now=7.0)
    job = store.get_job("a")
    assert job is not None and job.state is JobState.DONE


@pytest.mark.parametrize("running", [False, True])
def test_requeue_refuses_a_job_still_queued_or_running(store: Store, running: bool) -> None:
    store.submit([spec("a")], now=1.0)
    if running:
        store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    with pytest.raises(JobControlError, match="has not ended"):
        store.requeue("a", by="ann", now=3.0)
    with pytest.raises(UnknownJobError):
        store.requeue("nope", by="ann", now=3.0)


def test_requeue_judges_the_jobs_dependencies_again(store: Store) -> None:
    store.submit([spec("a"), spec("b", "afterok:a")], now=1.0)
    run_to(store, "a", JobState.FAILED)
    b = store.get_job("b")
    assert b is not None and b.state is JobState.FAILED  # afterok:a can never hold
    with pytest.raises(JobControlError, match="afterok:a can never hold"):
        store.requeue("b", by="ann", now=8.0)
    store.requeue("a", by="ann", now=9.0)
    b = store.requeue("b", by="ann", now=10.0)
    assert b.state is JobState.QUEUED and b.held  # waits for a again
    assert queued_ids(store) == {"a"}
    run_to(store, "a", JobState.DONE, now=11.0)
    assert queued_ids(store) == {"b"}


def test_priority_after_submission(store: Store) -> None:
    store.submit([spec("a", priority=5), spec("d")], now=1.0)
    job = store.set_priority("a", 9, by="op", now=2.0)
    assert job.priority == 9
    assert {e.id: e.priority for e in store.queue_entries()}["a"] == 9
    assert store.set_priority("a", 2, by="sub", now=3.0, may_raise=False).priority == 2
    with pytest.raises(JobControlError, match="may only lower"):
        store.set_priority("a", 3, by="sub", now=4.0, may_raise=False)
    got = store.get_job("a")
    assert got is not None and got.priority == 2
    changes = [e.detail for e in store.events(job_id="a") if e.kind == "priority_changed"]
    assert changes == [{"by": "op", "from": 5, "to": 9}, {"by": "sub", "from": 9, "to": 2}]
    run_to(store, "d", JobState.DONE)
    with pytest.raises(JobControlError, match="only a queued job's priority"):
        store.set_priority("d", 1, by="op", now=9.0)
