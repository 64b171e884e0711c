"""The serve protocol: how the broker and a warm serve worker talk over a unix socket.

Connection
----------
For each serve worker it starts, the broker listens on a unix stream socket
(``AF_UNIX``, ``SOCK_STREAM``; the socket file has mode 0600) and starts the
worker process with two more environment variables:

=========================  ====================================================
``GPUWARDEN_SERVE_SOCKET``  the path of the socket to connect to
``GPUWARDEN_SERVE_EPOCH``   the worker's epoch, a decimal integer
=========================  ====================================================

The worker also gets ``GPUWARDEN_SCRATCH_DIR``, a scratch folder for its load
(``<worker log dir>/scratch`` unless the broker sets another), besides the
usual job environment (section 7) with its GPU in ``CUDA_VISIBLE_DEVICES``.

The worker connects once. The broker accepts one connection, then closes the
listening socket and removes its file; nobody else can connect.

A worker started with ``GPUWARDEN_SERVE_WAIT_S`` above 0 outlives a broker that
goes away without ``stop`` (end of file): it connects to the same path again
until a new broker listens there, or that many seconds pass (then it exits 0).
The new broker accepts only a process carrying the worker's marker
(``SO_PEERCRED``); the worker says ``hello`` and ``ready`` again, each with
``"resumed": true``, the ``ready`` with its first load's ``load_s`` and
``device_bytes``, and loads nothing.

Framing
-------
Both directions carry frames. A frame is a 4-byte big-endian unsigned length
``N``, then ``N`` bytes of UTF-8 JSON holding exactly one object;
``1 <= N <= MAX_FRAME`` (16 MiB, 16 777 216 bytes). Every object has a string
``"type"`` and an integer ``"epoch"`` (``true``/``false`` are not integers).
Unknown keys are ignored.

A frame is garbage when its length is 0 or more than ``MAX_FRAME``, its bytes
are not UTF-8, not JSON (``NaN`` and ``Infinity`` are not JSON), not an object,
or the object has no string ``type`` or no integer ``epoch``. Garbage is a
protocol error: the connection is not used again. End of file, also in the
middle of a frame, means the peer is gone.

Messages
--------
Worker to broker:

================  ==========================================================
``hello``         ``{"type": "hello", "epoch": E, "pid": P}`` — the first
                  message, sent right after connecting; ``P`` is the worker's
                  process id
``ready``         ``{"type": "ready", "epoch": E, "load_s": S, "device_bytes":
                  B}`` — the model is loaded; ``S`` (a number >= 0) is how
                  many seconds the load took, ``B`` (an integer >= 0, or
                  ``null`` when the module does not say) how many bytes of
                  the model are in GPU memory
``load_failed``   ``{"type": "load_failed", "epoch": E, "error": R}`` — the
                  load raised; ``R`` is ``"<ExceptionType>: <message>"``. The
                  worker exits with status 1 after sending it
``result``        ``{"type": "result", "epoch": E, "job": J, "attempt": N,
                  "ok": K, "message": M, "error": X}`` — the end of job ``J``,
                  attempt ``N``. ``K`` is ``true`` when the handler returned;
                  ``M`` is what it returned (a string, or ``null``).
                  ``K`` is ``false`` when the handler raised; ``X`` is then
                  ``"<ExceptionType>: <message>"`` (``null`` when ``K`` is
                  ``true``)
================  ==========================================================

Broker to worker:

========  ==================================================================
``job``   ``{"type": "job", "epoch": E, "job": J, "attempt": N, "params":
          {...}, "input_dir": I, "output_dir": O, "scratch_dir": T}`` — run
          one job: ``J`` the job id, ``N`` the attempt number, the
          parameters as in ``params.json`` (section 7: defaults filled in,
          each ``input`` parameter an absolute path), and the absolute
          paths of the input, output and scratch folders of this attempt
``stop``  ``{"type": "stop", "epoch": E}`` — finish and exit with status 0
========  ==================================================================

Sequence
--------
1. The worker connects and sends ``hello``, then loads its model and sends
   ``ready`` or ``load_failed``. The broker waits for both within the load
   timeout.
2. The broker sends one ``job`` and waits for its ``result``, within the job
   type's ``timeout_s``. It sends the next ``job`` only after that ``result``:
   a worker runs one job at a time and keeps its model loaded between jobs.
3. On ``stop``, or at end of file, the worker exits with status 0. A worker
   that does not exit within a short grace is stopped like any attempt (its
   whole process tree: SIGTERM, then SIGKILL, until confirmed gone).

Epochs and attempts
-------------------
Each worker the broker starts gets a new epoch, never reused on that node. The
worker ignores a message whose epoch is not its own, and one of its own epoch
whose type it does not know; it exits with status 1 on garbage or a malformed
``job``. The broker counts a
``result`` only if its epoch, job and attempt are those of the job it is
waiting for; any other message (from an evicted or replaced worker, or for a
superseded attempt) is dropped and logged, never recorded.

Failures
--------
- The handler raises: ``result`` with ``ok`` false. That is the job's own
  failure (never retried); the worker goes on serving.
- The load raises (``load_failed``), no ``ready`` within the load timeout, or
  the placement check refuses the load (the module declares the bytes its
  model should have in GPU memory and ``device_bytes`` is missing or below 99 %
  of that: the model silently fell back to the CPU): the worker is stopped and
  the job that was waiting for it is retried as an infrastructure failure.
- No ``result`` within the job's timeout, garbage, end of file, or the worker
  process exits: the worker is stopped and confirmed gone, and the job is
  retried as an infrastructure failure. The next job of that type starts a
  fresh worker with a new epoch.
"""

