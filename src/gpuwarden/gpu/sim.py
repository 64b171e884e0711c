"""The simulated GPU: a device model shared by the broker and by job processes.

Not a test mock: it is how gpuwarden runs (``--mock-gpu``) on a machine without
a GPU. Its state is one small JSON file (``<state_dir>/simgpu.json``), read and
written under an ``fcntl`` lock on ``<path>.lock`` and replaced atomically, so
the broker (through :class:`SimProbe`) and any number of job processes
(through :mod:`gpuwarden.gpu.simclient`) see one device.

Memory is attributed to a process (its pid and create time, so a reused pid is
never mistaken for the original). Allocating past capacity fails the way CUDA
does. When the owner is gone, its memory is released ``release_delay_s`` after
a sweep first notices, as a real driver tears a context down. Faults are
injected through small seams: foreign memory, hangs, Xid codes, leaks and slow
release.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from gpuwarden import safefs
from gpuwarden.core.model import GIB
from gpuwarden.errors import GpuProbeError, SimOutOfMemoryError
from gpuwarden.gpu.base import GpuReading, ProcessUsage

#: the pid that memory held by processes gpuwarden did not start is attributed to
FOREIGN_PID = 0

_STATE_VERSION = 1
#: create times read by two processes may differ by float rounding, never by more
_CREATE_TIME_TOLERANCE_S = 0.005


#: the state and lock files are readable and writable by everyone, like the
#: /dev/nvidia* nodes a real GPU has: a sandboxed job (another uid) uses them
DEVICE_MODE = 0o666
#: a folder of the device's own (the broker's ``simgpu/``) is writable by every
#: uid too: a job replaces the state file in it. Sandboxed jobs can write there,
#: so the broker opens nothing in it through a link
SHARED_DIR_MODE = 0o777
#: the largest state file read
_MAX_STATE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class SimGpuConfig:
    """The simulated node: how many GPUs, their size and name, how fast memory returns."""

    count: int = 1
    vram_bytes: int = 24 * GIB
    name: str = "gpuwarden simulated GPU"
    #: memory of a process that exited is released this long after its exit was noticed
    release_delay_s: float = 0.2
    uuid_prefix: str = "GPU-sim"


@dataclass(frozen=True, slots=True)
class SimAllocation:
    """One block of simulated device memory and the process it belongs to."""

    id: int
    gpu: str
    nbytes: int
    pid: int
    #: ``psutil.Process(pid).create_time()`` at allocation; None if it could not be read
    create_time: float | None
    label: str = ""
    leak: bool = False
    #: when a sweep found the owner gone: the memory returns at this time (never if ``leak``)
    release_at: float | None = None

    @property
    def foreign(self) -> bool:
        return self.pid == FOREIGN_PID


def sim_uuid(path: Path, index: int, prefix: str = "GPU-sim") -> str:
    """A stable UUID for GPU ``index`` of the simulated device at ``path``."""
    digest = hashlib.sha256(f"{path.resolve()}:{index}".encode()).hexdigest()[:8]
    return f"{prefix}-{index:04d}-{digest}"


def torch_size(nbytes: int) -> str:
    """Bytes as PyTorch's OOM message prints them: ``8.00 GiB``, ``512.00 MiB``."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    if nbytes >= 1024**2:
        return f"{nbytes / 1024**2:.2f} MiB"
    if nbytes >= 1024:
        return f"{nbytes / 1024:.2f} KiB"
    return f"{nbytes} bytes"


