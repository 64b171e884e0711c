"""The client for a registered runtime, by its kind."""

from __future__ import annotations

from gpuwarden.core.runtime import RuntimeKind
from gpuwarden.runtimes.base import RuntimeApiError, RuntimeClient
from gpuwarden.runtimes.comfyui import ComfyUIClient
from gpuwarden.runtimes.generic import Call, GenericClient
from gpuwarden.runtimes.llama import LlamaServerClient
from gpuwarden.runtimes.ollama import OllamaClient
from gpuwarden.runtimes.vllm import VllmClient

#: the client of each kind that has one (``generic`` is built from its calls)
_CLIENTS: dict[RuntimeKind, type[RuntimeClient]] = {
    RuntimeKind.OLLAMA: OllamaClient,
    RuntimeKind.COMFYUI: ComfyUIClient,
    RuntimeKind.VLLM: VllmClient,
    RuntimeKind.LLAMA_SERVER: LlamaServerClient,
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
    """The client for a runtime of ``kind`` at ``url``; a kind without one is a
    :class:`RuntimeApiError` that says so."""
    if kind is RuntimeKind.GENERIC:
        return GenericClient(url, busy=busy, release=release, token=token, timeout_s=timeout_s)
    cls = _CLIENTS.get(kind)
    if cls is None:
        raise RuntimeApiError(
            f"gpuwarden has no client for {kind.value} runtimes yet: register it as "
            '"generic" with its busy and release calls'
        )
    return cls(url, token=token, timeout_s=timeout_s)
