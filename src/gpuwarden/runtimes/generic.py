"""A runtime spoken to by the calls its ``[[runtimes]]`` table names (``kind =
"generic"``): ``busy`` reads one JSON key, ``release`` is one call.

Without a ``busy`` call it has no busy signal (it may be asked only once silent
for its grace); without a ``release`` call it cannot be asked at all. Its
release is taken to wait for work in flight only if the operator said nothing
else: the broker still re-checks ``busy`` right before it asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from gpuwarden.core.runtime import (
    Activity,
    BusySignal,
    Capabilities,
    Reading,
    ReleaseSafety,
    RuntimeKind,
)
from gpuwarden.runtimes.base import ReleaseAsked, RuntimeApiError, RuntimeClient


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    busy_key: str = ""
    body: dict[str, Any] | None = None

    def shown(self) -> str:
        return f"{self.method} {self.path}"


def is_busy_value(value: Any) -> bool:
    """What a ``busy_key`` value means: true, a non-empty list or object, or a
    number above 0 is busy; false, empty, 0 and null are not."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value > 0
    if isinstance(value, list | dict | str):
        return len(value) > 0
    return False


class GenericClient(RuntimeClient):
    kind = RuntimeKind.GENERIC

    def __init__(
        self,
        url: str,
        *,
        busy: Call | None = None,
        release: Call | None = None,
        token: str | None = None,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, token=token, timeout_s=timeout_s, transport=transport)
        self.busy_call = busy
        self.release_call = release

    def probe(self) -> Capabilities:
        notes = []
        signal = BusySignal.NONE
        if self.busy_call is not None:
            self.read()  # it must answer as configured
            signal = BusySignal.EXACT
            notes.append(f"busy: {self.busy_call.shown()} key {self.busy_call.busy_key!r}")
        else:
            notes.append("no busy call configured: asked only once silent for its grace")
        if self.release_call is None:
            notes.append("no release call configured: it is never asked")
            return Capabilities(signal, ReleaseSafety.NOT_RELEASABLE, tuple(notes))
        notes.append(f"release: {self.release_call.shown()}")
        return Capabilities(signal, ReleaseSafety.WAITS, tuple(notes))

    def read(self) -> Reading:
        call = self.busy_call
        if call is None:
            return Reading(Activity.UNKNOWN, "no busy call configured")
        body = self.json_of(self.call(call.method, call.path, json=call.body))
        if not isinstance(body, dict) or call.busy_key not in body:
            raise RuntimeApiError(
                f"generic at {self.url}: {call.shown()} answered no key {call.busy_key!r}"
            )
        value = body[call.busy_key]
        busy = is_busy_value(value)
        return Reading(
            Activity.BUSY if busy else Activity.IDLE, f"{call.busy_key} = {str(value)[:60]}"
        )

    def release(self) -> ReleaseAsked:
        call = self.release_call
        if call is None:
            raise RuntimeApiError(f"generic at {self.url}: no release call is configured")
        response = self.call(call.method, call.path, json=call.body)
        if response.status_code >= 400:
            raise RuntimeApiError(
                f"generic at {self.url}: {call.shown()} answered {response.status_code}: "
                f"{response.text[:200]}"
            )
        return ReleaseAsked((call.shown(),))
