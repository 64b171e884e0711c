"""Choosing the node's ``GpuProbe`` from configuration."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from gpuwarden.errors import ConfigError, GpuProbeError
from gpuwarden.gpu.base import GpuProbe, NoGpuProbe
from gpuwarden.gpu.sim import SimGpuConfig, SimProbe
from gpuwarden.gpu.smi import SmiProbe

log = logging.getLogger("gpuwarden.gpu")

PROBE_KINDS = ("auto", "sim", "nvml", "nvidia-smi", "none")
#: the simulated GPU's state file, under the broker's state directory, in a folder of
#: its own (a sandboxed job on the simulated GPU is given that folder, nothing else)
SIM_STATE_FILE = "simgpu/simgpu.json"


def open_probe(kind: str, *, state_dir: Path, sim: SimGpuConfig) -> GpuProbe:
    """Open the probe ``kind`` names.

    ``auto`` tries NVML, then ``nvidia-smi`` if it is on PATH, then settles for
    no GPU (logging a warning). ``nvml`` and ``nvidia-smi`` raise
    ``GpuProbeError`` when they cannot start; an unknown kind raises
    ``ConfigError``.
    """
    if kind == "sim":
        return SimProbe(state_dir / SIM_STATE_FILE, sim, shared_folder=True)
    if kind == "none":
        return NoGpuProbe()
    # pynvml takes ~80 ms to import: only a host that probes a real GPU pays for it
    from gpuwarden.gpu.nvml import NvmlProbe  # noqa: PLC0415

    if kind == "nvml":
        return NvmlProbe()
    if kind == "nvidia-smi":
        return SmiProbe()
    if kind != "auto":
        raise ConfigError(f"unknown GPU probe {kind!r}: choose one of {', '.join(PROBE_KINDS)}")
    try:
        return NvmlProbe()
    except GpuProbeError as nvml_error:
        reason = nvml_error.message
    if shutil.which("nvidia-smi") is not None:
        log.warning("NVML is not available (%s); reading the GPUs with nvidia-smi", reason)
        return SmiProbe()
    log.warning(
        "no GPU found (%s); vram jobs will wait. Use --mock-gpu for the simulated GPU.", reason
    )
    return NoGpuProbe()
