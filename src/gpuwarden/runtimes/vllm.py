"""vLLM's OpenAI-compatible server (``vllm serve``, port 8000 by default).

- Busy signal, exact: ``GET /metrics`` (Prometheus text) has the gauges
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, one sample per
  ``model_name`` label (docs.vllm.ai, usage/metrics).
- Release: ``POST /sleep?level=1`` (weights offloaded to CPU RAM, KV cache
  discarded; docs, features/sleep_mode). The sleep routes exist only when the
  server runs with ``VLLM_SERVER_DEV_MODE=1`` (``attach_router`` returns early
  otherwise, ``vllm/entrypoints/serve/sleep/api_router.py``): without it
  ``GET /is_sleeping`` is a 404 and the runtime is not releasable. The engine also
  needs ``--enable-sleep-mode``; the router does not look at it, so a server in
  dev mode without it answers ``/is_sleeping`` and fails ``/sleep`` (500).
- ``/sleep``'s mode is ``abort`` by default: it aborts requests in flight. The
  broker therefore calls :meth:`VllmClient.release_if_idle`, which reads the
  gauges again right before and asks nothing while a request runs or waits.
  The race between that read and the sleep remains (a request may arrive in
  between): vLLM has no "sleep only if idle". (Newer servers take
  ``mode=wait``, vLLM PR #34528, 0.17 by kvcached's account; older ones read only
  ``level`` and would ignore it, so it is not sent: one behaviour for all.)
- What remains on the GPU after a sleep (CUDA context, allocations outside
  vLLM's sleep pool) is read from the device, never taken from the 200.
"""

from __future__ import annotations

import math
import re

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

__all__ = ["RUNNING", "WAITING", "Sample", "VllmClient", "parse_prometheus"]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
SLEEP_PATH = "/sleep?level=1"
NO_SLEEP_NOTE = (
    "/is_sleeping is absent (404): started without --enable-sleep-mode and "
    "VLLM_SERVER_DEV_MODE=1, so it cannot be asked to release"
)
ABORT_NOTE = (
    "/sleep's default mode aborts requests in flight: asked only after a fresh read "
    "of the metrics shows nothing running or waiting"
)
UNCONFIRMED_NOTE = (
    "the sleep routes answer (VLLM_SERVER_DEV_MODE=1); whether --enable-sleep-mode "
    "was given shows only at the first /sleep (500 without it)"
)

