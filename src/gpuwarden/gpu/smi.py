"""The ``GpuProbe`` fallback that runs ``nvidia-smi`` when NVML cannot be loaded.

The parsers are pure functions of nvidia-smi's CSV output so they can be tested
on captured text.
"""

from __future__ import annotations

import shutil
import subprocess

from gpuwarden.core.model import MIB
from gpuwarden.errors import GpuProbeError
from gpuwarden.gpu.base import GpuReading, ProcessUsage

GPU_QUERY = (
    "--query-gpu=index,uuid,name,memory.total,memory.used,driver_version",
    "--format=csv,noheader,nounits",
)
APPS_QUERY = (
    "--query-compute-apps=gpu_uuid,pid,used_memory",
    "--format=csv,noheader,nounits",
)

#: values nvidia-smi prints for a field it cannot report
_UNAVAILABLE = frozenset(
    {"[n/a]", "n/a", "[not supported]", "[unknown error]", "[insufficient permissions]", ""}
)


def _unavailable(value: str) -> bool:
    return value.strip().lower() in _UNAVAILABLE


def _malformed(line: str, expected: str) -> GpuProbeError:
    return GpuProbeError(f"nvidia-smi printed a line gpuwarden cannot read: {line!r} ({expected})")


def _mib(value: str, line: str, expected: str) -> int:
    """``"24564"`` (or ``"24564 MiB"``) MiB as bytes."""
    text = value.strip()
    if text.lower().endswith("mib"):
        text = text[:-3].strip()
    try:
        mib = float(text)
    except ValueError:
        raise _malformed(line, expected) from None
    if mib < 0:
        raise _malformed(line, expected)
    return round(mib * MIB)


def _int(value: str, line: str, expected: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise _malformed(line, expected) from None


def parse_gpu_csv(text: str) -> list[GpuReading]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,driver_version
    --format=csv,noheader,nounits``.

    Memory fields nvidia-smi cannot report (``[N/A]``, ``[Not Supported]``)
    read as 0 and are named in ``extra["unavailable"]``: a GPU of unknown size
    has no free memory. Raises ``GpuProbeError`` on a line that does not parse.
    """
    expected = "expected: index, uuid, name, memory.total, memory.used, driver_version"
    readings: list[GpuReading] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        head = line.split(",", 2)
        tail = head[-1].rsplit(",", 3) if len(head) == 3 else []
        if len(tail) != 4:
            raise _malformed(line, expected)
        index_s, uuid = head[0].strip(), head[1].strip()
        name, total_s, used_s, driver = (f.strip() for f in tail)
        if _unavailable(uuid):
            raise _malformed(line, expected + "; the GPU has no UUID")
        unavailable: list[str] = []
        sizes: list[int] = []
        for field, value in (("memory.total", total_s), ("memory.used", used_s)):
            if _unavailable(value):
                unavailable.append(field)
                sizes.append(0)
            else:
                sizes.append(_mib(value, line, expected))
        readings.append(
            GpuReading(
                uuid=uuid,
                name="" if _unavailable(name) else name,
                total_bytes=sizes[0],
                used_bytes=sizes[1],
                index=_int(index_s, line, expected),
                driver="" if _unavailable(driver) else driver,
                extra={"unavailable": ",".join(unavailable)} if unavailable else {},
            )
        )
    return readings


def parse_apps_csv(text: str) -> dict[str, list[ProcessUsage]]:
    """Parse ``nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory
    --format=csv,noheader,nounits`` into per-GPU process usage, summed by pid
    and sorted by pid.

    ``used_memory`` that nvidia-smi cannot report reads as 0. Raises
    ``GpuProbeError`` on a line that does not parse.
    """
    expected = "expected: gpu_uuid, pid, used_memory"
    sums: dict[str, dict[int, int]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.lower().startswith("no running"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or _unavailable(fields[0]):
            raise _malformed(line, expected)
        uuid, pid_s, used_s = fields
        pid = _int(pid_s, line, expected)
        used = 0 if _unavailable(used_s) else _mib(used_s, line, expected)
        per_gpu = sums.setdefault(uuid, {})
        per_gpu[pid] = per_gpu.get(pid, 0) + used
    return {
        uuid: [ProcessUsage(pid, n) for pid, n in sorted(per_pid.items())]
        for uuid, per_pid in sums.items()
    }


class SmiProbe:
    """Reads the host's NVIDIA GPUs by running ``nvidia-smi`` twice per read.

    Raises ``GpuProbeError`` at construction when the binary is not on PATH,
    and on read when it fails, times out or prints what cannot be parsed.
    """

    kind = "nvidia-smi"

    def __init__(self, binary: str = "nvidia-smi", timeout_s: float = 10.0) -> None:
        found = shutil.which(binary)
        if found is None:
            raise GpuProbeError(
                f"{binary} was not found on PATH: no NVIDIA driver tools on this host. "
                "Install the NVIDIA driver, or start gpuwarden with --mock-gpu to use its "
                "simulated GPU."
            )
        self.binary = found
        self.timeout_s = timeout_s

    def _run(self, args: tuple[str, ...]) -> str:
        cmd = [self.binary, *args]
        shown = " ".join(["nvidia-smi", *args])
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise GpuProbeError(
                f"`{shown}` did not answer within {self.timeout_s:g} s: the GPU or driver "
                "may be hung"
            ) from None
        except OSError as exc:
            raise GpuProbeError(f"could not run `{shown}`: {exc}") from exc
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
            raise GpuProbeError(
                f"`{shown}` failed with exit status {done.returncode}: {said[-1].strip()}"
            )
        return done.stdout

    def read(self) -> list[GpuReading]:
        gpus = parse_gpu_csv(self._run(GPU_QUERY))
        apps = parse_apps_csv(self._run(APPS_QUERY))
        return [
            GpuReading(
                uuid=g.uuid,
                name=g.name,
                total_bytes=g.total_bytes,
                used_bytes=g.used_bytes,
                processes=tuple(apps.get(g.uuid, ())),
                index=g.index,
                driver=g.driver,
                extra=g.extra,
            )
            for g in gpus
        ]

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": gpu_uuid or ""}

    def close(self) -> None:
        return None
