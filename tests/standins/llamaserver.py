"""A stand-in for llama.cpp's ``llama-server``, faithful to the parts of its HTTP
protocol gpuwarden speaks, in its two modes, with model memory held on
gpuwarden's simulated GPU. Run it as::

    python -m tests.standins.llamaserver --port 0 --preset tiny=1 --preset big=4   # router
    python -m tests.standins.llamaserver --port 0 --model tiny=1                   # single

with ``GPUWARDEN_SIM_GPU`` and ``CUDA_VISIBLE_DEVICES`` set (a sim probe's
``job_env``). It prints ``listening on http://127.0.0.1:PORT`` once it answers.
``NAME=GIB`` is a model and the GiB it takes on the GPU.

Where each behaviour comes from (llama.cpp 0c1e5709, 2026-10, the copy vendored by
llama-cpp-python 0.3.36: ``tools/server/server.cpp``, ``server-context.cpp``,
``server-models.cpp``/``.h``, ``server-queue.cpp``, ``server-http.cpp``,
``common/arg.cpp``, and ``tools/server/README.md``):

- Modes (``server.cpp``). With a model (``-m``; here ``--model``) it serves that
  model from its own process, which holds the memory. Without one it is a
  *router*: "no model will be loaded in this process"; each model it knows (from
  ``--models-dir``, ``--models-preset`` or the cache; here ``--preset``) runs, once
  loaded, as a child ``llama-server`` on a free port at 127.0.0.1 (``CHILD_ADDR``),
  spawned with the router's environment plus ``LLAMA_SERVER_ROUTER_PORT``; the
  router proxies requests to it (``server_models::proxy_request``). Here the child
  is this module in single mode with ``--child``, and it holds the memory.
- Child and router talk over the child's stdio (``server-models.cpp``): the child
  prints ``cmd_child_to_router:state:{"state": "ready", "payload": {...}}`` once
  loaded (``server_child::notify_to_router``); the router writes
  ``cmd_router_to_child:exit`` to its stdin to stop it, and the child exits 1 on
  EOF (its router is gone). On the exit command the child's shutdown handler
  ends its task loop (``ctx_server.terminate()``) and HTTP server: requests in
  flight are cut, not finished (here: the child exits, their connections drop).
  The router force-kills a child that has not exited ``stop-timeout`` seconds
  later (a preset option, ``DEFAULT_STOP_TIMEOUT`` 10; here ``--stop-timeout``;
  ``--ignore-exit`` makes the children ignore the command, to see the kill).
  Unloading a model still loading kills it at once.
- ``GET /models`` (and ``/v1/models``), router (``get_router_models``):
  ``{"data": [{"id", "aliases", "tags", "object": "model", "owned_by":
  "llamacpp", "created", "status": {"value", "args", "failed"?, "exit_code"?},
  ...}], "object": "list"}``; ``value`` is ``unloaded``, ``loading``, ``loaded``
  (``sleeping``/``downloading`` are not modelled). ``failed`` and ``exit_code``
  when it exited non-zero. Single mode (``get_res_models``): ``{"models": [...],
  "object": "list", "data": [{"id", "aliases", "tags", "object", "owned_by",
  "created", "meta": {...}}]}``, no ``status``.
- ``POST /models/load {"model"}``: 404 ``model is not found``, 400 ``model is
  already running``, else ``{"success": true}`` at once (the load goes on).
  ``POST /models/unload {"model"}``: 400 ``model is not found``, 400 ``model is
  not running``, else ``{"success": true}`` at once. Errors are
  ``{"error": {"code", "message", "type"}}`` (``format_error_response``: 400
  ``invalid_request_error``, 404 ``not_found_error``, 501
  ``not_supported_error``, 503 ``unavailable_error``).
- Router GETs that a model answers (``/slots``, ``/metrics``, ``/props?model=``)
  and POSTs (``/v1/completions`` ...) need the model, by ``?model=`` or the body's
  ``model`` (400 ``model name is missing from the request``; 400 ``model 'X' not
  found``); with autoload (``--models-autoload``, on by default; per request
  ``?autoload=true|false``) a model not running is loaded first and the request
  waits, without it 400 ``model is not loaded`` (``router_validate_model``). The
  router's ``/props`` without a model: ``{"role": "router", ...}``.
- ``GET /slots`` (on by default, ``--no-slots``: 501 "This server does not
  support slots endpoint. Start it with `--slots`"): a list, per slot ``{"id",
  "n_ctx", "speculative", "is_processing"}`` and ``id_task`` once it ran one
  (``server_slot::to_json``). ``GET /metrics`` (only with ``--metrics``, else 501
  "... Start it with `--metrics`"): Prometheus text, ``llamacpp:`` names, gauges
  ``requests_processing`` (slots processing) and ``requests_deferred`` (tasks
  waiting for a slot), counters ``prompt_tokens_total``, ``tokens_predicted_total``
  (``server_task_result_metrics::to_metrics``). ``--parallel`` slots (``-np``).
- ``GET /health``: ``{"status": "ok"}``; before the model is loaded every route
  answers 503 ``Loading model`` (``middleware_server_state``).
- ``POST /v1/completions`` (also ``/completion``, ``/completions``): a free slot
  takes it, else it is deferred until one frees. The stand-in field ``delay_s``
  is how long it "generates"; the answer is OpenAI's ``text_completion``.
- ``--api-key`` (or ``LLAMA_API_KEY``): every route but ``/health`` and
  ``/v1/health`` needs ``Authorization: Bearer KEY`` (or ``X-Api-Key``), else 401
  ``{"error": {"message": "Invalid API Key", "type": "authentication_error",
  "code": 401}}`` (``middleware_validate_api_key``). The router does not pass the
  key on to its children (``unset_reserved_args``).

UNVERIFIED (not read in the source): what the router answers a client whose
request was in flight in a child that stopped (here 500, ``server_error``); the
``/props`` fields beyond those named. Not modelled: ``--sleep-idle-seconds``,
``--models-max`` (LRU eviction), downloads, ``/models/sse``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

GIB = 1024**3
REPO_ROOT = Path(__file__).resolve().parents[2]
EXIT_CMD = "cmd_router_to_child:exit"
STATE_CMD = "cmd_child_to_router:state:"
PUBLIC = ("/health", "/v1/health")
COMPLETIONS = ("/v1/completions", "/completions", "/completion")


def error_body(code: int, message: str) -> dict[str, Any]:
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        500: "server_error",
        501: "not_supported_error",
        503: "unavailable_error",
    }
    return {"error": {"code": code, "message": message, "type": kinds.get(code, "server_error")}}


def parse_model(text: str) -> tuple[str, float]:
    name, _, gib = text.partition("=")
    return name, float(gib or 1)


# -- one model served: the single-model server, and a router's child ------------------


@dataclass
class Slot:
    id: int
    id_task: int | None = None
    processing: bool = False


class Single:
    """A single-model llama-server's state: its slots and the model it holds."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.name, self.gib = parse_model(args.model)
        self.metrics_on = args.metrics
        self.slots_on = not args.no_slots
        self.load_s = args.load_s
        self.cond = threading.Condition()
        self.slots = [Slot(i) for i in range(args.parallel)]
        self.deferred = 0
        self.next_task = 0
        self.prompt_tokens = 0
        self.predicted = 0
        self.ready = False
        self.stopping = threading.Event()

    def load(self) -> None:
        from gpuwarden.gpu import simclient

        time.sleep(self.load_s)
        self.gpu = simclient.attach()
        self.gpu.allocate(int(self.gib * GIB), label=f"llama-server {self.name}")
        self.ready = True

    def run(self, delay_s: float) -> bool:
        """Take a slot (deferred until one is free) and "generate" ``delay_s``;
        False if the server stopped meanwhile."""
        with self.cond:
            self.deferred += 1
            while not (free := [s for s in self.slots if not s.processing]):
                self.cond.wait()
            self.deferred -= 1
            slot = free[0]
            slot.processing, slot.id_task = True, self.next_task
            self.next_task += 1
        try:
            stopped = self.stopping.wait(delay_s)
        finally:
            with self.cond:
                slot.processing = False
                self.prompt_tokens += 1
                self.predicted += 1
                self.cond.notify_all()
        return not stopped

    def slots_json(self) -> list[dict[str, Any]]:
        with self.cond:
            out = []
            for s in self.slots:
                row: dict[str, Any] = {
                    "id": s.id,
                    "n_ctx": 4096,
                    "speculative": False,
                    "is_processing": s.processing,
                }
                if s.id_task is not None:
                    row["id_task"] = s.id_task
                out.append(row)
            return out

    def metrics(self) -> str:
        with self.cond:
            processing = sum(s.processing for s in self.slots)
            items = [
                (
                    "counter",
                    "prompt_tokens_total",
                    "Number of prompt tokens processed.",
                    self.prompt_tokens,
                ),
                (
                    "counter",
                    "tokens_predicted_total",
                    "Number of generation tokens processed.",
                    self.predicted,
                ),
                ("gauge", "requests_processing", "Number of requests processing", processing),
                ("gauge", "requests_deferred", "Number of requests deferred", self.deferred),
            ]
        return "".join(
            f"# HELP llamacpp:{name} {text}\n# TYPE llamacpp:{name} {kind}\n"
            f"llamacpp:{name} {value}\n"
            for kind, name, text, value in items
        )

    def model_info(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "aliases": [],
            "tags": [],
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {"n_ctx": 4096, "n_params": 1000, "size": int(self.gib * GIB)},
        }

    def models(self) -> dict[str, Any]:
        return {
            "models": [{"name": self.name, "model": self.name, "type": "model"}],
            "object": "list",
            "data": [self.model_info()],
        }


