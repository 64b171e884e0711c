"""``GET /v1/events`` (server-sent events) and ``gpuwarden events``: the format,
the filters, the role rules, resuming after a dropped connection without losing
or repeating an event, hostile cursors, the per-token cap, the end at shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden import client as gwclient
from gpuwarden.api.routers import events as events_router
from gpuwarden.cli import main
from gpuwarden.cli.httpserver import ApiThread
from gpuwarden.core.model import Event, JobSpec
from gpuwarden.registry import Registry
from gpuwarden.store.base import Submission
from gpuwarden.store.sqlite import SqliteStore
from tests.integration.test_api import Api, build

pytestmark = pytest.mark.timeout(90)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def blocks(text: str) -> list[dict[str, str]]:
    """The stream's blocks, each as its fields (a comment as ``":"``)."""
    out: list[dict[str, str]] = []
    for raw in text.split("\n\n"):
        if not raw:
            continue
        fields: dict[str, str] = {}
        for line in raw.split("\n"):
            name, _, value = line.partition(":")
            fields[name or ":"] = value.removeprefix(" ")
        out.append(fields)
    return out


def shown(text: str) -> list[dict[str, Any]]:
    """The events (data) of a stream's text, in order."""
    return [json.loads(b["data"]) for b in blocks(text) if "data" in b]


def job(store: SqliteStore, job_id: str, owner: str | None, type_name: str = "echo.echo") -> None:
    store.submit(
        [JobSpec(id=job_id, type=type_name, params={"text": "x"})],
        now=1.0,
        origin=Submission(owner=owner),
    )


def note(store: SqliteStore, kind: str, job_id: str | None = None, **detail: Any) -> int:
    event = store.add_event(Event(ts=time.time(), kind=kind, job_id=job_id, detail=detail))
    assert event.id is not None
    return event.id


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


def get(a: Api, who: str, query: str = "", **headers: str) -> httpx.Response:
    url = "/v1/events?follow=false" + (f"&{query}" if query else "")
    return a.client.get(url, headers={**a.h(who), **headers})


# -- format, history, filters -------------------------------------------------------


def test_each_event_is_an_sse_block_with_its_id_kind_and_one_line_of_json(api: Api) -> None:
    job(api.store, "host-1", None)
    note(api.store, "gpu_fault", gpu="GPU-1", xid=79, reason="fell off the bus\nreally")
    r = get(api, "owner", "after=0")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-store"
    assert r.text.startswith("retry: 2000\nid: 0\n\n")
    stored = api.store.events()
    got = [b for b in blocks(r.text) if "data" in b]
    assert [int(b["id"]) for b in got] == [e.id for e in stored]
    assert [b["event"] for b in got] == ["submitted", "gpu_fault"]
    for b in got:
        data = json.loads(b["data"])  # one line: a newline in a reason is escaped
        assert set(data) == {"id", "ts", "kind", "job", "from", "to", "detail"}
        assert str(data["id"]) == b["id"] and data["kind"] == b["event"]
    first, fault = (json.loads(b["data"]) for b in got)
    assert first["job"] == "host-1" and first["to"] == "queued"
    assert fault["job"] is None and fault["detail"]["reason"] == "fell off the bus\nreally"


def test_without_a_cursor_the_stream_starts_now(api: Api) -> None:
    job(api.store, "host-1", None)
    last = api.store.last_event_id()
    r = get(api, "owner")
    assert r.status_code == 200
    assert shown(r.text) == []
    assert blocks(r.text)[0] == {"retry": "2000", "id": str(last)}


def test_the_cursor_comes_from_last_event_id_over_after(api: Api) -> None:
    ids = [note(api.store, "probe_failed", reason=str(i)) for i in range(5)]
    r = get(api, "owner", "after=0", **{"Last-Event-ID": str(ids[2])})
    assert [e["id"] for e in shown(r.text)] == ids[3:]
    r = get(api, "owner", f"after={ids[3]}")
    assert [e["id"] for e in shown(r.text)] == ids[4:]


def test_filters_by_job_and_by_type(api: Api) -> None:
    job(api.store, "a-1", None)
    job(api.store, "b-1", None, "burn.custom")
    note(api.store, "warm_server_loaded", type="burn.custom", gpu="GPU-1")
    note(api.store, "gpu_fault", gpu="GPU-1")
    by_job = shown(get(api, "operator", "after=0&job=a-1").text)
    assert [(e["kind"], e["job"]) for e in by_job] == [("submitted", "a-1")]
    by_type = shown(get(api, "owner", "after=0&type=burn.custom").text)
    assert [(e["kind"], e["job"]) for e in by_type] == [
        ("submitted", "b-1"),
        ("warm_server_loaded", None),
    ]
    assert get(api, "owner", "job=nope").status_code == 404
    r = get(api, "owner", "type=not a type")
    assert r.status_code == 422 and "module.type" in r.json()["error"]


