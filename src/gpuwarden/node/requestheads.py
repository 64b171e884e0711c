"""The requests a service forwarder relays, one by one (SPEC.md section 14,
"Reaching a service"): every request head of a connection is read and its route
header removed before it is passed on, not only the first one's.

:class:`RequestHeads` takes what the client side of a forwarder's connection
sends, as it comes, and returns what may go to the service. It reads HTTP/1.1's
framing of requests (RFC 9112): a head up to its blank line, then a body of
``Content-Length`` bytes or in chunks (``Transfer-Encoding: chunked``, whose
trailer lines are read as header lines), then the next head. Bodies pass as they
are, byte for byte. After a request that asks to switch protocols (``Upgrade``
named in ``Connection``: a WebSocket) everything passes, as the protocol that
follows has no heads. What it cannot frame without guessing is refused
(:class:`BadRequest`, and the connection is closed): a head over
:data:`HEAD_MAX`, a folded header line, a header name that is not a token,
``Content-Length`` and ``Transfer-Encoding`` together, a ``Transfer-Encoding``
that does not end in ``chunked``, differing or malformed lengths, ``CONNECT``.
"""

from __future__ import annotations

import re

#: the header that carries a route's credential (never relayed to a service)
ROUTE_HEADER = "X-Gpuwarden-Route"
#: the most one request head (or a chunked body's trailer) may hold
HEAD_MAX = 64 * 1024
#: the most a chunk-size line may hold
CHUNK_LINE_MAX = 4096

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(rb"HTTP/1\.[0-9]")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_ROUTE = ROUTE_HEADER.lower().encode()


class BadRequest(Exception):
    """What the client sent cannot be framed as HTTP/1.1 requests: the forwarder
    closes the connection."""


def route_header_line(line: bytes) -> bool:
    """Whether a header line is the route header (any case)."""
    name, sep, _ = line.partition(b":")
    return bool(sep) and name.strip().lower() == _ROUTE


class RequestHeads:
    """A connection's requests as they come (see the module's docstring)."""

    def __init__(self) -> None:
        self._buf = b""
        #: "head", "body", "size", "chunk", "chunk-end", "trailer" or "raw"
        self._state = "head"
        self._left = 0  # bytes of the body or chunk still to pass
        self._upgrade = False  # the message being read asks to switch protocols
        self._trailer = 0  # bytes of the trailer read so far

    @property
    def raw(self) -> bool:
        """Whether everything passes from now on (after a switch of protocols)."""
        return self._state == "raw"

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (and what came before it, held back) goes to the
        service now. Raises :class:`BadRequest`."""
        if self._state == "raw":
            return data
        self._buf += data
        out = bytearray()
        while self._step(out):
            pass
        return bytes(out)

    def _step(self, out: bytearray) -> bool:
        """One step of the state machine; False when it needs more bytes."""
        state = self._state
        if state == "raw":
            out += self._buf
            self._buf = b""
            return False
        if state in ("body", "chunk"):
            return self._pass(out)
        if state == "chunk-end":
            if len(self._buf) < 2:
                return False
            if self._buf[:2] != b"\r\n":
                raise BadRequest("a chunk does not end with CRLF")
            out += b"\r\n"
            self._buf, self._state = self._buf[2:], "size"
            return True
        if state == "size":
            return self._size(out)
        if state == "trailer":
            return self._trailer_line(out)
        return self._head(out)

    def _pass(self, out: bytearray) -> bool:
        n = min(self._left, len(self._buf))
        out += self._buf[:n]
        self._buf, self._left = self._buf[n:], self._left - n
        if self._left:
            return False
        self._state = "chunk-end" if self._state == "chunk" else self._after()
        return True

    def _line(self, most: int) -> bytes | None:
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > most:
                raise BadRequest(f"a line of more than {most} bytes")
            return None
        if end > most:
            raise BadRequest(f"a line of more than {most} bytes")
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return line

    def _size(self, out: bytearray) -> bool:
        line = self._line(CHUNK_LINE_MAX)
        if line is None:
            return False
        digits = line.split(b";", 1)[0].strip(b" \t")
        if not _HEX.fullmatch(digits):
            raise BadRequest("a chunk size that is not hexadecimal")
        size = int(digits, 16)
        out += line + b"\r\n"
        if size == 0:
            self._state, self._trailer = "trailer", 0
        else:
            self._state, self._left = "chunk", size
        return True

    def _trailer_line(self, out: bytearray) -> bool:
        line = self._line(HEAD_MAX)
        if line is None:
            return False
        if not line:
            out += b"\r\n"
            self._state = self._after()
            return True
        self._trailer += len(line) + 2
        if self._trailer > HEAD_MAX:
            raise BadRequest(f"a trailer of more than {HEAD_MAX} bytes")
        _header_line(line)
        if not route_header_line(line):
            out += line + b"\r\n"
        return True

    def _head(self, out: bytearray) -> bool:
        while self._buf.startswith(b"\r\n"):  # empty lines before a request are ignored
            self._buf = self._buf[2:]
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > HEAD_MAX:
                raise BadRequest(f"a request head of more than {HEAD_MAX} bytes")
            return False
        if end > HEAD_MAX:
            raise BadRequest(f"a request head of more than {HEAD_MAX} bytes")
        head, self._buf = self._buf[:end], self._buf[end + 4 :]
        out += self._frame(head) + b"\r\n\r\n"
        return True

    def _frame(self, head: bytes) -> bytes:
        """The head as relayed (without the route header); sets how its body is read."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
            raise BadRequest("a request line that is not METHOD TARGET HTTP/1.x")
        if parts[0] == b"CONNECT":
            raise BadRequest("CONNECT is not relayed")
        kept = [lines[0]]
        lengths: list[bytes] = []
        codings: list[bytes] = []
        connection: set[bytes] = set()
        upgrade = False
        for line in lines[1:]:
            name, value = _header_line(line)
            if name == _ROUTE:
                continue
            kept.append(line)
            if name == b"content-length":
                lengths += [v.strip() for v in value.split(b",")]
            elif name == b"transfer-encoding":
                codings += [v.strip().lower() for v in value.split(b",") if v.strip()]
            elif name == b"connection":
                connection |= {v.strip().lower() for v in value.split(b",")}
            elif name == b"upgrade":
                upgrade = True
        self._upgrade = upgrade and b"upgrade" in connection
        self._body(lengths, codings)
        return b"\r\n".join(kept)

    def _body(self, lengths: list[bytes], codings: list[bytes]) -> None:
        if codings:
            if lengths:
                raise BadRequest("Content-Length and Transfer-Encoding together")
            if codings[-1] != b"chunked":
                raise BadRequest("a Transfer-Encoding that does not end in chunked")
            self._state = "size"
            return
        if lengths:
            if any(not v.isdigit() or len(v) > 18 for v in lengths) or len(set(lengths)) > 1:
                raise BadRequest("a Content-Length that is not one number")
            self._left = int(lengths[0])
            if self._left:
                self._state = "body"
                return
        self._state = self._after()

    def _after(self) -> str:
        """The state after a whole request: the next head, or everything raw."""
        return "raw" if self._upgrade else "head"


def _header_line(line: bytes) -> tuple[bytes, bytes]:
    """A header line's name (lower case) and value; :class:`BadRequest` for a
    folded line or a name that is not a token."""
    if line[:1] in (b" ", b"\t"):
        raise BadRequest("a folded header line")
    name, sep, value = line.partition(b":")
    if not sep or not _TOKEN.fullmatch(name):
        raise BadRequest("a header line without a name")
    return name.lower(), value.strip(b" \t")
