"""The node's local socket (api/localsock.py) against hostile clients, served in
process over a real Unix socket and both store backends: what the command job
is stored with, garbage and oversized requests, a client that sends nothing,
more connections than it serves, another user's job."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.api import localsock
from gpuwarden.config import load_config
from gpuwarden.core.command import LocalUser
from gpuwarden.errors import UserError, ValidationError
from gpuwarden.registry import Registry
from gpuwarden.store.base import Store

ROOT = LocalUser(0, 0, "root")


@pytest.fixture
def server(store: Store, tmp_path: Path) -> Iterator[localsock.LocalServer]:
    config = load_config(None, state_dir=tmp_path / "state")
    session = localsock.LocalSession(store, Registry.load([], builtin=False), config)
    srv = localsock.LocalServer(tmp_path / "s" / "gpuwarden.sock", session).start()
    try:
        yield srv
    finally:
        srv.close()


def connect(srv: localsock.LocalServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with localsock.addressable(srv.path) as address:
        sock.connect(address)
    sock.settimeout(10)
    return sock


def ask(srv: localsock.LocalServer, raw: bytes) -> list[dict[str, Any]]:
    with connect(srv) as sock, sock.makefile("rb") as answers:
        sock.sendall(raw)
        return [json.loads(line) for line in answers]


def submit_body(**extra: Any) -> dict[str, Any]:
    return {"op": "submit", "argv": ["echo", "hi"], "cwd": "/tmp", "env": {}} | extra


def test_a_submit_stores_the_command_as_the_kernel_named_its_user(
    server: localsock.LocalServer, store: Store
) -> None:
    body = submit_body(id="one", vram_bytes=1 << 30, env={"A": "1"}, name="greet")
    [answer] = ask(server, json.dumps(body).encode() + b"\n")
    assert answer == {"ids": ["one"]}
    job = store.get_job("one")
    assert job is not None and job.type == "command:greet" and job.vram_bytes == 1 << 30
    assert job.command is not None
    assert (job.command.argv, job.command.cwd, dict(job.command.env)) == (
        ("echo", "hi"), "/tmp", {"A": "1"},
    )  # fmt: skip
    assert job.command.uid == 0  # the test runs as root: the peer the kernel names


def test_a_uid_in_the_request_is_not_believed(server: localsock.LocalServer, store: Store) -> None:
    body = submit_body(id="liar", uid=4242, gid=4242, user="mallory")
    [answer] = ask(server, json.dumps(body).encode() + b"\n")
    assert answer == {"ids": ["liar"]}
    job = store.get_job("liar")
    assert job is not None and job.command is not None and job.command.uid == 0


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"not json\n", "not one JSON object"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"op": "format-disk"}\n', "unknown op"),
        (json.dumps(submit_body(argv=[])).encode() + b"\n", "the command is empty"),
        (json.dumps(submit_body(cwd="rel")).encode() + b"\n", "absolute path"),
        (json.dumps(submit_body(env={"CUDA_VISIBLE_DEVICES": "0"})).encode() + b"\n", "may not"),
        (json.dumps(submit_body(priority="high")).encode() + b"\n", "whole number"),
        (json.dumps(submit_body(array={"indices": [1, 1]})).encode() + b"\n", "distinct"),
    ],
)
def test_bad_requests_get_a_clear_error_and_store_nothing(
    server: localsock.LocalServer, store: Store, raw: bytes, said: str
) -> None:
    [answer] = ask(server, raw)
    assert said in answer["error"]
    assert store.list_jobs(limit=10) == []


def test_an_oversized_request_is_refused(
    server: localsock.LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localsock, "MAX_REQUEST", 1000)
    [answer] = ask(server, b"x" * 5000 + b"\n")
    assert "over 1000 bytes" in answer["error"]


def test_a_client_that_sends_nothing_is_dropped(
    server: localsock.LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localsock._Handler, "timeout", 0.3)
    with connect(server) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""  # the server closed it
        assert time.monotonic() - started < 5


def test_more_connections_than_it_serves_are_told_it_is_busy(
    server: localsock.LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle = [connect(server) for _ in range(localsock.MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # every one of them is being served (waits for its request)
        [answer] = ask(server, json.dumps(submit_body()).encode() + b"\n")
        assert "busy" in answer["error"]
    finally:
        for s in idle:
            s.close()


def test_another_users_job_is_neither_followed_nor_cancelled(
    server: localsock.LocalServer, store: Store
) -> None:
    [answer] = ask(server, json.dumps(submit_body(id="roots")).encode() + b"\n")
    assert answer == {"ids": ["roots"]}
    alice = LocalUser(1001, 1001, "alice")
    session = server.session
    for call in (session.cancel, lambda j, u: session.follow(j, u, lambda m: None)):
        with pytest.raises(UserError, match="no command job roots of user alice"):
            call("roots", alice)
    assert store.get_job("roots").state.value == "queued"  # type: ignore[union-attr]
    with pytest.raises(ValidationError):
        session.own_job(None, ROOT)
