"""Short-lived entries by a random key, in one API process's memory: browser
sessions (:mod:`gpuwarden.api.session`), a service's handoffs and passes
(:mod:`gpuwarden.api.runsite`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Expires", "Expiring"]


class Expires(Protocol):
    @property
    def expires_at(self) -> float: ...


V = TypeVar("V", bound=Expires)


class Expiring(Generic[V]):
    """Values by key, each until its ``expires_at``, at most ``limit`` at once
    (the oldest go first: dicts keep insertion order). Thread-safe."""

    def __init__(self, limit: int, clock: Callable[[], float]) -> None:
        self.limit = limit
        self.clock = clock
        self._by_key: dict[str, V] = {}
        self._lock = threading.Lock()

    def add(self, key: str, value: V) -> None:
        now = self.clock()
        with self._lock:
            for k in [k for k, v in self._by_key.items() if now >= v.expires_at]:
                del self._by_key[k]
            while len(self._by_key) >= self.limit:
                del self._by_key[next(iter(self._by_key))]
            self._by_key[key] = value

    def get(self, key: str, *, take: bool = False) -> V | None:
        """The live value of ``key`` (None: unknown or expired); ``take``: it is
        used up."""
        with self._lock:
            value = self._by_key.pop(key, None) if take else self._by_key.get(key)
            if value is not None and self.clock() >= value.expires_at:
                self._by_key.pop(key, None)
                return None
            return value

    def pop(self, key: str) -> bool:
        with self._lock:
            return self._by_key.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)
