"""The real-GPU probes: NVML and nvidia-smi, on a host with or (usually) without a GPU."""

from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpuwarden.core.model import GIB, MIB
from gpuwarden.errors import ConfigError, GpuProbeError
from gpuwarden.gpu import nvml as nvml_module
from gpuwarden.gpu.base import GpuSensors, NoGpuProbe, ProcessUsage
from gpuwarden.gpu.nvml import NvmlProbe
from gpuwarden.gpu.select import SIM_STATE_FILE, open_probe
from gpuwarden.gpu.sim import SimGpuConfig
from gpuwarden.gpu.smi import SmiProbe

GPU_CSV = """\
0, GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, NVIDIA GeForce RTX 4090, 24564, 18342, 550.54.14
1, GPU-a1b2c3d4-e5f6-7a8b-9c0d-e1f2a3b4c5d6, NVIDIA RTX A6000, 49140, [N/A], 550.54.14
"""
APPS_CSV = """\
GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, 41213, 16120
GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, 40007, [N/A]
"""


# -- NVML -----------------------------------------------------------------------


def test_nvml_probe_real_or_helpful_error() -> None:
    try:
        probe = NvmlProbe()
    except GpuProbeError as err:  # the usual case: no driver on this machine
        message = err.message
        assert message.startswith("No NVIDIA driver was found")
        assert "--mock-gpu" in message
        assert "simulated GPU" in message
        assert isinstance(err.__cause__, pynvml.NVMLError)
        return
    try:  # a real GPU host
        assert probe.kind == "nvml"
        readings = probe.read()
        assert readings, "NVML started but reported no GPU"
        for r in readings:
            assert r.uuid.startswith(("GPU-", "MIG-"))
            assert r.total_bytes > 0
            assert 0 <= r.used_bytes <= r.total_bytes
            assert r.driver
        assert probe.job_env(readings[0].uuid) == {"CUDA_VISIBLE_DEVICES": readings[0].uuid}
    finally:
        probe.close()
    with pytest.raises(GpuProbeError, match="closed"):
        probe.read()


def _fake_pynvml(*, fail_read: bool = False) -> Any:
    """A stand-in for the NVML bindings: two GPUs, bytes-typed strings as old bindings return."""
    mem = {0: (80 * GIB, 20 * GIB), 1: (80 * GIB, 0)}
    procs = {
        0: [
            SimpleNamespace(pid=300, usedGpuMemory=12 * GIB),
            SimpleNamespace(pid=100, usedGpuMemory=None),
            SimpleNamespace(pid=300, usedGpuMemory=GIB),
        ],
        1: None,  # this GPU does not support listing processes
    }

    def get_procs(h: int) -> list[Any]:
        found = procs[h]
        if found is None:
            raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return found

    def get_count() -> int:
        if fail_read:
            raise pynvml.NVMLError_GpuIsLost(pynvml.NVML_ERROR_GPU_IS_LOST)
        return 2

    def get_power(h: int) -> int:
        if h:
            raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 312_500  # milliwatts

    calls: list[str] = []
    fake = SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        NVMLError_LibraryNotFound=pynvml.NVMLError_LibraryNotFound,
        NVMLError_DriverNotLoaded=pynvml.NVMLError_DriverNotLoaded,
        NVMLError_NoPermission=pynvml.NVMLError_NoPermission,
        NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"550.54.14",
        nvmlDeviceGetCount=get_count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd".encode(),
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3" if h else b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(
            total=mem[h][0], used=mem[h][1], free=mem[h][0] - mem[h][1]
        ),
        nvmlDeviceGetComputeRunningProcesses=get_procs,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87 if h == 0 else 0, memory=40),
        NVML_TEMPERATURE_GPU=pynvml.NVML_TEMPERATURE_GPU,
        nvmlDeviceGetTemperature=lambda h, sensor: 64 + h,
        nvmlDeviceGetPowerUsage=get_power,
        calls=calls,
    )
    return fake


def test_nvml_read_with_stand_in_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setattr(nvml_module, "pynvml", fake)
    probe = NvmlProbe()
    r0, r1 = probe.read()
    assert r0.uuid == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    assert r0.name == "NVIDIA H100 80GB HBM3"
    assert (r0.index, r0.driver) == (0, "550.54.14")
    assert (r0.total_bytes, r0.used_bytes) == (80 * GIB, 20 * GIB)
    assert r0.processes == (ProcessUsage(100, 0), ProcessUsage(300, 13 * GIB))
    assert r1.uuid == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"
    assert r1.processes == ()
    # the sensors: what each GPU reports; a field it does not is None, not an error
    assert r0.sensors == GpuSensors(util_pct=87.0, temp_c=64.0, power_w=312.5)
    assert r1.sensors == GpuSensors(util_pct=0.0, temp_c=65.0, power_w=None)
    assert probe.job_env(None) == {"CUDA_VISIBLE_DEVICES": ""}
    probe.close()
    probe.close()
    assert fake.calls == ["init", "shutdown"]


def test_nvml_errors_while_reading_are_probe_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_module, "pynvml", _fake_pynvml(fail_read=True))
    probe = NvmlProbe()
    with pytest.raises(GpuProbeError, match="NVML could not read the GPUs") as err:
        probe.read()
    assert isinstance(err.value.__cause__, pynvml.NVMLError)


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (pynvml.NVMLError_LibraryNotFound, "libnvidia-ml.so"),
        (pynvml.NVMLError_DriverNotLoaded, "driver is not loaded"),
        (pynvml.NVMLError_NoPermission, "may not access"),
        (pynvml.NVMLError_Unknown, "NVML could not start"),
    ],
)
def test_nvml_init_errors(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception], why: str
) -> None:
    fake = _fake_pynvml()

    def fail() -> None:
        raise error()

    fake.nvmlInit = fail
    monkeypatch.setattr(nvml_module, "pynvml", fake)
    with pytest.raises(GpuProbeError) as err:
        NvmlProbe()
    assert err.value.message.startswith("No NVIDIA driver was found")
    assert why in err.value.message
    assert "--mock-gpu" in err.value.message


