"""The Store contract. Every backend runs this suite unchanged (see conftest.store)."""

from __future__ import annotations

import threading

import pytest

from gpuwarden.core.model import Event, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError, UnknownJobError, UserError
from gpuwarden.store.base import (
    DuplicateBundleError,
    DuplicateJobError,
    NodeStatus,
    Store,
    Submission,
)


def spec(i: str, **kw: object) -> JobSpec:
    return JobSpec(id=i, type="echo.echo", params={"text": i}, **kw)  # type: ignore[arg-type]


def test_submit_inserts_queued_jobs_with_events(store: Store) -> None:
    jobs = store.submit([spec("a"), spec("b", priority=3)], now=10.0)
    assert [j.id for j in jobs] == ["a", "b"]
    assert all(j.state is JobState.QUEUED for j in jobs)
    assert jobs[0].seq < jobs[1].seq
    assert jobs[1].priority == 3
    got = store.get_job("a")
    assert got is not None and got.params == {"text": "a"} and got.submitted_at == 10.0
    kinds = [(e.job_id, e.kind, e.to_state) for e in store.events()]
    assert kinds == [("a", "submitted", "queued"), ("b", "submitted", "queued")]


def test_submit_is_all_or_nothing_on_duplicate_id(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    with pytest.raises(DuplicateJobError) as info:
        store.submit([spec("new"), spec("a")], now=2.0)
    assert info.value.ids == ("a",)
    assert "already accepted" in info.value.message
    assert store.get_job("new") is None
    assert len(store.list_jobs()) == 1


def test_same_id_twice_in_one_submission_refused(store: Store) -> None:
    with pytest.raises(UserError, match="twice"):
        store.submit([spec("x"), spec("x")], now=1.0)
    assert store.get_job("x") is None


def test_bundle_recorded_once(store: Store) -> None:
    origin = Submission(input_dir="/in", queue_root="/q", bundle="b1.zip")
    store.submit([spec("a"), spec("b")], now=1.0, origin=origin)
    rec = store.get_bundle("/q", "b1.zip")
    assert rec is not None and rec.job_ids == ("a", "b") and rec.finished_at is None
    assert [b.name for b in store.open_bundles()] == ["b1.zip"]
    with pytest.raises(DuplicateBundleError):
        store.submit([spec("c")], now=2.0, origin=origin)
    assert store.get_job("c") is None
    job = store.get_job("a")
    assert job is not None and job.bundle == "b1.zip" and job.input_dir == "/in"
    store.finish_bundle("/q", "b1.zip", now=3.0, outcome="done", result_path="/q/outbox/b1.zip")
    assert store.open_bundles() == []
    rec = store.get_bundle("/q", "b1.zip")
    assert rec is not None and rec.outcome == "done" and rec.finished_at == 3.0


def test_rejected_bundle_recorded_with_event(store: Store) -> None:
    store.record_rejected_bundle("/q", "bad.zip", now=5.0, reason="corrupt", result_path="/r")
    rec = store.get_bundle("/q", "bad.zip")
    assert rec is not None and rec.outcome == "rejected" and rec.job_ids == ()
    assert store.open_bundles() == []
    ev = store.events()[-1]
    assert ev.kind == "bundle_rejected" and ev.detail["reason"] == "corrupt"


def test_queued_order_priority_then_arrival(store: Store) -> None:
    store.submit([spec("low1")], now=1.0)
    store.submit([spec("high", priority=5)], now=2.0)
    store.submit([spec("low2")], now=3.0)
    assert [j.id for j in store.queued_jobs()] == ["high", "low1", "low2"]


def test_attempt_lifecycle(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    job, attempt = store.start_attempt("a", node="n1", gpu_uuid="GPU-1", now=2.0)
    assert job.state is JobState.RUNNING and job.attempts == 1
    assert attempt.number == 1 and attempt.gpu_uuid == "GPU-1"
    store.set_attempt_pid("a", 1, 4242)
    done = store.finish_attempt(
        "a",
        1,
        target=JobState.DONE,
        now=3.0,
        outcome="succeeded",
        reason="done",
        exit_code=0,
        stdout="out",
        stderr="err",
        result={"message": "hi"},
    )
    assert done.state is JobState.DONE and done.exit_code == 0 and done.result == {"message": "hi"}
    [a] = store.attempts("a")
    assert (a.ended_at, a.exit_code, a.stdout, a.stderr, a.pid) == (3.0, 0, "out", "err", 4242)
    changes = [(e.from_state, e.to_state) for e in store.events(job_id="a") if e.to_state]
    assert changes == [(None, "queued"), ("queued", "running"), ("running", "done")]


def test_retry_numbers_attempts_and_refuses_stale_reports(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    store.finish_attempt(
        "a", 1, target=JobState.QUEUED, now=3.0, outcome="launch_error", reason="retry"
    )
    job, second = store.start_attempt("a", node="n", gpu_uuid=None, now=4.0)
    assert second.number == 2 and job.attempts == 2
    # a late report from attempt 1 is refused and changes nothing
    with pytest.raises(TransitionError, match="not the current"):
        store.finish_attempt("a", 1, target=JobState.DONE, now=5.0, outcome="x", reason="late")
    assert store.get_job("a").state is JobState.RUNNING  # type: ignore[union-attr]
    store.finish_attempt("a", 2, target=JobState.DONE, now=6.0, outcome="succeeded", reason="ok")
    # a repeated report of the finished attempt is refused too: one result per job
    with pytest.raises(TransitionError):
        store.finish_attempt("a", 2, target=JobState.FAILED, now=7.0, outcome="x", reason="again")
    job2 = store.get_job("a")
    assert job2 is not None and job2.state is JobState.DONE and job2.reason == "ok"
    assert [a.number for a in store.attempts("a")] == [1, 2]


@pytest.mark.parametrize("terminal", [JobState.DONE, JobState.FAILED, JobState.CANCELLED])
def test_transition_guards(store: Store, terminal: JobState) -> None:
    store.submit([spec("a")], now=1.0)
    with pytest.raises(TransitionError):
        store.transition("a", JobState.DONE, now=2.0)  # queued -> done is forbidden
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    store.transition("a", terminal, now=3.0, reason="r")
    for target in JobState:
        with pytest.raises(TransitionError):
            store.transition("a", target, now=4.0)
    job = store.get_job("a")
    assert job is not None and job.state is terminal and job.updated_at == 3.0
    with pytest.raises(UnknownJobError):
        store.transition("missing", JobState.FAILED, now=1.0)


def test_failed_before_running(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    job = store.transition("a", JobState.FAILED, now=2.0, reason="type removed")
    assert job.state is JobState.FAILED and job.reason == "type removed"
    ev = store.events(job_id="a")[-1]
    assert (ev.from_state, ev.to_state, ev.detail["reason"]) == ("queued", "failed", "type removed")


def test_cancel_queued_and_running(store: Store) -> None:
    store.submit([spec("q"), spec("r")], now=1.0)
    assert store.request_cancel("q", now=2.0).state is JobState.CANCELLED
    store.start_attempt("r", node="n", gpu_uuid=None, now=2.0)
    marked = store.request_cancel("r", now=3.0)
    assert marked.state is JobState.RUNNING and marked.cancel_requested
    with pytest.raises(UserError, match="already ended"):
        store.request_cancel("q", now=4.0)
    with pytest.raises(UnknownJobError):
        store.request_cancel("nope", now=4.0)
    final = store.finish_attempt(
        "r", 1, target=JobState.CANCELLED, now=5.0, outcome="cancelled", reason="stopped"
    )
    assert final.state is JobState.CANCELLED and not final.cancel_requested


def test_cancel_request_blocks_start(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    store.request_cancel("a", now=3.0)
    # even if the attempt is retried, a cancelled job never runs again
    store.finish_attempt("a", 1, target=JobState.QUEUED, now=4.0, outcome="x", reason="retry")
    with pytest.raises(TransitionError, match="cancel"):
        store.start_attempt("a", node="n", gpu_uuid=None, now=5.0)


def test_list_and_count(store: Store) -> None:
    store.submit([spec("a"), spec("b"), spec("c")], now=1.0)
    store.request_cancel("b", now=2.0)
    assert [j.id for j in store.list_jobs()] == ["c", "b", "a"]
    assert [j.id for j in store.list_jobs(limit=1)] == ["c"]
    assert [j.id for j in store.list_jobs(states=frozenset({JobState.CANCELLED}))] == ["b"]
    assert store.count_by_state() == {JobState.QUEUED: 2, JobState.CANCELLED: 1}
    store.start_attempt("a", node="n", gpu_uuid=None, now=3.0)
    assert [j.id for j in store.running_jobs()] == ["a"]


def test_events_cursor_and_free_events(store: Store) -> None:
    assert store.last_event_id() == 0
    store.submit([spec("a")], now=1.0)
    first = store.last_event_id()
    ev = store.add_event(Event(ts=2.0, kind="loop_error", detail={"where": "x"}))
    assert ev.id is not None and ev.id > first
    assert [e.kind for e in store.events(after_id=first)] == ["loop_error"]
    assert store.events(after_id=store.last_event_id()) == []
    assert [e.kind for e in store.events(limit=1)] == ["submitted"]


def test_node_status_upsert(store: Store) -> None:
    store.put_node_status(NodeStatus(node="n", pid=1, updated_at=1.0, payload={"a": 1}))
    store.put_node_status(NodeStatus(node="n", pid=2, updated_at=2.0, payload={"a": 2}))
    [s] = store.node_statuses()
    assert (s.pid, s.updated_at, s.payload) == (2, 2.0, {"a": 2})


def test_concurrent_starts_run_a_job_once(store: Store) -> None:
    """Two writers racing to start the same job: exactly one wins."""
    store.submit([spec("a")], now=1.0)
    wins: list[int] = []
    losses: list[int] = []
    barrier = threading.Barrier(4)

    def race(i: int) -> None:
        barrier.wait()
        try:
            store.start_attempt("a", node=f"n{i}", gpu_uuid=None, now=2.0)
            wins.append(i)
        except TransitionError:
            losses.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 3
    assert len(store.attempts("a")) == 1


def test_footprints_only_ever_rise(store: Store) -> None:
    assert store.footprints() == {}
    assert store.raise_footprint("burn.llm", 10 * 2**30, now=1.0, job_id="a")
    assert not store.raise_footprint("burn.llm", 8 * 2**30, now=2.0, job_id="b")  # never lower
    assert not store.raise_footprint("burn.llm", 10 * 2**30, now=3.0, job_id="c")  # not higher
    assert store.raise_footprint("burn.llm", 12 * 2**30, now=4.0, job_id="d")
    fp = store.footprints()["burn.llm"]
    assert (fp.bytes, fp.job_id, fp.updated_at) == (12 * 2**30, "d", 4.0)
    raised = [e for e in store.events() if e.kind == "footprint_raised"]
    assert [e.detail["previous_bytes"] for e in raised] == [None, 10 * 2**30]


def test_recent_run_times_are_succeeded_attempts_newest_first(store: Store) -> None:
    store.submit([spec("a"), spec("b"), spec("c")], now=0.0)
    for i, (job, outcome) in enumerate(
        [("a", "succeeded"), ("b", "job_failed"), ("c", "succeeded")]
    ):
        store.start_attempt(job, node="n", gpu_uuid=None, now=10.0 * i)
        target = JobState.DONE if outcome == "succeeded" else JobState.FAILED
        store.finish_attempt(
            job, 1, target=target, now=10.0 * i + 2 + i, outcome=outcome, reason=""
        )
    assert store.recent_run_times() == [("echo.echo", 4.0), ("echo.echo", 2.0)]
    assert store.recent_run_times(limit=1) == [("echo.echo", 4.0)]


def test_quarantine_is_terminal_and_only_from_running(store: Store) -> None:
    store.submit([spec("q")], now=1.0)
    with pytest.raises(TransitionError):
        store.transition("q", JobState.QUARANTINED, now=2.0)
    store.start_attempt("q", node="n", gpu_uuid=None, now=2.0)
    job = store.finish_attempt(
        "q", 1, target=JobState.QUARANTINED, now=3.0, outcome="launch_error", reason="gave up"
    )
    assert job.state is JobState.QUARANTINED and job.state.terminal
    assert store.count_by_state() == {JobState.QUARANTINED: 1}


def test_gpu_clear_requests_are_taken_once(store: Store) -> None:
    assert store.take_gpu_clears(now=1.0) == []
    store.request_gpu_clear("GPU-a", now=1.0)
    store.request_gpu_clear("GPU-b", now=2.0)
    assert store.take_gpu_clears(now=3.0) == ["GPU-a", "GPU-b"]
    assert store.take_gpu_clears(now=4.0) == []
    assert [e.detail["gpu"] for e in store.events() if e.kind == "gpu_clear_requested"] == [
        "GPU-a",
        "GPU-b",
    ]
