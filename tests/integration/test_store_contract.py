"""The Store contract. Every backend runs this suite unchanged (see conftest.store)."""

from __future__ import annotations

import threading

import pytest

from gpuwarden.core.model import Event, JobSpec, Role
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError, UnknownJobError, UserError
from gpuwarden.store.base import (
    AuditRow,
    DuplicateBundleError,
    DuplicateJobError,
    DuplicateTokenError,
    GpuClear,
    IdempotencyConflict,
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


def test_live_jobs_of_type_are_every_queued_or_running_one_newest_first(store: Store) -> None:
    """However many newer live jobs of other types there are (the leases a status,
    the dashboard or GET /v1/leases lists were once looked for among the newest
    1,000 live jobs, and missed behind them)."""
    lease = {"type": "lease", "params": {}}
    store.submit([JobSpec(id="l1", **lease), JobSpec(id="l2", **lease)], now=1.0)  # type: ignore[arg-type]
    store.submit([spec(f"e{i}") for i in range(1200)], now=2.0)
    store.submit([JobSpec(id="l3", **lease)], now=3.0)  # type: ignore[arg-type]
    store.start_attempt("l2", node="n", gpu_uuid=None, now=4.0)
    store.request_cancel("l3", now=5.0)
    assert [j.id for j in store.live_jobs_of_type("lease")] == ["l2", "l1"]
    assert len(store.live_jobs_of_type("echo.echo")) == 1200
    assert store.live_jobs_of_type("nope") == []


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
    store.request_gpu_clear("GPU-a", now=1.0, by="local:ann", reason="reseated the card")
    store.request_gpu_clear("GPU-b", now=2.0)
    assert store.take_gpu_clears(now=3.0) == [
        GpuClear("GPU-a", "local:ann", "reseated the card"),
        GpuClear("GPU-b", "", ""),
    ]
    assert store.take_gpu_clears(now=4.0) == []
    assert [e.detail["gpu"] for e in store.events() if e.kind == "gpu_clear_requested"] == [
        "GPU-a",
        "GPU-b",
    ]


def test_a_gpu_fault_latch_is_kept_until_cleared_with_who_and_why(store: Store) -> None:
    assert store.gpu_faults() == []
    assert store.latch_gpu_fault(node="n1", gpu_uuid="GPU-a", xid=79, reason="Xid 79", now=1.0)
    # one open latch per node and GPU: a second is refused, another node's is its own
    assert not store.latch_gpu_fault(node="n1", gpu_uuid="GPU-a", xid=48, reason="x", now=2.0)
    assert store.latch_gpu_fault(node="n2", gpu_uuid="GPU-a", xid=48, reason="Xid 48", now=2.0)
    (opened,) = store.gpu_faults(node="n1", open_only=True)
    assert (opened.gpu_uuid, opened.xid, opened.latched_at, opened.cleared_at) == (
        "GPU-a",
        79,
        1.0,
        None,
    )
    assert store.clear_gpu_fault(
        node="n1", gpu_uuid="GPU-a", now=5.0, by="local:ann", reason="reseated the card"
    )
    assert not store.clear_gpu_fault(node="n1", gpu_uuid="GPU-a", now=6.0, by="x", reason="y")
    assert store.gpu_faults(node="n1", open_only=True) == []
    (closed,) = store.gpu_faults(node="n1", gpu_uuid="GPU-a")
    assert (closed.cleared_at, closed.cleared_by, closed.clear_reason) == (
        5.0,
        "local:ann",
        "reseated the card",
    )
    # the history is kept: a new latch on the same GPU is a new row
    assert store.latch_gpu_fault(node="n1", gpu_uuid="GPU-a", xid=94, reason="Xid 94", now=7.0)
    assert [(f.xid, f.cleared_at is None) for f in store.gpu_faults(node="n1")] == [
        (79, False),
        (94, True),
    ]
    assert [f.node for f in store.gpu_faults(open_only=True)] == ["n2", "n1"]


def test_a_gpu_fault_latch_shares_the_commit_of_its_batch(store: Store) -> None:
    with store.batch():
        store.latch_gpu_fault(node="n1", gpu_uuid="GPU-a", xid=79, reason="Xid 79", now=1.0)
        store.add_event(Event(ts=1.0, kind="gpu_fault", detail={"gpu": "GPU-a"}))
    assert [f.gpu_uuid for f in store.gpu_faults(open_only=True)] == ["GPU-a"]
    assert "gpu_fault" in [e.kind for e in store.events()]


# -- the HTTP API's needs: owners, tokens, audit, idempotency -----------------------


def test_jobs_have_an_owner_and_list_filters_by_it(store: Store) -> None:
    store.submit([spec("mine1")], now=1.0, origin=Submission(owner="aaaaaaaaaaaa"))
    store.submit([spec("theirs")], now=2.0, origin=Submission(owner="bbbbbbbbbbbb"))
    store.submit([spec("local")], now=3.0)
    store.submit([spec("mine2")], now=4.0, origin=Submission(owner="aaaaaaaaaaaa"))
    assert store.get_job("mine1").owner == "aaaaaaaaaaaa"  # type: ignore[union-attr]
    assert store.get_job("local").owner is None  # type: ignore[union-attr]
    assert [j.id for j in store.list_jobs(owner="aaaaaaaaaaaa")] == ["mine2", "mine1"]
    assert [j.id for j in store.list_jobs(owner="aaaaaaaaaaaa", limit=1)] == ["mine2"]
    assert [j.id for j in store.list_jobs()] == ["mine2", "local", "theirs", "mine1"]
    store.request_cancel("mine1", now=5.0)
    cancelled = frozenset({JobState.CANCELLED})
    assert [j.id for j in store.list_jobs(owner="aaaaaaaaaaaa", states=cancelled)] == ["mine1"]
    assert store.list_jobs(owner="bbbbbbbbbbbb", states=cancelled) == []
    assert store.list_jobs(owner="cccccccccccc") == []


def test_tokens_create_get_list_revoke(store: Store) -> None:
    assert store.list_tokens() == [] and store.get_token("0123456789ab") is None
    t = store.create_token(
        token_id="0123456789ab",
        name="admin",
        role=Role.OWNER,
        secret_hash="a" * 64,
        now=10.0,
        created_by="local",
    )
    assert (t.id, t.name, t.role, t.secret_hash, t.created_at) == (
        "0123456789ab",
        "admin",
        Role.OWNER,
        "a" * 64,
        10.0,
    )
    assert t.created_by == "local" and t.revoked_at is None and t.expires_at is None
    assert t.active(11.0)
    node = store.create_token(
        token_id="ba9876543210",
        name="gpu-host-1",
        role=Role.NODE,
        secret_hash="b" * 64,
        now=11.0,
        created_by="0123456789ab",
        expires_at=100.0,
        node="gpu-host-1",
    )
    assert node.node == "gpu-host-1" and node.expires_at == 100.0
    assert node.active(99.0) and not node.active(100.0)
    assert store.get_token("ba9876543210") == node
    assert [x.id for x in store.list_tokens()] == ["0123456789ab", "ba9876543210"]
    with pytest.raises(DuplicateTokenError):
        store.create_token(
            token_id="0123456789ab",
            name="again",
            role=Role.SUBMITTER,
            secret_hash="c" * 64,
            now=12.0,
            created_by="local",
        )
    assert store.revoke_token("0123456789ab", now=20.0)
    assert not store.revoke_token("0123456789ab", now=21.0)  # once
    assert not store.revoke_token("ffffffffffff", now=21.0)  # no such token
    revoked = store.get_token("0123456789ab")
    assert revoked is not None and revoked.revoked_at == 20.0 and not revoked.active(21.0)
    assert len(store.list_tokens()) == 2  # revoked tokens stay listed


@pytest.mark.parametrize("role", list(Role))
def test_every_role_can_be_stored(store: Store, role: Role) -> None:
    t = store.create_token(
        token_id="00000000000" + "1",
        name=role.value,
        role=role,
        secret_hash="d" * 64,
        now=1.0,
        created_by="local",
    )
    got = store.get_token(t.id)
    assert got is not None and got.role is role


def test_audit_rows_append_and_page(store: Store) -> None:
    assert store.audit_rows() == []
    first = store.add_audit(
        AuditRow(
            ts=1.0,
            actor="local",
            actor_name="root",
            role="local",
            action="token.create",
            target="0123456789ab",
            detail={"name": "admin", "role": "owner"},
        )
    )
    second = store.add_audit(
        AuditRow(
            ts=2.0,
            actor="0123456789ab",
            actor_name="admin",
            role="owner",
            action="job.submit",
            target="j1",
            outcome="refused: unknown job type 'x.y'",
        )
    )
    assert first.id is not None and second.id is not None and second.id > first.id
    rows = store.audit_rows()
    assert rows == [first, second]
    assert rows[0].detail == {"name": "admin", "role": "owner"} and rows[0].outcome == "ok"
    assert rows[1].outcome.startswith("refused:") and rows[1].detail == {}
    assert store.audit_rows(after_id=first.id) == [second]
    assert store.audit_rows(limit=1) == [first]
    assert store.audit_rows(after_id=second.id) == []


def test_idempotent_submit_returns_the_first_jobs(store: Store) -> None:
    key = ("0123456789ab", "key-1", "hash-1")
    first = store.submit([spec("a"), spec("b")], now=1.0, idempotency=key)
    again = store.submit([spec("a"), spec("b")], now=2.0, idempotency=key)
    assert [j.id for j in again] == ["a", "b"]
    assert [j.submitted_at for j in again] == [1.0, 1.0]
    assert again == first
    # the replay may even carry other (generated) ids: the key decides, not the ids
    again2 = store.submit([spec("other")], now=3.0, idempotency=key)
    assert [j.id for j in again2] == ["a", "b"] and store.get_job("other") is None
    assert len(store.list_jobs()) == 2
    rec = store.idempotency_record("0123456789ab", "key-1")
    assert rec is not None and rec.job_ids == ("a", "b") and rec.body_hash == "hash-1"
    assert rec.created_at == 1.0
    assert store.idempotency_record("0123456789ab", "key-2") is None
    assert store.idempotency_record("ba9876543210", "key-1") is None


def test_idempotency_key_with_another_body_is_a_conflict(store: Store) -> None:
    store.submit([spec("a")], now=1.0, idempotency=("0123456789ab", "k", "h1"))
    with pytest.raises(IdempotencyConflict, match="different"):
        store.submit([spec("b")], now=2.0, idempotency=("0123456789ab", "k", "h2"))
    assert store.get_job("b") is None
    # another token's key of the same name is its own
    jobs = store.submit([spec("c")], now=3.0, idempotency=("ba9876543210", "k", "h2"))
    assert [j.id for j in jobs] == ["c"]
    assert isinstance(IdempotencyConflict("x"), UserError)


def test_failed_submit_records_no_idempotency_key(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    with pytest.raises(DuplicateJobError):
        store.submit([spec("a")], now=2.0, idempotency=("0123456789ab", "k", "h"))
    assert store.idempotency_record("0123456789ab", "k") is None
    jobs = store.submit([spec("b")], now=3.0, idempotency=("0123456789ab", "k", "h"))
    assert [j.id for j in jobs] == ["b"]


def test_constraints_round_trip(store: Store) -> None:
    want = {"min_gpu_vram_gib": 40.5, "gpu_model": "H100", "labels": {"rack": "a"}, "node": "n1"}
    [job] = store.submit([spec("c", constraints=want), spec("plain")], now=1.0)[:1]
    assert job.constraints == want
    got = store.get_job("c")
    assert got is not None and got.constraints == want
    plain = store.get_job("plain")
    assert plain is not None and plain.constraints == {}
    listed = {j.id: j.constraints for j in store.list_jobs()}
    assert listed == {"c": want, "plain": {}}
    assert {j.id: j.constraints for j in store.queued_jobs()} == listed


def test_unavailable_is_false_for_what_the_store_refused(store: Store) -> None:
    store.submit([spec("u")], now=1.0)
    with pytest.raises(TransitionError) as refused:
        store.transition("u", JobState.DONE, now=2.0)
    assert store.unavailable(refused.value) is False
    with pytest.raises(UnknownJobError) as unknown:
        store.request_cancel("nobody", now=2.0)
    assert store.unavailable(unknown.value) is False
    assert store.unavailable(ValueError("a bug")) is False


def test_queue_entries_and_count_are_the_queued_jobs_only(store: Store) -> None:
    store.submit(
        [
            JobSpec("a", "t.x", priority=5),
            JobSpec("b", "t.x", vram_bytes=3 * 2**30),
            JobSpec("c", "t.y"),
            JobSpec("d", "t.y"),
        ],
        now=1.0,
    )
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    store.request_cancel("c", now=3.0)
    assert store.queued_count() == 2
    entries = {e.id: e for e in store.queue_entries()}
    assert set(entries) == {"b", "d"}
    b = entries["b"]
    assert (b.type, b.priority, b.vram_bytes, b.cancel_requested) == ("t.x", 0, 3 * 2**30, False)
    assert entries["d"].vram_bytes is None and entries["d"].seq > b.seq
    # by id: only those that are queued now
    assert [e.id for e in store.queue_entries(["a", "c", "d", "nope"])] == ["d"]
