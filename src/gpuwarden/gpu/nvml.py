"""The ``GpuProbe`` for a real NVIDIA host, through NVML (package ``nvidia-ml-py``)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pynvml

from gpuwarden.errors import GpuProbeError
from gpuwarden.gpu.base import GpuReading, GpuSensors, ProcessUsage

_NO_DRIVER_HINT = (
    "Install the NVIDIA driver on this host, or start gpuwarden with --mock-gpu "
    "to use its simulated GPU."
)


def _text(value: Any) -> str:
    """NVML returns ``bytes`` in older bindings and ``str`` in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _init_error(exc: Exception) -> GpuProbeError:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        why = "the NVML library (libnvidia-ml.so) was not found"
    elif isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        why = "the NVIDIA kernel driver is not loaded"
    elif isinstance(exc, pynvml.NVMLError_NoPermission):
        why = "this user may not access the NVIDIA driver"
    else:
        why = f"NVML could not start ({exc})"
    return GpuProbeError(f"No NVIDIA driver was found: {why}. {_NO_DRIVER_HINT}")


class NvmlProbe:
    """Reads the host's NVIDIA GPUs through NVML.

    Constructing it starts NVML; it raises ``GpuProbeError`` when there is no
    usable driver. Every NVML error while reading is raised as ``GpuProbeError``.
    """

    kind = "nvml"

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise _init_error(exc) from exc
        except OSError as exc:  # a broken library, not one NVML names
            raise _init_error(exc) from exc
        self._open = True
        self._xids: dict[str, list[tuple[int, int]]] = {}
        self._xid_seq = 0
        self._events = self._register_xid_events()

    @staticmethod
    def _register_xid_events() -> Any:
        """Listen for critical Xid events on every GPU; None where NVML cannot."""
        try:
            events = pynvml.nvmlEventSetCreate()
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, events
                )
        except (pynvml.NVMLError, AttributeError):
            return None
        return events

    def _drain_xids(self) -> None:
        """Collect the Xid events NVML has queued, without waiting."""
        if self._events is None:
            return
        while True:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError:  # timeout: nothing (more) queued
                return
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
            self._xid_seq += 1
            self._xids.setdefault(uuid, []).append((self._xid_seq, int(data.eventData)))

    def read(self) -> list[GpuReading]:
        if not self._open:
            raise GpuProbeError("the NVML probe was closed")
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            self._drain_xids()
            readings = [self._read_one(i, driver) for i in range(pynvml.nvmlDeviceGetCount())]
            return [
                dataclasses.replace(r, xids=tuple(self._xids.get(r.uuid, ()))) for r in readings
            ]
        except pynvml.NVMLError as exc:
            raise GpuProbeError(f"NVML could not read the GPUs: {exc}") from exc

    @staticmethod
    def _read_one(index: int, driver: str) -> GpuReading:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError_NotSupported:
            procs = []
        by_pid: dict[int, int] = {}
        for p in procs:
            # usedGpuMemory is None where the driver cannot attribute memory
            # (Windows WDDM, some containers): the process is shown with 0.
            used = p.usedGpuMemory
            by_pid[int(p.pid)] = by_pid.get(int(p.pid), 0) + (int(used) if used else 0)
        return GpuReading(
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            name=_text(pynvml.nvmlDeviceGetName(handle)),
            total_bytes=int(mem.total),
            used_bytes=int(mem.used),
            processes=tuple(ProcessUsage(pid, n) for pid, n in sorted(by_pid.items())),
            index=index,
            driver=driver,
            sensors=sensors(handle),
        )

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": gpu_uuid or ""}

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                raise GpuProbeError(f"NVML did not shut down cleanly: {exc}") from exc


def sensors(handle: Any) -> GpuSensors:
    """Utilisation, temperature and power of one device; each None where this GPU
    or driver does not report it (an NVML error of one field loses only it)."""

    def one(read: Any, *args: Any) -> Any:
        try:
            return read(handle, *args)
        except pynvml.NVMLError:  # this GPU does not report it (NotSupported, ...)
            return None

    util = one(pynvml.nvmlDeviceGetUtilizationRates)
    temp = one(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
    milliwatts = one(pynvml.nvmlDeviceGetPowerUsage)
    return GpuSensors(
        util_pct=None if util is None else float(util.gpu),
        temp_c=None if temp is None else float(temp),
        power_w=None if milliwatts is None else milliwatts / 1000.0,
    )


#: the driver's control nodes every CUDA process opens, besides its GPU's own node
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def device_nodes(gpu_uuid: str) -> list[str]:
    """The device nodes a sandbox must be given to use exactly the GPU ``gpu_uuid``
    (found by UUID, never by index): its ``/dev/nvidiaN`` and the control nodes."""
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as exc:
        raise _init_error(exc) from exc
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        minor = int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError as exc:
        raise GpuProbeError(f"NVML does not know the GPU {gpu_uuid}: {exc}") from exc
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    nodes = [f"/dev/nvidia{minor}", *CONTROL_NODES]
    return [n for n in nodes if Path(n).exists()]