def _process_create_time(pid: int) -> float | None:
    """The process's create time, or None when it does not exist or cannot be read."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _process_is_original(pid: int, create_time: float | None) -> bool:
    """True while the process that allocated is still running (not exited, not a
    zombie, and not a different process that was given the same pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if create_time is None:
            return True
        return abs(proc.create_time() - create_time) <= _CREATE_TIME_TOLERANCE_S
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def _devices_for(path: Path, config: SimGpuConfig) -> list[dict[str, Any]]:
    return [
        {
            "uuid": sim_uuid(path, i, config.uuid_prefix),
            "index": i,
            "name": config.name,
            "total_bytes": config.vram_bytes,
            "hang": False,
            "xids": [],
        }
        for i in range(config.count)
    ]


def _config_key(config: SimGpuConfig) -> dict[str, Any]:
    """The parts of the config that shape the devices (release delay is not one)."""
    return {
        "count": config.count,
        "vram_bytes": config.vram_bytes,
        "name": config.name,
        "uuid_prefix": config.uuid_prefix,
    }


class SimDevice:
    """The shared state of the simulated GPUs, backed by a JSON file.

    Every method is one transaction: take the lock, read the file, change it,
    replace it. Instances hold no state but the path, so any number of them, in
    any number of processes, see the same devices.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")

    # -- opening ---------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, config: SimGpuConfig, *, shared_folder: bool = False) -> SimDevice:
        """Create the state at ``path``, or re-open it keeping its allocations.

        If the existing devices do not match ``config`` (count, size, name,
        UUID prefix), or the file cannot be read, the devices are reset and
        every allocation is dropped. ``shared_folder``: ``path``'s folder holds
        nothing but the device, and is made writable for every uid
        (:data:`SHARED_DIR_MODE`), since sandboxed jobs run as a uid of their own.
        """
        if config.count < 0 or config.vram_bytes < 0 or config.release_delay_s < 0:
            raise GpuProbeError(f"invalid simulated GPU configuration: {config}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if shared_folder:
            path.parent.chmod(SHARED_DIR_MODE)
        device = cls(path)
        with device._lock():
            state: dict[str, Any] | None
            try:
                state = device._load()
            except GpuProbeError:
                state = None
            if state is None or state.get("config") != _config_key(config):
                state = {
                    "version": _STATE_VERSION,
                    "config": _config_key(config),
                    "release_delay_s": config.release_delay_s,
                    "next_id": 1,
                    "devices": _devices_for(path, config),
                    "allocations": [],
                }
            else:
                state["release_delay_s"] = config.release_delay_s
            device._save(state)
        return device

    @classmethod
    def open(cls, path: Path) -> SimDevice:
        """Open existing state; raise ``GpuProbeError`` if there is none."""
        if not path.is_file():
            raise GpuProbeError(
                f"no simulated GPU at {path}: the broker creates it when it starts with --mock-gpu"
            )
        device = cls(path)
        with device._transaction(write=False):
            pass  # fail now, clearly, if the file is not readable
        return device

    # -- storage -----------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.lock_path, flags, DEVICE_MODE)  # a link there: ELOOP
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise GpuProbeError(f"the simulated GPU's lock {self.lock_path} is not a file")
            # only its owner may, once is enough; and never a file linked elsewhere
            if st.st_uid == os.geteuid() and st.st_nlink == 1 and st.st_mode & 0o777 != DEVICE_MODE:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, DEVICE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def _load(self) -> dict[str, Any]:
        try:
            text = safefs.read_text(self.path, _MAX_STATE_BYTES)
        except FileNotFoundError:
            raise GpuProbeError(f"no simulated GPU at {self.path}") from None
        except safefs.UnsafePathError as exc:
            raise GpuProbeError(f"simulated GPU state: {exc}") from None
        try:
            state = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GpuProbeError(
                f"simulated GPU state {self.path} is not valid JSON: {exc}"
            ) from exc
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise GpuProbeError(f"simulated GPU state {self.path} has an unknown format")
        return state

    def _save(self, state: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            os.fchmod(fd, DEVICE_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            Path(tmp).replace(self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
            raise

    @contextlib.contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[dict[str, Any]]:
        with self._lock():
            state = self._load()
            yield state
            if write:
                self._save(state)

    @staticmethod
    def _device(state: dict[str, Any], gpu_uuid: str) -> dict[str, Any]:
        for dev in state["devices"]:
            if dev["uuid"] == gpu_uuid:
                return dict(dev)
        known = ", ".join(d["uuid"] for d in state["devices"]) or "none"
        raise GpuProbeError(f"no simulated GPU with UUID {gpu_uuid!r} (known: {known})")

    @staticmethod
    def _set_device(state: dict[str, Any], gpu_uuid: str, **changes: Any) -> None:
        SimDevice._device(state, gpu_uuid)  # raises if unknown
        for dev in state["devices"]:
            if dev["uuid"] == gpu_uuid:
                dev.update(changes)

    # -- memory -------------------------------------------------------------------

    def allocate(
        self, gpu_uuid: str, nbytes: int, pid: int, label: str = "", leak: bool = False
    ) -> int:
        """Give ``nbytes`` of GPU ``gpu_uuid`` to process ``pid``; return the allocation id.

        Capacity is the total minus every allocation still present, including
        memory of exited processes that has not been released yet. Raises
        ``SimOutOfMemoryError`` (with PyTorch's wording) when it does not fit.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size: {nbytes}")
        create_time = None if pid == FOREIGN_PID else _process_create_time(pid)
        with self._transaction() as state:
            dev = self._device(state, gpu_uuid)
            live = [a for a in state["allocations"] if a["gpu"] == gpu_uuid]
            used = sum(a["nbytes"] for a in live)
            free = dev["total_bytes"] - used
            if nbytes > free:
                raise SimOutOfMemoryError(_oom_message(dev, nbytes, max(0, free), live))
            alloc_id = int(state["next_id"])
            state["next_id"] = alloc_id + 1
            alloc = SimAllocation(alloc_id, gpu_uuid, nbytes, pid, create_time, label, leak)
            state["allocations"].append(asdict(alloc))
        return alloc_id

    def free(self, alloc_id: int) -> None:
        """Release one allocation. Raises ``GpuProbeError`` if there is no such allocation."""
        with self._transaction() as state:
            before = len(state["allocations"])
            state["allocations"] = [a for a in state["allocations"] if a["id"] != alloc_id]
            if len(state["allocations"]) == before:
                raise GpuProbeError(f"no allocation {alloc_id} on the simulated GPU")

    def free_pid(self, pid: int) -> int:
        """Release every allocation of process ``pid`` (leaks included); return how many."""
        with self._transaction() as state:
            keep = [a for a in state["allocations"] if a["pid"] != pid]
            freed = len(state["allocations"]) - len(keep)
            state["allocations"] = keep
        return freed

    def allocations(self) -> list[SimAllocation]:
        """Every allocation present now, in allocation order."""
        with self._transaction(write=False) as state:
            return [SimAllocation(**a) for a in state["allocations"]]

    def uuids(self) -> list[str]:
        """The simulated GPUs' UUIDs in index order."""
        with self._transaction(write=False) as state:
            return [d["uuid"] for d in state["devices"]]

    # -- time -----------------------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Notice exited owners and return memory whose release time has come.

        An allocation whose process is gone (exited, a zombie, or its pid now
        names another process) is given ``release_at = now + release_delay_s``;
        allocations past ``release_at`` are removed, except leaks, which stay
        until freed explicitly. Foreign memory is never swept.
        """
        with self._lock():
            state = self._load()
            if self._sweep(state, now):
                self._save(state)

    @staticmethod
    def _sweep(state: dict[str, Any], now: float) -> bool:
        delay = float(state["release_delay_s"])
        changed = False
        keep: list[dict[str, Any]] = []
        for a in state["allocations"]:
            gone = (
                a["pid"] != FOREIGN_PID
                and a["release_at"] is None
                and not _process_is_original(a["pid"], a["create_time"])
            )
            if gone:
                a["release_at"] = now + delay
                changed = True
            if a["release_at"] is not None and a["release_at"] <= now and not a["leak"]:
                changed = True
                continue
            keep.append(a)
        state["allocations"] = keep
        return changed

    def readings(self, now: float) -> list[GpuReading]:
        """Sweep, then read every GPU: used memory and per-process usage.

        Raises ``GpuProbeError`` if a GPU was set to hang.
        """
        with self._lock():
            state = self._load()
            if self._sweep(state, now):
                self._save(state)
        for dev in state["devices"]:
            if dev["hang"]:
                raise GpuProbeError(
                    f"GPU {dev['uuid']} (index {dev['index']}) stopped answering (simulated hang)"
                )
        out: list[GpuReading] = []
        for dev in state["devices"]:
            by_pid: dict[int, int] = {}
            for a in state["allocations"]:
                if a["gpu"] == dev["uuid"]:
                    by_pid[a["pid"]] = by_pid.get(a["pid"], 0) + a["nbytes"]
            extra = {"xid": str(dev["xids"][-1])} if dev["xids"] else {}
            out.append(
                GpuReading(
                    uuid=dev["uuid"],
                    name=dev["name"],
                    total_bytes=dev["total_bytes"],
                    used_bytes=sum(by_pid.values()),
                    processes=tuple(ProcessUsage(p, n) for p, n in sorted(by_pid.items())),
                    index=dev["index"],
                    driver="sim",
                    extra=extra,
                    xids=tuple(
                        enumerate(
                            (int(x) for x in dev["xids"]), start=int(dev.get("xid_base", 0)) + 1
                        )
                    ),
                )
            )
        return out

    # -- fault injection ------------------------------------------------------------

    def add_foreign(self, gpu_uuid: str, nbytes: int, label: str = "foreign") -> int:
        """Memory held by a process gpuwarden did not start (pid 0): it stays until
        ``clear_foreign``. Ignores capacity, like another tenant would."""
        with self._transaction() as state:
            self._device(state, gpu_uuid)
            alloc_id = int(state["next_id"])
            state["next_id"] = alloc_id + 1
            alloc = SimAllocation(alloc_id, gpu_uuid, nbytes, FOREIGN_PID, None, label)
            state["allocations"].append(asdict(alloc))
        return alloc_id

    def clear_foreign(self, gpu_uuid: str | None = None) -> int:
        """Remove foreign memory (on one GPU, or all); return how many blocks went."""
        with self._transaction() as state:
            keep = [
                a
                for a in state["allocations"]
                if not (a["pid"] == FOREIGN_PID and gpu_uuid in (None, a["gpu"]))
            ]
            removed = len(state["allocations"]) - len(keep)
            state["allocations"] = keep
        return removed

    def set_hang(self, gpu_uuid: str, hang: bool) -> None:
        """While set, reading the GPUs raises ``GpuProbeError`` (the GPU stopped answering)."""
        with self._transaction() as state:
            self._set_device(state, gpu_uuid, hang=hang)

    def inject_xid(self, gpu_uuid: str, code: int) -> None:
        """Record a hardware fault; readings carry the latest as ``extra["xid"]``."""
        with self._transaction() as state:
            xids = [*self._device(state, gpu_uuid)["xids"], int(code)]
            self._set_device(state, gpu_uuid, xids=xids)

    def clear_xids(self, gpu_uuid: str) -> None:
        """Forget the GPU's recorded faults (an operator reset it). Event numbers
        keep counting up, so a reader never mistakes a new Xid for an old one."""
        with self._transaction() as state:
            dev = self._device(state, gpu_uuid)
            base = int(dev.get("xid_base", 0)) + len(dev["xids"])
            self._set_device(state, gpu_uuid, xids=[], xid_base=base)

    def xids(self, gpu_uuid: str) -> list[int]:
        """Every Xid code injected on the GPU, oldest first."""
        with self._transaction(write=False) as state:
            return [int(x) for x in self._device(state, gpu_uuid)["xids"]]

    def set_release_delay(self, seconds: float) -> None:
        """Slow (or speed up) memory release for owners not yet noticed gone."""
        if seconds < 0:
            raise ValueError(f"release delay cannot be negative: {seconds}")
        with self._transaction() as state:
            state["release_delay_s"] = float(seconds)


def _oom_message(dev: dict[str, Any], nbytes: int, free: int, live: list[dict[str, Any]]) -> str:
    by_pid: dict[int, int] = {}
    for a in live:
        by_pid[a["pid"]] = by_pid.get(a["pid"], 0) + a["nbytes"]
    holders = " ".join(
        f"Process {pid} has {torch_size(n)} memory in use."
        for pid, n in sorted(by_pid.items(), key=lambda kv: -kv[1])
    )
    parts = [
        f"CUDA out of memory. Tried to allocate {torch_size(nbytes)}.",
        f"GPU {dev['index']} has a total capacity of {torch_size(dev['total_bytes'])}"
        f" of which {torch_size(free)} is free.",
    ]
    if holders:
        parts.append(holders)
    parts.append(f"(gpuwarden simulated GPU {dev['uuid']})")
    return " ".join(parts)


class SimProbe:
    """The ``GpuProbe`` for the simulated GPU: creates (or re-opens) the device
    state at ``path`` and reads it, sweeping exited owners, at ``clock()``."""

    kind = "sim"

    def __init__(
        self,
        path: Path,
        config: SimGpuConfig,
        clock: Callable[[], float] = time.time,
        *,
        shared_folder: bool = False,
    ) -> None:
        self.path = path.absolute()
        self.config = config
        self.clock = clock
        #: the shared state, also the seam for fault injection
        self.device = SimDevice.create(self.path, config, shared_folder=shared_folder)

    def read(self) -> list[GpuReading]:
        return self.device.readings(self.clock())

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": gpu_uuid or "", "GPUWARDEN_SIM_GPU": str(self.path)}

    def close(self) -> None:
        return None
