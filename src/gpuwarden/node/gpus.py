"""The node's GPUs as the broker loop watches them.

:class:`GpuWatch` reads the probe (once per tick at most) and lets the VRAM book
take the readings in. A probe that fails pauses VRAM admission on the whole node
(admission fails closed) until it reads again. An Xid a GPU reports is answered
here: a critical one stops VRAM admission on that GPU until an operator clears
it (``gpuwarden gpu clear``, carried out here too) and stops what runs there; an
application one fails the jobs running there; others are logged.

Owned by the loop; every method returns whether the node's status changed.
"""

from __future__ import annotations

from gpuwarden.core.classify import xid_kind
from gpuwarden.errors import GpuProbeError
from gpuwarden.gpu.base import GpuProbe, GpuReading
from gpuwarden.node.runner import AttemptRunner
from gpuwarden.node.running import Emit
from gpuwarden.node.vram import VramBook
from gpuwarden.node.warm import WarmServers
from gpuwarden.node.warmpool import ServerState
from gpuwarden.store.base import Store

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
    ) -> None:
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
                changed |= self._on_xid(event["gpu"], int(event["xid"]))
                continue
            self.emit(kind, **event)
            changed = True
        return changed

    def _on_xid(self, gpu: str, code: int) -> bool:
        """A GPU reported an Xid. A critical one stops VRAM admission there until an
        operator clears it, and its jobs go back to the queue as infrastructure
        failures; an application one fails the jobs running there; others are logged."""
        kind = xid_kind(code)
        self.emit("gpu_xid", gpu=gpu, xid=code, severity=kind)
        if kind == "other":
            return False
        if kind == "critical":
            reason = (
                f"Xid {code}: check `nvidia-smi -q` and the kernel log (dmesg) on this host; "
                f"once fixed, `gpuwarden gpu clear {gpu}` (or a broker restart) resumes it"
            )
            self.vram.fault(gpu, reason)
            self.emit("gpu_fault", gpu=gpu, xid=code, reason=reason)
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

    def operator_requests(self, now: float) -> bool:
        """Carry out what operators asked through the store (``gpuwarden gpu clear``)."""
        if now - self._last_requests_check < REQUESTS_EVERY_S:
            return False
        self._last_requests_check = now
        changed = False
        for gpu in self.store.take_gpu_clears(now=now):
            if self.vram.clear_fault(gpu):
                self.emit("gpu_fault_cleared", gpu=gpu)
                changed = True
            else:
                self.emit("gpu_clear_ignored", gpu=gpu, reason="no fault on that GPU here")
        return changed