from __future__ import annotations

import contextlib
import json
import math
import select
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, TypeVar

from gpuwarden.errors import GpuwardenError

__all__ = [
    "HEADER_BYTES",
    "MAX_FRAME",
    "Channel",
    "PeerClosed",
    "ProtocolError",
    "decode",
    "encode",
    "field",
    "optional_field",
]

#: the largest frame body, in bytes
MAX_FRAME = 16 * 1024 * 1024
#: bytes of the length prefix
HEADER_BYTES = 4
#: bytes read from the socket at a time
_RECV_CHUNK = 64 * 1024

_T = TypeVar("_T")


class ProtocolError(GpuwardenError):
    """The peer sent something that is not a valid serve-protocol frame."""


class PeerClosed(GpuwardenError):
    """The peer closed the connection."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_message(obj: object) -> dict[str, Any]:
    """Return ``obj`` if it is a message (a dict with a string ``type`` and an
    integer ``epoch``); raise :class:`ProtocolError` saying what is wrong."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"the frame holds a JSON {type(obj).__name__}, not an object")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("the message has no string 'type'")
    epoch = obj.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ProtocolError(f"the {kind!r} message has no integer 'epoch'")
    return obj


def encode(msg: Mapping[str, Any]) -> bytes:
    """Return the frame for ``msg``: its length as 4 bytes big-endian, then its
    UTF-8 JSON. Raise :class:`ProtocolError` if ``msg`` is not a valid message
    (string ``type``, integer ``epoch``), cannot be written as strict JSON, or
    its frame would be larger than :data:`MAX_FRAME`."""
    check_message(dict(msg))
    try:
        body = json.dumps(msg, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8"
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"cannot encode the {msg.get('type')!r} message: {exc}") from exc
    if len(body) > MAX_FRAME:
        raise ProtocolError(
            f"the {msg.get('type')!r} message is {len(body)} bytes, more than {MAX_FRAME}"
        )
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def decode(body: bytes) -> dict[str, Any]:
    """Return the message in one frame ``body`` (the bytes after the length);
    raise :class:`ProtocolError` if it is garbage."""
    if not body:
        raise ProtocolError("empty frame")
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes, more than {MAX_FRAME}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"the frame is not UTF-8: {exc}") from exc
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the frame is not JSON: {exc}") from exc
    return check_message(obj)


def field(msg: Mapping[str, Any], name: str, kind: type[_T]) -> _T:
    """Return ``msg[name]`` if it is a ``kind`` (for ``int``, not a boolean; for
    ``float``, any finite int or float, converted); else raise
    :class:`ProtocolError` naming the message and the field."""
    value = msg.get(name)
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)  # type: ignore[return-value]
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ProtocolError(
        f"the {msg.get('type')!r} message has no valid {name!r} ({kind.__name__} expected, "
        f"got {_short(value)})"
    )


def optional_field(msg: Mapping[str, Any], name: str, kind: type[_T]) -> _T | None:
    """Like :func:`field`, but a missing key or ``null`` gives ``None``."""
    if msg.get(name) is None:
        return None
    return field(msg, name, kind)


