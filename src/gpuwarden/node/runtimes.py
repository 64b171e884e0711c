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

Release on demand: when a waiting job needs room a runtime past its grace holds,
the plan says :class:`gpuwarden.core.policy.AskRuntime`; :meth:`ManagedRuntimes.ask`
hands the call to the poller's thread (a runtime whose release aborts work is
asked only if it is still idle right then) and notes when it was asked. Each tick
:meth:`ManagedRuntimes.follow` compares what the runtime holds on that GPU (the
device's reading, through the VRAM book) with what it held: once it is free the
release is ``runtime_released`` (with ``after_s`` and the bytes back); past its
``release_timeout_s`` with nothing back it is ``runtime_release_ineffective``, the
residual stays counted and it is not asked again until its memory changes. A
runtime that takes memory back within ``HANDOFF_S`` of a release (a client that
pins its model) is reported ``runtime_reloaded_during_handoff``, unless a
gpuwarden job of that runtime holds it then (its own preload). Nothing is ever
killed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.core.model import format_bytes
from gpuwarden.core.policy import AskRuntime, RuntimeView
from gpuwarden.core.runtime import (
    Activity,
    Capabilities,
    Loaded,
    Ownership,
    ReleaseSafety,
    RuntimeKind,
    resolve_runtime,
)
from gpuwarden.launch.base import Launcher
from gpuwarden.node.running import Emit, Mailbox, RuntimeNote
from gpuwarden.node.runtimejobs import RuntimeLaunch
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
#: after a release, how long a regrowth of the runtime's memory is its reloading
HANDOFF_S = 30.0
#: the longest one call of a runtime job's preparation may take (a load is one)
PREPARE_CALL_S = 600.0
#: memory differences below this are noise
_TOLERANCE = 64 * 1024 * 1024


@dataclass
class _Release:
    """A release asked and not yet seen on the device."""

    gpu: str
    before: int
    asked_at: float
    job_id: str
    deadline: float


@dataclass
class _Runtime:
    spec: RuntimeSpec
    ownership: Ownership
    capabilities: Capabilities | None = None
    pids: frozenset[int] = frozenset()
    error: str = ""
    seen_at: float | None = None
    release: _Release | None = None
    #: a release freed nothing: what stayed (it is not asked again while it stays)
    ineffective: int | None = None
    #: when its last release was seen done, and on which GPU (the handoff watch)
    released: tuple[float, str] | None = None
    reloads: int = 0
    #: a release failed or was refused: not asked again before this (and why)
    retry_at: float = float("-inf")
    retry_why: str = ""


@dataclass
class _Look:
    """The poller's own memory of one runtime (its thread only)."""

    client: RuntimeClient
    root: int | None = None
    looked_for: float = float("-inf")
    capabilities: Capabilities | None = None


def _call(c: RuntimeCallSpec | None) -> Call | None:
    return None if c is None else Call(c.method, c.path, c.busy_key, c.body)


def client_for(spec: RuntimeSpec, *, timeout_s: float = 5.0) -> RuntimeClient:
    """The client of a registered runtime (a :class:`RuntimeApiError` for a kind
    that has none yet)."""
    return open_client(
        spec.kind,
        spec.url,
        token=spec.token,
        busy=_call(spec.busy),
        release=_call(spec.release),
        timeout_s=timeout_s,
    )


def _model_names(kind: RuntimeKind, loaded: tuple[Loaded, ...]) -> tuple[str, ...]:
    """The names a runtime type's ``model`` may give a loaded model by: Ollama's
    ``NAME:latest`` is ``NAME`` too (its own default tag)."""
    names = [m.name for m in loaded]
    if kind is RuntimeKind.OLLAMA:
        names += [n.removesuffix(":latest") for n in names if n.endswith(":latest")]
    return tuple(names)


class ManagedRuntimes:
    """The runtimes this node owns: what the loop knows of them."""

    def __init__(
        self,
        specs: tuple[RuntimeSpec, ...],
        *,
        vram: VramBook,
        mailbox: Mailbox,
        clock: Callable[[], float],
        emit: Emit,
    ) -> None:
        self.vram = vram
        self.mailbox = mailbox
        self.clock = clock
        self.emit = emit
        #: releases the loop asked for, for the poller's thread to make
        self._asks: queue.Queue[str] = queue.Queue()
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
            next_look = 0.0
            by_name = {s.name: s for s in specs}
            while not self._stop.is_set():
                for spec in specs:
                    if spec.name not in looks:
                        looks[spec.name] = _Look(self._client(spec))
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + POLL_S
                    for spec in specs:
                        self.mailbox.post(self._look(spec, looks[spec.name]))
                try:
                    name = self._asks.get(timeout=max(0.0, next_look - time.monotonic()))
                except queue.Empty:
                    continue
                self.mailbox.post(self._release(by_name[name], looks[name]))
        finally:
            for look in looks.values():
                look.client.close()

    def _client(self, spec: RuntimeSpec) -> RuntimeClient:
        try:
            return client_for(spec, timeout_s=min(2.0, POLL_S * 2))
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

    def _release(self, spec: RuntimeSpec, look: _Look) -> RuntimeNote:
        """Make an asked release (on the poller's thread); a runtime whose release
        aborts work is read again first and not asked while it works."""
        pids = frozenset(process_tree(look.root) if look.root is not None else ())
        try:
            caps = look.capabilities or look.client.probe()
            if caps.release is ReleaseSafety.ABORTS:
                reading = look.client.read()
                if reading.activity is not Activity.IDLE:
                    return RuntimeNote(
                        spec.name,
                        self.clock(),
                        pids,
                        reading,
                        caps,
                        released=f"not asked: it works again ({reading.detail})",
                    )
            asked = look.client.release()
        except RuntimeApiError as exc:
            return RuntimeNote(spec.name, self.clock(), pids, error=str(exc), released="failed")
        return RuntimeNote(
            spec.name, self.clock(), pids, capabilities=caps, released=", ".join(asked.calls)
        )

    # -- the loop's thread ----------------------------------------------------------

    def resolve(self, word: str) -> str | None:
        """The runtime a runtime type's ``runtime`` key names here (by name, or the
        only one of that kind); None where none does."""
        return resolve_runtime(word, ((n, r.spec.kind.value) for n, r in self.runtimes.items()))

    def launcher(self, name: str, model: str, inner: Launcher) -> RuntimeLaunch:
        """The launcher of a runtime job: the model made resident first."""
        return RuntimeLaunch(
            inner,
            self.runtimes[name].spec,
            model,
            client=lambda spec: client_for(spec, timeout_s=PREPARE_CALL_S),
            clock=self.clock,
        )

    def views(self, now: float) -> tuple[RuntimeView, ...]:
        """The runtimes as admission sees them now."""
        out = []
        in_use = self.vram.runtime_jobs()
        for rt in self.runtimes.values():
            may, why = rt.ownership.may_ask(now)
            users = in_use.get(rt.spec.name)
            if users:
                may, why = False, f"in use by gpuwarden job(s) {', '.join(sorted(users)[:5])}"
            elif rt.error:
                may, why = False, f"unreachable ({rt.error})"
            elif rt.ownership.last is None:
                may, why = False, "not looked at yet"
            elif rt.capabilities is None or not rt.capabilities.releasable:
                may, why = False, "it cannot be asked to release (its API has no release)"
            elif now < rt.retry_at:
                may = False
                why = f"its last release did not go through ({rt.retry_why}): asked again later"
            elif rt.ineffective is not None:
                may = False
                why = (
                    f"release-ineffective: {format_bytes(rt.ineffective)} stayed after its "
                    "last release"
                )
            reading = rt.ownership.last
            out.append(
                RuntimeView(
                    rt.spec.name,
                    may,
                    why,
                    releasing=rt.release is not None,
                    reachable=not rt.error and reading is not None,
                    models=_model_names(rt.spec.kind, reading.loaded) if reading else (),
                    gpus=rt.spec.gpus,
                    kind=rt.spec.kind.value,
                )
            )
        return tuple(out)

    def ask(self, ask: AskRuntime, now: float) -> None:
        """Have the poller's thread ask the runtime to release (once at a time)."""
        rt = self.runtimes.get(ask.name)
        if rt is None or rt.release is not None:
            return
        rt.release = _Release(
            ask.gpu_uuid, ask.nbytes, now, ask.job_id, now + rt.spec.release_timeout_s
        )
        self.emit(
            "runtime_release_requested",
            job=ask.job_id,
            runtime=ask.name,
            gpu=ask.gpu_uuid,
            bytes=ask.nbytes,
        )
        self._asks.put(ask.name)

    def follow(self, now: float) -> bool:
        """Compare what each runtime holds with its pending release (each tick, after
        the probe was read). True when something changed for status."""
        held = {(g.uuid, name): b for g in self.vram.views() for name, b in g.runtimes}
        ours = self.vram.runtime_jobs()  # runtimes a gpuwarden job of theirs holds now
        changed = False
        for rt in self.runtimes.values():
            name = rt.spec.name
            r = rt.release
            if r is not None:
                left = held.get((r.gpu, name), 0)
                if left <= _TOLERANCE or r.before - left >= r.before * 0.9:
                    self.emit(
                        "runtime_released",
                        job=r.job_id,
                        runtime=name,
                        gpu=r.gpu,
                        after_s=round(now - r.asked_at, 3),
                        bytes=max(0, r.before - left),
                    )
                    rt.release, rt.released, changed = None, (now, r.gpu), True
                elif now > r.deadline:
                    self.emit(
                        "runtime_release_ineffective",
                        job=r.job_id,
                        runtime=name,
                        gpu=r.gpu,
                        after_s=round(now - r.asked_at, 3),
                        residual_bytes=left,
                    )
                    rt.release, rt.ineffective, changed = None, left, True
            elif rt.ineffective is not None:
                total = sum(b for (u, n), b in held.items() if n == name)
                if abs(total - rt.ineffective) > _TOLERANCE:
                    rt.ineffective, changed = None, True  # its memory moved: ask again later
            if rt.released is not None:
                at, gpu = rt.released
                if now - at > HANDOFF_S or ours.get(name):
                    rt.released = None  # over, or the reload is our own runtime job's
                elif held.get((gpu, name), 0) > _TOLERANCE:
                    rt.reloads += 1
                    self.emit(
                        "runtime_reloaded_during_handoff",
                        runtime=name,
                        gpu=gpu,
                        after_s=round(now - at, 3),
                        bytes=held[(gpu, name)],
                        reloads=rt.reloads,
                    )
                    rt.released, changed = None, True
        return changed

    def on_note(self, note: RuntimeNote) -> bool:
        """Take in one look, or the outcome of a release (on the loop's thread).
        True when what status shows of it changed."""
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
        if note.released:
            self.emit("runtime_release_sent", runtime=note.name, calls=note.released)
            if note.released == "failed" or note.released.startswith("not asked"):
                # a later pass asks again, if the room is still wanted, not at once
                rt.release = None
                rt.retry_at = note.at + rt.spec.release_timeout_s
                rt.retry_why = note.error or note.released
        if note.error:
            rt.error = note.error
        elif note.reading is not None:
            rt.error = ""
            rt.capabilities = note.capabilities or rt.capabilities
            rt.ownership.see(note.reading, note.at)
        return before != (rt.pids, rt.error, rt.ownership.last)

    def statuses(self, now: float) -> list[dict[str, Any]]:
        """What ``status`` shows of each runtime (its memory is in the GPUs' views)."""
        out = []
        views = {v.name: v for v in self.views(now)}
        in_use = self.vram.runtime_jobs()
        for rt in self.runtimes.values():
            reading = rt.ownership.last
            view = views[rt.spec.name]
            may, why = view.may_ask, view.why
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
                    "releasing": rt.release is not None,
                    "release_ineffective_bytes": rt.ineffective,
                    "reloads_during_handoff": rt.reloads,
                    "models": list(view.models),
                    "gpus": list(rt.spec.gpus),
                    "in_use_by": sorted(in_use.get(rt.spec.name, ())),
                }
            )
        return out
