"""A stand-in for vLLM's OpenAI-compatible server (``vllm serve``), faithful to
the parts of its HTTP protocol gpuwarden speaks, with memory held on gpuwarden's
simulated GPU. Run it as::

    VLLM_SERVER_DEV_MODE=1 python -m tests.standins.vllm --port 0 --enable-sleep-mode

It prints ``listening on http://127.0.0.1:PORT`` once it answers.

Where each behaviour comes from (vLLM's source and docs):

- Memory. vLLM pre-reserves most of the GPU at start (``--gpu-memory-utilization``,
  a fraction, 0.9 by default; here a number of GiB for weights and for the KV
  cache) in its *engine core*, a process of its own in vLLM V1 (the API server
  talks to it over ZMQ): the memory NVML lists belongs to that child, not to the
  process that answers HTTP. The engine child here allocates with
  :func:`gpuwarden.gpu.simclient.attach` and is told what to do over a pipe.
- ``GET /metrics``: Prometheus text; ``vllm:num_requests_running`` ("Number of
  requests currently running on GPU") and ``vllm:num_requests_waiting`` ("Number
  of requests waiting to be processed") are gauges labelled ``model_name``
  (docs.vllm.ai, usage/metrics, "Production Metrics").
- The sleep routes (``vllm/entrypoints/serve/sleep/api_router.py``, later
  ``serve/dev/sleep/api_router.py``): ``attach_router`` returns early unless
  ``envs.VLLM_SERVER_DEV_MODE``, so without ``VLLM_SERVER_DEV_MODE=1`` the routes
  do not exist (404). ``--enable-sleep-mode`` is not looked at by the router: with
  dev mode but without it, ``GET /is_sleeping`` answers ``{"is_sleeping": false}``
  and ``POST /sleep`` fails in the engine (``assert model_config.enable_sleep_mode,
  "Sleep mode is not enabled in the model config"``, vLLM's engine ``sleep``): a
  500 here.
- ``POST /sleep``: ``level`` from the query (default ``"1"``), ``mode`` (default
  ``"abort"``: ``EngineClient.sleep(level=1, mode: PauseMode = "abort")``); an
  empty 200 once the engine slept. Level 1 offloads the weights to CPU RAM and
  discards the KV cache, level 2 discards both (docs, features/sleep_mode): on the
  GPU both free the same; what remains is the CUDA context and the allocations
  outside vLLM's sleep-mode pool (``--residual-mib``; pitfalls in vLLM issues
  #32714, #47654 show it can be large). ``mode=wait`` lets in-flight requests end
  first; ``mode=abort`` aborts them (``PauseMode = Literal["abort", "wait",
  "keep"]``, ``vllm/v1/engine/__init__.py``; the sleep pauses the scheduler first
  since vLLM PR #34528, "Add optional pause-mode arg to sleep method"; older
  servers read only ``level``). ``keep`` is not modelled (a 400 here).
- ``POST /wake_up``: optional ``tags`` (``weights``, ``kv_cache``; none: all),
  an empty 200. ``GET /is_sleeping`` → ``{"is_sleeping": bool}``.
- ``POST /v1/completions``: the OpenAI completion API; the stand-in field
  ``delay_s`` is how long the request "generates". What vLLM answers to an
  aborted request is not checked here (UNVERIFIED): the stand-in answers 500 with
  an OpenAI-style error body. A request that arrives while the engine sleeps
  waits (counted in ``num_requests_waiting``) until it wakes (UNVERIFIED too).
- ``--api-key`` (or ``VLLM_API_KEY``): vLLM's ``authentication`` middleware
  (``vllm/entrypoints/openai/api_server.py``) checks ``Authorization: Bearer KEY``
  only on paths that start with ``/v1``: ``/metrics`` and the sleep routes stay
  open (401 ``{"error": "Unauthorized"}`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

GIB = 1024**3
MIB = 1024**2
REPO_ROOT = Path(__file__).resolve().parents[2]
TAGS = ("weights", "kv_cache")


# -- the engine core: a child process that holds the memory -------------------


def engine_main(sizes: dict[str, int], residual: int) -> int:
    """The engine child: allocate the residual and every tag, then obey lines on
    stdin (``sleep``, ``wake TAG...``) and answer ``ok ...`` on stdout. It ends
    when stdin closes (its server is gone)."""
    from gpuwarden.gpu import simclient

    gpu = simclient.attach()
    gpu.allocate(residual, label="cuda-context")
    held: dict[str, int] = {}
    for tag in TAGS:
        held[tag] = gpu.allocate(sizes[tag], label=tag)
    print("ok ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "sleep":
            for tag in list(held):
                gpu.free(held.pop(tag))
            print("ok asleep", flush=True)
        elif words[0] == "wake":
            for tag in words[1:] or TAGS:
                if tag not in held:
                    held[tag] = gpu.allocate(sizes[tag], label=tag)
            print("ok awake " + " ".join(sorted(held)), flush=True)
        else:
            print(f"error unknown command {words[0]!r}", flush=True)
    return 0


class Engine:
    """The server's side of the pipe to the engine child."""

    def __init__(self, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH")) if p
        )
        command = [
            sys.executable,
            "-m",
            "tests.standins.vllm",
            "--engine-core",
            "--weights-gib",
            str(args.weights_gib),
            "--kv-gib",
            str(args.kv_gib),
            "--residual-mib",
            str(args.residual_mib),
        ]
        self.proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()
        first = self.proc.stdout.readline() if self.proc.stdout else ""
        if first.strip() != "ok ready":
            raise SystemExit(f"the engine core did not start (it said {first!r})")
        self.tags: set[str] = set(TAGS)

    def command(self, line: str) -> str:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"engine core answered {answer!r}")
        return answer

    def sleep(self) -> None:
        self.command("sleep")
        self.tags = set()

    def wake(self, tags: list[str]) -> None:
        answer = self.command("wake " + " ".join(tags))
        self.tags = set(answer.split()[2:])

    @property
    def sleeping(self) -> bool:
        return not self.tags