def _short(value: object) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


class Channel:
    """Frames over one connected stream socket.

    ``send`` may be called from any thread (sends are serialised); ``recv`` from
    one thread at a time; ``close`` must not race a ``recv`` in another thread
    (the caller serialises them). Partial frames stay buffered across ``recv``
    calls, so a timeout never loses bytes. After a :class:`ProtocolError` the
    channel is unusable: every later ``recv`` raises the same error.
    """

    def __init__(self, sock: socket.socket) -> None:
        # blocking fd; each call waits with poll() and reads or writes with
        # MSG_DONTWAIT, so no per-socket timeout is shared between threads
        sock.setblocking(True)
        self._sock = sock
        self._buf = bytearray()
        self._eof = False
        self._broken: ProtocolError | None = None
        self._send_lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, msg: Mapping[str, Any], timeout_s: float | None = None) -> None:
        """Send one message. Raise :class:`PeerClosed` if the peer is gone,
        :class:`ProtocolError` if ``msg`` cannot be encoded, and
        :class:`TimeoutError` if the peer does not take it within ``timeout_s``
        (``None``: wait as long as it takes)."""
        data = memoryview(encode(msg))
        deadline = _deadline(timeout_s)
        flags = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
        with self._send_lock:
            if self._closed:
                raise PeerClosed("the channel is closed")
            while data:
                if not self._wait(select.POLLOUT, deadline):
                    raise TimeoutError(f"the peer did not take a frame within {timeout_s} s")
                try:
                    sent = self._sock.send(data, flags)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    raise PeerClosed(f"the peer closed the connection: {exc}") from exc
                data = data[sent:]

    def recv(self, timeout_s: float | None) -> dict[str, Any]:
        """Return the next message. Raise :class:`TimeoutError` when none is
        complete within ``timeout_s`` (``None`` or infinite: wait as long as it
        takes; 0: only what has arrived) — the bytes of a partial frame are
        kept for the next call. Raise :class:`ProtocolError` on garbage and
        :class:`PeerClosed` at end of file."""
        deadline = _deadline(timeout_s)
        while True:
            msg = self._take()
            if msg is not None:
                return msg
            if self._eof:
                if self._buf:
                    raise PeerClosed(
                        f"the peer closed the connection in the middle of a frame "
                        f"({len(self._buf)} bytes of it received)"
                    )
                raise PeerClosed("the peer closed the connection")
            if self._closed:
                raise PeerClosed("the channel is closed")
            if not self._wait(select.POLLIN, deadline):
                raise TimeoutError(f"no complete message within {timeout_s} s")
            try:
                data = self._sock.recv(_RECV_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # reset by the peer, or shut down
                data = b""
            if data:
                self._buf += data
            else:
                self._eof = True

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _take(self) -> dict[str, Any] | None:
        """Return the first complete message of the buffer (and remove it), or
        ``None`` if the buffer holds no complete frame."""
        if self._broken is not None:
            raise self._broken
        buf = self._buf
        if len(buf) < HEADER_BYTES:
            return None
        size = int.from_bytes(buf[:HEADER_BYTES], "big")
        try:
            if size == 0:
                raise ProtocolError("frame of length 0")
            if size > MAX_FRAME:
                raise ProtocolError(f"frame of length {size}, more than {MAX_FRAME}")
            if len(buf) < HEADER_BYTES + size:
                return None
            body = bytes(buf[HEADER_BYTES : HEADER_BYTES + size])
            del buf[: HEADER_BYTES + size]
            return decode(body)
        except ProtocolError as exc:
            self._broken = exc
            raise

    def _wait(self, event: int, deadline: float | None) -> bool:
        """Wait until the socket is ready for ``event`` (or hung up); False if
        ``deadline`` passed first."""
        poller = select.poll()
        poller.register(self._sock, event)
        while True:
            if deadline is None:
                timeout_ms: int | None = None
            else:
                timeout_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if poller.poll(timeout_ms):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def _deadline(timeout_s: float | None) -> float | None:
    """The monotonic time ``timeout_s`` from now; ``None`` for no limit (``None``
    or +inf). Negative and NaN timeouts count as 0."""
    if timeout_s is None or timeout_s == math.inf:
        return None
    if not timeout_s > 0:  # negative, zero or NaN
        return time.monotonic()
    return time.monotonic() + timeout_s
