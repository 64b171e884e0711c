"""A stand-in for ComfyUI's HTTP API, faithful to its protocol where gpuwarden
reads it, holding its model memory on gpuwarden's simulated GPU.

Run ``python -m tests.standins.comfyui --port N`` (``--port 0``: a free port) with
``GPUWARDEN_SIM_GPU`` and ``CUDA_VISIBLE_DEVICES`` set (a sim probe's ``job_env``).
It prints ``listening on http://127.0.0.1:PORT`` once it answers.

Where each behaviour comes from (ComfyUI, comfyanonymous/ComfyUI, read 2026-12):

* ``server.py`` ``PromptServer.__init__`` routes (every route is also served under
  ``/api``, ``add_routes``):

  - ``POST /prompt`` (``post_prompt``): ``{"prompt": {...}, "extra_data": {...},
    "client_id": ..., "number": ..., "front": ...}``; queues
    ``(number, prompt_id, prompt, extra_data, outputs_to_execute)`` and answers
    ``{"prompt_id", "number", "node_errors"}``; without ``"prompt"``: 400
    ``{"error": "no prompt", "node_errors": []}``. The stand-in has no node graph to
    validate: any JSON object is a valid prompt, and what it does is said in its
    ``extra_data``: ``{"model_gib": X, "work_s": S}`` (the worker loads a model of
    X GiB if it has none of that size loaded, then works S seconds; defaults 1, 0).
  - ``GET /prompt`` (``get_prompt``/``get_queue_info``):
    ``{"exec_info": {"queue_remaining": n}}``.
  - ``GET /queue`` (``get_queue``): ``{"queue_running": [...], "queue_pending":
    [...]}``, the items as queued (``PromptQueue.get_current_queue`` in
    ``execution.py``: running items, then a copy of the heap).
  - ``GET /system_stats`` (``system_stats``): ``devices[0]`` has ``vram_total``,
    ``vram_free``, ``torch_vram_total``, ``torch_vram_free`` from
    ``comfy/model_management.py`` ``get_total_memory``/``get_free_memory``:
    ``vram_free = mem_get_info() free + (reserved - active)``, a whole-device number
    (every process's memory counts), plus torch's cache slack, which the stand-in
    does not have (0). ``torch_vram_total`` is torch's reserved bytes: here the
    worker's model.
  - ``POST /free`` (``post_free``): sets the ``unload_models`` / ``free_memory``
    flags on the queue (``PromptQueue.set_flag``, which also notifies the worker)
    and answers 200 with an empty body at once.
  - ``POST /interrupt`` (``post_interrupt``): ``nodes.interrupt_processing()``, it
    cuts the running prompt short; answers 200, empty body. gpuwarden never uses it.

* ``main.py`` ``prompt_worker``: ``q.get(timeout=...)`` (a notify with an empty
  queue returns None), executes the prompt, ``q.task_done``; only then
  ``q.get_flags()`` (reset): ``unload_models`` (default: ``free_memory``) calls
  ``comfy.model_management.unload_all_models()`` (``free_memory(1e30, device)``),
  ``free_memory`` also ``e.reset()`` (the output cache); then ``gc.collect()`` and
  ``soft_empty_cache()`` (``torch.cuda.empty_cache(); torch.cuda.ipc_collect()``).
  So a ``/free`` during a prompt acts after that prompt ends, and the prompt is
  out of ``queue_running`` a moment before the memory goes.

ComfyUI holds its models in its own process; the stand-in holds them in a CHILD
process (``--worker``), driven over a pipe by the prompt worker thread, so that a
test sees memory attributed by process tree, as for runtimes whose models live in
child processes (Ollama's runners, llama-server's router children).
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import os
import select
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from subprocess import PIPE, Popen
from typing import IO, Any

from gpuwarden.gpu import simclient
from gpuwarden.gpu.sim import SimDevice

GIB = 1024**3
ROOT = str(Path(__file__).resolve().parents[2])


# -- the worker child: holds the model ---------------------------------------------


def worker_main() -> None:
    """One JSON command a line on stdin, one JSON answer a line on stdout."""
    gpu = simclient.attach()
    held: tuple[int, int] | None = None  # (alloc id, bytes)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "run":
            nbytes = int(float(cmd.get("model_gib", 1)) * GIB)
            if held is None or held[1] != nbytes:
                if held is not None:
                    gpu.free(held[0])
                held = (gpu.allocate(nbytes, label="comfyui model"), nbytes)
            interrupted = _work(float(cmd.get("work_s", 0)))
            answer: dict[str, Any] = {"ok": True, "interrupted": interrupted}
        elif op == "unload":
            if held is not None:
                gpu.free(held[0])
                held = None
            answer = {"ok": True}
        elif op == "interrupt":
            continue  # arrived between prompts: nothing to cut
        else:
            answer = {"ok": False, "error": f"unknown op {op!r}"}
        answer["held"] = held[1] if held else 0
        print(json.dumps(answer), flush=True)


def _work(seconds: float) -> bool:
    """Work ``seconds``; an ``interrupt`` line on stdin ends it early."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready:
            line = sys.stdin.readline()
            if not line or json.loads(line).get("op") == "interrupt":
                return True
    return False


