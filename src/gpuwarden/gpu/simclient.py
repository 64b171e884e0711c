"""The client a job process uses to hold memory on gpuwarden's simulated GPU.

A job started by a broker running ``--mock-gpu`` finds two variables in its
environment: ``GPUWARDEN_SIM_GPU`` (the device state file) and
``CUDA_VISIBLE_DEVICES`` (the UUID of the GPU it was given)::

    from gpuwarden.gpu import simclient

    gpu = simclient.attach()
    weights = gpu.allocate(8 * 1024**3)  # SimOutOfMemoryError if it does not fit
    ...
    gpu.free(weights)

Memory is attributed to the calling process; what it does not free is released
some time after it exits, unless it was allocated with ``leak=True``. In a
sandbox with a PID namespace of its own (bubblewrap, podman) the process is
recorded by the pid it sees and that namespace; the broker's probe lists it
under its host pid, as NVML would (see :mod:`gpuwarden.gpu.sim`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gpuwarden.errors import GpuProbeError
from gpuwarden.gpu.sim import SimDevice

SIM_ENV = "GPUWARDEN_SIM_GPU"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class SimClient:
    """One job process's handle on one simulated GPU."""

    def __init__(self, device: SimDevice, gpu_uuid: str) -> None:
        self.device = device
        self.gpu_uuid = gpu_uuid

    def allocate(self, nbytes: int, leak: bool = False, label: str = "") -> int:
        """Hold ``nbytes`` for this process; return the allocation id.

        Raises ``SimOutOfMemoryError`` when the GPU does not have that much free.
        With ``leak=True`` the memory outlives the process (a driver-level leak).
        """
        return self.device.allocate(self.gpu_uuid, nbytes, os.getpid(), label=label, leak=leak)

    def free(self, alloc_id: int) -> None:
        """Release one allocation."""
        self.device.free(alloc_id)

    def free_all(self) -> int:
        """Release everything this process holds (by its pid in its own PID
        namespace); return how many allocations went."""
        return self.device.free_pid(os.getpid())


def attach(env: Mapping[str, str] | None = None) -> SimClient:
    """Attach to the simulated GPU this process was given (read from ``env``,
    by default ``os.environ``; the first, for a job given several). Raises
    ``GpuProbeError`` outside gpuwarden's simulated GPU, or when the job was given
    no GPU."""
    return attach_all(env)[0]


def attach_all(env: Mapping[str, str] | None = None) -> list[SimClient]:
    """One client per simulated GPU this process was given, in the order
    ``CUDA_VISIBLE_DEVICES`` names them (a multi-GPU job's)."""
    env = os.environ if env is None else env
    path = env.get(SIM_ENV, "")
    if not path:
        raise GpuProbeError(
            f"not running under gpuwarden's simulated GPU: {SIM_ENV} is not set "
            "(start the broker with --mock-gpu, or set it to the simulated GPU's state file)"
        )
    device = SimDevice.open(Path(path))
    visible = env.get(VISIBLE_ENV)
    if visible is None:
        raise GpuProbeError(
            f"not running under gpuwarden's simulated GPU: {VISIBLE_ENV} is not set"
        )
    names = [n.strip() for n in visible.split(",")]
    if not names[0]:
        raise GpuProbeError(
            f"this job was given no GPU ({VISIBLE_ENV} is empty): it cannot allocate VRAM"
        )
    uuids = device.uuids()
    return [SimClient(device, _uuid_of(name, uuids, visible)) for name in names]


def _uuid_of(name: str, uuids: list[str], visible: str) -> str:
    """A name in ``CUDA_VISIBLE_DEVICES``: a UUID, or an index as CUDA also accepts."""
    if name.isdigit():
        index = int(name)
        if index >= len(uuids):
            raise GpuProbeError(
                f"{VISIBLE_ENV}={visible!r} names GPU {index}, but the simulated node has "
                f"{len(uuids)}"
            )
        return uuids[index]
    if name not in uuids:
        raise GpuProbeError(
            f"{VISIBLE_ENV}={visible!r} names no simulated GPU (known: {', '.join(uuids)})"
        )
    return name
