"""A protocol-faithful stand-in for Ollama's HTTP API, for tests that cannot run Ollama.

Run as ``python -m tests.standins.ollama --port N [--model NAME=BYTES[@FRACTION]]...``
(port 0 picks one); it prints ``listening on http://127.0.0.1:PORT`` once it serves.

What it follows, checked against ollama/ollama at fb307609 (2026-08):

- ``GET /api/ps``: ``server/routes.go`` ``PsHandler`` returns
  ``{"models": [ProcessModelResponse]}`` with the fields of ``api/types.go``
  ``ProcessModelResponse`` (name, model, size, digest, details, expires_at,
  size_vram, context_length), longest remaining ``expires_at`` first. A model
  still loading, or in its first request, has no ``expiresAt`` yet and is listed
  with ``now + sessionDuration`` (``server/sched.go`` ``loadedModels``).
- ``POST /api/generate``: ``routes.go`` ``GenerateHandler``. An empty prompt with
  ``keep_alive`` 0 calls ``sched.expireRunner`` and answers at once with
  ``done_reason: "unload"``, before any scheduling (so it never loads a model).
  Otherwise the model is scheduled (loaded if it is not); an empty prompt then
  answers ``done_reason: "load"`` (a preload).
- ``server/sched.go``: each model is one runner subprocess (so an unload is the
  child's exit, and its memory goes with it). ``useLoadedRunner`` counts a
  request in ``refCount``, stops the expiry timer and takes the request's
  ``keep_alive`` as the runner's ``sessionDuration``, but leaves ``expiresAt``
  alone; when the last request ends (the ``finishedReqCh`` case of
  ``processCompleted``) a zero duration unloads, any other sets the timer and
  ``expiresAt = now + sessionDuration``. ``expireRunner`` sets ``expiresAt =
  now``, ``sessionDuration = 0`` and unloads only when ``refCount <= 0``;
  otherwise the last request's end unloads it (no in-flight work is cut).
- ``keep_alive``: ``api/types.go`` ``Duration.UnmarshalJSON``: a number is
  seconds, a string a Go duration (``"5m"``, ``"1h30m"``), anything negative is
  forever (``math.MaxInt64`` nanoseconds, about 292 years); absent, the default
  is ``OLLAMA_KEEP_ALIVE`` or 5 min (``envconfig/config.go`` ``KeepAlive``).
- ``GET /api/version`` and ``GET /`` ("Ollama is running") as in ``routes.go``.

The stand-in's own additions: ``delay_s`` in a generate request (seconds of
"work" before the answer), and the ``--model`` catalogue (what is "pulled": its
size, and the fraction of it that a load places on the GPU; the rest would be
on the CPU). Answers are JSON (``"stream": false``) or, as Ollama's default, one
NDJSON line per chunk. Not modelled: VRAM-recovery waits (``waitForVRAMRecovery``,
at most 5 s), eviction to make room, ``/api/chat``, streaming of real tokens.

A runner allocates on gpuwarden's simulated GPU (``simclient.attach()``, from the
``GPUWARDEN_SIM_GPU`` and ``CUDA_VISIBLE_DEVICES`` it inherits) and holds the
memory until its stdin closes; the stand-in closes it to unload, and a runner
whose stand-in dies exits too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: api/types.go Duration.UnmarshalJSON: negative means math.MaxInt64 ns
FOREVER_S = (2**63 - 1) / 1e9
#: envconfig/config.go KeepAlive: the default when a request gives none
DEFAULT_KEEP_ALIVE_S = 300.0
VERSION = "0.11.0-standin"

RUNNER_CODE = """
import sys
from gpuwarden.gpu import simclient
nbytes = int(sys.argv[1])
if nbytes > 0:
    simclient.attach().allocate(nbytes, label="ollama runner " + sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class BadRequest(Exception):
    """A request Ollama answers with 400 and ``{"error": ...}``."""


def parse_go_duration(text: str) -> float:
    """Go's ``time.ParseDuration`` (seconds), as ``Duration.UnmarshalJSON`` uses it."""
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(body):
        match = _GO_PART.match(body, pos)
        if match is None:
            raise BadRequest(f'time: invalid duration "{text}"')
        total += float(match.group(1)) * _GO_UNITS[match.group(2)]
        pos = match.end()
    if not body:
        raise BadRequest(f'time: invalid duration "{text}"')
    return sign * total


def keep_alive_of(value: Any) -> float | None:
    """``keep_alive`` in seconds (``math.inf`` forever); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise BadRequest(f"Unsupported type: '{type(value).__name__}'")
    seconds = parse_go_duration(value) if isinstance(value, str) else float(value)
    return math.inf if seconds < 0 else seconds


def rfc3339(moment: datetime) -> str:
    """Go's ``time.Time`` JSON form (RFC 3339 with fractional seconds)."""
    return moment.isoformat().replace("+00:00", "Z")


def now() -> datetime:
    return datetime.now(UTC)


def after(seconds: float) -> datetime:
    return now() + timedelta(seconds=min(seconds, FOREVER_S))


@dataclass
class ModelSpec:
    """A "pulled" model: its name, its size, and how much of it loads on the GPU."""

    name: str
    size: int
    vram_fraction: float = 1.0

    @property
    def vram(self) -> int:
        return int(self.size * self.vram_fraction)


@dataclass
class Runner:
    """sched.go ``runnerRef``: one model's runner subprocess and its reference count."""

    spec: ModelSpec
    session_s: float
    proc: subprocess.Popen[str] | None = None
    ref_count: int = 0
    expires_at: datetime | None = None  # unset until the first request ends
    timer: threading.Timer | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    failed: str = ""

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Scheduler:
    """The parts of ``server/sched.go`` a client can see."""

    def __init__(self, catalogue: dict[str, ModelSpec], default_keep_alive_s: float) -> None:
        self.catalogue = catalogue
        self.default_keep_alive_s = default_keep_alive_s
        self.lock = threading.Lock()
        self.loaded: dict[str, Runner] = {}

    def spec(self, requested: str) -> ModelSpec | None:
        name = requested if ":" in requested else f"{requested}:latest"
        return self.catalogue.get(name)

    def acquire(self, spec: ModelSpec, keep_alive_s: float | None) -> Runner:
        """getRunner + useLoadedRunner: the model's runner, loaded if need be,
        with this request counted in its refCount."""
        with self.lock:
            runner = self.loaded.get(spec.name)
            fresh = runner is None
            if runner is None:
                session = self.default_keep_alive_s if keep_alive_s is None else keep_alive_s
                runner = Runner(spec, session)
                self.loaded[spec.name] = runner
            elif keep_alive_s is not None:
                runner.session_s = keep_alive_s
            runner.ref_count += 1
            runner.stop_timer()
        if fresh:
            self.start(runner)
        runner.ready.wait()
        if runner.failed:
            self.release(runner)
            raise RuntimeError(runner.failed)
        return runner

    def start(self, runner: Runner) -> None:
        """Start the runner subprocess and wait until it holds its memory."""
        proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER_CODE, str(runner.spec.vram), runner.spec.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        runner.proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            runner.failed = f"llama runner process has terminated: exit status {proc.wait()}"
        runner.ready.set()

    def release(self, runner: Runner) -> None:
        """processCompleted's finishedReqCh case: the request has ended."""
        with self.lock:
            runner.ref_count -= 1
            if runner.ref_count > 0:
                return
            if runner.session_s <= 0 or runner.failed:
                self.unload_locked(runner)
            elif math.isinf(runner.session_s):
                runner.expires_at = after(math.inf)
            else:
                runner.timer = threading.Timer(runner.session_s, self.expired, (runner,))
                runner.timer.daemon = True
                runner.timer.start()
                runner.expires_at = after(runner.session_s)

    def expired(self, runner: Runner) -> None:
        """The expiry timer (or expireRunner) fired: unload unless a request holds it
        (sched.go retries every 10 ms while refCount > 0; here the end of the last
        request unloads it, since sessionDuration is then 0)."""
        with self.lock:
            runner.timer = None
            if runner.ref_count <= 0:
                self.unload_locked(runner)
            else:
                runner.session_s = 0.0

    def expire(self, spec: ModelSpec) -> None:
        """sched.go ``expireRunner``."""
        with self.lock:
            runner = self.loaded.get(spec.name)
            if runner is None:
                return
            runner.expires_at = now()
            runner.stop_timer()
            runner.session_s = 0.0
            if runner.ref_count <= 0:
                self.unload_locked(runner)

    def unload_locked(self, runner: Runner) -> None:
        """runnerRef.unload: the runner leaves the list and its process exits."""
        runner.stop_timer()
        if self.loaded.get(runner.spec.name) is runner:
            del self.loaded[runner.spec.name]
        proc = runner.proc
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            threading.Thread(target=proc.wait, daemon=True).start()

    def ps(self) -> list[dict[str, Any]]:
        """PsHandler over loadedModels."""
        with self.lock:
            runners = list(self.loaded.values())
            rows = [(r, r.expires_at or after(r.session_s)) for r in runners]
        rows.sort(key=lambda row: row[1], reverse=True)
        return [ps_entry(r.spec, expires) for r, expires in rows]

    def shutdown(self) -> None:
        with self.lock:
            for runner in list(self.loaded.values()):
                self.unload_locked(runner)


def ps_entry(spec: ModelSpec, expires: datetime) -> dict[str, Any]:
    base, _, tag = spec.name.partition(":")
    return {
        "name": spec.name,
        "model": spec.name,
        "size": spec.size,
        "digest": "sha256:" + hashlib.sha256(spec.name.encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": base,
            "families": [base],
            "parameter_size": tag or "latest",
            "quantization_level": "Q4_K_M",
        },
        "expires_at": rfc3339(expires),
        "size_vram": spec.vram,
        "context_length": 4096,
    }


def answer(model: str, response: str, reason: str, **extra: Any) -> dict[str, Any]:
    """api.GenerateResponse, as GenerateHandler fills it."""
    return {
        "model": model,
        "created_at": rfc3339(now()),
        "response": response,
        "done": True,
        "done_reason": reason,
        **extra,
    }


class Handler(BaseHTTPRequestHandler):
    server_version = "ollama-standin"
    scheduler: Scheduler  # set on the class by serve()

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/", ""):
            self.send(200, b"Ollama is running", "text/plain; charset=utf-8")
        elif self.path == "/api/version":
            self.send(200, {"version": VERSION})
        elif self.path == "/api/ps":
            self.send(200, {"models": self.scheduler.ps()})
        else:
            self.send(404, b"404 page not found", "text/plain")

    def do_POST(self) -> None:
        if self.path != "/api/generate":
            self.send(404, b"404 page not found", "text/plain")
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            self.send(400, {"error": "missing request body"})
            return
        try:
            self.generate(json.loads(raw))
        except (BadRequest, ValueError) as exc:
            self.send(400, {"error": str(exc)})

    def generate(self, req: Any) -> None:
        if not isinstance(req, dict):
            raise BadRequest("json: cannot unmarshal into Go value of type api.GenerateRequest")
        model = str(req.get("model") or "")
        prompt = str(req.get("prompt") or "")
        keep_alive_s = keep_alive_of(req.get("keep_alive"))
        spec = self.scheduler.spec(model)
        if spec is None:
            self.send(404, {"error": f"model '{model}' not found"})
            return
        if prompt == "" and keep_alive_s == 0:
            self.scheduler.expire(spec)
            self.reply(req, answer(model, "", "unload"))
            return
        try:
            runner = self.scheduler.acquire(spec, keep_alive_s)
        except RuntimeError as exc:
            self.send(500, {"error": str(exc)})
            return
        try:
            if prompt == "":
                self.reply(req, answer(model, "", "load"))
                return
            time.sleep(float(req.get("delay_s") or 0.0))
            self.reply(req, answer(model, f"(stand-in answer to {len(prompt)} chars)", "stop"))
        finally:
            self.scheduler.release(runner)

    def reply(self, req: dict[str, Any], body: dict[str, Any]) -> None:
        if req.get("stream") is False:
            self.send(200, body)
        else:  # Ollama streams NDJSON by default; the last line has done: true
            self.send(200, (json.dumps(body) + "\n").encode(), "application/x-ndjson")


def parse_model(text: str) -> ModelSpec:
    name, _, rest = text.partition("=")
    size, _, fraction = rest.partition("@")
    if ":" not in name:
        name += ":latest"
    return ModelSpec(name, int(size), float(fraction) if fraction else 1.0)


def env_keep_alive() -> float:
    """envconfig/config.go ``KeepAlive``: a Go duration or whole seconds; 5 min
    when unset or unreadable; negative is forever."""
    text = os.environ.get("OLLAMA_KEEP_ALIVE", "")
    if not text:
        return DEFAULT_KEEP_ALIVE_S
    try:
        seconds = float(int(text)) if text.lstrip("-").isdigit() else parse_go_duration(text)
    except BadRequest:
        return DEFAULT_KEEP_ALIVE_S
    return math.inf if seconds < 0 else seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=11434)
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="NAME=BYTES[@FRACTION]: a pulled model, its size, its share on the GPU",
    )
    args = parser.parse_args(argv)
    specs = [parse_model(m) for m in args.model or ["tiny=1073741824"]]
    Handler.scheduler = Scheduler({s.name: s for s in specs}, env_keep_alive())
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        Handler.scheduler.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