# -- nvidia-smi ---------------------------------------------------------------------


def fake_smi(bin_dir: Path, *, mode: str = "ok") -> Path:
    """Write an ``nvidia-smi`` that answers the two queries with captured CSV."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "gpus.csv").write_text(GPU_CSV)
    (bin_dir / "apps.csv").write_text(APPS_CSV)
    script = bin_dir / "nvidia-smi"
    # absolute paths: the tests narrow PATH to bin_dir
    cat, sleep = shutil.which("cat"), shutil.which("sleep")
    body = {
        "ok": f"""
[ "$2" = "--format=csv,noheader,nounits" ] || {{ echo "bad format: $2" >&2; exit 2; }}
case "$1" in
  --query-gpu=index,uuid,name,memory.total,memory.used,driver_version)
    {cat} '{bin_dir}/gpus.csv' ;;
  --query-compute-apps=gpu_uuid,pid,used_memory) {cat} '{bin_dir}/apps.csv' ;;
  *) echo "unexpected arguments: $*" >&2; exit 2 ;;
esac
""",
        "nodriver": """
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. \
Make sure that the latest NVIDIA driver is installed and running."
exit 9
""",
        "hang": f"exec {sleep} 30\n",
    }[mode]
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def test_smi_absent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(GpuProbeError) as err:
        SmiProbe()
    assert "nvidia-smi was not found on PATH" in err.value.message
    assert "--mock-gpu" in err.value.message


def test_smi_reads_fake_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    probe = SmiProbe()
    assert probe.kind == "nvidia-smi"
    r0, r1 = probe.read()
    assert r0.uuid == "GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a"
    assert (r0.index, r0.name, r0.driver) == (0, "NVIDIA GeForce RTX 4090", "550.54.14")
    assert (r0.total_bytes, r0.used_bytes) == (24564 * MIB, 18342 * MIB)
    assert r0.processes == (ProcessUsage(40007, 0), ProcessUsage(41213, 16120 * MIB))
    assert (r1.index, r1.total_bytes, r1.used_bytes) == (1, 49140 * MIB, 0)
    assert r1.extra == {"unavailable": "memory.used"}
    assert r1.processes == ()
    assert probe.job_env(r1.uuid) == {"CUDA_VISIBLE_DEVICES": r1.uuid}
    probe.close()


def test_smi_failure_names_what_happened(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_smi(tmp_path / "bin", mode="nodriver")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(GpuProbeError) as err:
        SmiProbe().read()
    assert "exit status 9" in err.value.message
    assert "couldn't communicate with the NVIDIA driver" in err.value.message


def test_smi_timeout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_smi(tmp_path / "bin", mode="hang")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(GpuProbeError, match=r"did not answer within 0.2 s"):
        SmiProbe(timeout_s=0.2).read()


def test_smi_binary_vanishes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = fake_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    probe = SmiProbe()
    script.unlink()
    with pytest.raises(GpuProbeError, match="could not run `nvidia-smi"):
        probe.read()


# -- choosing a probe ---------------------------------------------------------------


def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()

    def fail() -> None:
        raise pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    fake.nvmlInit = fail
    monkeypatch.setattr(nvml_module, "pynvml", fake)


def test_auto_falls_back_to_smi_then_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _no_nvml(monkeypatch)
    cfg = SimGpuConfig()
    fake_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with caplog.at_level(logging.WARNING, logger="gpuwarden.gpu"):
        assert isinstance(open_probe("auto", state_dir=tmp_path, sim=cfg), SmiProbe)
    assert "using nvidia-smi" in caplog.text or "with nvidia-smi" in caplog.text

    caplog.clear()
    monkeypatch.setenv("PATH", str(tmp_path / "state"))
    with caplog.at_level(logging.WARNING, logger="gpuwarden.gpu"):
        probe = open_probe("auto", state_dir=tmp_path, sim=cfg)
    assert isinstance(probe, NoGpuProbe)
    assert "no GPU found" in caplog.text
    assert "libnvidia-ml.so" in caplog.text


def test_open_probe_kinds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_nvml(monkeypatch)
    cfg = SimGpuConfig()
    assert open_probe("none", state_dir=tmp_path, sim=cfg).kind == "none"
    assert open_probe("sim", state_dir=tmp_path, sim=cfg).kind == "sim"
    assert (tmp_path / SIM_STATE_FILE).is_file()
    with pytest.raises(GpuProbeError, match="No NVIDIA driver was found"):
        open_probe("nvml", state_dir=tmp_path, sim=cfg)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GpuProbeError, match="not found on PATH"):
        open_probe("nvidia-smi", state_dir=tmp_path, sim=cfg)
    with pytest.raises(ConfigError, match="unknown GPU probe 'cuda'"):
        open_probe("cuda", state_dir=tmp_path, sim=cfg)


def test_real_nvidia_smi_if_present() -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi on this host")
    try:
        readings = SmiProbe().read()
    except GpuProbeError as err:  # installed, but no working driver
        assert "nvidia-smi" in err.message
        return
    assert all(r.uuid.startswith(("GPU-", "MIG-")) and r.total_bytes > 0 for r in readings)
