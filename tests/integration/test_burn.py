"""The burn module: simulated VRAM held for a while, out of memory, leaks, no GPU,
and (with a stand-in for PyTorch) the real-GPU path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.model import GIB
from gpuwarden.gpu.sim import SimDevice, SimGpuConfig
from gpuwarden.registry import Registry
from tests.conftest import need_tool

REPO = Path(__file__).resolve().parents[2]
BURN = REPO / "src" / "gpuwarden" / "modules" / "burn"
GW = [sys.executable, "-m", "gpuwarden"]
DECLARED = {"llm": 14, "vision": 6, "embed": 3, "whisper": 2, "custom": 1}
CORESIDENT = {"embed", "whisper"}


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPUWARDEN_") and k != "CUDA_VISIBLE_DEVICES"
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torch_sees_a_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.fixture
def device(tmp_path: Path) -> SimDevice:
    return SimDevice.create(
        tmp_path / "sim" / "simgpu.json",
        SimGpuConfig(count=1, vram_bytes=24 * GIB, release_delay_s=0.05),
    )


class Job:
    """burn.py started directly, with the environment a broker gives a job."""

    def __init__(self, tmp: Path, name: str, params: dict[str, Any]) -> None:
        self.dir = tmp / name
        (self.dir / "out").mkdir(parents=True)
        full = {"gib": 1, "seconds": 0.1, "ramp_s": 0, "leak": False, **params}
        (self.dir / "params.json").write_text(json.dumps(full))
        self.env = clean_env()
        self.env.update(
            {
                "GPUWARDEN_JOB_TYPE": f"burn.{name}",
                "GPUWARDEN_PARAMS": str(self.dir / "params.json"),
                "GPUWARDEN_OUTPUT_DIR": str(self.dir / "out"),
                "GPUWARDEN_SCRATCH_DIR": str(self.dir),
                "GPUWARDEN_RESULT": str(self.dir / "message.json"),
            }
        )

    def on(self, device: SimDevice) -> Job:
        self.env["GPUWARDEN_SIM_GPU"] = str(device.path)
        self.env["CUDA_VISIBLE_DEVICES"] = device.uuids()[0]
        return self

    def run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "src/burn.py"],
            cwd=BURN,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    @property
    def message(self) -> str:
        return str(json.loads((self.dir / "message.json").read_text())["message"])

    @property
    def record(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.dir / "out" / "burn.json").read_text())
        return data


def wait_used(device: SimDevice, want: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while True:
        used = device.readings(time.time())[0].used_bytes
        if used == want or time.monotonic() > deadline:
            return used
        time.sleep(0.02)


# -- the module's declaration -------------------------------------------------------


def test_types_declare_footprint_coresidence_and_gib_default() -> None:
    registry = Registry.load([REPO / "src" / "gpuwarden" / "modules"])
    for name, gib in DECLARED.items():
        t = registry.get(f"burn.{name}")
        assert t.lane.value == "vram"
        assert t.launch.value == "container"  # model-shaped: runs sandboxed where it can
        assert t.vram_bytes == gib * GIB
        assert t.coresident is (name in CORESIDENT)
        params = {p.name: p for p in t.params}
        assert set(params) == {"gib", "seconds", "leak", "ramp_s"}
        assert params["gib"].default == gib  # defaults to the declared footprint
        assert params["leak"].default is False
        assert params["ramp_s"].default == 0


# -- through the broker (the CLI, as a user runs it) --------------------------------------


BURN_1GIB = ("--gib", "1", "--seconds", "0.2")
BURN_30GIB = ("--gib", "30", "--seconds", "0.1")


def burn_config(tmp_path: Path, runtime: str) -> Path:
    """burn's types are container types: run them unsandboxed, or in bubblewrap."""
    if runtime == "bubblewrap":
        need_tool("bwrap")
        text = 'container_runtime = "bubblewrap"\n'
    else:
        text = "allow_unsandboxed_containers = true\n"
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text(
        text + f'module_paths = ["{REPO / "src" / "gpuwarden" / "modules"}"]\nstate_dir = "state"\n'
    )
    return cfg


