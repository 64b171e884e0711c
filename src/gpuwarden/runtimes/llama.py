"""llama.cpp's ``llama-server`` (ggml-org/llama.cpp ``tools/server``; port 8080 by
default), single-model or router.

Facts from its source (llama.cpp 0c1e5709, 2026-10, as vendored by
llama-cpp-python 0.3.36: ``tools/server/server.cpp``, ``server-context.cpp``,
``server-models.cpp``, ``server-queue.cpp``, ``common/arg.cpp``, and its README):

- Two modes. Started with a model it serves that one, in its own process.
  Started without one it is a *router*: ``GET /models`` lists every model it
  knows with a ``status`` object (``{"value": "unloaded" | "loading" | "loaded" |
  "sleeping" | "downloading", "args": [...], "failed"?, "exit_code"?}``), and each
  loaded model runs in a child ``llama-server`` on a port of its own at
  127.0.0.1, to which the router proxies. A single-model server's ``/models``
  and ``/v1/models`` answer the same list without ``status`` (``get_res_models``).
- Busy, exact: ``GET /metrics`` (only with ``--metrics``; else 501
  ``not_supported_error``) has the gauges ``llamacpp:requests_processing`` (slots
  processing) and ``llamacpp:requests_deferred`` (tasks waiting for a slot).
  ``GET /slots`` (on unless ``--no-slots``; else 501) lists the slots, each with
  ``is_processing``. In router mode both need ``?model=`` (400 "model name is
  missing from the request" without it), and ``autoload=false`` so that a look
  never loads a model (``router_validate_model``, ``is_autoload``).
- ``/metrics`` is read first: with ``--sleep-idle-seconds`` a server sleeps
  (frees its model and KV cache) after that long without tasks, and ``GET
  /slots`` is a task (``task_resets_idle_timer``: every type but METRICS) that
  waits for the model to wake (``server_res_generator`` ``wait_until_no_sleep``):
  polling ``/slots`` would keep it awake for ever. ``/metrics``, ``/health``,
  ``/props`` and ``/models`` are exempt (README, "Sleeping on Idle"). ``/slots`` is
  the fallback when ``--metrics`` is off, and the probe says so.
- Release, router only: ``POST /models/unload {"model": M}`` answers
  ``{"success": true}`` at once; the router writes ``cmd_router_to_child:exit``
  to the child's stdin, whose handler ends the task loop
  (``ctx_server.terminate()``) and the HTTP server: requests in flight are cut,
  not waited for; after ``stop-timeout`` (a preset option, 10 s by default) the
  child is force-killed (``server_monitor``). A model still loading is killed at
  once. So it ABORTS: the broker reads the gauges again right before it asks.
  400 "model is not running" when it is not (it went by itself: not an error).
- A single-model server has no unload route: only ``--sleep-idle-seconds``, given
  at launch, frees its memory. It is not releasable.
- Load, router: ``POST /models/load {"model": M}``, ``{"success": true}`` at once
  (404 "model is not found"; 400 "model is already running"); the status goes
  ``loading`` then ``loaded`` (or ``unloaded`` with ``failed``). llama-server has
  no keep-alive: a model stays until unloaded, evicted (``--models-max``, least
  recently used) or asleep.
- No route reports bytes: what it holds is read from the device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

from gpuwarden.core.runtime import (
    Activity,
    BusySignal,
    Capabilities,
    Loaded,
    Reading,
    ReleaseSafety,
    RuntimeKind,
)
from gpuwarden.runtimes.base import (
    MAX_BODY,
    Prepared,
    ReleaseAsked,
    RuntimeApiError,
    RuntimeClient,
)
from gpuwarden.runtimes.vllm import parse_prometheus

__all__ = [
    "ABORT_NOTE",
    "DEFERRED",
    "PROCESSING",
    "SINGLE_NOTE",
    "LlamaServerClient",
    "RouterModel",
]

MODELS = "/models"
V1_MODELS = "/v1/models"
METRICS = "/metrics"
SLOTS = "/slots"
LOAD = "/models/load"
UNLOAD = "/models/unload"
PROCESSING = "llamacpp:requests_processing"
DEFERRED = "llamacpp:requests_deferred"
#: the statuses of a router's model whose child process runs (``is_running``)
RUNNING = ("loaded", "loading", "sleeping")
KNOWN = (*RUNNING, "unloaded", "downloading", "downloaded")
#: the most models, and slots, read from one answer
MAX_MODELS = 4096
MAX_SLOTS = 4096
MAX_NAME = 1024
#: how often prepare() looks at a model being loaded
LOAD_POLL_S = 0.25

SINGLE_NOTE = (
    "single-model llama-server: it has no unload route (only --sleep-idle-seconds, "
    "given at launch, frees its memory), so it cannot be asked to release"
)
ABORT_NOTE = (
    "POST /models/unload stops the model's child process: requests in flight are cut "
    "(force-killed after stop-timeout, 10 s by default): asked only after a fresh read "
    "shows nothing processing"
)
SLOTS_NOTE = (
    "/metrics is off (start it with --metrics): GET /slots is read instead, which "
    "counts as a task: it resets --sleep-idle-seconds' idle timer and wakes a sleeping model"
)


@dataclass(frozen=True, slots=True)
class RouterModel:
    """One row of a router's ``GET /models``, as read."""

    name: str
    status: str
    aliases: tuple[str, ...] = ()
    failed: bool = False
    exit_code: int | None = None

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


