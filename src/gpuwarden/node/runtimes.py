"""The node's managed runtimes (``[[runtimes]]``), looked at from a thread of their own.

A poller thread looks at each runtime about once a second: its server process
(the one listening on its URL's port here; looked for again every
``FIND_EVERY_S`` while none is found or when it went), that process's tree, and
the runtime's own account of whether it works (its client's ``read()``: an HTTP
call, which must never hold up the loop). It posts a :class:`RuntimeNote` per
runtime; the loop drains them (it alone writes its state): the VRAM book learns
each runtime's processes, so what they hold is named by the runtime and no longer
counted as foreign, and each runtime's :class:`gpuwarden.core.runtime.Ownership`
learns its signs of work.

The broker does not ask a runtime to release yet (issue 15, in progress): this
is what it sees of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.core.runtime import Capabilities, Ownership, RuntimeKind
from gpuwarden.node.running import Mailbox, RuntimeNote
from gpuwarden.node.settings import RuntimeCallSpec, RuntimeSpec
from gpuwarden.node.vram import VramBook
from gpuwarden.runtimes.base import RuntimeApiError, RuntimeClient
from gpuwarden.runtimes.generic import Call
from gpuwarden.runtimes.select import open_client
from gpuwarden.runtimes.tree import listener_pid, process_tree

log = logging.getLogger("gpuwarden.node.loop")

#: how often each runtime is looked at
POLL_S = 1.0
#: how often a runtime whose server was not found is looked for again
FIND_EVERY_S = 10.0


@dataclass
class _Runtime:
    spec: RuntimeSpec
    ownership: Ownership
    capabilities: Capabilities | None = None
    pids: frozenset[int] = frozenset()
    error: str = "not looked at yet"
    seen_at: float | None = None


@dataclass
class _Look:
    """The poller's own memory of one runtime (its thread only)."""

    client: RuntimeClient
    root: int | None = None
    looked_for: float = float("-inf")
    capabilities: Capabilities | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _call(c: RuntimeCallSpec | None) -> Call | None:
    return None if c is None else Call(c.method, c.path, c.busy_key, c.body)


class ManagedRuntimes:
    """The runtimes this node owns: what the loop knows of them."""

    def __init__(
        self,
        specs: tuple[RuntimeSpec, ...],
        *,
        vram: VramBook,
        mailbox: Mailbox,
        clock: Callable[[], float],
    ) -> None:
        self.vram = vram
        self.mailbox = mailbox
        self.clock = clock
        now = clock()
        self.runtimes = {
            s.name: _Runtime(s, Ownership(idle_grace_s=s.idle_grace_s, registered_at=now))
            for s in specs
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self.runtimes)

    # -- the poller's thread ------------------------------------------------------

    def start(self) -> None:
        """Start the poller (nothing to do without runtimes)."""
        if not self.runtimes or self._thread is not None:
            return
        specs = [r.spec for r in self.runtimes.values()]
        self._thread = threading.Thread(
            target=self._poll, args=(specs,), name="gpuwarden-runtimes", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _poll(self, specs: list[RuntimeSpec]) -> None:
        looks: dict[str, _Look] = {}
        try:
            while not self._stop.is_set():
                for spec in specs:
                    look = looks.get(spec.name)
                    if look is None:
                        look = looks[spec.name] = _Look(self._client(spec))
                    self.mailbox.post(self._look(spec, look))
                self._stop.wait(POLL_S)
        finally:
            for look in looks.values():
                look.client.close()

    def _client(self, spec: RuntimeSpec) -> RuntimeClient:
        try:
            return open_client(
                spec.kind,
                spec.url,
                token=spec.token,
                busy=_call(spec.busy),
                release=_call(spec.release),
                timeout_s=min(2.0, POLL_S * 2),
            )
        except RuntimeApiError:
            # a kind without a client: looked at as generic without calls (no signal)
            return open_client(RuntimeKind.GENERIC, spec.url, token=spec.token)

    def _look(self, spec: RuntimeSpec, look: _Look) -> RuntimeNote:
        now = time.monotonic()
        pids: set[int] = process_tree(look.root) if look.root is not None else set()
        if not pids and now - look.looked_for >= FIND_EVERY_S:
            look.looked_for = now
            look.root = listener_pid(spec.url)
            pids = process_tree(look.root) if look.root is not None else set()
        try:
            if look.capabilities is None:
                look.capabilities = look.client.probe()
            reading = look.client.read()
        except RuntimeApiError as exc:
            look.capabilities = None  # probed again once it answers
            return RuntimeNote(spec.name, self.clock(), frozenset(pids), error=str(exc))
        return RuntimeNote(
            spec.name, self.clock(), frozenset(pids), reading, capabilities=look.capabilities
        )

    # -- the loop's thread ----------------------------------------------------------

    def on_note(self, note: RuntimeNote) -> bool:
        """Take in one look (on the loop's thread). True when what status shows of
        it changed."""
        rt = self.runtimes.get(note.name)
        if rt is None:
            return False
        before = (rt.pids, rt.error, rt.ownership.last)
        rt.pids = note.pids
        rt.seen_at = note.at
        if note.pids:
            self.vram.runtime_pids[note.name] = set(note.pids)
        else:
            self.vram.runtime_pids.pop(note.name, None)
        if note.reading is None:
            rt.error = note.error
        else:
            rt.error = ""
            rt.capabilities = note.capabilities
            rt.ownership.see(note.reading, note.at)
        return before != (rt.pids, rt.error, rt.ownership.last)

    def statuses(self, now: float) -> list[dict[str, Any]]:
        """What ``status`` shows of each runtime (its memory is in the GPUs' views)."""
        out = []
        for rt in self.runtimes.values():
            reading = rt.ownership.last
            may, why = rt.ownership.may_ask(now)
            caps = rt.capabilities
            out.append(
                {
                    "name": rt.spec.name,
                    "kind": rt.spec.kind.value,
                    "url": rt.spec.url,
                    "state": "unreachable"
                    if rt.error
                    else reading.activity.value
                    if reading
                    else "unknown",
                    "detail": rt.error or (reading.detail if reading else ""),
                    "pids": sorted(rt.pids),
                    "idle_s": round(rt.ownership.idle_for(now), 1),
                    "idle_grace_s": rt.spec.idle_grace_s,
                    "may_be_asked": may and not rt.error,
                    "why": why,
                    "busy_signal": caps.busy_signal.value if caps else None,
                    "release": caps.release.value if caps else None,
                }
            )
        return out
