"""Admission and ordering: ``plan(snapshot, now) -> decisions``. Pure.

The broker gathers a :class:`Snapshot` (queued jobs, GPU readings, what runs
where) and carries out the decisions. This is the walking skeleton's policy:
one ``vram`` job per GPU at a time, admitted only where its footprint fits the
memory the probe shows free; ``cpu`` jobs up to ``cpu_slots`` at once. The full
VRAM ledger, co-residence and reservations replace it in the admission work.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.core.model import Lane, format_bytes


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: str
    type: str
    lane: Lane
    vram_bytes: int
    priority: int
    seq: int


@dataclass(frozen=True, slots=True)
class GpuState:
    uuid: str
    total_bytes: int
    used_bytes: int  # as the probe reads it: ours and foreign processes alike
    running: tuple[str, ...] = ()  # job ids of vram attempts on this GPU

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)


@dataclass(frozen=True, slots=True)
class Snapshot:
    queued: tuple[QueuedJob, ...]
    gpus: tuple[GpuState, ...]
    running_cpu: int
    cpu_slots: int
    accepting: bool = True
    #: why vram admission is paused on the whole node (e.g. the probe failed), or ""
    vram_paused: str = ""


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    gpu_uuid: str | None


@dataclass(frozen=True, slots=True)
class Wait:
    job_id: str
    reason: str


Decision = Start | Wait


def order(jobs: tuple[QueuedJob, ...]) -> list[QueuedJob]:
    """Higher priority first, then arrival order."""
    return sorted(jobs, key=lambda j: (-j.priority, j.seq))


def plan(snapshot: Snapshot, now: float) -> list[Decision]:
    """Decide, for every queued job, whether it starts now (and where) or waits (and why)."""
    del now  # the skeleton's policy does not depend on time yet
    decisions: list[Decision] = []
    cpu_free = snapshot.cpu_slots - snapshot.running_cpu
    busy = {g.uuid for g in snapshot.gpus if g.running}
    for job in order(snapshot.queued):
        if not snapshot.accepting:
            decisions.append(Wait(job.id, "the broker is shutting down"))
            continue
        if job.lane is Lane.CPU:
            if cpu_free > 0:
                cpu_free -= 1
                decisions.append(Start(job.id, None))
            else:
                decisions.append(Wait(job.id, f"all {snapshot.cpu_slots} cpu slots are in use"))
            continue
        decisions.append(_place_vram(job, snapshot, busy))
        if isinstance(decisions[-1], Start):
            busy.add(decisions[-1].gpu_uuid or "")
    return decisions


def _place_vram(job: QueuedJob, snapshot: Snapshot, busy: set[str]) -> Decision:
    need = format_bytes(job.vram_bytes)
    if snapshot.vram_paused:
        return Wait(job.id, f"VRAM admission is paused: {snapshot.vram_paused}")
    if not snapshot.gpus:
        return Wait(job.id, f"needs {need} on one GPU; this node has no GPU")
    fitting = [g for g in snapshot.gpus if g.uuid not in busy and g.free_bytes >= job.vram_bytes]
    if fitting:
        best = min(fitting, key=lambda g: (g.free_bytes, g.uuid))  # best fit
        return Start(job.id, best.uuid)
    parts = []
    for g in snapshot.gpus:
        if g.uuid in busy:
            parts.append(f"{g.uuid} runs another job")
        else:
            parts.append(f"{g.uuid} has {format_bytes(g.free_bytes)} free")
    return Wait(job.id, f"needs {need} on one GPU; " + "; ".join(parts))