def test_a_filtered_stream_moves_the_cursor_past_what_it_skipped(api: Api) -> None:
    job(api.store, "a-1", None)
    note(api.store, "gpu_fault", gpu="GPU-1")
    last = note(api.store, "probe_failed", reason="x")
    r = get(api, "owner", "after=0&type=echo.echo")
    assert [e["job"] for e in shown(r.text)] == ["a-1"]
    assert blocks(r.text)[-1] == {"id": str(last)}  # a reconnect starts after it


# -- roles ---------------------------------------------------------------------------


def test_a_submitter_sees_only_its_own_jobs_events(api: Api) -> None:
    mine, theirs = f"{api.id_of('submitter')}-mine", f"{api.id_of('submitter2')}-theirs"
    job(api.store, mine, api.id_of("submitter"))
    job(api.store, theirs, api.id_of("submitter2"))
    job(api.store, "host-1", None)
    note(api.store, "gpu_fault", gpu="GPU-1", reason="Xid 79")
    note(api.store, "memory_reclaimed", mine, reason=f"waited for job {theirs}", gpu="GPU-1")
    note(api.store, "memory_reclaimed", theirs, gpu="GPU-1")
    # the events are there, and an owner sees all of them
    everything = shown(get(api, "owner", "after=0").text)
    assert {e["job"] for e in everything} == {mine, theirs, "host-1", None}
    got = shown(get(api, "submitter", "after=0").text)
    assert [(e["kind"], e["job"]) for e in got] == [
        ("submitted", mine),
        ("memory_reclaimed", mine),
    ]
    assert got[1]["detail"]["reason"] == "waited for another job"
    assert theirs not in json.dumps(got)
    # another's job by name: the 404 of a job that does not exist
    r = get(api, "submitter", f"after=0&job={theirs}")
    assert r.status_code == 404 and "no job with id" in r.json()["error"]
    assert get(api, "submitter", "after=0&job=nope").json() == {
        "error": "no job with id 'nope' (GET /v1/jobs lists yours)"
    }
    # its own job, named with or without its token's prefix
    for name in (mine, "mine"):
        assert [e["job"] for e in shown(get(api, "submitter", f"after=0&job={name}").text)] == [
            mine,
            mine,
        ]
    # nothing of the type filter lets another's or a node's events through
    assert shown(get(api, "submitter", "after=0&type=echo.echo").text) == got


@pytest.mark.parametrize("role", ["node", "enroll"])
def test_node_and_enroll_tokens_may_not_read_events(api: Api, role: str) -> None:
    r = get(api, role, "after=0")
    assert r.status_code == 403 and "events.read" in r.json()["error"]


# -- hostile cursors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["abc", "-1", "1e3", "1.5", "0x10", "99999999999999999999", "9223372036854775808"]
)
def test_a_cursor_that_is_no_event_id_is_refused(api: Api, bad: str) -> None:
    r = get(api, "owner", **{"Last-Event-ID": bad})
    assert r.status_code == 400
    assert "Last-Event-ID header must be an event id" in r.json()["error"]
    r = api.client.get("/v1/events", params={"after": bad}, headers=api.h("owner"))
    assert r.status_code == 400 and "after must be an event id" in r.json()["error"]


def test_unicode_digits_and_a_long_header_are_refused(api: Api) -> None:
    r = api.client.get("/v1/events", params={"after": "١٢"}, headers=api.h("owner"))
    assert r.status_code == 400
    r = get(api, "owner", **{"Last-Event-ID": "1" * 5000})
    assert r.status_code == 400 and len(r.json()["error"]) < 300


# -- a real server ---------------------------------------------------------------------


@dataclass
class Live:
    api: Api
    thread: ApiThread
    url: str
    store: SqliteStore  # the API's own connection

    def client(self, who: str) -> gwclient.Client:
        return gwclient.Client(self.url, self.api.tokens[who])