# -- the server's state ---------------------------------------------------------


class Request:
    def __init__(self) -> None:
        self.aborted = threading.Event()


class State:
    def __init__(self, args: argparse.Namespace, engine: Engine) -> None:
        self.model = args.model
        self.sleep_mode = args.enable_sleep_mode
        self.api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")
        self.engine = engine
        self.cond = threading.Condition()
        self.running: set[Request] = set()
        self.waiting = 0
        self.completed = 0
        self.aborted = 0

    def run_request(self, delay_s: float) -> bool:
        """Generate for ``delay_s``; False if the request was aborted."""
        request = Request()
        with self.cond:
            self.waiting += 1
            while self.engine.sleeping:
                self.cond.wait()
            self.waiting -= 1
            self.running.add(request)
        try:
            aborted = request.aborted.wait(delay_s)
        finally:
            with self.cond:
                self.running.discard(request)
                if aborted:
                    self.aborted += 1
                else:
                    self.completed += 1
                self.cond.notify_all()
        return not aborted

    def sleep(self, mode: str) -> None:
        with self.cond:
            if mode == "abort":
                for request in self.running:
                    request.aborted.set()
            while self.running:
                self.cond.wait()
            self.engine.sleep()

    def wake(self, tags: list[str]) -> None:
        with self.cond:
            self.engine.wake(tags)
            self.cond.notify_all()

    def metrics(self) -> str:
        label = '{model_name="' + self.model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        with self.cond:
            running, waiting = len(self.running), self.waiting
        return (
            "# HELP vllm:num_requests_running Number of requests currently running on GPU.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {float(waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{label} {0.1 if running else 0.0}\n"
        )


# -- HTTP --------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, value: Any) -> None:
        self.send(status, json.dumps(value).encode())

    def error(self, status: int, message: str, kind: str) -> None:
        self.send_json(status, {"error": {"message": message, "type": kind, "code": status}})

    def not_found(self) -> None:
        self.send_json(404, {"detail": "Not Found"})  # FastAPI's own 404 body

    def dev_route(self) -> bool:
        return self.server.state.dev_mode

    def unauthorized(self) -> bool:
        """vLLM's middleware: only ``/v1`` paths need the key."""
        key = self.server.state.api_key
        if key is None or not urlsplit(self.path).path.startswith("/v1"):
            return False
        if self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self.send_json(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:
        state = self.server.state
        path = urlsplit(self.path).path
        if self.unauthorized():
            return
        if path == "/metrics":
            self.send(200, state.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/health":
            self.send(200)
        elif path == "/v1/models":
            models = [{"id": state.model, "object": "model"}]
            self.send_json(200, {"object": "list", "data": models})
        elif path == "/is_sleeping" and self.dev_route():
            self.send_json(200, {"is_sleeping": state.engine.sleeping})
        else:
            self.not_found()

    def do_POST(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.unauthorized():
            return
        if parts.path == "/v1/completions":
            self.completions(body)
        elif parts.path == "/sleep" and self.dev_route():
            self.sleep(query)
        elif parts.path == "/wake_up" and self.dev_route():
            self.wake_up(query)
        else:
            self.not_found()

    def completions(self, body: bytes) -> None:
        state = self.server.state
        try:
            asked = json.loads(body or b"{}")
            delay_s = float(asked.get("delay_s", 0.0))
        except (ValueError, TypeError, AttributeError):
            self.error(400, "the body is not a completion request", "BadRequestError")
            return
        if state.run_request(delay_s):
            self.send_json(
                200,
                {
                    "id": f"cmpl-{time.monotonic_ns()}",
                    "object": "text_completion",
                    "model": state.model,
                    "choices": [{"index": 0, "text": " done", "finish_reason": "length"}],
                },
            )
        else:
            self.error(500, "the request was aborted (the engine went to sleep)", "AbortError")

    def sleep(self, query: dict[str, list[str]]) -> None:
        state = self.server.state
        level = query.get("level", ["1"])[0]
        mode = query.get("mode", ["abort"])[0]
        if level not in ("1", "2") or mode not in ("abort", "wait"):
            self.error(400, f"level {level!r} or mode {mode!r} is not known", "BadRequestError")
            return
        if not state.sleep_mode:
            self.error(500, "Sleep mode is not enabled in the model config", "InternalServerError")
            return
        state.sleep(mode)
        self.send(200)

    def wake_up(self, query: dict[str, list[str]]) -> None:
        state = self.server.state
        tags = query.get("tags", [])
        if not state.sleep_mode:
            self.error(500, "Sleep mode is not enabled in the model config", "InternalServerError")
            return
        if any(tag not in TAGS for tag in tags):
            self.error(400, f"unknown tags {tags!r}", "BadRequestError")
            return
        state.wake(tags)
        self.send(200)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: State) -> None:
        super().__init__(address, Handler)
        self.state = state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="standin/tiny-llm")
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--weights-gib", type=float, default=1.0)
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--residual-mib", type=float, default=256.0)
    parser.add_argument("--engine-core", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_core:
        sizes = {"weights": int(args.weights_gib * GIB), "kv_cache": int(args.kv_gib * GIB)}
        return engine_main(sizes, int(args.residual_mib * MIB))
    engine = Engine(args)
    server = Server((args.host, args.port), State(args, engine))
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        if engine.proc.stdin:
            engine.proc.stdin.close()
        engine.proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
