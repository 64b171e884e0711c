"""Job dependencies in the store, on every backend (see conftest.store): the edges,
the held flag, the cascade in the transaction of a job's end, the refusals."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.core.dependencies import Dependency, DependencyError, DepKind, Standing, standing
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError
from gpuwarden.store.base import Store
from gpuwarden.store.cluster import ClusterStore
from gpuwarden.store.sqlite import SqliteStore


def spec(i: str, *after: str) -> JobSpec:
    return JobSpec(id=i, type="echo.echo", params={"text": i}, after=tuple(after))


def state(store: Store, job_id: str) -> JobState:
    job = store.get_job(job_id)
    assert job is not None
    return job.state


def end(store: Store, job_id: str, target: JobState, *, now: float = 5.0) -> None:
    """Run the job's attempt and end it as ``target``. A start that finds the job's
    row locked by another writer (on PostgreSQL, a submission naming it locks it)
    is tried again, as a broker's next pass would."""
    for _ in range(200):
        try:
            store.start_attempt(job_id, node="n", gpu_uuid=None, now=now)
            break
        except TransitionError as exc:
            if "being changed by another writer" not in str(exc):
                raise
            time.sleep(0.01)
    else:
        raise AssertionError(f"{job_id} stayed locked by another writer")
    store.finish_attempt(
        job_id, 1, target=target, now=now + 1, outcome="x", reason=f"it {target.value}"
    )


def test_a_dependent_is_held_out_of_the_queue_until_its_dependency_holds(store: Store) -> None:
    store.submit([spec("a")], now=1.0)
    [b] = store.submit([spec("b", "afterok:a")], now=2.0)
    assert b.state is JobState.QUEUED and b.held and b.after == ("afterok:a",)
    assert {e.id for e in store.queue_entries()} == {"a"}
    assert store.queue_entries(["b"]) == []
    assert store.queued_count() == 1
    assert store.dependencies("b") == [(Dependency(DepKind.AFTEROK, "a"), JobState.QUEUED)]
    with pytest.raises(TransitionError, match="waits for its dependencies"):
        store.start_attempt("b", node="n", gpu_uuid=None, now=3.0)
    end(store, "a", JobState.DONE)
    got = store.get_job("b")
    assert got is not None and got.state is JobState.QUEUED and not got.held
    assert {e.id for e in store.queue_entries()} == {"b"}
    held = [e for e in store.events(job_id="b") if e.kind == "dependencies_held"]
    assert len(held) == 1


def test_a_failure_cascades_down_the_chain_each_with_its_reason(store: Store) -> None:
    store.submit(
        [
            spec("s1"),
            spec("s2", "afterok:s1"),
            spec("s3", "afterok:s2"),
            spec("s4", "afternotok:s2"),
            spec("s5", "afterok:s3"),
            spec("s6", "afterany:s3"),
        ],
        now=1.0,
    )
    end(store, "s1", JobState.DONE)
    assert not store.get_job("s2").held  # type: ignore[union-attr]
    end(store, "s2", JobState.FAILED, now=10.0)
    s3, s4, s5, s6 = (store.get_job(i) for i in ("s3", "s4", "s5", "s6"))
    assert s3 is not None and s3.state is JobState.FAILED
    assert s3.reason == "dependency afterok:s2 can never hold: s2 failed"
    assert s5 is not None and s5.state is JobState.FAILED
    assert s5.reason == "dependency afterok:s3 can never hold: s3 failed"
    assert s4 is not None and s4.state is JobState.QUEUED and not s4.held
    assert s6 is not None and s6.state is JobState.QUEUED and not s6.held
    assert {e.id for e in store.queue_entries()} == {"s4", "s6"}


def test_cancel_and_quarantine_are_not_ok(store: Store) -> None:
    store.submit([spec("a"), spec("b", "afterok:a"), spec("c", "afternotok:a")], now=1.0)
    store.request_cancel("a", now=2.0)
    assert state(store, "b") is JobState.FAILED
    assert store.get_job("b").reason == (  # type: ignore[union-attr]
        "dependency afterok:a can never hold: a cancelled"
    )
    assert not store.get_job("c").held  # type: ignore[union-attr]
    # cancelling a held job is an end too
    store.submit([spec("d"), spec("e", "afterany:d"), spec("f", "afterok:e")], now=3.0)
    store.request_cancel("e", now=4.0)
    assert state(store, "f") is JobState.FAILED


def test_a_dependency_that_ended_before_the_submit(store: Store) -> None:
    store.submit([spec("ok"), spec("bad")], now=1.0)
    end(store, "ok", JobState.DONE)
    end(store, "bad", JobState.FAILED)
    jobs = store.submit(
        [spec("x", "afterok:ok"), spec("y", "afterok:bad"), spec("z", "afterok:y")], now=9.0
    )
    x, y, z = jobs
    assert x.state is JobState.QUEUED and not x.held
    assert y.state is JobState.FAILED and y.reason.endswith("bad failed")
    assert (
        z.state is JobState.FAILED and z.reason == "dependency afterok:y can never hold: y failed"
    )