@pytest.fixture
def live(api: Api) -> Iterator[Live]:
    registry = Registry.load(api.config.module_paths, api.config.launch_rules)
    store = SqliteStore(api.tmp / "gpuwarden.db")  # the API's own connection, as `serve --api`
    thread = ApiThread(store, registry, api.config, "127.0.0.1", 0, name="test-api")
    assert thread.start()
    try:
        yield Live(api=api, thread=thread, url=thread.url, store=store)
    finally:
        thread.stop()
        store.close()


class CuttingProxy:
    """A TCP proxy in front of the API that can cut every connection through it and,
    while ``refusing``, closes new ones at once."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.refusing = threading.Event()
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing.is_set():
                down.close()
                continue
            up = socket.create_connection(self.upstream)
            with self.lock:
                self.open += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        with self.lock:
            cut, self.open = self.open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.cuts += 1
        return len(cut)

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_the_stream_resumes_after_a_dropped_connection_without_losing_or_repeating(
    live: Live,
) -> None:
    store = live.api.store
    proxy = CuttingProxy(live.thread.bound)
    got: list[int] = []
    drops: list[str] = []
    written: list[int] = []
    done = threading.Event()

    def follow() -> None:
        with gwclient.Client(f"http://127.0.0.1:{proxy.port}", live.api.tokens["owner"]) as c:
            for event in c.events(after=0, on_drop=drops.append):
                got.append(int(event["id"]))
                if event["kind"] == "the_end":
                    break
        done.set()

    written += [note(store, "probe_failed", reason=f"before {i}") for i in range(5)]
    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_for("the first events", lambda: len(got) == 5)
    proxy.refusing.set()
    assert proxy.cut() >= 2  # the fault: the client's connection is gone
    # written while the client cannot reach the server
    written += [note(store, "probe_failed", reason=f"while cut {i}") for i in range(10)]
    wait_for("a reconnect to be refused", lambda: len(drops) >= 2)
    proxy.refusing.clear()
    written += [note(store, "probe_failed", reason=f"after {i}") for i in range(5)]
    written.append(note(store, "the_end"))
    assert done.wait(30), f"got {got}, drops {drops}"
    proxy.close()
    assert drops and "reconnecting" in drops[0] and "resuming after event" in drops[0]
    assert got == written  # every one, once, in order


def test_a_submitter_following_never_sees_anothers_job(live: Live) -> None:
    store = live.api.store
    mine, theirs = f"{live.api.id_of('submitter')}-m", f"{live.api.id_of('submitter2')}-t"
    job(store, mine, live.api.id_of("submitter"))
    job(store, theirs, live.api.id_of("submitter2"))
    got: list[dict[str, Any]] = []

    def follow() -> None:
        with live.client("submitter") as c:
            for event in c.events():  # from now on
                got.append(event)
                if event["kind"] == "the_end":
                    return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_for("the stream to be open", lambda: events_router.streams_of(live.thread.app).total)
    for i in range(20):
        note(store, "memory_reclaimed", theirs, n=i)
        note(store, "gpu_xid", gpu="GPU-1", xid=13)
    note(store, "memory_reclaimed", mine, n=0)
    note(store, "the_end", mine)
    reader.join(20)
    assert not reader.is_alive()
    assert [(e["kind"], e["job"]) for e in got] == [
        ("memory_reclaimed", mine),
        ("the_end", mine),
    ]


def _open(live: Live, who: str) -> tuple[httpx.Client, httpx.Response]:
    return _open_url(live, who, "/v1/events")


def _open_url(live: Live, who: str, url: str) -> tuple[httpx.Client, httpx.Response]:
    http = httpx.Client(base_url=live.url, headers=live.api.h(who), timeout=10)
    response = http.send(http.build_request("GET", url), stream=True)
    return http, response


def test_a_token_may_hold_only_so_many_streams(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_router, "MAX_PER_TOKEN", 2)
    held = [_open(live, "submitter") for _ in range(2)]
    try:
        assert [r.status_code for _, r in held] == [200, 200]
        extra_http, extra = _open(live, "submitter")
        extra.read()
        assert extra.status_code == 429
        assert "2 event streams open already" in extra.json()["error"]
        assert extra.headers["Retry-After"] == "5"
        extra_http.close()
        other_http, other = _open(live, "submitter2")  # another token is not held back
        assert other.status_code == 200
        other.close()
        other_http.close()
        http, response = held.pop()
        response.close()
        http.close()  # the client goes away: its place is given back

        def again() -> bool:
            h, r = _open(live, "submitter")
            held.append((h, r))
            return r.status_code == 200

        wait_for("a place once a stream closed", again)
    finally:
        for h, r in held:
            r.close()
            h.close()
    wait_for("every place given back", lambda: events_router.streams_of(live.thread.app).total == 0)


def test_heartbeats_keep_the_connection_and_move_the_cursor(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_router, "HEARTBEAT_S", 0.3)
    job(live.api.store, "a-1", None)
    http, response = _open(live, "owner")
    try:
        lines = response.iter_lines()
        assert next(lines).startswith("retry:")
        skipped = note(live.api.store, "gpu_fault", gpu="GPU-1")
        response.close()
        # a filtered stream: the fault does not pass, but the cursor moves past it
        filtered = http.send(
            http.build_request("GET", "/v1/events?type=echo.echo&after=0"), stream=True
        )
        seen: list[str] = []
        for line in filtered.iter_lines():
            seen.append(line)
            if line == f"id: {skipped}":
                break
        assert ": keep-alive" in seen
        assert any(line.startswith("data: ") and '"a-1"' in line for line in seen)
        filtered.close()
    finally:
        http.close()


def test_a_stream_ends_when_the_server_stops(live: Live) -> None:
    http, response = _open(live, "owner")
    ended = threading.Event()

    def read() -> None:
        try:
            for _ in response.iter_lines():
                pass
        except httpx.HTTPError:
            pass
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    wait_for("the stream to be open", lambda: events_router.streams_of(live.thread.app).total)
    started = time.monotonic()
    live.thread.stop()
    assert ended.wait(5)
    assert time.monotonic() - started < 5  # not the 10 s the stop would wait for
    assert not live.thread.thread.is_alive()
    http.close()


# -- the command line --------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_events_on_the_host(
    api: Api, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    job(api.store, "a-1", None)
    job(api.store, "b-1", None, "burn.custom")
    note(api.store, "gpu_fault", "a-1", reason="a\x1b[31m red\nline", xid=79)
    state = str(api.tmp)
    code, out, _ = run(capsys, "--state-dir", state, "events", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [e["id"] for e in rows] == [e.id for e in api.store.events()]
    assert rows[0] == {
        "id": rows[0]["id"],
        "ts": rows[0]["ts"],
        "kind": "submitted",
        "job": "a-1",
        "from": None,
        "to": "queued",
        "detail": {"type": "echo.echo"},
    }
    code, out, _ = run(capsys, "--state-dir", state, "events", "--job", "a-1")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert " submitted a-1 ->queued type=echo.echo" in lines[0]
    assert "\x1b" not in out and "\\u001b[31m" in lines[1] and 'reason="a' in lines[1]
    code, out, _ = run(capsys, "--state-dir", state, "events", "--type", "burn.custom", "--json")
    assert [json.loads(x)["job"] for x in out.splitlines()] == ["b-1"]
    first = rows[0]["id"]
    code, out, _ = run(capsys, "--state-dir", state, "events", "--after", str(first), "--json")
    assert [json.loads(x)["id"] for x in out.splitlines()] == [e["id"] for e in rows[1:]]
    code, _, err = run(capsys, "--state-dir", state, "events", "--job", "nope")
    assert code == 2 and "no job with id 'nope'" in err
    code, _, err = run(capsys, "--state-dir", state, "events", "--type", "x y")
    assert code == 2 and "module.type" in err


def test_events_through_the_api(
    live: Live, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    mine = f"{live.api.id_of('submitter')}-m"
    job(live.api.store, mine, live.api.id_of("submitter"))
    job(live.api.store, "host-1", None)
    monkeypatch.setenv("GPUWARDEN_TOKEN", live.api.tokens["submitter"])
    code, out, _ = run(capsys, "events", "--url", live.url, "--after", "0", "--json")
    assert code == 0
    assert [json.loads(x)["job"] for x in out.splitlines()] == [mine]
    code, out, _ = run(capsys, "events", "--url", live.url, "--after", "0")
    assert code == 0 and f" submitted {mine} ->queued" in out
    code, _, err = run(capsys, "events", "--url", live.url, "--job", "host-1")
    assert code == 2 and "no job with id 'host-1'" in err


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    return {**env, "PYTHONUNBUFFERED": "1", **more}


def _follow_then_interrupt(argv: list[str], env: dict[str, str], write: Callable[[], int]) -> None:
    """``gpuwarden events --follow`` in a process: an event written once it runs
    arrives as a line, and SIGINT ends it quietly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwarden", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []

        def reader() -> None:
            assert proc.stdout is not None
            lines.extend(iter(proc.stdout.readline, ""))

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        ids: list[int] = []

        def arrived() -> bool:  # it starts from now: write until one line shows
            ids.append(write())
            time.sleep(0.2)
            return bool(lines)

        wait_for("an event line", arrived, timeout=30)
        assert json.loads(lines[0])["id"] in ids
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        t.join(5)
        assert proc.stderr is not None
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_follow_on_the_host_ends_quietly_on_ctrl_c(api: Api) -> None:
    argv = ["--state-dir", str(api.tmp), "events", "--follow", "--json"]
    _follow_then_interrupt(argv, _env(), lambda: note(api.store, "probe_failed", reason="x"))


