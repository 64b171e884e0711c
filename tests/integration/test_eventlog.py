"""The event log's cursor (``serve --log``): what a broker killed between a write
and its cursor, or mid-line, or around a ``copytruncate`` left, is written once,
and only once, by the next start. The states a kill leaves are made by hand here
(the cursor file's documented content); tests/acceptance/test_eventlog_kills.py
kills real brokers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.app import open_node
from gpuwarden.config import Config
from gpuwarden.core.model import Event
from gpuwarden.eventlog import CURSOR_FILE, EventLog
from gpuwarden.store.sqlite import SqliteStore
from tests.conftest import MODULES


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "state" / "gpuwarden.db")
    yield s
    s.close()


def add(store: SqliteStore, n: int) -> list[Event]:
    for i in range(n):
        store.add_event(Event(ts=float(i), kind="test_event", detail={"n": i}))
    return store.events(after_id=0, limit=100_000)


def ids_in(*logs: Path) -> list[int]:
    return [json.loads(line)["id"] for log in logs for line in log.read_text().splitlines()]


def open_log(tmp_path: Path, name: str = "events.jsonl") -> EventLog:
    return EventLog(tmp_path / name, cursor=tmp_path / "state" / CURSOR_FILE)


def test_a_first_start_goes_on_from_now_and_writes_its_cursor_at_once(
    store: SqliteStore, tmp_path: Path
) -> None:
    add(store, 3)
    log = open_log(tmp_path)
    assert log.resume(store.last_event_id()) == 3
    saved = json.loads((tmp_path / "state" / CURSOR_FILE).read_text())
    assert saved["id"] == 3 and saved["log"] == str(tmp_path / "events.jsonl")
    log.close()
    # a kill before the first batch: the next start still goes on from there
    add(store, 2)
    again = open_log(tmp_path)
    assert again.resume(store.last_event_id()) == 3
    again.close()


def test_lines_written_after_the_cursor_are_not_written_again(
    store: SqliteStore, tmp_path: Path
) -> None:
    events = add(store, 6)
    cursor = tmp_path / "state" / CURSOR_FILE
    log = open_log(tmp_path)
    log.resume(0)
    log.write_events(events[:2])
    before = cursor.read_text()
    log.write_events(events[2:5])
    log.close()
    # the broker died after the second write, before its cursor: put it back
    cursor.write_text(before)
    assert json.loads(cursor.read_text())["id"] == 2  # the kill's state is in place
    log = open_log(tmp_path)
    after = log.resume(store.last_event_id())
    assert after == 5
    log.write_events(store.events(after_id=after))
    log.close()
    assert ids_in(tmp_path / "events.jsonl") == [1, 2, 3, 4, 5, 6]


def test_a_line_a_kill_cut_short_is_cut_off_and_written_again_whole(
    store: SqliteStore, tmp_path: Path
) -> None:
    events = add(store, 4)
    log = open_log(tmp_path)
    log.resume(0)
    log.write_events(events[:2])
    log.close()
    path = tmp_path / "events.jsonl"
    whole = json.dumps({"ts": 2.0, "event": "test_event", "n": 2, "id": 3})
    with path.open("a") as f:
        f.write(whole[:17])  # the kill came in the middle of the third line
    assert not path.read_text().endswith("\n")  # in place
    log = open_log(tmp_path)
    after = log.resume(store.last_event_id())
    assert after == 2
    log.write_events(store.events(after_id=after))
    log.close()
    assert ids_in(path) == [1, 2, 3, 4]  # every line whole, none twice


def test_copytruncate_keeps_each_event_once_across_the_copy_and_the_file(
    store: SqliteStore, tmp_path: Path
) -> None:
    events = add(store, 6)
    path = tmp_path / "events.jsonl"
    log = open_log(tmp_path)
    log.resume(0)
    log.write_events(events[:3])
    rotated = tmp_path / "events.jsonl.1"
    rotated.write_bytes(path.read_bytes())  # logrotate's copytruncate: copy...
    path.write_bytes(b"")  # ...then truncate, while the log stays open
    log.write_events(events[3:5])  # O_APPEND: lands at the new end
    log.close()
    assert ids_in(rotated) == [1, 2, 3] and ids_in(path) == [4, 5]
    log = open_log(tmp_path)
    after = log.resume(store.last_event_id())
    assert after == 5
    log.write_events(store.events(after_id=after))
    log.close()
    assert ids_in(rotated, path) == [1, 2, 3, 4, 5, 6]


def test_a_kill_after_a_write_into_a_truncated_file_is_found_in_the_new_lines(
    store: SqliteStore, tmp_path: Path
) -> None:
    events = add(store, 5)
    cursor = tmp_path / "state" / CURSOR_FILE
    path = tmp_path / "events.jsonl"
    log = open_log(tmp_path)
    log.resume(0)
    log.write_events(events[:3])
    before = cursor.read_text()
    path.write_bytes(b"")  # rotated (copied away) and truncated...
    log.write_events(events[3:4])  # ...one more batch, then killed before its cursor
    log.close()
    cursor.write_text(before)
    assert json.loads(before)["size"] > path.stat().st_size  # in place: shorter now
    log = open_log(tmp_path)
    assert log.resume(store.last_event_id()) == 4
    log.close()


def test_a_new_log_file_goes_on_where_the_cursor_was(store: SqliteStore, tmp_path: Path) -> None:
    events = add(store, 4)
    log = open_log(tmp_path, "first.jsonl")
    log.resume(0)
    log.write_events(events[:2])
    log.close()
    log = open_log(tmp_path, "second.jsonl")
    after = log.resume(store.last_event_id())
    assert after == 2
    log.write_events(store.events(after_id=after))
    log.close()
    assert ids_in(tmp_path / "first.jsonl", tmp_path / "second.jsonl") == [1, 2, 3, 4]


def test_a_cursor_that_cannot_be_read_goes_on_from_now(
    store: SqliteStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add(store, 3)
    cursor = tmp_path / "state" / CURSOR_FILE
    cursor.write_text("not json")
    log = open_log(tmp_path)
    with caplog.at_level("WARNING", logger="gpuwarden.eventlog"):
        assert log.resume(store.last_event_id()) == 3
    log.close()
    assert "cannot be read" in caplog.text


def test_the_log_file_and_its_cursor_are_the_owners_alone(
    store: SqliteStore, tmp_path: Path
) -> None:
    log = open_log(tmp_path)
    log.resume(0)
    log.write_events(add(store, 1))
    log.close()
    assert (tmp_path / "events.jsonl").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state" / CURSOR_FILE).stat().st_mode & 0o777 == 0o600


def test_a_store_that_lost_commits_does_not_silence_the_log(tmp_path: Path) -> None:
    """The store came back from an older copy: its last event id is below the
    cursor's. The events it writes from then on reuse those ids and are new: the
    log goes on from the store's last event instead of waiting for it to catch up."""
    db = tmp_path / "state" / "gpuwarden.db"
    store = SqliteStore(db)
    events = add(store, 3)
    store.close()
    older = tmp_path / "older.db"
    older.write_bytes(db.read_bytes())  # no WAL content beyond this point: checkpointed
    store = SqliteStore(db)
    log = open_log(tmp_path)
    log.resume(store.last_event_id())
    log.write_events(add(store, 4)[3:])
    log.close()
    store.close()
    assert json.loads((tmp_path / "state" / CURSOR_FILE).read_text())["id"] == 7
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    db.write_bytes(older.read_bytes())
    store = SqliteStore(db)
    try:
        assert store.last_event_id() == 3  # the store lost events 4..7
        log = open_log(tmp_path)
        after = log.resume(store.last_event_id())
        assert after == 3
        new = add(store, 2)[3:]
        log.write_events(store.events(after_id=after))
        log.close()
        assert [e.id for e in new] == [4, 5]
        assert ids_in(tmp_path / "events.jsonl")[-2:] == [4, 5]
        assert events[0].id == 1
    finally:
        store.close()