#: how a model's work is read: "metrics", "slots", or None (no signal)
Route = str | None


class LlamaServerClient(RuntimeClient):
    """A llama-server's API: ``/metrics`` or ``/slots`` for busy, the router's
    ``/models/unload`` for memory."""

    kind = RuntimeKind.LLAMA_SERVER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: router mode (None: not probed yet)
        self.router: bool | None = None
        #: the route that reads each model's work ("" in single-model mode)
        self.routes: dict[str, Route] = {}
        #: what the last GET /models, /metrics and /slots answered (for the notes)
        self.models_code = 0
        self.signal_codes: tuple[int, int] = (0, 0)

    def where(self, method: str, path: str) -> str:
        return f"{self.kind.value} at {self.url}: {method} {path}"

    # -- the interface ------------------------------------------------------------

    def probe(self) -> Capabilities:
        self.routes = {}
        models = self.router_models()
        self.router = models is not None
        if models is None:
            served = ", ".join(self.served()) or "nothing"
            how = "answered 404" if self.models_code == 404 else "has no status per model"
            notes = [f"GET {MODELS} {how}: single-model, serving {served}"]
            busy, note = self.signal("")
            notes += [note, SINGLE_NOTE]
            caps = Capabilities(busy, ReleaseSafety.NOT_RELEASABLE, tuple(notes))
        else:
            loaded = [m.name for m in models if m.status == "loaded"]
            notes = [
                f"GET {MODELS} lists {len(models)} model(s) with a status, "
                f"{len(loaded)} loaded: router mode"
            ]
            if loaded:
                busy, note = self.signal(loaded[0])
            else:
                busy = BusySignal.EXACT
                note = (
                    "no model loaded, so nothing runs; each loaded model's /metrics "
                    "(or /slots) is read with ?model="
                )
            notes += [note, ABORT_NOTE]
            caps = Capabilities(busy, ReleaseSafety.ABORTS, tuple(notes))
        self.capabilities = caps
        return caps

    def read(self) -> Reading:
        if self.router is None:
            self.probe()
        if not self.router:
            busy, detail = self.activity("")
            loaded = tuple(Loaded(name) for name in self.served())
            return Reading(_activity([busy]), detail=detail, loaded=loaded)
        models = self.router_models()
        if models is None:
            self.router = None  # it no longer answers as a router: probed again
            raise RuntimeApiError(
                f"{self.where('GET', MODELS)} no longer answers as a router (restarted?)"
            )
        states: list[bool | None] = []
        parts: list[str] = []
        for model in models:
            if model.status == "loaded":
                busy, detail = self.activity(model.name)
            elif model.status in ("loading", "downloading"):
                busy, detail = True, model.status
            elif model.status == "sleeping":
                busy, detail = False, "sleeping"
            elif model.status in KNOWN:
                continue
            else:
                busy, detail = None, f"status {model.status!r} is not one gpuwarden knows"
            states.append(busy)
            parts.append(f"{model.name}: {detail}")
        loaded = tuple(Loaded(m.name) for m in models if m.status in ("loaded", "loading"))
        detail = "; ".join(parts) if parts else "no model loaded"
        return Reading(_activity(states), detail=detail, loaded=loaded)

    def release(self) -> ReleaseAsked:
        """``POST /models/unload`` for each model whose child runs, whatever it
        does (in-flight requests are cut): the broker reads again first."""
        if self.router is None:
            self.probe()
        models = self.router_models() if self.router else None
        if models is None:
            self.capabilities, self.router = None, None
            raise RuntimeApiError(f"{self.kind.value} at {self.url}: {SINGLE_NOTE}")
        calls, names = [], []
        for model in models:
            if model.status not in RUNNING:
                continue
            if self.unload(model.name):
                calls.append(f"POST {UNLOAD} {model.name}")
                names.append(model.name)
        return ReleaseAsked(tuple(calls), tuple(names))

    def prepare(self, model: str, *, keep_alive_s: float, timeout_s: float) -> Prepared:
        """Router: load ``model`` (``POST /models/load``) and wait until its status
        is ``loaded``. Single-model: only the model it serves. ``keep_alive_s`` is
        not sent: llama-server keeps a model until it is unloaded, evicted or asleep."""
        if self.router is None:
            self.probe()
        if not self.router:
            served = self.served()
            if model not in served:
                raise RuntimeApiError(
                    f"{self.where('GET', V1_MODELS)}: this single-model llama-server serves "
                    f"{', '.join(served) or 'nothing'}, not {model!r}, and cannot load another"
                )
            return Prepared(model, None, "served by this single-model llama-server")
        row = self.find(model)
        if row.status == "loaded":
            return Prepared(row.name, None, "already loaded")
        if row.status == "sleeping":
            return Prepared(row.name, None, "asleep (--sleep-idle-seconds): it wakes at a task")
        asked = "was loading"
        if row.status != "loading":
            self.load(row.name)
            asked = f"POST {LOAD}"
        return self.wait_loaded(row.name, asked, time.monotonic() + timeout_s)

    # -- llama-server's own -------------------------------------------------------

    def router_models(self) -> list[RouterModel] | None:
        """A router's ``GET /models``, checked; None for a single-model server (its
        rows have no ``status``, or it has no ``/models``: older servers)."""
        response = self.call("GET", MODELS)
        self.models_code = response.status_code
        if response.status_code == 404:
            return None
        rows = self.data_of(response, MODELS)
        if rows and all("status" not in row for row in rows):
            return None
        return [self.router_row(row) for row in rows]

    def served(self) -> list[str]:
        """The model ids ``GET /v1/models`` lists (a single-model server's one)."""
        rows = self.data_of(self.call("GET", V1_MODELS), V1_MODELS)
        return [_name(row.get("id"), self.where("GET", V1_MODELS)) for row in rows]

    def find(self, model: str) -> RouterModel:
        models = self.router_models() or []
        for row in models:
            if model in row.names():
                return row
        known = ", ".join(m.name for m in models[:20]) or "none"
        raise RuntimeApiError(
            f"{self.where('GET', MODELS)} does not list {model!r} (it lists: {known})"
        )

    def load(self, model: str) -> None:
        response = self.call("POST", LOAD, json={"model": model})
        if response.status_code == 400 and "already running" in response.text:
            return  # loaded since the look (a request's autoload)
        body = self.json_of(response)
        if not isinstance(body, dict) or body.get("success") is not True:
            raise RuntimeApiError(
                f"{self.where('POST', LOAD)} {model} answered {response.text[:200]!r}, "
                'not {"success": true}'
            )

    def unload(self, model: str) -> bool:
        """Ask the router to stop ``model``'s child; False if it had stopped."""
        response = self.call("POST", UNLOAD, json={"model": model})
        if response.status_code == 400 and "not running" in response.text:
            return False
        body = self.json_of(response)
        if not isinstance(body, dict) or body.get("success") is not True:
            raise RuntimeApiError(
                f"{self.where('POST', UNLOAD)} {model} answered {response.text[:200]!r}, "
                'not {"success": true}'
            )
        return True

    def wait_loaded(self, model: str, asked: str, deadline: float) -> Prepared:
        started = time.monotonic()
        while True:
            row = self.find(model)
            if row.status == "loaded":
                waited = time.monotonic() - started
                return Prepared(model, None, f"{asked}; loaded after {waited:.1f} s")
            if row.status == "unloaded":
                code = f" (exit code {row.exit_code})" if row.exit_code is not None else ""
                said = "failed to load" if row.failed else "went back to unloaded"
                raise RuntimeApiError(f"{self.where('GET', MODELS)}: {model} {said}{code}")
            if time.monotonic() >= deadline:
                raise RuntimeApiError(
                    f"{self.where('GET', MODELS)}: {model} is still {row.status} after "
                    f"{time.monotonic() - started:.1f} s"
                )
            time.sleep(min(LOAD_POLL_S, max(0.0, deadline - time.monotonic())))

    # -- the busy signal ------------------------------------------------------------

    def signal(self, model: str) -> tuple[BusySignal, str]:
        """Find the route that reads ``model``'s work ("" : the single model)."""
        route = self.find_route(model)
        self.routes[model] = route
        if route == "metrics":
            return BusySignal.EXACT, f"/metrics has {PROCESSING} and {DEFERRED}"
        if route == "slots":
            return BusySignal.EXACT, SLOTS_NOTE
        metrics, slots = self.signal_codes
        return BusySignal.NONE, (
            f"GET /metrics answered {metrics} and GET /slots {slots} (off: started with "
            "--no-slots and without --metrics, or not llama.cpp's own server): no busy signal"
        )

    def find_route(self, model: str) -> Route:
        response = self.call("GET", METRICS, params=self.params(model))
        if response.status_code == 200:
            names = {name for name, _, _ in self.samples_of(response)}
            if PROCESSING in names:
                return "metrics"
        elif response.status_code not in (404, 501):
            self.json_of(response)  # a clear error: the route and what it said
        metrics = response.status_code
        response = self.call("GET", SLOTS, params=self.params(model))
        self.signal_codes = (metrics, response.status_code)
        if response.status_code in (404, 501):
            return None
        self.slots_of(response)
        return "slots"

    def activity(self, model: str) -> tuple[bool | None, str]:
        """Whether ``model`` works now (None: no signal), and what was seen."""
        if model not in self.routes:
            self.routes[model] = self.find_route(model)
        route = self.routes[model]
        if route == "metrics":
            response = self.call("GET", METRICS, params=self.params(model))
            if _gone(response, model):
                return False, "unloaded since the look"
            if response.status_code not in (404, 501):
                counts = self.counts(self.samples_of(response))
                if counts is not None:
                    processing, deferred = counts
                    busy = processing + deferred > 0
                    return busy, f"{processing} processing, {deferred} deferred"
            route = self.routes[model] = self.find_route(model)  # restarted since
        if route == "slots":
            response = self.call("GET", SLOTS, params=self.params(model))
            if _gone(response, model):
                return False, "unloaded since the look"
            if response.status_code not in (404, 501):
                working = [str(s) for s, busy in self.slots_of(response) if busy]
                if not working:
                    return False, "no slot processing"
                ids = ", ".join(working)
                return True, f"slot{'s' if len(working) > 1 else ''} {ids} processing"
            self.routes.pop(model, None)
        return None, "no busy signal (/metrics and /slots answer 404 or 501)"

    def params(self, model: str) -> dict[str, str]:
        return {"model": model, "autoload": "false"} if model else {}

    # -- reading answers ------------------------------------------------------------

    def data_of(self, response: httpx.Response, path: str) -> list[dict[str, Any]]:
        body = self.json_of(response)
        rows = body.get("data") if isinstance(body, dict) else None
        where = self.where("GET", path)
        if not isinstance(rows, list):
            raise RuntimeApiError(f"{where} answered no 'data' list: {response.text[:200]!r}")
        if len(rows) > MAX_MODELS:
            raise RuntimeApiError(f"{where} lists {len(rows)} models (at most {MAX_MODELS})")
        for row in rows:
            if not isinstance(row, dict):
                raise RuntimeApiError(f"{where} listed a model that is not an object: {row!r:.200}")
        return rows

    def router_row(self, row: dict[str, Any]) -> RouterModel:
        where = self.where("GET", MODELS)
        name = _name(row.get("id"), where)
        status = row.get("status")
        value = status.get("value") if isinstance(status, dict) else None
        if not isinstance(status, dict) or not isinstance(value, str) or len(value) > 64:
            raise RuntimeApiError(
                f"{where}: {name}'s status is not {{'value': ...}}: {status!r:.200}"
            )
        aliases = row.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise RuntimeApiError(f"{where}: {name}'s aliases are not names: {aliases!r:.200}")
        code = status.get("exit_code")
        if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
            raise RuntimeApiError(f"{where}: {name}'s exit_code is not a number: {code!r:.80}")
        failed = status.get("failed", False) is True
        return RouterModel(name, value, tuple(a for a in aliases if a), failed, code)

    def samples_of(self, response: httpx.Response) -> list[tuple[str, dict[str, str], float]]:
        where = self.where("GET", METRICS)
        if response.status_code >= 400:
            raise RuntimeApiError(f"{where} answered {response.status_code}: {response.text[:200]}")
        if len(response.content) > MAX_BODY:
            raise RuntimeApiError(f"{where} answered more than {MAX_BODY} bytes")
        try:
            return parse_prometheus(response.text)
        except ValueError as exc:
            raise RuntimeApiError(f"{where} answered what is not Prometheus text: {exc}") from exc

    def counts(self, samples: list[tuple[str, dict[str, str], float]]) -> tuple[int, int] | None:
        """(processing, deferred), or None when the gauges are gone."""
        found: dict[str, float] = {}
        for name, _, value in samples:
            if name in (PROCESSING, DEFERRED):
                if math.isnan(value) or value < 0 or value > 1e9:
                    raise RuntimeApiError(f"{self.where('GET', METRICS)}: {name} is {value}")
                found[name] = found.get(name, 0.0) + value
        if PROCESSING not in found:
            return None
        return int(found[PROCESSING]), int(found.get(DEFERRED, 0.0))

    def slots_of(self, response: httpx.Response) -> list[tuple[int, bool]]:
        """``GET /slots``: (id, is_processing) per slot, checked."""
        body = self.json_of(response)
        where = self.where("GET", SLOTS)
        if not isinstance(body, list) or len(body) > MAX_SLOTS:
            raise RuntimeApiError(f"{where} answered no list of slots: {response.text[:200]!r}")
        slots = []
        for slot in body:
            ident = slot.get("id") if isinstance(slot, dict) else None
            busy = slot.get("is_processing") if isinstance(slot, dict) else None
            if isinstance(ident, bool) or not isinstance(ident, int) or not isinstance(busy, bool):
                raise RuntimeApiError(
                    f"{where} listed a slot without an id and is_processing: {slot!r:.200}"
                )
            slots.append((ident, busy))
        return slots


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise RuntimeApiError(f"{where} listed a model without an id: {value!r:.200}")
    return value


def _gone(response: httpx.Response, model: str) -> bool:
    """A router's 400 for a model that stopped between its ``/models`` and this
    look (``router_validate_model``: "model is not loaded")."""
    return bool(model) and response.status_code == 400 and "not loaded" in response.text


def _activity(states: list[bool | None]) -> Activity:
    if any(state is True for state in states):
        return Activity.BUSY
    if any(state is None for state in states):
        return Activity.UNKNOWN
    return Activity.IDLE
