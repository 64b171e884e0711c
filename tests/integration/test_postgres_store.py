"""PostgreSQL-specific checks: migrations under concurrent opens, several stores
(brokers) racing for one job, SKIP LOCKED, log ids in commit order, connection
errors, and the ``database`` config key. The Store contract itself runs in
test_store_contract.py on both backends."""

from __future__ import annotations

import math
import multiprocessing
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from gpuwarden.app import open_store
from gpuwarden.config import Config, load_config
from gpuwarden.core.model import Event, JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.errors import ConfigError, TransitionError
from gpuwarden.store.base import DuplicateJobError, Submission
from gpuwarden.store.postgres import PostgresStore, redact_url
from gpuwarden.store.queries import load_migrations, load_queries

LATEST = max(v for v, _, _ in load_migrations("postgres"))


def spec(i: str, **kw: Any) -> JobSpec:
    return JobSpec(id=i, type="echo.echo", params={"text": i}, **kw)


@pytest.fixture
def open_pg(pg_url: str, pg_schema: str) -> Iterator[Callable[[], PostgresStore]]:
    """Opens stores on one fresh schema (as several processes would) and closes them."""
    opened: list[PostgresStore] = []
    lock = threading.Lock()

    def make() -> PostgresStore:
        s = PostgresStore(pg_url, schema=pg_schema, max_size=4)
        with lock:
            opened.append(s)
        return s

    try:
        yield make
    finally:
        for s in opened:
            s.close()


def _raw(pg_url: str, schema: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(pg_url)
    conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
    conn.commit()
    return conn


# -- migrations -------------------------------------------------------------------


def test_migrations_recorded_and_idempotent(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    store = open_pg()
    assert store.schema_version() == LATEST
    assert store.migrate() == []
    assert open_pg().migrate() == []  # a second open applies nothing either
    with _raw(pg_url, pg_schema) as conn:
        rows = conn.execute("SELECT version, name FROM schema_migrations ORDER BY version")
        assert [(v, n) for v, n in rows] == [(v, n) for v, n, _ in load_migrations("postgres")]
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                [pg_schema],
            )
        }
    assert {"jobs", "attempts", "events", "bundles", "node_status", "footprints"} <= tables


def test_same_versions_as_sqlite() -> None:
    """Each SQLite migration has its PostgreSQL twin under the same number."""
    assert [v for v, _, _ in load_migrations("postgres")] == [
        v for v, _, _ in load_migrations("sqlite")
    ]


