"""Ollama's client: what it has loaded (``GET /api/ps``), a sign of work, release.

Facts from Ollama's source (ollama/ollama fb307609, 2026-08):

- ``GET /api/ps`` (``server/routes.go`` ``PsHandler``) lists each loaded model
  with ``size`` and ``size_vram`` in bytes (the runner's own estimate,
  ``server/sched.go`` ``loadedModels``: a hint, never the ledger's number) and
  ``expires_at``, when it will unload by itself.
- There is no busy signal. A request holds the runner's ``refCount`` and leaves
  ``expiresAt`` alone (``sched.go`` ``useLoadedRunner``); the end of the last one
  sets ``expiresAt = now + keep_alive``. So an ``expires_at`` that moved later
  between two reads means a request ended in between (and one still loading, or
  in its first request, is listed with ``now + keep_alive``, moving at every
  read: it works). ``expireRunner`` moves it back to "now": that is a release, not
  work, so only a move to a moment after the read counts.
- ``POST /api/generate {"model", "keep_alive": 0}`` with no prompt
  (``routes.go`` ``GenerateHandler``) answers ``done_reason: "unload"`` at once
  and unloads when the last in-flight request ends (``expireRunner`` gates on
  ``refCount``): it waits, it never aborts. Any later request reloads the model.
- ``POST /api/generate {"model"}`` with no prompt loads it (``done_reason:
  "load"``); ``keep_alive`` -1 pins it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpuwarden.core.runtime import (
    Activity,
    BusySignal,
    Capabilities,
    Loaded,
    Reading,
    ReleaseSafety,
    RuntimeKind,
)
from gpuwarden.runtimes.base import Prepared, ReleaseAsked, RuntimeApiError, RuntimeClient

__all__ = ["OllamaClient", "OllamaModel"]

PS = "/api/ps"
GENERATE = "/api/generate"
VERSION = "/api/version"
#: the most models read from one /api/ps answer (Ollama holds a handful)
MAX_MODELS = 256


@dataclass(frozen=True, slots=True)
class OllamaModel:
    """One row of ``/api/ps``, as read."""

    name: str
    size: int | None
    size_vram: int | None
    expires_at: str | None

    def loaded(self) -> Loaded:
        return Loaded(self.name, self.size, self.size_vram, self.expires_at)


def tagged(name: str) -> str:
    """Ollama's name for a model without a tag is ``NAME:latest``."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time as Go writes it (up to nanoseconds), or None."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class OllamaClient(RuntimeClient):
    """An Ollama server (default ``http://127.0.0.1:11434``, no auth)."""

    kind = RuntimeKind.OLLAMA

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: each model's expires_at at the previous read (None: not read yet)
        self.previous: dict[str, str | None] | None = None

    # -- the interface ------------------------------------------------------------

    def probe(self) -> Capabilities:
        models = self.models()
        notes = [f"GET {PS} answered: {len(models)} model(s) loaded"]
        try:
            version = self.json_of(self.call("GET", VERSION))
            shown = version.get("version") if isinstance(version, dict) else None
            notes.append(f"GET {VERSION} answered {shown!r}")
        except RuntimeApiError as exc:
            notes.append(f"GET {VERSION} did not answer ({exc})")
        notes += [
            "no busy signal: expires_at moving later between reads is the sign of work",
            "release: keep_alive 0 unloads once in-flight requests end (never aborts)",
        ]
        return Capabilities(BusySignal.HEURISTIC, ReleaseSafety.WAITS, tuple(notes))

    def read(self) -> Reading:
        models = self.models()
        now = datetime.now(UTC)
        current = {m.name: m.expires_at for m in models}
        worked = self.worked(current, now)
        self.previous = current
        overdue = [
            m.name for m in models if (when := parse_time(m.expires_at)) is not None and when < now
        ]
        detail = f"{len(models)} model(s) loaded" if models else "no model loaded"
        if overdue:
            detail += f"; past expires_at (in a request, or unloading): {', '.join(overdue)}"
        return Reading(
            Activity.UNKNOWN,
            detail=detail,
            worked=worked,
            loaded=tuple(m.loaded() for m in models),
        )

    def release(self) -> ReleaseAsked:
        models = self.models()
        calls = []
        for model in models:
            self.generate(model.name, "unload", keep_alive=0)
            calls.append(f"POST {GENERATE} {model.name} keep_alive=0")
        return ReleaseAsked(tuple(calls), tuple(m.name for m in models))

    # -- Ollama's own -------------------------------------------------------------

    def preload(
        self, model: str, keep_alive: str | float | None = None, *, timeout_s: float | None = None
    ) -> None:
        """Make ``model`` resident (a generate with no prompt); ``keep_alive`` as
        Ollama takes it (``"10m"``, seconds, -1 forever; None: its default).
        A load can take long: ``timeout_s`` overrides the client's for this call."""
        self.generate(model, "load", keep_alive=keep_alive, timeout_s=timeout_s)

    def prepare(self, model: str, *, keep_alive_s: float, timeout_s: float) -> Prepared:
        """Preload ``model`` (kept at least ``keep_alive_s``) and read how much of it
        Ollama placed in VRAM."""
        self.preload(model, keep_alive=keep_alive_s, timeout_s=timeout_s)
        share = self.placement(model)
        return Prepared(model, share, f"GET {PS}: size_vram / size = {share:.3f}")

    def placement(self, model: str) -> float:
        """The share of ``model`` that Ollama placed in VRAM (``size_vram / size``,
        its own account), for the ">= 99 % on the GPU" check."""
        wanted = tagged(model)
        for row in self.models():
            if row.name in (wanted, model):
                if not row.size or row.size_vram is None:
                    raise RuntimeApiError(
                        f"ollama at {self.url}: GET {PS} gives {row.name} no size "
                        f"(size={row.size}, size_vram={row.size_vram})"
                    )
                return row.size_vram / row.size
        raise RuntimeApiError(f"ollama at {self.url}: GET {PS} does not list {model} as loaded")

    def models(self) -> list[OllamaModel]:
        """``GET /api/ps``, checked."""
        body = self.json_of(self.call("GET", PS))
        rows = body.get("models") if isinstance(body, dict) else None
        if not isinstance(rows, list):
            raise RuntimeApiError(
                f"ollama at {self.url}: GET {PS} answered no 'models' list: {str(body)[:200]!r}"
            )
        if len(rows) > MAX_MODELS:
            raise RuntimeApiError(
                f"ollama at {self.url}: GET {PS} lists {len(rows)} models (at most {MAX_MODELS})"
            )
        return [self.row(row) for row in rows]

    # -- helpers ------------------------------------------------------------------

    def row(self, row: Any) -> OllamaModel:
        where = f"ollama at {self.url}: GET {PS}"
        if not isinstance(row, dict):
            raise RuntimeApiError(f"{where} listed a model that is not an object: {row!r:.200}")
        name = row.get("name") or row.get("model")
        if not isinstance(name, str) or not name or len(name) > 512:
            raise RuntimeApiError(f"{where} listed a model without a name: {row!r:.200}")
        sizes = {key: row.get(key) for key in ("size", "size_vram")}
        for key, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise RuntimeApiError(f"{where}: {name}'s {key} is not a number: {value!r:.80}")
            if isinstance(value, int) and value < 0:
                raise RuntimeApiError(f"{where}: {name}'s {key} is negative: {value}")
        expires = row.get("expires_at")
        if expires is not None and (not isinstance(expires, str) or len(expires) > 64):
            raise RuntimeApiError(f"{where}: {name}'s expires_at is not a time: {expires!r:.80}")
        return OllamaModel(name, sizes["size"], sizes["size_vram"], expires)

    def worked(self, current: dict[str, str | None], now: datetime) -> bool:
        """A model appeared, or its expires_at moved to a moment after ``now`` (a
        request ended, or one is loading). The first read is the baseline."""
        if self.previous is None:
            return False
        for name, expires in current.items():
            if name not in self.previous:
                return True
            if expires != self.previous[name]:
                when = parse_time(expires)
                if when is None or when > now:
                    return True
        return False

    def generate(
        self,
        model: str,
        reason: str,
        *,
        keep_alive: str | float | None,
        timeout_s: float | None = None,
    ) -> None:
        """A generate with no prompt, which Ollama answers with ``done_reason``
        ``reason`` ("load" or "unload")."""
        body: dict[str, Any] = {"model": model, "stream": False}
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        answer = self.json_of(self.call("POST", GENERATE, json=body, **extra))
        said = answer.get("done_reason") if isinstance(answer, dict) else None
        if said != reason or answer.get("done") is not True:
            raise RuntimeApiError(
                f"ollama at {self.url}: POST {GENERATE} {model} answered "
                f"{str(answer)[:200]!r}, not done_reason {reason!r}"
            )