def test_follow_through_the_api_ends_quietly_on_ctrl_c(live: Live) -> None:
    argv = ["events", "--url", live.url, "--follow", "--json"]
    env = _env(GPUWARDEN_TOKEN=live.api.tokens["owner"])
    _follow_then_interrupt(argv, env, lambda: note(live.api.store, "probe_failed", reason="x"))


def test_a_cursor_past_the_newest_event_goes_on_from_now(api: Api) -> None:
    last = note(api.store, "probe_failed", reason="x")
    r = get(api, "owner", **{"Last-Event-ID": "9000000000"})
    assert r.status_code == 200 and blocks(r.text)[0] == {"retry": "2000", "id": str(last)}


def test_the_type_filter_takes_a_warm_servers_footprint_by_its_type(api: Api) -> None:
    note(api.store, "footprint_raised", "warm:17", type="burn.custom", bytes=1)
    note(api.store, "footprint_raised", "warm:18", type="echo.echo", bytes=1)
    got = shown(get(api, "owner", "after=0&type=burn.custom").text)
    assert [e["job"] for e in got] == ["warm:17"]
    assert shown(get(api, "submitter", "after=0").text) == []


def test_events_refuse_a_state_dir_that_has_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: dict[str, str]
) -> None:
    code, _, err = run(capsys, "--state-dir", str(tmp_path / "typo"), "events")
    assert code == 2 and f"no gpuwarden state in {tmp_path / 'typo'}" in err
    assert not (tmp_path / "typo").exists()
    code, _, err = run(capsys, "--state-dir", str(tmp_path), "events", "--after", "-3")
    assert code == 2 and "--after -3" in err