def test_concurrent_opens_of_a_fresh_schema_migrate_once(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    n = 6
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    applied: list[list[int]] = []

    def opener() -> None:
        barrier.wait()
        try:
            s = open_pg()
            applied.append(s.migrate())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert applied == [[]] * n  # every open found the schema complete afterwards
    with _raw(pg_url, pg_schema) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations")]
    assert sorted(versions) == [v for v, _, _ in load_migrations("postgres")]


def test_migrating_an_older_schema_keeps_its_jobs(pg_url: str, pg_schema: str) -> None:
    """A schema made by an earlier version (migrations 1 to 3) is migrated on open
    and keeps its rows."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(pg_schema)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(pg_schema)))
        conn.execute(
            "CREATE TABLE schema_migrations (version BIGINT PRIMARY KEY, name TEXT NOT NULL,"
            " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        for version, name, script in load_migrations("postgres")[:3]:
            conn.execute(script)  # type: ignore[arg-type]
            conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", [version, name]
            )
        conn.execute(
            "INSERT INTO jobs (id, type, state, params, inputs, outputs, spec_hash,"
            " submitted_at, updated_at) VALUES ('old', 'echo.echo', 'done', '{}', '[]', '[]',"
            " 'h', 1.0, 2.0)"
        )
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        assert store.schema_version() == LATEST
        job = store.get_job("old")
        assert job is not None and job.state is JobState.DONE
        [new] = store.submit([spec("new")], now=3.0)
        assert new.seq > job.seq  # the identity goes on past the old rows
    finally:
        store.close()


def test_every_named_query_parses(open_pg: Callable[[], PostgresStore], pg_url: str) -> None:
    store = open_pg()
    assert store.schema is not None
    with _raw(pg_url, store.schema) as conn:
        for name, query in load_queries("postgres").items():
            params = {k: None for k in re.findall(r"%\((\w+)\)s", query)}
            try:
                conn.execute(f"EXPLAIN {query}", params)  # type: ignore[arg-type]
            except psycopg.Error as exc:
                pytest.fail(f"query {name}: {exc}")
            conn.rollback()


# -- several brokers on one database ----------------------------------------------------


def _race_to_start(job: str, racers: list[tuple[PostgresStore, str]]) -> tuple[list[str], int]:
    """Every racer starts ``job`` at once; the nodes that won, and how many lost."""
    barrier = threading.Barrier(len(racers))
    wins: list[str] = []
    losses: list[str] = []

    def race(store: PostgresStore, node: str) -> None:
        barrier.wait()
        try:
            store.start_attempt(job, node=node, gpu_uuid=None, now=2.0)
            wins.append(node)
        except TransitionError:
            losses.append(node)

    threads = [threading.Thread(target=race, args=r) for r in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return wins, len(losses)


def test_two_stores_racing_to_start_a_job_exactly_one_wins(
    open_pg: Callable[[], PostgresStore],
) -> None:
    a, b = open_pg(), open_pg()
    rounds = 20
    a.submit([spec(f"j{i}") for i in range(rounds)], now=1.0)
    for i in range(rounds):
        job_id = f"j{i}"
        wins, lost = _race_to_start(job_id, [(a, "a0"), (b, "b0"), (a, "a1"), (b, "b1")])
        assert len(wins) == 1 and lost == 3, (i, wins, lost)
        [attempt] = b.attempts(job_id)
        assert attempt.node == wins[0] and attempt.number == 1
        job = a.get_job(job_id)
        assert job is not None and job.state is JobState.RUNNING and job.attempts == 1
        starts = [e for e in a.events(job_id=job_id) if e.to_state == "running"]
        assert len(starts) == 1


def _start_in_child(url: str, schema: str, q: multiprocessing.Queue[str]) -> None:
    store = PostgresStore(url, schema=schema, max_size=1)
    try:
        store.start_attempt("a", node="child", gpu_uuid=None, now=2.0)
        q.put("won")
    except TransitionError:
        q.put("lost")
    finally:
        store.close()


def test_two_processes_start_a_job_once(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    store = open_pg()
    store.submit([spec("a")], now=1.0)
    ctx = multiprocessing.get_context("spawn")
    q: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_start_in_child, args=(pg_url, pg_schema, q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(q.get(timeout=5) for _ in procs) == ["lost", "lost", "won"]
    job = store.get_job("a")
    assert job is not None and job.state is JobState.RUNNING and job.attempts == 1


def test_start_skips_a_locked_job_instead_of_waiting(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    """FOR UPDATE SKIP LOCKED: while another writer holds the job's row, a start
    fails at once with TransitionError; once it lets go, the start goes through."""
    store = open_pg()
    store.submit([spec("a")], now=1.0)
    with _raw(pg_url, pg_schema) as other:
        other.execute("SELECT id FROM jobs WHERE id = 'a' FOR UPDATE")
        began = time.monotonic()
        with pytest.raises(TransitionError, match="another writer"):
            store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
        assert time.monotonic() - began < 2.0
        job = store.get_job("a")
        assert job is not None and job.state is JobState.QUEUED and store.attempts("a") == []
        other.rollback()
    job, attempt = store.start_attempt("a", node="n", gpu_uuid=None, now=3.0)
    assert job.state is JobState.RUNNING and attempt.number == 1


def test_transitions_wait_for_a_locked_job(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    """Unlike a start, a transition waits for the row and then re-checks the state:
    a job that another writer ended meanwhile is refused, never moved twice."""
    a, b = open_pg(), open_pg()
    a.submit([spec("j")], now=1.0)
    a.start_attempt("j", node="n", gpu_uuid=None, now=2.0)
    outcome: list[object] = []
    with _raw(pg_url, pg_schema) as other:
        other.execute("SELECT id FROM jobs WHERE id = 'j' FOR UPDATE")

        def cancel() -> None:
            try:
                outcome.append(b.transition("j", JobState.CANCELLED, now=4.0))
            except TransitionError as exc:
                outcome.append(exc)

        t = threading.Thread(target=cancel)
        t.start()
        time.sleep(0.3)
        assert outcome == []  # waiting on the row lock
        other.execute("UPDATE jobs SET state = 'done' WHERE id = 'j'")
        other.commit()
    t.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], TransitionError)
    job = a.get_job("j")
    assert job is not None and job.state is JobState.DONE


def test_gpu_clears_skip_requests_another_broker_is_taking(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    store = open_pg()
    for g in ("GPU-a", "GPU-b", "GPU-c"):
        store.request_gpu_clear(g, now=1.0)
    with _raw(pg_url, pg_schema) as other:
        other.execute("SELECT id FROM gpu_clears WHERE gpu_uuid = 'GPU-b' FOR UPDATE")
        assert [c.gpu_uuid for c in store.take_gpu_clears(now=2.0)] == ["GPU-a", "GPU-c"]
        other.rollback()
    assert [c.gpu_uuid for c in store.take_gpu_clears(now=3.0)] == ["GPU-b"]
    assert store.take_gpu_clears(now=4.0) == []


def test_concurrent_takers_take_each_gpu_clear_once(
    open_pg: Callable[[], PostgresStore],
) -> None:
    stores = [open_pg() for _ in range(3)]
    gpus = [f"GPU-{i}" for i in range(30)]
    for g in gpus:
        stores[0].request_gpu_clear(g, now=1.0)
    taken: list[str] = []
    barrier = threading.Barrier(len(stores))

    def take(s: PostgresStore) -> None:
        barrier.wait()
        for _ in range(5):
            taken.extend(c.gpu_uuid for c in s.take_gpu_clears(now=2.0))

    threads = [threading.Thread(target=take, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(taken) == sorted(gpus)


def test_event_ids_follow_commit_order(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    """A reader following events by id never skips a row: a writer that takes an id
    holds the log until it commits, so a later writer's id is larger and shows
    only after it."""
    store = open_pg()
    got: list[Event] = []
    with _raw(pg_url, pg_schema) as slow:
        slow.execute("SELECT pg_advisory_xact_lock(%s)", [store._events_key])
        slow.execute("INSERT INTO events (ts, kind) VALUES (1.0, 'slow')")
        t = threading.Thread(target=lambda: got.append(store.add_event(Event(ts=2.0, kind="f"))))
        t.start()
        time.sleep(0.3)
        assert got == [] and store.events() == []  # waits for the slow writer
        slow.commit()
    t.join(10)
    assert [e.kind for e in store.events()] == ["slow", "f"]


def test_concurrent_submissions_of_one_id_accept_it_once(
    open_pg: Callable[[], PostgresStore],
) -> None:
    stores = [open_pg() for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    results: list[object] = []

    def submit(s: PostgresStore, n: int) -> None:
        barrier.wait()
        try:
            results.append(s.submit([spec(f"own{n}"), spec("shared")], now=1.0))
        except DuplicateJobError as exc:
            results.append(exc)

    threads = [threading.Thread(target=submit, args=(s, n)) for n, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    accepted = [r for r in results if isinstance(r, list)]
    refused = [r for r in results if isinstance(r, DuplicateJobError)]
    assert len(accepted) == 1 and len(refused) == 3
    assert all(r.ids == ("shared",) for r in refused)
    assert len(stores[0].list_jobs()) == 2  # the winner's two jobs, nothing of the others


def test_concurrent_retries_with_one_idempotency_key_submit_once(
    open_pg: Callable[[], PostgresStore],
) -> None:
    stores = [open_pg() for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def submit(s: PostgresStore) -> None:
        barrier.wait()
        try:
            jobs = s.submit(
                [spec("k1"), spec("k2")],
                now=1.0,
                origin=Submission(owner="aaaaaaaaaaaa"),
                idempotency=("aaaaaaaaaaaa", "key-1", "hash-1"),
            )
            results.append([j.id for j in jobs])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert results == [["k1", "k2"]] * len(stores)
    assert [j.id for j in stores[0].list_jobs()] == ["k2", "k1"]
    assert len([e for e in stores[0].events() if e.kind == "submitted"]) == 2


# -- values PostgreSQL text cannot hold ----------------------------------------------


def test_nul_and_non_finite_values_are_stored(open_pg: Callable[[], PostgresStore]) -> None:
    store = open_pg()
    store.submit([JobSpec(id="a", type="echo.echo", params={"t": "x\x00y"})], now=1.0)
    store.start_attempt("a", node="n", gpu_uuid=None, now=2.0)
    job = store.finish_attempt(
        "a",
        1,
        target=JobState.DONE,
        now=3.0,
        outcome="succeeded",
        reason="ok\x00",
        stdout="bin\x00ary",
        stderr="",
        result={"loss": math.nan, "k\x00": [math.inf, 1.5]},
    )
    assert job.params == {"t": "x\ufffdy"}
    assert job.result == {"loss": None, "k\ufffd": [None, 1.5]}
    [attempt] = store.attempts("a")
    assert attempt.stdout == "bin\ufffdary" and attempt.reason == "ok\ufffd"


# -- connecting ---------------------------------------------------------------------


def test_unreachable_server_names_the_url_without_its_password() -> None:
    url = "postgresql://gw:s3cr3t-pw@127.0.0.1:1/nodb?connect_timeout=3&password=s3cr3t-pw"
    with pytest.raises(ConfigError) as info:
        PostgresStore(url)
    message = info.value.message
    assert "s3cr3t" not in message
    assert "postgresql://gw@127.0.0.1:1/nodb" in message
    assert "running" in message and "database" in message


def test_unknown_database_is_a_config_error(pg_url: str) -> None:
    url = re.sub(r"/[^/?]*(\?|$)", r"/gpuwarden_no_such_db\1", pg_url, count=1)
    with pytest.raises(ConfigError, match="gpuwarden_no_such_db"):
        PostgresStore(url)


def test_bad_schema_name_refused(pg_url: str) -> None:
    with pytest.raises(ConfigError, match="schema name"):
        PostgresStore(pg_url, schema="x; DROP TABLE jobs")


def test_redact_url() -> None:
    assert redact_url("postgresql://u:p@h:5/d?password=p&sslmode=require") == (
        "postgresql://u@h:5/d?sslmode=require"
    )
    assert redact_url("postgresql://h/d") == "postgresql://h/d"
    assert redact_url("postgresql://:p@h/d") == "postgresql://h/d"


# -- the database config key and open_store ------------------------------------------------


def test_config_database_key(tmp_path: Path) -> None:
    assert Config().database == ""
    cfg = tmp_path / "c.toml"
    cfg.write_text('database = "postgresql://gw@db.example:5432/gpuwarden"\n')
    assert load_config(cfg).database == "postgresql://gw@db.example:5432/gpuwarden"
    cfg.write_text('database = "mysql://gw:hunter2@db/gpuwarden"\n')
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    message = info.value.message
    assert "'database'" in message and "postgresql://" in message and '""' in message
    assert "hunter2" not in message


def test_open_store_picks_postgres_for_a_url(pg_url: str, pg_schema: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(pg_schema)))
    sep = "&" if "?" in pg_url else "?"
    url = f"{pg_url}{sep}options=-c%20search_path%3D{pg_schema}"
    store = open_store(Config(database=url))
    try:
        assert isinstance(store, PostgresStore)
        store.submit([spec("a")], now=1.0)
    finally:
        store.close()
    with _raw(pg_url, pg_schema) as conn:
        assert conn.execute("SELECT id FROM jobs").fetchall() == [("a",)]


def test_unavailable_means_the_database_could_not_be_reached_now(
    open_pg: Callable[[], PostgresStore], pg_url: str, pg_schema: str
) -> None:
    store = open_pg()
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect("postgresql://gpuwarden@127.0.0.1:1/none", connect_timeout=2)
    assert store.unavailable(refused.value) is True  # a server not there (yet)
    with _raw(pg_url, pg_schema) as conn, pytest.raises(psycopg.Error) as broken:
        conn.execute("SELECT * FROM no_such_table")
    assert store.unavailable(broken.value) is False  # a bug's error: never "try later"
