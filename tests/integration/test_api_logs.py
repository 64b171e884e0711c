"""``GET /v1/jobs/{id}/logs/{stream}`` and :mod:`gpuwarden.node.joblogs`: a job's output
streams read through safefs, bounded, with the role rules of the other job routes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden import cli
from gpuwarden import client as c
from gpuwarden.api.routers import logs as logs_route
from gpuwarden.cli import common
from gpuwarden.cli.common import did_you_mean, printable
from gpuwarden.core.model import JobSpec
from gpuwarden.core.states import JobState
from gpuwarden.node import joblogs
from gpuwarden.store.base import Submission
from tests.integration.test_api import Api, build


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path)
    yield a
    a.store.close()


def ran(a: Api, owner: str, job_id: str, *, out: bytes, err: bytes = b"", end: bool = True) -> Path:
    """A job of ``owner`` whose attempt 1 ran on this node and wrote ``out`` and
    ``err``; ended done unless ``end`` is False. Returns the attempt folder."""
    a.store.submit(
        [JobSpec(id=job_id, type="echo.echo", params={"text": "x"})],
        now=1.0,
        origin=Submission(owner=a.id_of(owner)),
    )
    folder = a.tmp / "jobs" / job_id / "attempt-1"
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_bytes(out)
    (folder / "stderr.log").write_bytes(err)
    a.store.start_attempt(job_id, node=a.config.node_name, gpu_uuid=None, now=2.0)
    if end:
        a.store.finish_attempt(
            job_id,
            1,
            target=JobState.DONE,
            now=3.0,
            outcome="succeeded",
            reason="done",
            exit_code=0,
            result={"outputs": [], "message": "ok"},
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
        )
    return folder


def test_both_streams_of_an_attempt_as_bytes(api: Api) -> None:
    mine = f"{api.id_of('submitter')}-j"
    ran(api, "submitter", mine, out=b"hello\n\xff raw", err=b"oops\n")
    r = api.client.get(f"/v1/jobs/{mine}/logs/stdout", headers=api.h("submitter"))
    assert r.status_code == 200, r.text
    assert r.content == b"hello\n\xff raw"  # bytes as written, not re-encoded
    assert r.headers["X-Gpuwarden-Attempt"] == "1"
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "X-Gpuwarden-Note" not in r.headers
    r = api.client.get("/v1/jobs/j/logs/stderr?attempt=1", headers=api.h("submitter"))
    assert r.status_code == 200 and r.content == b"oops\n"  # by the id without its prefix
    r = api.client.get(f"/v1/jobs/{mine}/logs/stdout?follow=true", headers=api.h("submitter"))
    assert r.status_code == 200 and r.content == b"hello\n\xff raw"  # ended: the whole, then end


def test_bad_requests_say_what_to_change(api: Api) -> None:
    ran(api, "owner", "j", out=b"x")
    r = api.client.get("/v1/jobs/j/logs/stdin", headers=api.h("owner"))
    assert r.status_code == 422 and "stdout" in r.json()["error"]
    r = api.client.get("/v1/jobs/j/logs/stdout?attempt=7", headers=api.h("owner"))
    assert r.status_code == 404
    assert r.json()["error"] == "job j has no attempt 7 (its attempts: 1)"
    r = api.client.get("/v1/jobs/j/logs/stdout?attempt=0", headers=api.h("owner"))
    assert r.status_code == 422
    api.store.submit([JobSpec(id="q", type="echo.echo", params={"text": "x"})], now=1.0)
    r = api.client.get("/v1/jobs/q/logs/stdout?follow=true", headers=api.h("owner"))
    assert r.status_code == 409 and "has not started" in r.json()["error"]
    r = api.client.get("/v1/jobs/nope/logs/stdout", headers=api.h("owner"))
    assert r.status_code == 404 and "no job with id 'nope'" in r.json()["error"]


def test_a_link_planted_as_the_stream_is_refused_not_followed(api: Api) -> None:
    secret = api.tmp / "secret.txt"
    secret.write_text("the broker's secret")
    folder = ran(api, "owner", "j", out=b"kept copy", err=b"")
    (folder / "stdout.log").unlink()
    (folder / "stdout.log").symlink_to(secret)
    os.mkfifo(folder / "stderr.log.fifo")
    (folder / "stderr.log").unlink()
    os.rename(folder / "stderr.log.fifo", folder / "stderr.log")
    # the attack is in place: a link to a file outside, a FIFO with no writer
    assert (folder / "stdout.log").is_symlink() and (folder / "stdout.log").read_text()
    assert (folder / "stderr.log").is_fifo()
    r = api.client.get("/v1/jobs/j/logs/stdout", headers=api.h("owner"))
    assert r.status_code == 200
    assert b"secret" not in r.content and r.content == b"kept copy"  # the copy kept with it
    assert r.headers["X-Gpuwarden-Refused"] == "true"
    assert "is a symlink, not a regular file" in r.headers["X-Gpuwarden-Note"]
    r = api.client.get("/v1/jobs/j/logs/stderr?follow=true", headers=api.h("owner"))
    assert r.status_code == 200 and r.content == b""  # never blocked on the FIFO
    assert "is a fifo, not a regular file" in r.headers["X-Gpuwarden-Note"]
    # nothing was changed, and the API still answers
    assert secret.read_text() == "the broker's secret" and (folder / "stdout.log").is_symlink()
    assert api.client.get("/v1/jobs/j", headers=api.h("owner")).status_code == 200


def test_an_attempt_of_another_node_says_where_its_streams_are(api: Api) -> None:
    api.store.submit([JobSpec(id="far", type="echo.echo", params={"text": "x"})], now=1.0)
    api.store.start_attempt("far", node="gpu-b", gpu_uuid=None, now=2.0)
    r = api.client.get("/v1/jobs/far/logs/stdout", headers=api.h("owner"))
    assert r.status_code == 200 and r.content == b""
    assert r.headers["X-Gpuwarden-Note"] == (
        "attempt 1 runs on node gpu-b: its stdout.log is in that node's state directory"
    )
    assert str(api.tmp) not in str(r.headers)  # no host path


def test_follow_sends_what_is_written_until_the_attempt_ends(api: Api) -> None:
    folder = ran(api, "owner", "live", out=b"first\n", end=False)
    got: list[bytes] = []
    seen_first = threading.Event()

    def read() -> None:
        with api.client.stream(
            "GET", "/v1/jobs/live/logs/stdout?follow=true", headers=api.h("owner")
        ) as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():
                got.append(chunk)
                if b"first" in b"".join(got):
                    seen_first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert seen_first.wait(30), "the follower sent nothing of a running attempt"
    assert reader.is_alive()  # the attempt runs: the answer goes on
    with (folder / "stdout.log").open("ab") as f:
        f.write(b"second\n")
    api.store.finish_attempt(
        "live", 1, target=JobState.DONE, now=5.0, outcome="succeeded", reason="done",
        exit_code=0, result={"outputs": []},
    )  # fmt: skip
    reader.join(30)
    assert not reader.is_alive()
    assert b"".join(got) == b"first\nsecond\n"
    assert logs_route.FOLLOWERS.used == 0  # its slot was given back


def test_followers_are_bounded(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    ran(api, "owner", "live", out=b"x", end=False)
    monkeypatch.setattr(logs_route.FOLLOWERS, "used", logs_route.FOLLOWERS.most)
    r = api.client.get("/v1/jobs/live/logs/stdout?follow=true", headers=api.h("owner"))
    assert r.status_code == 429 and "being followed already" in r.json()["error"]
    assert r.headers["Retry-After"] == "5"


def test_a_read_stops_at_the_size_the_file_had(tmp_path: Path) -> None:
    f = tmp_path / "stdout.log"
    f.write_bytes(b"a" * (joblogs.CHUNK + 10))
    fd = os.open(f, os.O_RDONLY)
    try:
        with f.open("ab") as more:
            chunks = joblogs.read_all(fd)
            first = next(chunks)
            more.write(b"b" * 1000)  # a job that keeps writing
            rest = b"".join(chunks)
    finally:
        os.close(fd)
    assert len(first) == joblogs.CHUNK and rest == b"a" * 10


def test_terminal_output_is_escaped() -> None:
    assert printable("ok\tfine\n") == "ok\tfine\n"
    assert printable("\x1b]0;pwned\x07red\r\x9b2J") == "\\x1b]0;pwned\\x07red\\r\\x9b2J"


@pytest.mark.parametrize(
    ("word", "candidates", "said"),
    [
        ("--wiat", ["--want", "--wait", "--wait-timeout"], " (did you mean --wait?)"),
        ("sumbit", ["serve", "submit", "status"], " (did you mean submit?)"),
        ("--jsno", ["--json", "--limit"], " (did you mean --json?)"),
        ("--colour", ["--text", "--output"], ""),
        ("-x", ["-p", "-v"], ""),  # one edit of two characters is no match
        # another tool's word: the command that means it, not the nearest spelling
        ("undrain", ["invite", "list", "drain", "resume", "revoke"], " (did you mean resume?)"),
        ("uncordon", ["drain", "resume"], " (did you mean resume?)"),
        ("undrain", ["drain", "list"], ""),  # no resume here: no misleading drain either
    ],
)
def test_did_you_mean(word: str, candidates: list[str], said: str) -> None:
    assert did_you_mean(word, candidates) == said


def test_the_build_stream_is_the_attempts_build_log(
    api: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job from a pinned commit: ``build`` is the output of its image's build
    (``build.log`` beside ``stdout.log``; SPEC.md, "Jobs from a pinned commit"),
    through the API, the client and ``gpuwarden logs --stream build --url``."""
    folder = ran(api, "owner", "j", out=b"trained\n")
    r = api.client.get("/v1/jobs/j/logs/build", headers=api.h("owner"))
    assert r.status_code == 200 and r.content == b""  # no copy is kept of a build
    assert r.headers["X-Gpuwarden-Note"] == "attempt 1 left no build.log"
    (folder / "build.log").write_bytes(b"STEP 1/2: FROM base\nCOMMIT\n")
    r = api.client.get("/v1/jobs/j/logs/build", headers=api.h("owner"))
    assert r.status_code == 200 and r.content == b"STEP 1/2: FROM base\nCOMMIT\n"
    with c.Client("http://testserver", api.tokens["owner"], http=api.client) as client:
        monkeypatch.setattr(common, "remote", lambda args: client)
        code = cli.main(["logs", "--url", "http://testserver", "j", "--stream", "build"])
        assert code == 0 and "STEP 1/2: FROM base" in capsys.readouterr().out
        code = cli.main(
            ["logs", "--url", "http://testserver", "j", "--stream", "build", "--stderr"]
        )
        assert code == 2 and "do not go together" in capsys.readouterr().err
