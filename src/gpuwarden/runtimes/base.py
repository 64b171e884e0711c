"""What every managed runtime's client does: probe, list, read activity, release.

A client speaks one runtime's own API over HTTP (``httpx``), with an optional
credential (a bearer token). It never kills a process and never waits for the
memory to show free: the broker does that on the device (the reclaim gate).
Every call is bounded by ``timeout_s``; an answer it cannot read is a
:class:`RuntimeApiError` saying which route answered what.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from gpuwarden.core.runtime import Capabilities, Reading, RuntimeKind
from gpuwarden.errors import GpuwardenError

#: the most of an answer a client reads (a runtime's reply is small)
MAX_BODY = 1 << 20


class RuntimeApiError(GpuwardenError):
    """A runtime could not be reached, or answered what its API does not say."""


@dataclass(frozen=True, slots=True)
class ReleaseAsked:
    """What a release asked of the runtime (it may act later: Ollama, ComfyUI)."""

    #: the calls made, as ``METHOD /path [model]``
    calls: tuple[str, ...]
    #: the models it was asked to let go of (empty: all it holds)
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Prepared:
    """A model made resident for a gpuwarden job (:meth:`RuntimeClient.prepare`)."""

    model: str
    #: the share of the model in GPU memory, as the runtime says (None: it cannot say)
    in_vram: float | None
    #: what was asked and seen, for a person
    detail: str = ""


class RuntimeClient(abc.ABC):
    """One registered runtime's API."""

    kind: ClassVar[RuntimeKind]

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport
        )
        #: what the last probe found, for clients that keep it (None: not probed yet)
        self.capabilities: Capabilities | None = None

    def close(self) -> None:
        self.http.close()

    @abc.abstractmethod
    def probe(self) -> Capabilities:
        """Find out, from the API itself, what this runtime can do."""

    @abc.abstractmethod
    def read(self) -> Reading:
        """Whether it works now, and what it says it has loaded."""

    @abc.abstractmethod
    def release(self) -> ReleaseAsked:
        """Ask it to let go of its models' memory through its own API. Raises
        :class:`RuntimeApiError` where it cannot be asked (see :meth:`probe`)."""

    def prepare(self, model: str, *, keep_alive_s: float, timeout_s: float) -> Prepared:
        """Make ``model`` resident for a job that uses it (a preload where the API
        has one), kept for at least ``keep_alive_s``; the load may take up to
        ``timeout_s``. Raises :class:`RuntimeApiError` where the runtime cannot,
        or the model is not there."""
        raise RuntimeApiError(
            f"a {self.kind.value} runtime cannot load a model for a job: gpuwarden knows no "
            "way to load one through its API"
        )

    # -- helpers for the clients --------------------------------------------------

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RuntimeApiError(
                f"{self.kind.value} at {self.url}: {method} {path} failed: {exc}"
            ) from exc

    def json_of(self, response: httpx.Response) -> Any:
        """The body as JSON, or a clear error naming the route and the status."""
        asked = response.request
        where = f"{self.kind.value} at {self.url}: {asked.method} {asked.url.path}"
        if response.status_code >= 400:
            raise RuntimeApiError(f"{where} answered {response.status_code}: {response.text[:200]}")
        if len(response.content) > MAX_BODY:
            raise RuntimeApiError(f"{where} answered more than {MAX_BODY} bytes")
        try:
            return response.json()
        except ValueError as exc:
            raise RuntimeApiError(
                f"{where} answered something that is not JSON: {response.text[:200]!r}"
            ) from exc
