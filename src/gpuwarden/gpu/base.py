"""The GpuProbe port: what the broker knows about its GPUs, read fresh each tick."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """Device memory held by one process on one GPU."""

    pid: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class GpuSensors:
    """A GPU's utilisation, temperature and power draw now, each None where the
    device or its driver does not report it (DCGM's ``DCGM_FI_DEV_GPU_UTIL``,
    ``DCGM_FI_DEV_GPU_TEMP``, ``DCGM_FI_DEV_POWER_USAGE``)."""

    #: percent of the last sample period a kernel ran (NVML's utilization.gpu)
    util_pct: float | None = None
    #: degrees Celsius, the GPU's core
    temp_c: float | None = None
    #: watts drawn now
    power_w: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return {"util_pct": self.util_pct, "temp_c": self.temp_c, "power_w": self.power_w}

    def text(self) -> str:
        """``util 87 %  64 °C  312 W`` (what it reads; "" when nothing)."""
        parts = [
            f"util {self.util_pct:.0f} %" if self.util_pct is not None else "",
            f"{self.temp_c:.0f} °C" if self.temp_c is not None else "",
            f"{self.power_w:.0f} W" if self.power_w is not None else "",
        ]
        return "  ".join(p for p in parts if p)

    @classmethod
    def from_json(cls, d: object) -> GpuSensors | None:
        """Read back a published one (None for anything that is not one)."""
        if not isinstance(d, dict):
            return None
        return cls(*(_finite(d.get(k)) for k in ("util_pct", "temp_c", "power_w")))


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


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
    #: what the GPU's sensors say now (None: not read, or the GPU does not say)
    sensors: GpuSensors | None = None

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
