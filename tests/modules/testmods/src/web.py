"""testmods.web: a tiny HTTP service (stdlib ``http.server``) for the service-job
tests. It listens on ``GPUWARDEN_SERVICE_PORT`` on 127.0.0.1 and answers
``/healthz`` (200) and ``/echo`` (its request head back, as JSON). ``behave``:
``ok``, ``never_healthy`` (``/healthz`` answers 503), ``die`` (exits 4 after
``die_after_s``)."""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

params = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
behave = params["behave"]
port = int(os.environ["GPUWARDEN_SERVICE_PORT"])


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/healthz":
            code = 503 if behave == "never_healthy" else 200
            body = b"ok\n" if code == 200 else b"not yet\n"
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

    def log_message(self, fmt: str, *args: object) -> None:
        print(fmt % args, file=sys.stderr, flush=True)


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
print(f"pid {os.getpid()}: listening on 127.0.0.1:{port} ({behave})", flush=True)
if behave == "die":
    threading.Timer(params["die_after_s"], lambda: os._exit(4)).start()
server.serve_forever()
