"""ComfyUI's API (comfyanonymous/ComfyUI ``server.py``): busy from its queue, release
by ``POST /free``.

* Busy signal, EXACT: ``GET /queue`` answers ``{"queue_running": [...],
  "queue_pending": [...]}`` (``get_queue``, from ``PromptQueue.get_current_queue``
  in ``execution.py``). A prompt is listed in ``queue_running`` while it executes.
* Release, WAITS: ``POST /free {"unload_models": true, "free_memory": true}`` only
  sets two flags on the queue (``post_free``, ``PromptQueue.set_flag``) and
  answers 200 with an empty body at once. ``main.py``'s ``prompt_worker`` reads
  them between prompts, so the running prompt ends first; then
  ``comfy.model_management.unload_all_models()``, the output cache dropped, and
  ``soft_empty_cache()`` (``torch.cuda.empty_cache``). Best effort: memory of
  models ComfyUI does not manage (custom nodes) may stay; the broker re-measures.
* ``GET /system_stats``'s ``vram_total``/``vram_free`` are the WHOLE device's
  (``torch.cuda.mem_get_info`` plus torch's own cache slack, in
  ``comfy/model_management.py`` ``get_free_memory``): every other process's memory
  counts. They are never ComfyUI's holding (that is read from the device, by
  process tree); :meth:`ComfyUIClient.vram_hint` gives them as a hint only.
* ``/interrupt`` cuts the running prompt: it is never used for release.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpuwarden.core.runtime import (
    Activity,
    BusySignal,
    Capabilities,
    Reading,
    ReleaseSafety,
    RuntimeKind,
)
from gpuwarden.runtimes.base import ReleaseAsked, RuntimeApiError, RuntimeClient

__all__ = ["ComfyUIClient", "VramHint"]

FREE_BODY = {"unload_models": True, "free_memory": True}


@dataclass(frozen=True, slots=True)
class VramHint:
    """One device as ``/system_stats`` reports it: device-wide numbers (plus
    torch's cache slack), not what ComfyUI holds."""

    name: str
    vram_total: int
    vram_free: int
    torch_vram_total: int | None = None
    torch_vram_free: int | None = None


def _prompts(n: int) -> str:
    return f"{n} prompt" if n == 1 else f"{n} prompts"


class ComfyUIClient(RuntimeClient):
    kind = RuntimeKind.COMFYUI

    def _where(self, route: str) -> str:
        return f"{self.kind.value} at {self.url}: {route}"

    def _queue(self) -> tuple[list[Any], list[Any]]:
        body = self.json_of(self.call("GET", "/queue"))
        if not isinstance(body, dict):
            raise RuntimeApiError(f"{self._where('GET /queue')} answered no JSON object")
        lists = []
        for key in ("queue_running", "queue_pending"):
            value = body.get(key)
            if not isinstance(value, list):
                raise RuntimeApiError(
                    f"{self._where('GET /queue')} answered no {key} list "
                    f"(got {type(value).__name__}): is this ComfyUI?"
                )
            lists.append(value)
        return lists[0], lists[1]

    def vram_hint(self) -> tuple[VramHint, ...]:
        """``GET /system_stats``'s devices: a hint, never the runtime's holding."""
        body = self.json_of(self.call("GET", "/system_stats"))
        devices = body.get("devices") if isinstance(body, dict) else None
        if not isinstance(devices, list):
            raise RuntimeApiError(f"{self._where('GET /system_stats')} answered no devices list")
        out = []
        for dev in devices:
            if not isinstance(dev, dict) or not all(
                _is_count(dev.get(k)) for k in ("vram_total", "vram_free")
            ):
                raise RuntimeApiError(
                    f"{self._where('GET /system_stats')} answered a device without "
                    f"vram_total/vram_free byte counts: {str(dev)[:200]}"
                )
            out.append(
                VramHint(
                    name=str(dev.get("name", "")),
                    vram_total=int(dev["vram_total"]),
                    vram_free=int(dev["vram_free"]),
                    torch_vram_total=_count_or_none(dev.get("torch_vram_total")),
                    torch_vram_free=_count_or_none(dev.get("torch_vram_free")),
                )
            )
        return tuple(out)

    def probe(self) -> Capabilities:
        self._queue()
        self.vram_hint()
        return Capabilities(
            busy_signal=BusySignal.EXACT,
            release=ReleaseSafety.WAITS,
            notes=(
                "GET /queue answered queue_running and queue_pending (busy: exact)",
                "GET /system_stats answered device-wide VRAM (a hint, not its holding)",
                "POST /free unloads after the running prompt ends (release waits)",
            ),
        )

    def read(self) -> Reading:
        running, pending = self._queue()
        parts = []
        if running:
            parts.append(f"queue_running has {_prompts(len(running))}")
        if pending:
            parts.append(f"queue_pending has {_prompts(len(pending))}")
        if parts:
            return Reading(Activity.BUSY, detail=", ".join(parts))
        return Reading(Activity.IDLE, detail="queue empty")

    def release(self) -> ReleaseAsked:
        response = self.call("POST", "/free", json=FREE_BODY)
        if response.status_code >= 400:
            raise RuntimeApiError(
                f"{self._where('POST /free')} answered {response.status_code}: "
                f"{response.text[:200]}"
            )
        return ReleaseAsked(calls=("POST /free",))


def _is_count(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and 0 <= value < 2**63


def _count_or_none(value: Any) -> int | None:
    return int(value) if _is_count(value) else None
