"""The generic runtime client: the configured calls, against an in-process API
(httpx.MockTransport: the requests it makes are checked, not just its answers)."""

from __future__ import annotations

import json

import httpx
import pytest

from gpuwarden.core.runtime import Activity, BusySignal, ReleaseSafety
from gpuwarden.runtimes.base import RuntimeApiError
from gpuwarden.runtimes.generic import Call, GenericClient, is_busy_value


def server(state: dict[str, object], seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path} {request.headers.get('authorization')}")
        if request.url.path == "/status":
            return httpx.Response(200, json={"running": state["running"]})
        if request.url.path == "/unload" and request.method == "POST":
            state["unloaded"] = json.loads(request.content or b"null")
            return httpx.Response(200, text="OK")
        if request.url.path == "/broken":
            return httpx.Response(200, text="<html>")
        return httpx.Response(404, text="no such route")

    return httpx.MockTransport(handle)


def test_busy_and_release_through_the_configured_calls() -> None:
    state: dict[str, object] = {"running": [1]}
    seen: list[str] = []
    client = GenericClient(
        "http://127.0.0.1:9000",
        busy=Call("GET", "/status", busy_key="running"),
        release=Call("POST", "/unload", body={"all": True}),
        token="s3cret",
        transport=server(state, seen),
    )
    caps = client.probe()
    assert (caps.busy_signal, caps.release) == (BusySignal.EXACT, ReleaseSafety.WAITS)
    reading = client.read()
    assert (reading.activity, reading.detail) == (Activity.BUSY, "running = [1]")
    state["running"] = []
    assert client.read().activity is Activity.IDLE
    asked = client.release()
    assert asked.calls == ("POST /unload",)
    assert state["unloaded"] == {"all": True}
    assert all(line.endswith("Bearer s3cret") for line in seen)


def test_without_calls_it_has_no_signal_and_is_never_asked() -> None:
    client = GenericClient("http://127.0.0.1:9000", transport=server({}, []))
    caps = client.probe()
    assert (caps.busy_signal, caps.release) == (BusySignal.NONE, ReleaseSafety.NOT_RELEASABLE)
    assert not caps.releasable
    assert client.read().activity is Activity.UNKNOWN
    with pytest.raises(RuntimeApiError, match="no release call is configured"):
        client.release()


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (Call("GET", "/status", busy_key="queue"), "answered no key 'queue'"),
        (Call("GET", "/broken", busy_key="x"), "not JSON"),
        (Call("GET", "/nowhere", busy_key="x"), "answered 404"),
    ],
)
def test_an_answer_it_cannot_read_is_a_clear_error(call: Call, said: str) -> None:
    client = GenericClient("http://h:1", busy=call, transport=server({"running": 0}, []))
    with pytest.raises(RuntimeApiError, match=said):
        client.read()


def test_an_unreachable_runtime_names_its_url() -> None:
    client = GenericClient(
        "http://127.0.0.1:9", busy=Call("GET", "/status", busy_key="x"), timeout_s=1.0
    )
    with pytest.raises(RuntimeApiError, match=r"generic at http://127.0.0.1:9: GET /status failed"):
        client.read()


def test_busy_values() -> None:
    assert [is_busy_value(v) for v in (True, 1, 0.5, [1], {"a": 1}, "x")] == [True] * 6
    assert [is_busy_value(v) for v in (False, 0, [], {}, "", None)] == [False] * 6