def watch_router(single: Single, server: ThreadingHTTPServer, ignore_exit: bool) -> None:
    """A child's stdin: the router's exit command stops it; EOF (its router is
    gone) makes it exit 1."""
    for line in sys.stdin:
        if EXIT_CMD in line and not ignore_exit:
            single.stopping.set()  # cuts what is in flight (ctx_server.terminate())
            _leave(single, 0)
    _leave(single, 1)


def _leave(single: Single, code: int) -> None:
    gpu = getattr(single, "gpu", None)
    if gpu is not None:
        gpu.free_all()
    sys.stdout.flush()
    os._exit(code)


# -- the router ---------------------------------------------------------------------


@dataclass
class Instance:
    name: str
    gib: float
    status: str = "unloaded"
    proc: subprocess.Popen[str] | None = None
    port: int = 0
    args: list[str] = field(default_factory=list)
    exit_code: int = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class Router:
    """A router's model instances (``server_models``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.autoload = args.models_autoload
        self.cond = threading.Condition()
        self.models = {n: Instance(n, g) for n, g in map(parse_model, args.preset)}

    def child_command(self, inst: Instance) -> list[str]:
        a = self.args
        command = [sys.executable, "-m", "tests.standins.llamaserver", "--child"]
        command += ["--model", f"{inst.name}={inst.gib}", "--port", str(inst.port)]
        command += ["--parallel", str(a.parallel), "--load-s", str(a.load_s)]
        command += ["--metrics"] * a.metrics + ["--no-slots"] * a.no_slots
        return (
            command
            + ["--ignore-exit"] * a.ignore_exit
            + ["--fail-load", inst.name] * (inst.name in a.fail_load)
        )

    def load(self, name: str) -> None:
        with self.cond:
            inst = self.models[name]
            if inst.status != "unloaded":
                return
            inst.port = free_port()
            inst.args = self.child_command(inst)
            env = dict(os.environ, LLAMA_SERVER_ROUTER_PORT=str(self.args.port))
            env.pop("LLAMA_API_KEY", None)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH")) if p
            )
            inst.proc = subprocess.Popen(
                inst.args,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            inst.status, inst.exit_code = "loading", 0
        threading.Thread(target=self.monitor, args=(inst, inst.proc), daemon=True).start()

    def monitor(self, inst: Instance, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(STATE_CMD):
                state = json.loads(line[len(STATE_CMD) :]).get("state")
                with self.cond:
                    if state == "ready" and inst.proc is proc:
                        inst.status = "loaded"
                    self.cond.notify_all()
        code = proc.wait()
        with self.cond:
            if inst.proc is proc:
                inst.status, inst.exit_code, inst.proc = "unloaded", code, None
            self.cond.notify_all()

    def unload(self, name: str) -> None:
        with self.cond:
            inst = self.models[name]
            proc = inst.proc
            if proc is None:
                return
            if inst.status == "loading":
                proc.kill()  # a model still loading is force-killed
                return
            if proc.stdin is not None:
                try:
                    proc.stdin.write(EXIT_CMD + "\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        threading.Thread(target=self.reap, args=(proc,), daemon=True).start()

    def reap(self, proc: subprocess.Popen[str]) -> None:
        try:
            proc.wait(self.args.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # "force-killing model instance ... after timeout"

    def wait_settled(self, name: str) -> str:
        with self.cond:
            while self.models[name].status == "loading":
                self.cond.wait()
            return self.models[name].status

    def unload_all(self) -> None:
        for name in list(self.models):
            self.unload(name)
        with self.cond:
            procs = [i.proc for i in self.models.values() if i.proc is not None]
        for proc in procs:
            try:
                proc.wait(self.args.stop_timeout + 5)
            except subprocess.TimeoutExpired:
                proc.kill()

    def rows(self) -> dict[str, Any]:
        with self.cond:
            data = []
            for inst in self.models.values():
                status: dict[str, Any] = {"value": inst.status, "args": inst.args}
                if inst.status == "unloaded" and inst.exit_code != 0:
                    status |= {"exit_code": inst.exit_code, "failed": True}
                data.append(
                    {
                        "id": inst.name,
                        "aliases": [],
                        "tags": [],
                        "object": "model",
                        "owned_by": "llamacpp",
                        "created": int(time.time()),
                        "status": status,
                    }
                )
        return {"data": data, "object": "list"}


# -- HTTP ------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, value: Any) -> None:
        self.send(status, json.dumps(value).encode())

    def fail(self, code: int, message: str) -> None:
        self.send_json(code, error_body(code, message))

    def body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def refused(self, path: str) -> bool:
        key = self.server.api_key
        if key is None or path in PUBLIC:
            return False
        given = self.headers.get("Authorization") or self.headers.get("X-Api-Key") or ""
        if given.removeprefix("Bearer ") == key:
            return False
        self.send_json(401, error_body(401, "Invalid API Key"))
        return True

    def do_GET(self) -> None:
        self.route("GET", b"")

    def do_POST(self) -> None:
        self.route("POST", self.body())

    def route(self, method: str, body: bytes) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        if self.refused(parts.path):
            return
        if self.server.router is not None:
            self.router_route(method, parts.path, query, body)
        else:
            self.single_route(method, parts.path, body)

    # -- single mode ----------------------------------------------------------------

    def single_route(self, method: str, path: str, body: bytes) -> None:
        single = self.server.single
        assert single is not None
        if not single.ready:
            self.fail(503, "Loading model")
        elif method == "GET" and path in PUBLIC:
            self.send_json(200, {"status": "ok"})
        elif method == "GET" and path in ("/models", "/v1/models"):
            self.send_json(200, single.models())
        elif method == "GET" and path == "/props":
            self.send_json(
                200,
                {
                    "total_slots": len(single.slots),
                    "model_alias": single.name,
                    "model_path": f"/models/{single.name}.gguf",
                    "is_sleeping": False,
                    "default_generation_settings": {"n_ctx": 4096, "params": {}},
                },
            )
        elif method == "GET" and path == "/slots":
            if not single.slots_on:
                self.fail(
                    501, "This server does not support slots endpoint. Start it with `--slots`"
                )
            else:
                self.send_json(200, single.slots_json())
        elif method == "GET" and path == "/metrics":
            if not single.metrics_on:
                self.fail(
                    501, "This server does not support metrics endpoint. Start it with `--metrics`"
                )
            else:
                self.send(200, single.metrics().encode(), "text/plain; version=0.0.4")
        elif method == "POST" and path in COMPLETIONS:
            self.complete(single, body)
        else:
            self.fail(404, "File Not Found")

    def complete(self, single: Single, body: bytes) -> None:
        try:
            asked = json.loads(body or b"{}")
            delay_s = float(asked.get("delay_s", 0.0))
        except (ValueError, TypeError, AttributeError):
            self.fail(400, "the body is not a completion request")
            return
        if not single.run(delay_s):
            return  # the server stops: this connection drops with it
        self.send_json(
            200,
            {
                "id": f"cmpl-{time.monotonic_ns()}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": single.name,
                "choices": [
                    {"text": " done", "index": 0, "logprobs": None, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )

    # -- router mode ------------------------------------------------------------------

    def router_route(self, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        router = self.server.router
        assert router is not None
        if method == "GET" and path in PUBLIC:
            self.send_json(200, {"status": "ok"})
        elif method == "GET" and path in ("/models", "/v1/models"):
            self.send_json(200, router.rows())
        elif method == "POST" and path in ("/models/load", "/models/unload"):
            self.load_or_unload(router, path, body)
        elif method == "GET" and path == "/props" and not query.get("model"):
            self.send_json(
                200,
                {
                    "role": "router",
                    "max_instances": 4,
                    "models_autoload": router.autoload,
                    "model_alias": "llama-server",
                    "model_path": "none",
                },
            )
        elif method == "GET" and path in ("/props", "/slots", "/metrics"):
            self.proxy(router, method, query.get("model", ""), query, body)
        elif method == "POST" and path in COMPLETIONS:
            try:
                model = str(json.loads(body or b"{}").get("model") or "")
            except (ValueError, AttributeError):
                self.fail(500, "[json.exception.parse_error] the body is not JSON")
                return
            self.proxy(router, method, model, query, body)
        else:
            self.fail(404, "File Not Found")

    def load_or_unload(self, router: Router, path: str, body: bytes) -> None:
        try:
            name = str(json.loads(body or b"{}").get("model") or "")
        except (ValueError, AttributeError):
            self.fail(500, "[json.exception.parse_error] the body is not JSON")
            return
        inst = router.models.get(name)
        running = inst is not None and inst.status in ("loading", "loaded")
        if path == "/models/load":
            if inst is None:
                self.fail(404, "model is not found")
            elif running:
                self.fail(400, "model is already running")
            else:
                router.load(name)
                self.send_json(200, {"success": True})
        elif inst is None:
            self.fail(400, "model is not found")
        elif not running:
            self.fail(400, "model is not running")
        else:
            router.unload(name)
            self.send_json(200, {"success": True})

    def proxy(
        self, router: Router, method: str, name: str, query: dict[str, str], body: bytes
    ) -> None:
        if not name:
            self.fail(400, "model name is missing from the request")
            return
        inst = router.models.get(name)
        if inst is None:
            self.fail(400, f"model '{name}' not found")
            return
        autoload = query["autoload"] in ("true", "1") if "autoload" in query else router.autoload
        if inst.status not in ("loading", "loaded"):
            if not autoload:
                self.fail(400, "model is not loaded")
                return
            router.load(name)
        if autoload and router.wait_settled(name) != "loaded":
            self.fail(500, f"model name={name} failed to load")
            return
        try:
            conn = http.client.HTTPConnection("127.0.0.1", inst.port, timeout=600)
            headers = {"Content-Type": "application/json"} if body else {}
            conn.request(method, self.path, body=body or None, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            ctype = answer.getheader("Content-Type") or "application/json"
            conn.close()
        except (OSError, http.client.HTTPException) as exc:
            self.fail(500, f"the model instance {name} did not answer: {exc}")  # UNVERIFIED
            return
        self.send(answer.status, data, ctype)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        single: Single | None,
        router: Router | None,
        api_key: str | None,
    ) -> None:
        super().__init__(address, Handler)
        self.single = single
        self.router = router
        self.api_key = api_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model", default=None, help="NAME=GIB: single-model mode")
    parser.add_argument("--preset", action="append", default=[], help="NAME=GIB (router)")
    parser.add_argument("--load-on-startup", action="append", default=[])
    parser.add_argument("--no-models-autoload", dest="models_autoload", action="store_false")
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--no-slots", action="store_true")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--stop-timeout", type=float, default=10.0)
    parser.add_argument("--load-s", type=float, default=0.2)
    parser.add_argument("--ignore-exit", action="store_true")
    parser.add_argument("--fail-load", action="append", default=[])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    api_key = args.api_key or os.environ.get("LLAMA_API_KEY") or None
    single = Single(args) if args.model else None
    router = None if single else Router(args)
    server = Server((args.host, args.port), single, router, None if args.child else api_key)
    args.port = server.server_address[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if single is not None:
        if args.fail_load:
            return 1  # "exiting due to model loading error"
        single.load()
    print(f"listening on http://{args.host}:{args.port}", flush=True)
    if single is not None and args.child:
        info = json.dumps({"state": "ready", "payload": single.model_info()})
        print(f"\n{STATE_CMD}{info}", flush=True)
        watch_router(single, server, args.ignore_exit)
    for name in args.load_on_startup:
        assert router is not None
        router.load(name)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    if router is not None:
        router.unload_all()  # clean_up(): every child stopped before the router exits
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