@pytest.mark.parametrize(
    ("specs", "says"),
    [
        ([spec("a", "afterok:ghost")], "no job with id ghost"),
        ([spec("a", "afterok:b"), spec("b", "afterany:a")], "cycle"),
        ([spec("a", "afterok:a")], "itself"),
        ([spec("a", "after:b")], "unknown kind"),
        ([spec("a", "afterok:b", "afterok:b")], "twice"),
    ],
)
def test_refused_at_submission_nothing_stored(
    store: Store, specs: list[JobSpec], says: str
) -> None:
    if len(specs) == 1:
        store.submit([spec("b")], now=0.5)
    before = len(store.list_jobs())
    with pytest.raises(DependencyError, match=says):
        store.submit(specs, now=1.0)
    assert len(store.list_jobs()) == before
    assert store.get_job("a") is None


def test_settle_dependencies_rechecks_held_jobs(store: Store) -> None:
    """A restart's net: a held job whose dependency ended (here, by a write that went
    around the cascade) is released or failed by settle_dependencies."""
    store.submit([spec("a"), spec("b", "afterok:a"), spec("c", "afternotok:a")], now=1.0)
    assert store.settle_dependencies(now=2.0) == 0
    end(store, "a", JobState.DONE)
    assert store.settle_dependencies(now=9.0) == 0  # the end did it already
    assert state(store, "c") is JobState.FAILED
    assert not store.get_job("b").held  # type: ignore[union-attr]


def test_the_claim_path_skips_held_jobs(store: Store) -> None:
    assert isinstance(store, ClusterStore)
    store.submit([spec("a"), spec("b", "afterok:a")], now=1.0)
    claimable = [c.id for c in store.claimable_jobs(now=2.0, limit=10)]
    assert claimable == ["a"]
    leased = store.lease_jobs("n1", ["a", "b"], lease_id="L", expires_at=100.0, now=2.0)
    assert leased == ["a"]


# -- a property, on the real store ----------------------------------------------

ENDS = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


@st.composite
def pipelines(draw: st.DrawFn) -> list[tuple[list[str], JobState]]:
    """Jobs j0..jn, each naming earlier ones, and how each ends if it runs."""
    n = draw(st.integers(1, 8))
    out: list[tuple[list[str], JobState]] = []
    for i in range(n):
        targets = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        kinds = [draw(st.sampled_from(list(DepKind))) for _ in targets]
        out.append(
            (
                [f"{k.value}:j{t}" for k, t in zip(kinds, targets, strict=True)],
                draw(st.sampled_from(ENDS)),
            )
        )
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(), st.booleans())
def test_on_the_store_nothing_is_claimable_before_its_conditions_and_all_ends(
    pipeline: list[tuple[list[str], JobState]], one_submission: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "s.db")
        try:
            specs = [spec(f"j{i}", *after) for i, (after, _) in enumerate(pipeline)]
            if one_submission:
                store.submit(specs, now=1.0)
            else:
                for s in specs:
                    store.submit([s], now=1.0)
            now = 2.0
            while entries := store.queue_entries():
                for entry in sorted(entries, key=lambda e: e.seq):
                    for dep, dep_state in store.dependencies(entry.id):
                        assert standing(dep, dep_state) is Standing.HOLDS  # the property
                i = int(min(entries, key=lambda e: e.seq).id[1:])
                target = pipeline[i][1]
                if target is JobState.CANCELLED:
                    store.request_cancel(f"j{i}", now=now)
                else:
                    end(store, f"j{i}", target, now=now)
                now += 2.0
            for i in range(len(pipeline)):  # nothing is left waiting
                job = store.get_job(f"j{i}")
                assert job is not None and job.state.terminal and not job.held
                if job.attempts == 0 and job.state is JobState.FAILED:
                    assert "can never hold" in job.reason
        finally:
            store.close()


def test_a_dependent_submitted_while_its_dependency_ends_is_never_left_held(
    store: Store,
) -> None:
    """Submitting ``afterok:X`` races X's end on another connection: the submission
    locks X's row, so either it sees X ended, or X's end sees the dependent. No
    dependent is left held on an ended dependency."""
    n = 25
    store.submit([spec(f"r{i}") for i in range(n)], now=1.0)
    errors: list[BaseException] = []

    def ender() -> None:
        try:
            for i in range(n):
                end(store, f"r{i}", JobState.DONE, now=2.0 + i)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def submitter() -> None:
        try:
            for i in range(n):
                store.submit([spec(f"d{i}", f"afterok:r{i}")], now=2.0 + i)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ender), threading.Thread(target=submitter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(n):
        d = store.get_job(f"d{i}")
        assert d is not None and d.state is JobState.QUEUED and not d.held, d
    assert {e.id for e in store.queue_entries()} == {f"d{i}" for i in range(n)}