@pytest.mark.parametrize("runtime", ["local", "bubblewrap"])
def test_run_once_on_the_simulated_gpu_succeeds(tmp_path: Path, runtime: str) -> None:
    cfg = burn_config(tmp_path, runtime)
    proc = subprocess.run(
        [
            *GW,
            "--config",
            cfg,
            "--mock-gpu",
            "run-once",
            "burn.embed",
            "--gib",
            "1",
            "--seconds",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done" in proc.stdout
    assert "held 1.00 GiB on GPU-sim-" in proc.stdout
    assert "burn.json" in proc.stdout
    assert '"allocated_bytes": 1073741824' in proc.stdout


@pytest.mark.parametrize("runtime", ["local", "bubblewrap"])
def test_run_once_past_capacity_dies_of_cuda_oom(tmp_path: Path, runtime: str) -> None:
    cfg = burn_config(tmp_path, runtime)
    proc = subprocess.run(
        [
            *GW,
            "--config",
            cfg,
            "--mock-gpu",
            "run-once",
            "burn.llm",
            "--gib",
            "30",
            "--seconds",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "failed" in proc.stdout
    assert "CUDA out of memory. Tried to allocate 30.00 GiB" in proc.stdout


# -- burn.py itself ---------------------------------------------------------------------------


def test_holds_memory_while_it_runs_then_frees_it(tmp_path: Path, device: SimDevice) -> None:
    job = Job(tmp_path, "vision", {"gib": 6, "seconds": 1.5, "ramp_s": 0.4}).on(device)
    proc = subprocess.Popen(
        [sys.executable, "src/burn.py"],
        cwd=BURN,
        env=job.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_used(device, 6 * GIB) == 6 * GIB
        owners = {a.pid for a in device.allocations()}
        assert owners == {proc.pid}
    finally:
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "loaded 6.00 GiB" in out
    assert wait_used(device, 0) == 0
    rec = job.record
    assert rec["backend"] == "sim"
    assert rec["requested_bytes"] == rec["allocated_bytes"] == 6 * GIB
    assert rec["steps"] == 4  # 0.4 s of ramp in steps of 0.1 s
    assert rec["held_s"] >= 1.4
    assert rec["gpu"] == device.uuids()[0]
    assert job.message.startswith("held 6.00 GiB on GPU-sim-")


def test_exceeding_capacity_prints_the_cuda_message_and_exits_1(
    tmp_path: Path, device: SimDevice
) -> None:
    result = Job(tmp_path, "llm", {"gib": 30, "ramp_s": 0.2}).on(device)
    proc = result.run()
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "CUDA out of memory. Tried to allocate 15.00 GiB." in last  # the second of 2 steps
    assert "total capacity of 24.00 GiB" in last
    assert result.record["out_of_memory"] is True
    assert result.record["allocated_bytes"] == 15 * GIB
    assert "out of memory after loading 15.00 of 30.00 GiB" in result.message
    assert wait_used(device, 0) == 0  # a crashed job's memory returns after it exits


def test_exceeding_its_declaration_is_allowed_when_it_fits(
    tmp_path: Path, device: SimDevice
) -> None:
    job = Job(tmp_path, "custom", {"gib": 8}).on(device)
    proc = job.run()
    assert proc.returncode == 0, proc.stderr
    assert job.record["allocated_bytes"] == 8 * GIB


def test_leak_keeps_memory_attributed_after_exit(tmp_path: Path, device: SimDevice) -> None:
    leaky = Job(tmp_path, "whisper", {"gib": 2, "leak": True}).on(device)
    proc = leaky.run()
    assert proc.returncode == 0, proc.stderr
    assert "leaked" in leaky.message
    tidy = Job(tmp_path, "embed", {"gib": 3}).on(device)
    assert tidy.run().returncode == 0
    # well past the release delay: the tidy job's memory is gone, the leak stays
    device.readings(time.time())
    time.sleep(0.3)
    reading = device.readings(time.time())[0]
    assert reading.used_bytes == 2 * GIB
    [alloc] = device.allocations()
    assert alloc.leak
    assert alloc.pid == leaky.record["pid"]
    assert alloc.release_at is not None  # its owner was noticed gone
    assert [p.used_bytes for p in reading.processes] == [2 * GIB]


def test_another_job_ooms_beside_a_leak(tmp_path: Path, device: SimDevice) -> None:
    assert Job(tmp_path, "llm", {"gib": 14, "leak": True}).on(device).run().returncode == 0
    proc = Job(tmp_path, "vision", {"gib": 12}).on(device).run()
    assert proc.returncode == 1
    assert "CUDA out of memory" in proc.stderr


@pytest.mark.skipif(torch_sees_a_gpu(), reason="this host has a GPU that PyTorch sees")
def test_without_a_gpu_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    job = Job(tmp_path, "embed", {})
    proc = job.run()
    assert proc.returncode == 2
    assert "no GPU: run under gpuwarden --mock-gpu" in proc.stderr
    assert not (job.dir / "message.json").exists()


def test_bad_parameters_exit_2(tmp_path: Path, device: SimDevice) -> None:
    proc = Job(tmp_path, "embed", {"gib": 0, "seconds": -1}).on(device).run()
    assert proc.returncode == 2
    assert "seconds must be a number >= 0" in proc.stderr


def test_given_no_gpu_by_the_broker_exits_2(tmp_path: Path, device: SimDevice) -> None:
    job = Job(tmp_path, "embed", {}).on(device)
    job.env["CUDA_VISIBLE_DEVICES"] = ""
    proc = job.run()
    assert proc.returncode == 2
    assert "given no GPU" in proc.stderr


# -- the real-GPU path, with a stand-in for PyTorch -------------------------------------------

FAKE_TORCH = textwrap.dedent(
    """
    import json, os
    uint8 = "uint8"
    _log = os.environ["FAKE_TORCH_LOG"]
    _cap = int(os.environ["FAKE_TORCH_CAP"])
    _used = 0

    class _Cuda:
        class OutOfMemoryError(RuntimeError):
            pass

        @staticmethod
        def is_available():
            return os.environ.get("FAKE_TORCH_GPU") == "1"

        @staticmethod
        def get_device_name(i):
            return "Fake GPU"

        @staticmethod
        def empty_cache():
            with open(_log, "a") as f:
                f.write(json.dumps(["empty_cache"]) + "\\n")

    cuda = _Cuda()

    def empty(n, dtype=None, device=None):
        global _used
        if _used + n > _cap:
            raise cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n / 2**30:.2f} GiB. GPU 0 has a "
                f"total capacity of {_cap / 2**30:.2f} GiB"
            )
        _used += n
        with open(_log, "a") as f:
            f.write(json.dumps(["empty", n, str(dtype), device]) + "\\n")
        return object()
    """
)


@pytest.fixture
def fake_torch(tmp_path: Path) -> Path:
    site = tmp_path / "fake_site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return site


def torch_job(tmp_path: Path, site: Path, params: dict[str, Any], *, gpu: bool = True) -> Job:
    job = Job(tmp_path, "embed", params)
    job.env.update(
        {
            "PYTHONPATH": str(site),
            "FAKE_TORCH_LOG": str(tmp_path / "torch.log"),
            "FAKE_TORCH_CAP": str(4 * GIB),
            "FAKE_TORCH_GPU": "1" if gpu else "0",
            "CUDA_VISIBLE_DEVICES": "GPU-real-0",
        }
    )
    return job


def torch_calls(tmp_path: Path) -> list[list[Any]]:
    log = tmp_path / "torch.log"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_real_gpu_allocates_uint8_cuda_tensors(tmp_path: Path, fake_torch: Path) -> None:
    job = torch_job(tmp_path, fake_torch, {"gib": 3, "ramp_s": 0.3})
    proc = job.run()
    assert proc.returncode == 0, proc.stderr
    calls = torch_calls(tmp_path)
    assert calls[:3] == [["empty", GIB, "uint8", "cuda"]] * 3
    assert calls[-1] == ["empty_cache"]
    assert job.record["backend"] == "cuda"
    assert job.record["gpu"] == "GPU-real-0"


def test_real_gpu_oom_exits_1_like_pytorch(tmp_path: Path, fake_torch: Path) -> None:
    proc = torch_job(tmp_path, fake_torch, {"gib": 6}).run()
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB")
    )


def test_real_gpu_cannot_leak(tmp_path: Path, fake_torch: Path) -> None:
    proc = torch_job(tmp_path, fake_torch, {"leak": True}).run()
    assert proc.returncode == 2
    assert "leak=true needs gpuwarden's simulated GPU" in proc.stderr
    assert torch_calls(tmp_path) == []


def test_torch_without_cuda_is_no_gpu(tmp_path: Path, fake_torch: Path) -> None:
    proc = torch_job(tmp_path, fake_torch, {}, gpu=False).run()
    assert proc.returncode == 2
    assert "no GPU: run under gpuwarden --mock-gpu" in proc.stderr
