"""SQLite group commit (``Store.batch``), the submit wake and ``terminal_count``."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import TransitionError
from gpuwarden.store.sqlite import SqliteStore


def spec(i: str) -> JobSpec:
    return JobSpec(id=i, type="echo.echo", params={"text": i})


def states_seen_by_another_connection(db: Path) -> dict[str, str]:
    with sqlite3.connect(db) as other:
        return dict(other.execute("SELECT id, state FROM jobs").fetchall())


def test_a_batch_commits_once_at_its_end_and_a_failing_write_undoes_only_itself(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.db"
    store = SqliteStore(db)
    store.submit([spec("a"), spec("b")], now=1.0)
    with store.batch():
        store.transition("a", JobState.CANCELLED, now=2.0, reason="x")
        with pytest.raises(TransitionError):  # done only from running: refused
            store.transition("b", JobState.DONE, now=2.0)
        store.transition("b", JobState.CANCELLED, now=2.0, reason="y")
        # this thread sees its own writes; another connection not yet
        assert store.get_job("a").state is JobState.CANCELLED  # type: ignore[union-attr]
        assert states_seen_by_another_connection(db) == {"a": "queued", "b": "queued"}
    assert states_seen_by_another_connection(db) == {"a": "cancelled", "b": "cancelled"}
    kinds = [(e.job_id, e.kind, e.to_state) for e in store.events() if e.kind == "transition"]
    assert kinds == [("a", "transition", "cancelled"), ("b", "transition", "cancelled")]


def test_commit_inside_a_batch_makes_its_writes_visible_at_once(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SqliteStore(db)
    store.submit([spec("a")], now=1.0)
    with store.batch():
        store.transition("a", JobState.CANCELLED, now=2.0)
        store.commit()
        assert states_seen_by_another_connection(db) == {"a": "cancelled"}


def test_a_block_that_raises_still_commits_the_writes_it_made(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    store = SqliteStore(db)
    store.submit([spec("a")], now=1.0)
    with pytest.raises(RuntimeError), store.batch():
        store.transition("a", JobState.CANCELLED, now=2.0)
        raise RuntimeError("a bug in the loop's step")
    assert states_seen_by_another_connection(db) == {"a": "cancelled"}


def test_another_thread_waits_for_the_batch_to_commit(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.submit([spec("a")], now=1.0)
    seen: list[JobState] = []
    with store.batch():
        store.transition("a", JobState.CANCELLED, now=2.0)
        reader = threading.Thread(target=lambda: seen.append(store.get_job("a").state))  # type: ignore[union-attr]
        reader.start()
        reader.join(0.2)  # blocked on the connection while the batch is open
        assert seen == []
    reader.join(10)
    assert seen == [JobState.CANCELLED]


def test_a_submit_in_another_process_store_wakes_the_listener(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    broker_side = SqliteStore(db)
    woken = threading.Event()
    broker_side.on_submit(woken.set)
    assert broker_side.wake_path.exists()
    client_side = SqliteStore(db)  # as `gpuwarden submit` opens it
    client_side.submit([spec("a")], now=1.0)
    assert woken.wait(10)
    woken.clear()
    client_side.request_cancel("a", now=2.0)
    assert woken.wait(10)
    broker_side.close()
    assert not broker_side.wake_path.exists()
    client_side.submit([spec("b")], now=3.0)  # nobody listening: no error
    client_side.close()


def test_terminal_count(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.submit([spec("a"), spec("b"), spec("c")], now=1.0)
    store.transition("a", JobState.CANCELLED, now=2.0)
    assert store.terminal_count(["a", "b", "c", "missing"]) == 1
    assert store.terminal_count([]) == 0


def test_queued_jobs_reuses_only_rows_that_did_not_change(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.submit([spec("a"), spec("b")], now=1.0)
    a1, b1 = store.queued_jobs()
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    store.transition("a", JobState.QUEUED, now=3.0, reason="retry")  # queued again
    a2, b2 = store.queued_jobs()
    assert b2 is b1  # the same row: the same Job, not decoded again
    assert a2 is not a1 and (a2.attempts, a2.updated_at) == (1, 3.0), a2
    assert [j.id for j in store.queued_jobs(limit=1)] == ["a"]
