"""testmods.wsplain: a service that speaks HTTP and WebSocket with the standard
library alone (so that it runs in any image with a Python 3, a podman sandbox's
base image too). It listens on ``GPUWARDEN_SERVICE_PORT`` on 127.0.0.1:
``/healthz`` (200), ``/echo`` (its request line and headers back, as JSON, with
its pid); a WebSocket on ``/ws`` (RFC 6455, no extensions) sends each message
back, text as text and bytes as bytes, and answers a close with a close."""

import base64
import hashlib
import json
import os
import socket
import struct
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(os.environ["GPUWARDEN_SERVICE_PORT"])
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One whole message (fragments joined): its opcode and payload."""
    opcode, payload = 0, b""
    while True:
        b0, b1 = read_exact(sock, 2)
        size = b1 & 0x7F
        if size == 126:
            size = struct.unpack("!H", read_exact(sock, 2))[0]
        elif size == 127:
            size = struct.unpack("!Q", read_exact(sock, 8))[0]
        mask = read_exact(sock, 4) if b1 & 0x80 else b"\0\0\0\0"
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(read_exact(sock, size)))
        opcode = opcode or (b0 & 0x0F)
        payload += data
        if b0 & 0x80:
            return opcode, payload


def send_frame(sock: socket.socket, opcode: int, payload: bytes) -> None:
    head = bytes([0x80 | opcode])
    if len(payload) < 126:
        head += bytes([len(payload)])
    elif len(payload) < 65536:
        head += bytes([126]) + struct.pack("!H", len(payload))
    else:
        head += bytes([127]) + struct.pack("!Q", len(payload))
    sock.sendall(head + payload)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            self.websocket()
            return
        if self.path == "/healthz":
            code, body = 200, b"ok\n"
        elif self.path.startswith("/echo"):
            code = 200
            body = json.dumps(
                {"path": self.path, "headers": dict(self.headers), "pid": os.getpid()}
            ).encode()
        else:
            code, body = 404, b"no\n"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def websocket(self) -> None:
        key = self.headers.get("Sec-WebSocket-Key", "").encode()
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        sock = self.connection
        self.close_connection = True
        try:
            while True:
                opcode, payload = read_frame(sock)
                if opcode == 0x8:  # close: answered with the same code
                    send_frame(sock, 0x8, payload[:2])
                    return
                if opcode == 0x9:  # ping
                    send_frame(sock, 0xA, payload)
                elif opcode in (0x1, 0x2):
                    send_frame(sock, opcode, payload)
        except (ConnectionError, OSError):
            return

    def log_message(self, fmt: str, *args: object) -> None:
        print(fmt % args, file=sys.stderr, flush=True)


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
server.daemon_threads = True
print(f"pid {os.getpid()}: listening on 127.0.0.1:{port} (HTTP and WebSocket)", flush=True)
server.serve_forever()
