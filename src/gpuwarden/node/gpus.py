"""The node's GPUs as the broker loop watches them.

:class:`GpuWatch` reads the probe (once per tick at most) and lets the VRAM book
take the readings in. A probe that fails pauses VRAM admission on the whole node
(admission fails closed) until it reads again. An Xid a GPU reports is answered
here: a critical one latches a fault on that GPU (no VRAM admission there) and
stops what runs there; an application one fails the jobs running there; others
are logged. A latch is written to the store and to ``faults.json`` in the state
directory, is put back at the broker's next start (:meth:`GpuWatch.restore`,
:func:`gpuwarden.core.faultlatch.restore`), and ends only when an operator clears
it (``gpuwarden gpu clear UUID --reason TEXT``, carried out here too), with who
cleared it and why.

Owned by the loop; every method returns whether the node's status changed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gpuwarden import safefs
from gpuwarden.core import faultlatch
from gpuwarden.core.classify import xid_kind
from gpuwarden.core.faultlatch import Latch
from gpuwarden.errors import GpuProbeError
from gpuwarden.gpu.base import GpuProbe, GpuReading
from gpuwarden.node.runner import AttemptRunner
from gpuwarden.node.running import Emit
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warm import WarmServers
from gpuwarden.node.warmpool import ServerState
from gpuwarden.store.base import Store

log = logging.getLogger("gpuwarden.node.gpus")

#: the latched faults' file in the state directory
FAULTS_FILE = "faults.json"

#: the most of that file read (a few latches take a few hundred bytes)
_FAULTS_MAX = 1 << 20

#: operator requests (gpu clear) are looked for this often
REQUESTS_EVERY_S = 0.5


#: the least time between two probe readings (the loop's old poll cadence was 0.1 s)
OBSERVE_GAP_S = 0.02


class GpuWatch:
    """The probe's latest readings, and what the loop does about them."""

    def __init__(
        self,
        *,
        probe: GpuProbe,
        vram: VramBook,
        store: Store,
        attempts: AttemptRunner,
        warm: WarmServers,
        emit: Emit,
        node: str = "",
        state_dir: Path | None = None,
    ) -> None:
        """``node``: whose latches these are in the store; ``state_dir``: where
        ``faults.json`` is kept (None: no file)."""
        self.probe = probe
        self.vram = vram
        self.store = store
        self.attempts = attempts
        self.warm = warm
        self.emit = emit
        #: what the probe read last (kept while it fails)
        self.readings: list[GpuReading] = []
        #: why the probe's last read failed, or ""
        self.error = ""
        self._observed_at = -1.0
        self._last_requests_check = 0.0
        self.node = node
        self.faults_file = state_dir / FAULTS_FILE if state_dir is not None else None
        #: the open latches, by GPU (each also a fault in the VRAM book)
        self.latches: dict[str, Latch] = {}
        #: latches not written to the store yet (its write failed): tried again
        self._unsaved: dict[str, Latch] = {}

    def observe(self, now: float) -> bool:
        """Read the probe (once per tick, and at most every ``OBSERVE_GAP_S``) and
        let the VRAM book take it in. The loop ticks as soon as something happens,
        hundreds of times a second with a busy warm server; the probe is read at a
        steady rate instead (a reading costs a millisecond or more)."""
        if 0 <= now - self._observed_at < OBSERVE_GAP_S:
            return False
        self._observed_at = now
        try:
            self.readings = self.probe.read()
        except GpuProbeError as exc:
            if not self.error:
                self.emit("probe_failed", reason=exc.message)
            self.error = exc.message  # admission fails closed
            return False
        if self.error:
            self.emit("probe_recovered")
        self.error = ""
        changed = False
        for event in self.vram.observe(self.readings, now):
            kind = event.pop("event")
            if kind == "gpu_xid":
                changed |= self._on_xid(event["gpu"], int(event["xid"]), now)
                continue
            self.emit(kind, **event)
            changed = True
        return changed

    def _on_xid(self, gpu: str, code: int, now: float) -> bool:
        """A GPU reported an Xid. A critical one latches a fault there (no VRAM
        admission until an operator clears it), and its jobs go back to the queue as
        infrastructure failures; an application one fails the jobs running there;
        others are logged."""
        kind = xid_kind(code)
        self.emit("gpu_xid", gpu=gpu, xid=code, severity=kind)
        if kind == "other":
            return False
        if kind == "critical" and gpu not in self.latches:
            self._latch(Latch(gpu, code, now))
            self.warm.stop_idle_on(gpu, f"its GPU reported Xid {code}")
        for run in self.attempts:
            if gpu not in run.attempt.gpus or run.stop_reason is not None:
                continue
            run.stop_reason = "gpu_fault" if kind == "critical" else "app_error"
            run.fault = f"Xid {code}"
            run.stop.set()
            if run.server is not None and run.server.state is not ServerState.STOPPING:
                self.warm.stop(run.server, f"its GPU reported Xid {code}")
        return True

    def _latch(self, latch: Latch) -> None:
        """Latch a fault: in memory, in the file, then in the store (in the open
        batch: it commits with the ``gpu_fault`` event)."""
        reason = faultlatch.latched_reason(latch)
        self.latches[latch.gpu] = latch
        self.vram.fault(latch.gpu, reason)
        self._save()
        self._store_latch(latch)
        self.emit(
            "gpu_fault", gpu=latch.gpu, xid=latch.xid, reason=reason, latched_at=latch.latched_at
        )

    def _store_latch(self, latch: Latch) -> None:
        """Write a latch to the store; when that fails it is kept in memory and in
        the file, and tried again with the next operator requests."""
        try:
            self.store.latch_gpu_fault(
                node=self.node,
                gpu_uuid=latch.gpu,
                xid=latch.xid,
                reason=faultlatch.latched_reason(latch),
                now=latch.latched_at,
            )
        except Exception:
            log.exception("could not write the fault latched on %s to the store", latch.gpu)
            self._unsaved[latch.gpu] = latch
        else:
            self._unsaved.pop(latch.gpu, None)

    def restore(self) -> bool:
        """At the broker's start: put back the faults latched before it (the store's,
        else the file's when the store cannot be read; one the store lost is written
        again), each with its ``gpu_fault_restored`` event."""
        filed = self._load()
        try:
            history = self.store.gpu_faults(node=self.node)
        except Exception as exc:  # the file's latches hold until the store answers
            log.warning(
                "cannot read latched GPU faults from the store (%s): using %s",
                exc,
                self.faults_file,
            )
            stored, known = None, []
        else:
            stored = [
                Latch(f.gpu_uuid, f.xid, f.latched_at) for f in history if f.cleared_at is None
            ]
            known = [(f.gpu_uuid, f.latched_at) for f in history]
        latches, lost = faultlatch.restore(stored, filed, known)
        for latch in latches:
            reason = faultlatch.latched_reason(latch)
            self.latches[latch.gpu] = latch
            self.vram.fault(latch.gpu, reason)
            self.emit(
                "gpu_fault_restored",
                gpu=latch.gpu,
                xid=latch.xid,
                latched_at=latch.latched_at,
                reason=reason,
            )
        for latch in lost:
            self._store_latch(latch)
        if sorted(filed, key=lambda f: f.gpu) != sorted(latches, key=lambda f: f.gpu):
            self._save()
        return bool(latches)

    def _load(self) -> list[Latch]:
        """The latches ``faults.json`` holds (none when it is missing or unreadable)."""
        if self.faults_file is None:
            return []
        try:
            data = json.loads(safefs.read_bytes(self.faults_file, _FAULTS_MAX))
        except FileNotFoundError:
            return []
        except (OSError, ValueError, safefs.UnsafePathError) as exc:
            log.warning("ignoring %s: %s", self.faults_file, exc)
            return []
        entries = data.get("latches") if isinstance(data, dict) else None
        return [x for e in entries or () if (x := Latch.from_json(e)) is not None]

    def _save(self) -> None:
        """Write the open latches to ``faults.json`` (replaced whole, at once)."""
        if self.faults_file is None:
            return
        doc = {
            "node": self.node,
            "latches": [self.latches[g].to_json() for g in sorted(self.latches)],
        }
        try:
            safefs.write_file(self.faults_file, json.dumps(doc, indent=2).encode() + b"\n")
        except (OSError, safefs.UnsafePathError):  # the store still has them
            log.exception("could not write %s", self.faults_file)

    def operator_requests(self, now: float) -> bool:
        """Carry out what operators asked through the store (``gpuwarden gpu clear``):
        a request taken, its latch closed and its event share one commit."""
        if now - self._last_requests_check < REQUESTS_EVERY_S:
            return False
        self._last_requests_check = now
        for latch in list(self._unsaved.values()):
            if latch.gpu in self.latches:
                self._store_latch(latch)
        changed = False
        with self.store.batch():
            for clear in self.store.take_gpu_clears(now=now):
                gpu = clear.gpu_uuid
                held = self.latches.pop(gpu, None)
                self._unsaved.pop(gpu, None)
                if self.vram.clear_fault(gpu) or held is not None:
                    self.store.clear_gpu_fault(
                        node=self.node, gpu_uuid=gpu, now=now, by=clear.by, reason=clear.reason
                    )
                    self.emit(
                        "gpu_fault_cleared",
                        gpu=gpu,
                        xid=held.xid if held else None,
                        latched_at=held.latched_at if held else None,
                        by=clear.by,
                        reason=clear.reason,
                    )
                    changed = True
                else:
                    self.emit("gpu_clear_ignored", gpu=gpu, reason="no fault on that GPU here")
        if changed:
            self._save()
        return changed

    def fault_status(self) -> dict[str, dict[str, object]]:
        """The open latches as ``status`` shows them, by GPU."""
        return {
            g: {
                "xid": latch.xid,
                "latched_at": latch.latched_at,
                "reason": faultlatch.latched_reason(latch),
            }
            for g, latch in sorted(self.latches.items())
        }
