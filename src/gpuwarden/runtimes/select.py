"""The client for a registered runtime, by its kind."""

from __future__ import annotations

import importlib

from gpuwarden.core.runtime import RuntimeKind
from gpuwarden.runtimes.base import RuntimeApiError, RuntimeClient
from gpuwarden.runtimes.generic import Call, GenericClient

#: the client of each kind that has one: (module, class)
_CLIENTS = {
    RuntimeKind.OLLAMA: ("gpuwarden.runtimes.ollama", "OllamaClient"),
    RuntimeKind.COMFYUI: ("gpuwarden.runtimes.comfyui", "ComfyUIClient"),
    RuntimeKind.VLLM: ("gpuwarden.runtimes.vllm", "VllmClient"),
}


def open_client(
    kind: RuntimeKind,
    url: str,
    *,
    token: str | None = None,
    busy: Call | None = None,
    release: Call | None = None,
    timeout_s: float = 5.0,
) -> RuntimeClient:
    """The client for a runtime of ``kind`` at ``url``; a kind without one yet is
    a :class:`RuntimeApiError` that says so."""
    if kind is RuntimeKind.GENERIC:
        return GenericClient(url, busy=busy, release=release, token=token, timeout_s=timeout_s)
    where = _CLIENTS.get(kind)
    if where is None:
        raise RuntimeApiError(
            f"gpuwarden has no client for {kind.value} runtimes yet: register it as "
            '"generic" with its busy and release calls'
        )
    try:
        cls = getattr(importlib.import_module(where[0]), where[1])
    except (ImportError, AttributeError) as exc:  # a client not shipped in this build
        raise RuntimeApiError(f"gpuwarden has no client for {kind.value} runtimes yet") from exc
    client: RuntimeClient = cls(url, token=token, timeout_s=timeout_s)
    return client
