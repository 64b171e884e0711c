"""The serve protocol's framing over real sockets: round trips, frames split
across reads, every kind of garbage, end of file, and timeouts that keep a
partial frame."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gpuwarden.server.protocol import (
    MAX_FRAME,
    Channel,
    PeerClosed,
    ProtocolError,
    decode,
    encode,
    field,
    optional_field,
)


@pytest.fixture
def pair() -> Iterator[tuple[Channel, socket.socket]]:
    """A channel and the raw socket at the other end."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = Channel(a)
    try:
        yield channel, b
    finally:
        channel.close()
        b.close()


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def test_encode_is_length_then_utf8_json() -> None:
    data = encode({"type": "hello", "epoch": 3, "pid": 42, "name": "é"})
    body = data[4:]
    assert int.from_bytes(data[:4], "big") == len(body)
    assert json.loads(body.decode("utf-8")) == {"type": "hello", "epoch": 3, "pid": 42, "name": "é"}
    assert decode(body) == {"type": "hello", "epoch": 3, "pid": 42, "name": "é"}


def test_round_trip_both_ways(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    other = Channel(raw)
    job = {
        "type": "job",
        "epoch": 1,
        "job": "j1",
        "attempt": 2,
        "params": {"prompt": "ünïcode ✓", "n": 3, "x": 1.5, "flag": True, "none": None},
        "input_dir": "/in",
        "output_dir": "/out",
        "scratch_dir": "/tmp/s",
    }
    channel.send(job)
    assert other.recv(1.0) == job
    other.send({"type": "result", "epoch": 1, "job": "j1", "attempt": 2, "ok": True})
    assert channel.recv(1.0)["ok"] is True


def test_several_frames_in_one_read(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    raw.sendall(b"".join(encode({"type": "m", "epoch": 0, "i": i}) for i in range(5)))
    assert [channel.recv(1.0)["i"] for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(TimeoutError):
        channel.recv(0)


def test_partial_frames_across_recv_calls(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    data = encode({"type": "ready", "epoch": 9, "load_s": 1.25, "device_bytes": None})
    data += encode({"type": "stop", "epoch": 9})
    got = []
    # byte by byte, with a timed-out recv after each byte: nothing is lost
    for byte in data:
        raw.sendall(bytes([byte]))
        with contextlib.suppress(TimeoutError):
            got.append(channel.recv(0.01))
    assert got == [
        {"type": "ready", "epoch": 9, "load_s": 1.25, "device_bytes": None},
        {"type": "stop", "epoch": 9},
    ]


def test_timeout_keeps_the_partial_buffer(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    data = encode({"type": "hello", "epoch": 1, "pid": 7})
    raw.sendall(data[:2])
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        channel.recv(0.1)
    assert time.monotonic() - start >= 0.09
    raw.sendall(data[2:9])
    with pytest.raises(TimeoutError):
        channel.recv(0)
    raw.sendall(data[9:])
    assert channel.recv(1.0) == {"type": "hello", "epoch": 1, "pid": 7}


def test_recv_without_timeout_waits(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    timer = threading.Timer(0.1, raw.sendall, (encode({"type": "stop", "epoch": 2}),))
    timer.start()
    try:
        assert channel.recv(None) == {"type": "stop", "epoch": 2}
    finally:
        timer.cancel()


def test_large_frame_round_trip(pair: tuple[Channel, socket.socket]) -> None:
    """A frame much larger than the socket buffer: the reader drains while the
    writer writes."""
    channel, raw = pair
    other = Channel(raw)
    msg = {"type": "result", "epoch": 1, "message": "x" * (4 * 1024 * 1024)}
    sender = threading.Thread(target=other.send, args=(msg,))
    sender.start()
    try:
        assert channel.recv(10.0) == msg
    finally:
        sender.join(10)


GARBAGE = {
    "length 0": b"\x00\x00\x00\x00",
    "length over MAX_FRAME": (MAX_FRAME + 1).to_bytes(4, "big"),
    "an HTTP request": b"GET / HTTP/1.1\r\n\r\n",
    "not UTF-8": frame(b'{"type": "hello", "epoch": 1, "x": "\xff\xfe"}'),
    "not JSON": frame(b"hello there"),
    "truncated JSON": frame(b'{"type": "hello", "epoch": 1'),
    "NaN": frame(b'{"type": "ready", "epoch": 1, "load_s": NaN}'),
    "Infinity": frame(b'{"type": "ready", "epoch": 1, "load_s": Infinity}'),
    "an array": frame(b'[{"type": "hello", "epoch": 1}]'),
    "a string": frame(b'"hello"'),
    "a number": frame(b"1"),
    "null": frame(b"null"),
    "no type": frame(b'{"epoch": 1}'),
    "type not a string": frame(b'{"type": 5, "epoch": 1}'),
    "no epoch": frame(b'{"type": "hello"}'),
    "epoch a string": frame(b'{"type": "hello", "epoch": "1"}'),
    "epoch a float": frame(b'{"type": "hello", "epoch": 1.0}'),
    "epoch a boolean": frame(b'{"type": "hello", "epoch": true}'),
    "epoch null": frame(b'{"type": "hello", "epoch": null}'),
}


@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_a_protocol_error(pair: tuple[Channel, socket.socket], data: bytes) -> None:
    channel, raw = pair
    raw.sendall(data + encode({"type": "stop", "epoch": 1}))
    with pytest.raises(ProtocolError):
        channel.recv(1.0)
    # the channel is not used again: the valid frame after the garbage is not read
    with pytest.raises(ProtocolError):
        channel.recv(0)


def test_oversized_length_fails_before_the_body_arrives(
    pair: tuple[Channel, socket.socket],
) -> None:
    channel, raw = pair
    raw.sendall((MAX_FRAME + 1).to_bytes(4, "big"))
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="more than"):
        channel.recv(5.0)
    assert time.monotonic() - start < 1.0


def test_a_frame_of_exactly_max_frame_is_accepted(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    head = b'{"type":"m","epoch":0,"pad":"'
    body = head + b"x" * (MAX_FRAME - len(head) - 2) + b'"}'
    assert len(body) == MAX_FRAME
    sender = threading.Thread(target=raw.sendall, args=(frame(body),))
    sender.start()
    try:
        assert len(channel.recv(10.0)["pad"]) == MAX_FRAME - len(head) - 2
    finally:
        sender.join(10)


def test_eof_is_peer_closed(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    raw.sendall(encode({"type": "hello", "epoch": 1, "pid": 1}))
    raw.close()
    assert channel.recv(1.0)["type"] == "hello"  # what came before the end is delivered
    with pytest.raises(PeerClosed, match="closed the connection"):
        channel.recv(1.0)


def test_eof_mid_frame_is_peer_closed(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    raw.sendall(encode({"type": "hello", "epoch": 1, "pid": 1})[:10])
    raw.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerClosed, match="middle of a frame"):
        channel.recv(1.0)


def test_eof_mid_header_is_peer_closed(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    raw.sendall(b"\x00\x00")
    raw.close()
    with pytest.raises(PeerClosed, match="middle of a frame"):
        channel.recv(1.0)


def test_send_to_a_closed_peer_is_peer_closed(pair: tuple[Channel, socket.socket]) -> None:
    channel, raw = pair
    raw.close()
    with pytest.raises(PeerClosed):
        for _ in range(100):  # the first sends may still be buffered
            channel.send({"type": "stop", "epoch": 1})


def test_send_times_out_when_the_peer_does_not_read(pair: tuple[Channel, socket.socket]) -> None:
    channel, _raw = pair
    msg = {"type": "m", "epoch": 0, "pad": "x" * (8 * 1024 * 1024)}
    with pytest.raises(TimeoutError):
        channel.send(msg, timeout_s=0.2)


def test_a_closed_channel_refuses(pair: tuple[Channel, socket.socket]) -> None:
    channel, _raw = pair
    channel.close()
    channel.close()  # idempotent
    assert channel.closed
    with pytest.raises(PeerClosed):
        channel.send({"type": "stop", "epoch": 1})
    with pytest.raises(PeerClosed):
        channel.recv(0)


@pytest.mark.parametrize(
    "msg",
    [
        {"epoch": 1},
        {"type": "hello"},
        {"type": "hello", "epoch": True},
        {"type": 1, "epoch": 1},
        {"type": "ready", "epoch": 1, "load_s": float("nan")},
        {"type": "ready", "epoch": 1, "obj": object()},
        {"type": "ready", "epoch": 1, "text": "\udcff"},
    ],
    ids=["no type", "no epoch", "bool epoch", "int type", "NaN", "object", "lone surrogate"],
)
def test_encode_refuses_what_is_not_a_message(msg: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        encode(msg)


def test_encode_refuses_a_frame_over_max_frame() -> None:
    with pytest.raises(ProtocolError, match="more than"):
        encode({"type": "m", "epoch": 0, "pad": "x" * MAX_FRAME})


def test_field_checks_types() -> None:
    msg = {"type": "t", "epoch": 1, "n": 3, "b": True, "f": 2, "s": "x", "z": None}
    assert field(msg, "n", int) == 3
    assert field(msg, "b", bool) is True
    assert field(msg, "f", float) == 2.0
    assert isinstance(field(msg, "f", float), float)
    assert field(msg, "s", str) == "x"
    assert optional_field(msg, "z", str) is None
    assert optional_field(msg, "missing", int) is None
    with pytest.raises(ProtocolError, match="'b'"):
        field(msg, "b", int)  # a boolean is not an integer
    with pytest.raises(ProtocolError, match="'b'"):
        field(msg, "b", float)
    with pytest.raises(ProtocolError, match="'missing'"):
        field(msg, "missing", str)
    with pytest.raises(ProtocolError):
        optional_field(msg, "s", int)