@pytest.mark.parametrize("how", ["leave", "shutdown", "flush"])
def test_a_stops_last_events_reach_the_log_however_many_came_at_once(
    tmp_path: Path, how: str
) -> None:
    """A burst of events just before a stop (more than a tick writes) and the stop's
    own: all in the file, in order, ending with ``broker_stopped``, before exit."""
    config = Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "gpu": "sim",
            "module_paths": [MODULES],
            "broker": {"poll_interval_s": 0.02},
        }
    )
    log = open_log(tmp_path)
    with open_node(config, mock_gpu=True, events=log) as node:
        node.broker.recover()
        node.broker.tick()
        for i in range(2500):  # two and a half pages, after the last tick
            node.store.add_event(Event(ts=float(i), kind="test_event", detail={"n": i}))
        if how == "leave":
            node.broker.leave()
        elif how == "shutdown":
            node.broker.shutdown(0)
        else:  # serve's last word, whatever the stop did (cli/node.py)
            node.broker.emit("broker_stopped")
            node.broker.flush_events()
        last = node.store.last_event_id()
    log.close()
    lines = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sum(1 for ln in lines if ln["event"] == "test_event") == 2500
    assert lines[-1]["event"] == "broker_stopped" and lines[-1]["id"] == last
    assert [ln["id"] for ln in lines] == sorted({ln["id"] for ln in lines})  # once each