class Worker:
    """The server's handle on its worker child."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = Popen(
            [sys.executable, "-m", "tests.standins.comfyui", "--worker"],
            stdin=PIPE,
            stdout=PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lock = threading.Lock()
        self.held = 0

    def _send(self, cmd: dict[str, Any]) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        with self.lock:
            stdin.write(json.dumps(cmd) + "\n")
            stdin.flush()

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self._send(cmd)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the worker child exited")
        answer: dict[str, Any] = json.loads(line)
        self.held = int(answer.get("held", 0))
        return answer

    def interrupt(self) -> None:
        self._send({"op": "interrupt"})


# -- the queue and the prompt worker (execution.py PromptQueue, main.py) ------------


class PromptQueue:
    def __init__(self) -> None:
        self.mutex = threading.RLock()
        self.not_empty = threading.Condition(self.mutex)
        self.task_counter = 0
        self.queue: list[tuple[Any, ...]] = []
        self.currently_running: dict[int, tuple[Any, ...]] = {}
        self.flags: dict[str, Any] = {}

    def put(self, item: tuple[Any, ...]) -> None:
        with self.mutex:
            heapq.heappush(self.queue, item)
            self.not_empty.notify()

    def get(self, timeout: float | None = None) -> tuple[tuple[Any, ...], int] | None:
        with self.not_empty:
            while len(self.queue) == 0:
                self.not_empty.wait(timeout=timeout)
                if timeout is not None and len(self.queue) == 0:
                    return None
            item = heapq.heappop(self.queue)
            i = self.task_counter
            self.currently_running[i] = copy.deepcopy(item)
            self.task_counter += 1
            return item, i

    def task_done(self, item_id: int) -> None:
        with self.mutex:
            self.currently_running.pop(item_id)

    def get_current_queue(self) -> tuple[list[Any], list[Any]]:
        with self.mutex:
            return list(self.currently_running.values()), copy.deepcopy(self.queue)

    def get_tasks_remaining(self) -> int:
        with self.mutex:
            return len(self.queue) + len(self.currently_running)

    def set_flag(self, name: str, data: Any) -> None:
        with self.mutex:
            self.flags[name] = data
            self.not_empty.notify()

    def get_flags(self) -> dict[str, Any]:
        with self.mutex:
            ret, self.flags = self.flags, {}
            return ret


def prompt_worker(q: PromptQueue, worker: Worker) -> None:
    while True:
        queue_item = q.get(timeout=1000.0)
        if queue_item is not None:
            item, item_id = queue_item
            extra = item[3]
            worker.ask(
                {
                    "op": "run",
                    "model_gib": extra.get("model_gib", 1),
                    "work_s": extra.get("work_s", 0),
                }
            )
            q.task_done(item_id)
        flags = q.get_flags()
        free_memory = flags.get("free_memory", False)
        if flags.get("unload_models", free_memory):
            worker.ask({"op": "unload"})  # unload_all_models()
        # free_memory's e.reset() and soft_empty_cache(): nothing to drop here


# -- HTTP ---------------------------------------------------------------------------


class State:
    def __init__(self) -> None:
        self.queue = PromptQueue()
        self.worker = Worker()
        self.number = 0
        self.sim_path = os.environ.get(simclient.SIM_ENV, "")
        self.gpu_uuid = os.environ.get(simclient.VISIBLE_ENV, "").split(",")[0].strip()

    def system_stats(self) -> dict[str, Any]:
        readings = SimDevice.open(Path(self.sim_path)).readings(time.time())
        gpu = next(r for r in readings if r.uuid == self.gpu_uuid)
        held = self.worker.held
        return {
            "system": {
                "os": os.name,
                "comfyui_version": "stand-in",
                "python_version": sys.version,
                "argv": sys.argv,
            },
            "devices": [
                {
                    "name": f"cuda:0 {gpu.name}",
                    "type": "cuda",
                    "index": 0,
                    "vram_total": gpu.total_bytes,
                    "vram_free": gpu.free_bytes + 0,  # + (reserved - active): no slack here
                    "torch_vram_total": held,
                    "torch_vram_free": 0,
                }
            ],
        }


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _path(self) -> str:
        path = self.path.split("?", 1)[0]
        return path[4:] if path.startswith("/api/") else path

    def _send(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null")

    def do_GET(self) -> None:
        state = self.server.state
        path = self._path()
        if path == "/queue":
            running, pending = state.queue.get_current_queue()
            self._send(200, {"queue_running": running, "queue_pending": pending})
        elif path == "/system_stats":
            self._send(200, state.system_stats())
        elif path == "/prompt":
            remaining = state.queue.get_tasks_remaining()
            self._send(200, {"exec_info": {"queue_remaining": remaining}})
        else:
            self._send(404)

    def do_POST(self) -> None:
        state = self.server.state
        path = self._path()
        try:
            body = self._json()
        except ValueError:
            self._send(400)  # aiohttp's request.json() raises: a 500 there
            return
        if path == "/prompt":
            self._post_prompt(state, body)
        elif path == "/free":
            body = body if isinstance(body, dict) else {}
            if body.get("unload_models", False):
                state.queue.set_flag("unload_models", body["unload_models"])
            if body.get("free_memory", False):
                state.queue.set_flag("free_memory", body["free_memory"])
            self._send(200)
        elif path == "/interrupt":
            state.worker.interrupt()
            self._send(200)
        else:
            self._send(404)

    def _post_prompt(self, state: State, body: Any) -> None:
        if not isinstance(body, dict) or "prompt" not in body:
            self._send(400, {"error": "no prompt", "node_errors": []})
            return
        with state.queue.mutex:
            if "number" in body:
                number = float(body["number"])
            else:
                number = state.number
                if body.get("front"):
                    number = -number
                state.number += 1
            extra = dict(body.get("extra_data") or {})
            if "client_id" in body:
                extra["client_id"] = body["client_id"]
            prompt_id = str(uuid.uuid4())
            outputs = sorted(body["prompt"]) if isinstance(body["prompt"], dict) else []
            state.queue.put((number, prompt_id, body["prompt"], extra, outputs))
        self._send(200, {"prompt_id": prompt_id, "number": number, "node_errors": {}})


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, state: State) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.state = state


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--port", type=int, default=8188)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return
    state = State()
    threading.Thread(target=prompt_worker, args=(state.queue, state.worker), daemon=True).start()
    server = Server(args.port, state)
    # SIGTERM ends the server like Ctrl-C, so the worker child is ended too (it
    # also ends by itself when its stdin closes)
    signal.signal(signal.SIGTERM, _interrupted)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        state.worker.proc.terminate()


if __name__ == "__main__":
    main()
