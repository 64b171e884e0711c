"""Managed runtimes (Ollama, ComfyUI, llama-server, vLLM, generic): what one can do,
what it says of itself, and when it may be asked to let go of its memory. Pure.

A managed runtime is a model server people already run beside gpuwarden. The
broker never kills one: it reads its memory from the device (the process tree's
per-process usage; what the runtime reports of itself is only a hint), tells busy
from idle by the runtime's own signal where it has one, and asks it to release
through its own API once it has been idle for its grace.

This module holds the vocabulary and the one rule (:class:`Ownership`); the
clients that speak each runtime's API are in :mod:`gpuwarden.runtimes`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "Activity",
    "BusySignal",
    "Capabilities",
    "Loaded",
    "Ownership",
    "Reading",
    "ReleaseSafety",
    "RuntimeKind",
    "resolve_runtime",
]


class RuntimeKind(StrEnum):
    OLLAMA = "ollama"
    COMFYUI = "comfyui"
    LLAMA_SERVER = "llama-server"
    VLLM = "vllm"
    GENERIC = "generic"


class BusySignal(StrEnum):
    """How the runtime says it is working."""

    EXACT = "exact"  # a counter or queue of its own (ComfyUI /queue, vLLM metrics)
    HEURISTIC = "heuristic"  # only signs of past work (Ollama: expires_at moved)
    NONE = "none"


class ReleaseSafety(StrEnum):
    """What the runtime's release does to work in flight."""

    WAITS = "waits-for-inflight"  # unloads once in-flight work ends (Ollama, ComfyUI)
    ABORTS = "aborts"  # cuts in-flight work (vLLM /sleep's default mode)
    ASSERTS_IDLE = "asserts-idle"  # refuses while busy
    NOT_RELEASABLE = "not-releasable"  # no release through its API at all


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What registration found the runtime can do (its API probed, not assumed)."""

    busy_signal: BusySignal
    release: ReleaseSafety
    #: why, in a person's words: which routes answered, which were absent
    notes: tuple[str, ...] = ()

    @property
    def releasable(self) -> bool:
        return self.release is not ReleaseSafety.NOT_RELEASABLE


@dataclass(frozen=True, slots=True)
class Loaded:
    """A model the runtime says it has loaded (its own account: a hint)."""

    name: str
    #: bytes the runtime says the model takes in all, and on the GPU (None: not said)
    size_bytes: int | None = None
    vram_bytes: int | None = None
    #: when the runtime will unload it by itself, as it says it (None: never said)
    expires_at: str | None = None


class Activity(StrEnum):
    BUSY = "busy"
    IDLE = "idle"
    UNKNOWN = "unknown"  # no signal: treated as busy until its grace has passed


@dataclass(frozen=True, slots=True)
class Reading:
    """One look at whether the runtime works."""

    activity: Activity
    #: what was seen, for a person ("queue_running has 1 prompt")
    detail: str = ""
    #: a sign that work happened since the last look (an activity of its own)
    worked: bool = False
    loaded: tuple[Loaded, ...] = field(default_factory=tuple)


@dataclass(slots=True)
class Ownership:
    """When a runtime may be asked to release: never while busy, and only once it
    has been idle (or silent, for a runtime without a busy signal) for
    ``idle_grace_s`` since the last sign of work. The grace starts at
    registration: a runtime just found is taken to have just worked."""

    idle_grace_s: float
    registered_at: float
    last_work: float | None = None
    last: Reading | None = None

    def see(self, reading: Reading, now: float) -> None:
        if reading.activity is Activity.BUSY or reading.worked:
            self.last_work = now
        self.last = reading

    def idle_for(self, now: float) -> float:
        return max(
            0.0, now - (self.last_work if self.last_work is not None else self.registered_at)
        )

    def may_ask(self, now: float) -> tuple[bool, str]:
        """Whether it may be asked now, and why (or why not), in a person's words."""
        reading = self.last
        if reading is None:
            return False, "not looked at yet"
        if reading.activity is Activity.BUSY:
            return False, f"busy ({reading.detail})" if reading.detail else "busy"
        idle = self.idle_for(now)
        if idle < self.idle_grace_s:
            what = "idle" if reading.activity is Activity.IDLE else "no sign of work"
            return False, f"in its grace: {what} for {idle:.0f} s of {self.idle_grace_s:g} s"
        if reading.activity is Activity.UNKNOWN:
            return True, f"no sign of work for {idle:.0f} s (it has no busy signal)"
        return True, f"idle for {idle:.0f} s"


def resolve_runtime(word: str, registered: Iterable[tuple[str, str]]) -> str | None:
    """Which registered runtime (``(name, kind)`` pairs) a runtime type's
    ``runtime`` key means: the one of that name, else the only one of that kind
    (``runtime = "ollama"`` finds the host's one Ollama whatever it is called);
    None where there is none, or several of that kind and none of that name."""
    pairs = list(registered)
    if any(name == word for name, _ in pairs):
        return word
    of_kind = [name for name, kind in pairs if kind == word]
    return of_kind[0] if len(of_kind) == 1 else None
