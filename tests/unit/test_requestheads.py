"""A forwarder reads every request head of a connection (node/requestheads.py;
issue 30, item 5): the route header is removed from each, bodies pass byte for
byte, and what cannot be framed is refused."""

from __future__ import annotations

import pytest

from gpuwarden.node.requestheads import HEAD_MAX, BadRequest, RequestHeads

CRED = b"X-Gpuwarden-Route: route-credential-0123456789\r\n"


def req(method: bytes = b"GET", body: bytes = b"", extra: bytes = b"") -> bytes:
    length = b"Content-Length: %d\r\n" % len(body) if body else b""
    return b"%s /p HTTP/1.1\r\nHost: h\r\n%s%s%s\r\n%s" % (method, CRED, length, extra, body)


def feed_all(data: bytes, step: int | None = None) -> bytes:
    heads = RequestHeads()
    if step is None:
        return heads.feed(data)
    return b"".join(heads.feed(data[i : i + step]) for i in range(0, len(data), step))


def test_the_route_header_goes_from_every_pipelined_request() -> None:
    sent = req() + req(b"POST", b"hello") + req()
    # planted: the header is on each of the three requests sent
    assert sent.count(b"X-Gpuwarden-Route") == 3
    for step in (None, 1, 7, 64):
        out = feed_all(sent, step)
        assert b"gpuwarden-route" not in out.lower(), step
        assert out.count(b"GET /p HTTP/1.1") == 2 and out.count(b"POST /p HTTP/1.1") == 1
        assert out.endswith(b"\r\n\r\n") and b"\r\n\r\nhello" in out


def test_a_body_passes_untouched_even_when_it_looks_like_a_header() -> None:
    body = b"X-Gpuwarden-Route: not-a-header\r\n\r\nGET / HTTP/1.1\r\n\r\n"
    out = feed_all(req(b"POST", body) + req())
    assert out.count(body) == 1
    assert out.count(b"X-Gpuwarden-Route") == 1  # the body's own text, nothing else


def test_chunked_bodies_and_their_trailers() -> None:
    chunked = (
        b"POST /c HTTP/1.1\r\nHost: h\r\n" + CRED + b"Transfer-Encoding: gzip, chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n"
        b"0\r\n" + CRED + b"X-Other: kept\r\n\r\n"
    )
    out = feed_all(chunked + req(), 3)
    assert b"gpuwarden-route" not in out.lower()
    assert b"5;ext=1\r\nhello\r\n0\r\nX-Other: kept\r\n\r\nGET /p HTTP/1.1" in out


def test_after_a_switch_of_protocols_everything_passes() -> None:
    upgrade = req(extra=b"Connection: Upgrade\r\nUpgrade: websocket\r\n")
    frames = b"\x81\x05hello" + req()  # after the switch: not heads any more
    heads = RequestHeads()
    out = heads.feed(upgrade)
    assert heads.raw and b"gpuwarden-route" not in out.lower()
    assert heads.feed(frames) == frames
    # Upgrade without Connection: upgrade is a plain request
    heads = RequestHeads()
    heads.feed(req(extra=b"Upgrade: websocket\r\n"))
    assert not heads.raw


@pytest.mark.parametrize(
    "bad",
    [
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-A: 1\r\n X-Gpuwarden-Route: folded\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-Gpuwarden-Route : spaced\r\n\r\n",
        b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
        b"GET /\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"CONNECT h:1 HTTP/1.1\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabX\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * (HEAD_MAX + 10),
    ],
)
def test_what_cannot_be_framed_is_refused(bad: bytes) -> None:
    with pytest.raises(BadRequest):
        RequestHeads().feed(bad)


def test_a_second_request_that_cannot_be_framed_is_refused_too() -> None:
    heads = RequestHeads()
    heads.feed(req())
    with pytest.raises(BadRequest):
        heads.feed(b"GET / HTTP/1.1\r\nX-Gpuwarden-Route : x\r\n\r\n")


def test_a_lone_content_length_list_of_one_value_is_one_body() -> None:
    out = feed_all(b"POST / HTTP/1.1\r\nContent-Length: 2, 2\r\n\r\nok" + req())
    assert out.count(b"GET /p") == 1 and b"\r\n\r\nokGET" in out
