"""nvidia-smi CSV parsers, on captured output."""

from __future__ import annotations

import pytest

from gpuwarden.core.model import MIB
from gpuwarden.errors import GpuProbeError
from gpuwarden.gpu.base import ProcessUsage
from gpuwarden.gpu.smi import parse_apps_csv, parse_gpu_csv

# nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,driver_version
#            --format=csv,noheader,nounits   (a mixed 4-GPU workstation)
GPU_CSV = """\
0, GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, NVIDIA GeForce RTX 4090, 24564, 18342, 550.54.14
1, GPU-a1b2c3d4-e5f6-7a8b-9c0d-e1f2a3b4c5d6, NVIDIA RTX A6000, 49140, 4, 550.54.14

2, GPU-0f9e8d7c-6b5a-4938-2716-05f4e3d2c1b0, NVIDIA A100-SXM4-80GB, 81920, [N/A], 550.54.14
3 ,  GPU-11111111-2222-3333-4444-555555555555 , Tesla T4 , [Not Supported] , [Not Supported],  [N/A]
"""

# nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits
APPS_CSV = """\
GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, 41213, 16120
GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, 40007, 2210
GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a, 41213, 12

GPU-a1b2c3d4-e5f6-7a8b-9c0d-e1f2a3b4c5d6,   977 ,  [N/A]
GPU-0f9e8d7c-6b5a-4938-2716-05f4e3d2c1b0, 5120, [Not Supported]
"""


def test_gpu_csv_multi_gpu() -> None:
    gpus = parse_gpu_csv(GPU_CSV)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    first = gpus[0]
    assert first.uuid == "GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a"
    assert first.name == "NVIDIA GeForce RTX 4090"
    assert first.total_bytes == 24564 * MIB
    assert first.used_bytes == 18342 * MIB
    assert first.free_bytes == (24564 - 18342) * MIB
    assert first.driver == "550.54.14"
    assert first.extra == {}
    assert first.processes == ()
    assert gpus[1].used_bytes == 4 * MIB


def test_gpu_csv_unavailable_fields() -> None:
    gpus = parse_gpu_csv(GPU_CSV)
    a100 = gpus[2]
    assert a100.total_bytes == 81920 * MIB
    assert a100.used_bytes == 0
    assert a100.extra == {"unavailable": "memory.used"}
    t4 = gpus[3]
    assert t4.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert t4.name == "Tesla T4"
    assert t4.total_bytes == 0  # unknown size: nothing is free
    assert t4.free_bytes == 0
    assert t4.driver == ""
    assert t4.extra == {"unavailable": "memory.total,memory.used"}


def test_gpu_csv_name_with_comma_and_units() -> None:
    text = "0, GPU-abc, Odd, Name, Inc., 1024 MiB, 512 MiB, 535.1\n"
    (gpu,) = parse_gpu_csv(text)
    assert gpu.name == "Odd, Name, Inc."
    assert gpu.total_bytes == 1024 * MIB
    assert gpu.used_bytes == 512 * MIB


def test_empty_output() -> None:
    assert parse_gpu_csv("") == []
    assert parse_gpu_csv("\n  \n") == []
    assert parse_apps_csv("") == {}
    assert parse_apps_csv("No running processes found\n") == {}


def test_apps_csv_sums_by_pid_and_tolerates_na() -> None:
    apps = parse_apps_csv(APPS_CSV)
    assert apps["GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a"] == [
        ProcessUsage(40007, 2210 * MIB),
        ProcessUsage(41213, 16132 * MIB),
    ]
    assert apps["GPU-a1b2c3d4-e5f6-7a8b-9c0d-e1f2a3b4c5d6"] == [ProcessUsage(977, 0)]
    assert apps["GPU-0f9e8d7c-6b5a-4938-2716-05f4e3d2c1b0"] == [ProcessUsage(5120, 0)]
    assert set(apps) == {
        "GPU-5e2a4c1b-8d3f-4e6a-9b7c-2f1e0d9c8b7a",
        "GPU-a1b2c3d4-e5f6-7a8b-9c0d-e1f2a3b4c5d6",
        "GPU-0f9e8d7c-6b5a-4938-2716-05f4e3d2c1b0",
    }


@pytest.mark.parametrize(
    "line",
    [
        "0, GPU-abc, Tesla T4, 15360, 100",  # a field short
        "zero, GPU-abc, Tesla T4, 15360, 100, 535.1",  # index not a number
        "0, GPU-abc, Tesla T4, lots, 100, 535.1",  # size not a number
        "0, GPU-abc, Tesla T4, -5, 100, 535.1",  # negative size
        "0, [N/A], Tesla T4, 15360, 100, 535.1",  # no UUID
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
    ],
)
def test_gpu_csv_malformed_line_is_quoted(line: str) -> None:
    text = "1, GPU-ok, Tesla T4, 15360, 0, 535.1\n" + line + "\n"
    with pytest.raises(GpuProbeError) as err:
        parse_gpu_csv(text)
    assert repr(line) in err.value.message
    assert "index, uuid, name" in err.value.message


@pytest.mark.parametrize(
    "line",
    [
        "GPU-abc, 1234",  # a field short
        "GPU-abc, 1234, 100, 7",  # a field too many
        "GPU-abc, [N/A], 100",  # no pid
        "GPU-abc, 1234, much",  # size not a number
        "[N/A], 1234, 100",  # no GPU
    ],
)
def test_apps_csv_malformed_line_is_quoted(line: str) -> None:
    with pytest.raises(GpuProbeError) as err:
        parse_apps_csv(line + "\n")
    assert repr(line) in err.value.message
    assert "gpu_uuid, pid, used_memory" in err.value.message