#: a metric or label name (Prometheus text format 0.0.4; vLLM's names hold ':')
_NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*$")
_LABEL = re.compile(rf'[ \t]*({_NAME})[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Sample = tuple[str, dict[str, str], float]


def _labels(text: str, lineno: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    at = 0
    while at < len(text.rstrip()):
        match = _LABEL.match(text, at)
        if match is None or match.end() == at:
            raise ValueError(f'line {lineno}: labels {text!r} are not name="value", ...')
        value = re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], match.group(2))
        labels[match.group(1)] = value
        at = match.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition, as (name, labels, value).
    Strict: a line that is neither a comment nor a sample is a ``ValueError``."""
    samples: list[Sample] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"line {lineno}: {line[:120]!r} is not a sample")
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"line {lineno}: {value[:40]!r} is not a number") from None
        samples.append((name, _labels(labels or "", lineno), number))
    return samples


class VllmClient(RuntimeClient):
    """vLLM's server API: metrics for busy, ``/sleep`` and ``/wake_up`` for memory."""

    kind = RuntimeKind.VLLM

    def where(self, method: str, path: str) -> str:
        return f"{self.kind.value} at {self.url}: {method} {path}"

    def probe(self) -> Capabilities:
        metrics = self.call("GET", "/metrics")
        notes: list[str] = []
        if metrics.status_code == 200:
            names = {name for name, _, _ in self.samples_of(metrics)}
            if {RUNNING, WAITING} <= names:
                busy = BusySignal.EXACT
                notes.append(f"/metrics has {RUNNING} and {WAITING}")
            else:
                busy = BusySignal.NONE
                notes.append(f"/metrics answers but lacks {RUNNING} or {WAITING}")
        else:
            busy = BusySignal.NONE
            notes.append(f"/metrics answered {metrics.status_code}: no busy signal")
        sleeping = self.call("GET", "/is_sleeping")
        if sleeping.status_code == 404:
            release = ReleaseSafety.NOT_RELEASABLE
            notes.append(NO_SLEEP_NOTE)
        else:
            self.is_sleeping_of(sleeping)
            release = ReleaseSafety.ABORTS
            notes += [UNCONFIRMED_NOTE, ABORT_NOTE]
        self.capabilities = Capabilities(busy_signal=busy, release=release, notes=tuple(notes))
        return self.capabilities

    def samples_of(self, response: httpx.Response) -> list[Sample]:
        where = self.where("GET", "/metrics")
        if response.status_code >= 400:
            raise RuntimeApiError(f"{where} answered {response.status_code}: {response.text[:200]}")
        if len(response.content) > MAX_BODY:
            raise RuntimeApiError(f"{where} answered more than {MAX_BODY} bytes")
        try:
            return parse_prometheus(response.text)
        except ValueError as exc:
            raise RuntimeApiError(f"{where} answered what is not Prometheus text: {exc}") from exc

    def is_sleeping_of(self, response: httpx.Response) -> bool:
        body = self.json_of(response)
        value = body.get("is_sleeping") if isinstance(body, dict) else None
        if not isinstance(value, bool):
            raise RuntimeApiError(
                f"{self.where('GET', '/is_sleeping')} answered {response.text[:200]!r}, "
                'not {"is_sleeping": true|false}'
            )
        return value

    def is_sleeping(self) -> bool:
        return self.is_sleeping_of(self.call("GET", "/is_sleeping"))

    def read(self) -> Reading:
        samples = self.samples_of(self.call("GET", "/metrics"))
        counts = {RUNNING: 0.0, WAITING: 0.0}
        seen: set[str] = set()
        models: list[str] = []
        for name, labels, value in samples:
            if name not in counts:
                continue
            if math.isnan(value) or value < 0:
                raise RuntimeApiError(f"{self.where('GET', '/metrics')}: {name} is {value}")
            seen.add(name)
            counts[name] += value
            model = labels.get("model_name")
            if model is not None and model not in models:
                models.append(model)
        loaded = tuple(Loaded(name=model) for model in models)
        if seen != set(counts):
            missing = ", ".join(sorted(set(counts) - seen))
            return Reading(Activity.UNKNOWN, detail=f"/metrics lacks {missing}", loaded=loaded)
        running, waiting = int(counts[RUNNING]), int(counts[WAITING])
        detail = f"{running} running, {waiting} waiting"
        busy = running + waiting > 0
        return Reading(Activity.BUSY if busy else Activity.IDLE, detail=detail, loaded=loaded)

    def release(self) -> ReleaseAsked:
        """``POST /sleep?level=1``, whatever runs (in-flight requests are aborted):
        the broker calls :meth:`release_if_idle`."""
        capabilities = self.capabilities or self.probe()
        if not capabilities.releasable:
            raise RuntimeApiError(f"{self.kind.value} at {self.url}: {NO_SLEEP_NOTE}")
        response = self.call("POST", SLEEP_PATH)
        if response.status_code == 404:  # restarted without the switches since the probe
            self.capabilities = None
            raise RuntimeApiError(f"{self.where('POST', SLEEP_PATH)} answered 404: {NO_SLEEP_NOTE}")
        if response.status_code != 200:
            raise RuntimeApiError(
                f"{self.where('POST', SLEEP_PATH)} answered {response.status_code}: "
                f"{response.text[:200]} (was it started with --enable-sleep-mode?)"
            )
        return ReleaseAsked(calls=(f"POST {SLEEP_PATH}",))

    def release_if_idle(self) -> ReleaseAsked | None:
        """Read the gauges again and sleep only if nothing runs or waits; None
        when something does (nothing was asked). Raises like :meth:`release`."""
        if self.read().activity is not Activity.IDLE:
            return None
        return self.release()

    def wake(self) -> ReleaseAsked:
        """``POST /wake_up`` (every tag): the engine takes its memory back."""
        capabilities = self.capabilities or self.probe()
        if not capabilities.releasable:
            raise RuntimeApiError(f"{self.kind.value} at {self.url}: {NO_SLEEP_NOTE}")
        response = self.call("POST", "/wake_up")
        if response.status_code != 200:
            raise RuntimeApiError(
                f"{self.where('POST', '/wake_up')} answered {response.status_code}: "
                f"{response.text[:200]}"
            )
        return ReleaseAsked(calls=("POST /wake_up",))

    def prepare(self, model: str, *, keep_alive_s: float, timeout_s: float) -> Prepared:
        """vLLM serves the model it was started with: check ``GET /v1/models``
        lists ``model``, and wake the engine where it sleeps (a released vLLM
        takes its memory back for the job). It cannot say where the weights sit."""
        body = self.json_of(self.call("GET", "/v1/models"))
        rows = body.get("data") if isinstance(body, dict) else None
        rows = rows if isinstance(rows, list) else []
        served = [r.get("id") for r in rows if isinstance(r, dict)]
        if model not in served:
            shown = ", ".join(str(s)[:100] for s in served[:10]) or "nothing"
            raise RuntimeApiError(
                f"{self.where('GET', '/v1/models')}: serves {shown}, not {model!r} (vLLM serves "
                "the model it was started with)"
            )
        detail = "served"
        capabilities = self.capabilities or self.probe()
        if capabilities.releasable and self.is_sleeping():
            self.wake()
            detail = "served; woken from sleep (POST /wake_up)"
        return Prepared(model, None, detail)