def test_a_store_that_cannot_answer_for_a_moment_does_not_end_the_stream(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = live.store.events
    failures: list[int] = []

    def locked(**kw: Any) -> list[Event]:
        if len(failures) < 3:
            failures.append(1)
            raise sqlite3.OperationalError("database is locked")
        return real(**kw)

    got: list[str] = []
    drops: list[str] = []

    def follow() -> None:
        with live.client("owner") as c:
            for event in c.events(on_drop=drops.append):
                got.append(event["kind"])
                if event["kind"] == "the_end":
                    return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_for("the stream to be open", lambda: events_router.streams_of(live.thread.app).total)
    monkeypatch.setattr(live.store, "events", locked)
    note(live.api.store, "probe_failed", reason="x")
    wait_for("the store to refuse", lambda: len(failures) == 3)
    note(live.api.store, "the_end")
    reader.join(20)
    assert not reader.is_alive()
    assert got == ["probe_failed", "the_end"] and drops == []


def test_a_stream_of_one_job_moves_its_cursor_past_other_events(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_router, "HEARTBEAT_S", 0.3)
    job(live.api.store, "a-1", None)
    reads: list[int] = []
    real = live.store.events

    def counted(**kw: Any) -> list[Event]:
        reads.append(1)
        return real(**kw)

    monkeypatch.setattr(live.store, "events", counted)
    http, response = _open_url(live, "owner", "/v1/events?job=a-1&after=0")
    try:
        lines = response.iter_lines()
        assert '"a-1"' in next(line for line in lines if line.startswith("data: "))
        other = note(live.api.store, "gpu_fault", gpu="GPU-1")
        assert _first(lines, lambda line: line.startswith("id: ")) == f"id: {other}"
        settled = len(reads)
        time.sleep(1.0)  # idle: the job's events are not read again every poll
        assert len(reads) <= settled + 1
    finally:
        response.close()
        http.close()


def _first(lines: Iterator[str], wanted: Callable[[str], bool], timeout: float = 10.0) -> str:
    """The first line that is ``wanted``, read within ``timeout`` (heartbeats keep
    lines coming)."""
    deadline = time.monotonic() + timeout
    for line in lines:
        if wanted(line):
            return line
        if time.monotonic() > deadline:
            break
    raise AssertionError("no such line in time")
