"""burn.*: hold GPU memory for a while, like a model service does.

Allocates ``gib`` GiB (in steps over ``ramp_s`` seconds, like a model load),
holds it for ``seconds``, frees it and exits 0. On gpuwarden's simulated GPU
(``GPUWARDEN_SIM_GPU`` set) through :mod:`gpuwarden.gpu.simclient`; otherwise
on a real GPU through PyTorch, if it is installed and sees one. Running out of
memory ends the job the way a PyTorch job dies: the CUDA message on stderr and
exit 1. Follows docs/MODULE_GUIDE.md and SPEC.md section 7.

Exit codes: 0 done, 1 out of memory, 2 no GPU or bad parameters.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

GIB = 1024**3
#: a ramp allocates in steps of about this many seconds (at most MAX_STEPS of them)
STEP_S = 0.1
MAX_STEPS = 16
NO_GPU = "no GPU: run under gpuwarden --mock-gpu (or on a host with a GPU and PyTorch)"


def usage_error(message: str) -> NoReturn:
    """Say what is wrong on stderr and exit 2 (no GPU, bad parameters)."""
    print(f"burn: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class OutOfMemory(Exception):
    """The device refused an allocation; ``args[0]`` is the CUDA message."""


class Backend:
    """Allocates and frees device memory for this process."""

    name = ""
    gpu = ""

    def allocate(self, nbytes: int, leak: bool, label: str) -> None:
        raise NotImplementedError

    def free_all(self) -> None:
        raise NotImplementedError


class SimBackend(Backend):
    name = "sim"

    def __init__(self) -> None:
        from gpuwarden.gpu import simclient

        self.client = simclient.attach()
        self.gpu = self.client.gpu_uuid

    def allocate(self, nbytes: int, leak: bool, label: str) -> None:
        from gpuwarden.errors import SimOutOfMemoryError

        try:
            self.client.allocate(nbytes, leak=leak, label=label)
        except SimOutOfMemoryError as exc:
            raise OutOfMemory(f"{type(exc).__module__}.{type(exc).__name__}: {exc}") from None

    def free_all(self) -> None:
        self.client.free_all()


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.blocks: list[Any] = []
        self.gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "") or torch.cuda.get_device_name(0)

    def allocate(self, nbytes: int, leak: bool, label: str) -> None:
        torch = self.torch
        oom = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
        try:
            self.blocks.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        except oom as exc:
            if "out of memory" not in str(exc):
                raise
            raise OutOfMemory(f"torch.OutOfMemoryError: {exc}") from None

    def free_all(self) -> None:
        self.blocks.clear()
        self.torch.cuda.empty_cache()


def open_backend(leak: bool) -> Backend:
    """The simulated GPU if the broker uses one, else a real GPU through PyTorch."""
    if os.environ.get("GPUWARDEN_SIM_GPU"):
        try:
            from gpuwarden.errors import GpuProbeError
        except ImportError:
            usage_error(
                "GPUWARDEN_SIM_GPU is set but gpuwarden is not importable; "
                "the type's command must use {python}"
            )
        try:
            return SimBackend()
        except GpuProbeError as exc:
            usage_error(str(exc))
    try:
        import torch
    except ImportError:
        usage_error(NO_GPU)
    if not torch.cuda.is_available():
        usage_error(NO_GPU)
    if leak:
        usage_error(
            "leak=true needs gpuwarden's simulated GPU: on a real GPU the driver "
            "frees a process's memory when it exits, so a leak cannot be made"
        )
    return CudaBackend(torch)


def read_params() -> dict[str, Any]:
    params: dict[str, Any] = json.loads(Path(os.environ["GPUWARDEN_PARAMS"]).read_text())
    problems = []
    for name, low in (("gib", 0.0), ("seconds", 0.0), ("ramp_s", 0.0)):
        value = params.get(name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value < low:
            problems.append(f"{name} must be a number >= {low:g} (got {value!r})")
    if not problems and params["gib"] <= 0:
        problems.append(f"gib must be greater than 0 (got {params['gib']!r})")
    if problems:
        usage_error("; ".join(problems))
    return params


def report(record: dict[str, Any], message: str) -> None:
    """The output file (what was allocated, for how long) and the job's message."""
    out_dir = Path(os.environ.get("GPUWARDEN_OUTPUT_DIR", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "burn.json").write_text(json.dumps(record, indent=2) + "\n")
    if result := os.environ.get("GPUWARDEN_RESULT"):
        Path(result).write_text(json.dumps({"message": message}))


def main() -> int:
    params = read_params()
    leak = bool(params.get("leak", False))
    backend = open_backend(leak)
    job_type = os.environ.get("GPUWARDEN_JOB_TYPE", "burn")
    want = int(float(params["gib"]) * GIB)
    ramp_s = float(params["ramp_s"])
    steps = max(1, min(MAX_STEPS, math.ceil(ramp_s / STEP_S)))
    record: dict[str, Any] = {
        "type": job_type,
        "backend": backend.name,
        "gpu": backend.gpu,
        "pid": os.getpid(),
        "requested_bytes": want,
        "allocated_bytes": 0,
        "steps": steps,
        "ramp_s": ramp_s,
        "held_s": 0.0,
        "leaked": leak,
        "out_of_memory": False,
    }
    start = time.monotonic()
    done = 0
    for i in range(steps):
        chunk = want // steps + (1 if i < want % steps else 0)
        try:
            backend.allocate(chunk, leak, f"{job_type} {i + 1}/{steps}")
        except OutOfMemory as exc:
            record.update(allocated_bytes=done, out_of_memory=True)
            record["load_s"] = round(time.monotonic() - start, 3)
            report(
                record,
                f"out of memory after loading {done / GIB:.2f} of {want / GIB:.2f} GiB "
                f"on {backend.gpu}",
            )
            print(exc.args[0], file=sys.stderr, flush=True)
            return 1
        done += chunk
        if i < steps - 1:
            time.sleep(ramp_s / steps)
    loaded = time.monotonic()
    print(f"loaded {want / GIB:.2f} GiB on {backend.gpu} in {loaded - start:.2f} s", flush=True)
    time.sleep(float(params["seconds"]))
    held = time.monotonic() - loaded
    if not leak:
        backend.free_all()
    record.update(allocated_bytes=done, held_s=round(held, 3), load_s=round(loaded - start, 3))
    what = "left allocated (leaked)" if leak else "freed"
    message = f"held {want / GIB:.2f} GiB on {backend.gpu} for {held:.1f} s, then {what}"
    report(record, message)
    print(message, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
