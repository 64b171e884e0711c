"""The GpuProbe port: what the broker knows about its GPUs, read fresh each tick."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """Device memory held by one process on one GPU."""

    pid: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as the probe sees it now. GPUs are named by UUID, never by index."""

    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    processes: tuple[ProcessUsage, ...] = ()
    index: int = 0
    driver: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    #: Xid events the GPU reported, as (sequence number, Xid code); the numbers
    #: only grow, so a reader keeps the last it saw and acts on the newer ones
    xids: tuple[tuple[int, int], ...] = ()

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)


class GpuProbe(Protocol):
    """Reads the node's GPUs. Implementations: ``SimProbe``, ``NvmlProbe``, ``SmiProbe``."""

    #: short name shown by ``gpuwarden status`` ("sim", "nvml", "nvidia-smi", "none")
    kind: str

    def read(self) -> list[GpuReading]:
        """Return one reading per GPU. Raise ``GpuProbeError`` when the devices
        cannot be read (no driver, NVML error, nvidia-smi failed)."""
        ...

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        """Environment for a job's process: it sees only ``gpu_uuid`` (or no GPU)."""
        ...

    def close(self) -> None: ...


class NoGpuProbe:
    """A node with no GPU: ``cpu`` lane jobs run, ``vram`` jobs wait with a reason."""

    kind = "none"

    def read(self) -> list[GpuReading]:
        return []

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ""}

    def close(self) -> None:
        return None
