"""The llama-server client against an in-process llama-server API
(httpx.MockTransport, answering as llama.cpp's tools/server does: see
tests/standins/llamaserver.py for the sources): which mode it finds, which busy
signal it reads, the requests it makes, and hostile answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety, RuntimeKind
from gpuwarden.runtimes import llama
from gpuwarden.runtimes.base import MAX_BODY, RuntimeApiError
from gpuwarden.runtimes.llama import (
    ABORT_NOTE,
    DEFERRED,
    PROCESSING,
    SINGLE_NOTE,
    LlamaServerClient,
)
from gpuwarden.runtimes.select import open_client

NOT_SUPPORTED = {"error": {"code": 501, "message": "not supported", "type": "not_supported_error"}}


def err(code: int, message: str) -> httpx.Response:
    return httpx.Response(code, json={"error": {"code": code, "message": message}})


def metrics_text(processing: int, deferred: int) -> str:
    return (
        f"# TYPE {PROCESSING} gauge\n{PROCESSING} {processing}\n"
        f"# TYPE {DEFERRED} gauge\n{DEFERRED} {deferred}\n"
        "llamacpp:prompt_tokens_total 12\n"
    )


@dataclass
class Fake:
    """A llama-server: single-model, or a router with ``models`` (name -> status)."""

    single: str | None = "tiny"
    models: dict[str, str] = field(default_factory=dict)
    metrics: bool = True
    slots: bool = True
    processing: dict[str, list[bool]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    overrides: dict[str, Callable[[httpx.Request], httpx.Response]] = field(default_factory=dict)
    #: what a load does to the status, one step a GET /models
    load_steps: list[str] = field(default_factory=lambda: ["loading", "loaded"])
    failed: set[str] = field(default_factory=set)

    def client(self, **kwargs: Any) -> LlamaServerClient:
        return LlamaServerClient(
            "http://llama.test", transport=httpx.MockTransport(self.handle), **kwargs
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        path, query = request.url.path, dict(request.url.params)
        self.seen.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
        if path in self.overrides:
            return self.overrides[path](request)
        if request.method == "POST":
            return self.post(path, json.loads(request.content or b"{}"))
        if path in ("/models", "/v1/models"):
            return self.list_models()
        if path in ("/metrics", "/slots"):
            return self.signal(path, query)
        return httpx.Response(404, json={"detail": "Not Found"})

    def list_models(self) -> httpx.Response:
        if self.single is not None:
            return httpx.Response(200, json={"object": "list", "data": [{"id": self.single}]})
        rows = []
        for name, status in self.models.items():
            if status == "loading" and self.load_steps:
                self.models[name] = self.load_steps.pop(0)
            value: dict[str, Any] = {"value": status, "args": ["llama-server"]}
            if name in self.failed and status == "unloaded":
                value |= {"failed": True, "exit_code": 1}
            rows.append({"id": name, "object": "model", "status": value, "aliases": []})
        return httpx.Response(200, json={"object": "list", "data": rows})

    def signal(self, path: str, query: dict[str, str]) -> httpx.Response:
        model = self.single or query.get("model", "")
        if self.single is None:
            if not model:
                return err(400, "model name is missing from the request")
            if query.get("autoload") != "false":
                raise AssertionError("a look must never load a model (autoload=false)")
            if self.models.get(model) not in ("loaded", "loading", "sleeping"):
                return err(400, "model is not loaded")
        slots = self.processing.get(model, [False])
        if path == "/metrics":
            if not self.metrics:
                return httpx.Response(501, json=NOT_SUPPORTED)
            return httpx.Response(200, text=metrics_text(sum(slots), 0))
        if not self.slots:
            return httpx.Response(501, json=NOT_SUPPORTED)
        return httpx.Response(
            200, json=[{"id": i, "n_ctx": 4096, "is_processing": b} for i, b in enumerate(slots)]
        )

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        name = body.get("model")
        if self.single is not None or path not in ("/models/load", "/models/unload"):
            return httpx.Response(404, json={"detail": "Not Found"})
        if name not in self.models:
            return err(404 if path == "/models/load" else 400, "model is not found")
        running = self.models[name] in ("loaded", "loading", "sleeping")
        if path == "/models/load":
            if running:
                return err(400, "model is already running")
            self.models[name] = "loading"
        else:
            if not running:
                return err(400, "model is not running")
            self.models[name] = "unloaded"
        return httpx.Response(200, json={"success": True})


def asked(fake: Fake, prefix: str) -> list[str]:
    return [s for s in fake.seen if s.startswith(prefix)]


# -- the kind ----------------------------------------------------------------------------


def test_open_client_gives_the_llama_server_client() -> None:
    client = open_client(RuntimeKind.LLAMA_SERVER, "http://127.0.0.1:8080", token="k")
    assert isinstance(client, LlamaServerClient)
    assert client.http.headers["Authorization"] == "Bearer k"
    client.close()


# -- single-model mode -------------------------------------------------------------------


def test_single_with_metrics_reads_the_gauges_and_never_slots() -> None:
    fake = Fake(processing={"tiny": [True]})
    client = fake.client()
    caps = client.probe()
    assert (caps.busy_signal, caps.release) == (BusySignal.EXACT, ReleaseSafety.NOT_RELEASABLE)
    assert not caps.releasable and SINGLE_NOTE in caps.notes
    assert "single-model, serving tiny" in caps.notes[0]
    reading = client.read()
    assert reading.activity is Activity.BUSY and reading.detail == "1 processing, 0 deferred"
    assert [m.name for m in reading.loaded] == ["tiny"]
    fake.processing["tiny"] = [False]
    assert client.read().activity is Activity.IDLE
    # /slots is a task that would wake a sleeping server: never read while /metrics answers
    assert not asked(fake, "GET /slots")


def test_single_without_metrics_reads_the_slots() -> None:
    fake = Fake(metrics=False, processing={"tiny": [False, True]})
    client = fake.client()
    caps = client.probe()
    assert caps.busy_signal is BusySignal.EXACT
    assert any("--metrics" in n and "wakes a sleeping model" in n for n in caps.notes)
    assert client.read().detail == "slot 1 processing"
    fake.processing["tiny"] = [True, True]
    assert client.read().detail == "slots 0, 1 processing"
    fake.processing["tiny"] = [False, False]
    reading = client.read()
    assert (reading.activity, reading.detail) == (Activity.IDLE, "no slot processing")


def test_single_without_either_signal_is_unknown_and_not_releasable() -> None:
    fake = Fake(metrics=False, slots=False)
    client = fake.client()
    caps = client.probe()
    assert caps.busy_signal is BusySignal.NONE
    assert any("GET /metrics answered 501 and GET /slots 501" in n for n in caps.notes)
    assert client.read().activity is Activity.UNKNOWN
    with pytest.raises(RuntimeApiError, match="cannot be asked to release"):
        client.release()
    assert not asked(fake, "POST")  # nothing was asked of it


def test_a_server_without_models_route_is_single_mode() -> None:
    """llama-cpp-python's server: /models, /metrics, /slots answer FastAPI's 404."""
    fake = Fake(single="/m/tiny.gguf", metrics=False, slots=False)
    fake.overrides["/models"] = lambda r: httpx.Response(404, json={"detail": "Not Found"})
    fake.overrides["/metrics"] = fake.overrides["/slots"] = fake.overrides["/models"]
    caps = fake.client().probe()
    assert caps.notes[0] == "GET /models answered 404: single-model, serving /m/tiny.gguf"
    assert caps.busy_signal is BusySignal.NONE
    assert caps.release is ReleaseSafety.NOT_RELEASABLE


def test_single_prepare_only_the_model_it_serves() -> None:
    client = Fake().client()
    prepared = client.prepare("tiny", keep_alive_s=60, timeout_s=5)
    assert (prepared.model, prepared.in_vram) == ("tiny", None)
    with pytest.raises(RuntimeApiError, match="serves tiny, not 'other', and cannot load another"):
        client.prepare("other", keep_alive_s=60, timeout_s=5)


def test_metrics_turned_off_since_the_probe_falls_back_to_slots() -> None:
    fake = Fake(processing={"tiny": [True]})
    client = fake.client()
    client.probe()
    fake.metrics = False  # the fault: restarted without --metrics
    assert client.read().detail == "slot 0 processing"
    assert client.routes[""] == "slots"


# -- router mode --------------------------------------------------------------------------


def router(**models: str) -> Fake:
    return Fake(single=None, models=dict(models))


def test_router_probe_reads_each_loaded_model_with_its_name() -> None:
    fake = router(tiny="loaded", big="unloaded")
    client = fake.client()
    caps = client.probe()
    assert (caps.busy_signal, caps.release) == (BusySignal.EXACT, ReleaseSafety.ABORTS)
    assert ABORT_NOTE in caps.notes and "1 loaded: router mode" in caps.notes[0]
    fake.processing["tiny"] = [True]
    reading = client.read()
    assert reading.activity is Activity.BUSY
    assert reading.detail == "tiny: 1 processing, 0 deferred"
    assert [m.name for m in reading.loaded] == ["tiny"]
    # every look names the model and never loads one (the fake asserts autoload=false)
    assert all("model=tiny&autoload=false" in s for s in asked(fake, "GET /metrics"))
    assert not any("big" in s for s in asked(fake, "GET /metrics"))


def test_router_with_nothing_loaded_is_idle() -> None:
    client = router(tiny="unloaded").client()
    assert client.probe().busy_signal is BusySignal.EXACT
    reading = client.read()
    assert (reading.activity, reading.detail, reading.loaded) == (
        Activity.IDLE,
        "no model loaded",
        (),
    )


def test_router_statuses_loading_is_busy_sleeping_is_idle() -> None:
    fake = router(a="loading", b="sleeping")
    fake.load_steps = []  # stays loading
    client = fake.client()
    client.probe()
    reading = client.read()
    assert reading.activity is Activity.BUSY and reading.detail == "a: loading; b: sleeping"
    fake.models["a"] = "unloaded"
    assert client.read().activity is Activity.IDLE
    fake.models["a"] = "exploding"  # a status it does not know
    reading = client.read()
    assert reading.activity is Activity.UNKNOWN and "not one gpuwarden knows" in reading.detail


def test_router_model_gone_between_the_list_and_the_look() -> None:
    fake = router(tiny="loaded")
    client = fake.client()
    client.probe()
    fake.overrides["/metrics"] = lambda r: err(400, "model is not loaded")  # the race
    reading = client.read()
    assert reading.activity is Activity.IDLE
    assert reading.detail == "tiny: unloaded since the look"


def test_router_release_unloads_every_running_model() -> None:
    fake = router(a="loaded", b="sleeping", c="unloaded")
    client = fake.client()
    client.probe()
    released = client.release()
    assert released.calls == ("POST /models/unload a", "POST /models/unload b")
    assert released.models == ("a", "b")
    assert fake.models == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}


def test_router_release_of_a_model_that_stopped_meanwhile() -> None:
    fake = router(a="loaded")
    client = fake.client()
    client.probe()

    def gone(request: httpx.Request) -> httpx.Response:
        return err(400, "model is not running")

    fake.overrides["/models/unload"] = gone
    assert client.release().calls == ()


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(500, text="boom"),
        httpx.Response(200, json={"success": False}),
        httpx.Response(200, text="OK"),
    ],
)
def test_router_release_refused(answer: httpx.Response) -> None:
    fake = router(a="loaded")
    fake.overrides["/models/unload"] = lambda r: answer
    client = fake.client()
    client.probe()
    with pytest.raises(RuntimeApiError, match="POST /models/unload"):
        client.release()


def test_router_prepare_loads_and_waits_for_loaded() -> None:
    fake = router(tiny="unloaded")
    client = fake.client()
    prepared = client.prepare("tiny", keep_alive_s=300, timeout_s=10)
    assert prepared.model == "tiny" and prepared.in_vram is None
    assert prepared.detail.startswith("POST /models/load; loaded after")
    assert asked(fake, "POST /models/load")
    assert client.prepare("tiny", keep_alive_s=300, timeout_s=10).detail == "already loaded"


def test_router_prepare_failures() -> None:
    fake = router(tiny="unloaded", bad="unloaded")
    client = fake.client()
    with pytest.raises(RuntimeApiError, match=r"does not list 'nope' \(it lists: tiny, bad\)"):
        client.prepare("nope", keep_alive_s=0, timeout_s=1)
    fake.load_steps = ["unloaded"]
    fake.failed.add("bad")
    with pytest.raises(RuntimeApiError, match=r"bad failed to load \(exit code 1\)"):
        client.prepare("bad", keep_alive_s=0, timeout_s=5)
    fake.load_steps = []  # never gets past loading
    with pytest.raises(RuntimeApiError, match=r"tiny is still loading after"):
        client.prepare("tiny", keep_alive_s=0, timeout_s=0.3)


def test_router_restarted_as_single_is_probed_again() -> None:
    fake = router(tiny="loaded")
    client = fake.client()
    client.probe()
    fake.single = "tiny"  # the fault: restarted with -m
    with pytest.raises(RuntimeApiError, match="no longer answers as a router"):
        client.read()
    assert client.probe().release is ReleaseSafety.NOT_RELEASABLE


# -- hostile answers ----------------------------------------------------------------------


def answering(path: str, response: httpx.Response) -> LlamaServerClient:
    fake = router(tiny="loaded") if path != "/v1/models" else Fake()
    fake.overrides[path] = lambda r: response
    return fake.client()


@pytest.mark.parametrize(
    ("path", "response", "said"),
    [
        ("/models", httpx.Response(200, text="<html>"), "GET /models answered something that is"),
        ("/models", httpx.Response(200, json={"data": "x"}), "answered no 'data' list"),
        ("/models", httpx.Response(200, json={"data": ["x"]}), "not an object"),
        ("/models", httpx.Response(200, json={"data": [{"id": 5, "status": {}}]}), "without an id"),
        (
            "/models",
            httpx.Response(200, json={"data": [{"id": "a" * 2000, "status": {"value": "x"}}]}),
            "without an id",
        ),
        ("/models", httpx.Response(200, json={"data": [{"id": "a", "status": "up"}]}), "status"),
        (
            "/models",
            httpx.Response(200, json={"data": [{"id": "a", "status": {"value": 3}}]}),
            "status",
        ),
        (
            "/models",
            httpx.Response(
                200, json={"data": [{"id": "a", "status": {"value": "loaded"}, "aliases": [1]}]}
            ),
            "aliases",
        ),
        (
            "/models",
            httpx.Response(
                200,
                json={"data": [{"id": "a", "status": {"value": "unloaded", "exit_code": "1"}}]},
            ),
            "exit_code",
        ),
        (
            "/models",
            httpx.Response(200, json={"data": [{"id": "m", "status": {}}] * 5000}),
            "at most",
        ),
        ("/models", httpx.Response(200, content=b" " * (MAX_BODY + 1)), "more than"),
        ("/models", httpx.Response(401, json={"error": "Invalid API Key"}), "answered 401"),
        ("/metrics", httpx.Response(200, text="<html>hi</html>"), "not Prometheus text"),
        ("/metrics", httpx.Response(200, text=f"{PROCESSING} NaN\n"), "is nan"),
        ("/metrics", httpx.Response(200, text=f"{PROCESSING} -1\n"), "is -1"),
        ("/metrics", httpx.Response(500, text="boom"), "GET /metrics answered 500"),
        ("/v1/models", httpx.Response(200, json={"data": [{}]}), "without an id"),
    ],
)
def test_hostile_answers_are_clear_errors(path: str, response: httpx.Response, said: str) -> None:
    client = answering(path, response)
    with pytest.raises(RuntimeApiError, match=r"llama-server at http://llama\.test") as raised:
        client.probe()
        client.read()
    assert said in str(raised.value)


@pytest.mark.parametrize(
    "slots",
    ["x", [{"id": 0}], [{"id": "0", "is_processing": True}], [{"id": True, "is_processing": 0}]],
)
def test_hostile_slots(slots: object) -> None:
    fake = Fake(metrics=False)
    fake.overrides["/slots"] = lambda r: httpx.Response(200, json=slots)
    with pytest.raises(RuntimeApiError, match="GET /slots"):
        fake.client().probe()


def test_metrics_without_the_gauges_fall_back_to_slots() -> None:
    fake = Fake(processing={"tiny": [True]})
    fake.overrides["/metrics"] = lambda r: httpx.Response(200, text="other_metric 1\n")
    client = fake.client()
    client.probe()
    assert client.routes[""] == "slots"
    assert client.read().detail == "slot 0 processing"


def test_unreachable_is_a_runtime_api_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = LlamaServerClient("http://llama.test", transport=httpx.MockTransport(refuse))
    with pytest.raises(RuntimeApiError, match=r"llama-server at .*GET /models failed"):
        client.probe()


def test_module_exports() -> None:
    assert set(llama.__all__) <= set(dir(llama))
