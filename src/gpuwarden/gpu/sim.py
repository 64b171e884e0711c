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

Readings list processes by their *host* pid, as NVML does: the pid in the PID
namespace of the process that created the device (the broker, "the host").
A job in a sandbox (bubblewrap, podman) has a PID namespace of its own, and
records the pid it sees there together with the identity of that namespace
(the inode of ``/proc/self/ns/pid``); a sweep run in the host's namespace
finds the host pid (the process in that namespace whose ``NSpid`` chain ends
in that pid, with the same create time) and keeps it in the state. Until it
is found (or when the owner is gone before anything saw it), the memory
counts as used but is listed under no process, as NVML lists no exited one.

One file because it is one device: the state file's format and lock, the
memory rules, the attribution of memory to processes across PID namespaces and
the fault seams all read and write the same state under the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import reprlib
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
#: the most of ``/proc/<pid>/status`` read for its ``NSpid`` line
_STATUS_READ_BYTES = 16384


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
    #: the owner's pid as the owner saw it (in its own PID namespace)
    pid: int
    #: ``psutil.Process(pid).create_time()`` at allocation; None if it could not be read
    create_time: float | None
    label: str = ""
    leak: bool = False
    #: when a sweep found the owner gone: the memory returns at this time (never if ``leak``)
    release_at: float | None = None
    #: the inode of the owner's PID namespace; None if it could not be read (taken
    #: as the host's)
    pidns: int | None = None
    #: the owner's pid in the host's PID namespace, what readings list: ``pid``
    #: when the owner runs in the host's namespace; for a sandboxed owner, None
    #: until a sweep in the host's namespace found it
    host_pid: int | None = None

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


def own_pidns() -> int | None:
    """The inode of this process's PID namespace (``/proc/self/ns/pid``), which
    names it on the whole host; None where it cannot be read. Read each time
    (one ``stat``): a child forked after ``unshare(CLONE_NEWPID)`` is in
    another namespace than its parent was."""
    try:
        return Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        return None


def _pidns_of(pid: int) -> int | None:
    """The PID namespace of process ``pid`` (as this process sees pids); None when
    there is no such process. Raises ``PermissionError`` where it may not be read."""
    try:
        return Path(f"/proc/{pid}/ns/pid").stat().st_ino
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None


def _innermost_pid(pid: int) -> int | None:
    """The pid process ``pid`` has in its own PID namespace: the last field of the
    ``NSpid:`` line of ``/proc/<pid>/status`` (the kernel writes that file; no job
    can put anything there). None when it cannot be read."""
    try:
        with Path(f"/proc/{pid}/status").open("rb") as f:
            text = f.read(_STATUS_READ_BYTES)
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"NSpid:"):
            fields = line.split()[1:]
            return int(fields[-1]) if fields and fields[-1].isdigit() else None
    return None


def find_host_pids(wanted: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Processes named by (PID namespace inode, pid inside that namespace): the pid
    each has in this process's namespace, for those found.

    One pass over ``/proc``: the namespace of each process is compared first
    (one ``stat``), and only the processes in a wanted namespace have their
    ``NSpid`` chain read. Processes whose namespace may not be read (another
    user's, for a reader that is not root) are passed over.
    """
    found: dict[tuple[int, int], int] = {}
    namespaces = {ns for ns, _ in wanted}
    try:
        names = [entry.name for entry in os.scandir("/proc")]
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            ns = _pidns_of(pid)
        except OSError:
            continue
        if ns is None or ns not in namespaces:
            continue
        inner = _innermost_pid(pid)
        if inner is not None and (ns, inner) in wanted:
            found[(ns, inner)] = pid
            if len(found) == len(wanted):
                break
    return found


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


def _owner_alive(host_pid: int, create_time: float | None, pidns: int | None) -> bool:
    """The owner is still the process at ``host_pid``: running, the same create
    time, and (for an owner in a namespace other than the host's) still in
    namespace ``pidns``, so a pid written into the state by anyone else is not
    taken for it."""
    if not _process_is_original(host_pid, create_time):
        return False
    if pidns is None:
        return True
    try:
        return _pidns_of(host_pid) == pidns
    except OSError:  # may not be read: as psutil's AccessDenied, taken as alive
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


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_time(value: Any) -> bool:
    """None, or a finite number (a create time, a release time)."""
    if value is None:
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: what each key of an allocation must hold
_ALLOCATION_KEYS: dict[str, Callable[[Any], bool]] = {
    "id": _is_int,
    "gpu": lambda v: isinstance(v, str),
    "nbytes": _is_int,
    "pid": _is_int,
    "create_time": _is_time,
    "label": lambda v: isinstance(v, str),
    "leak": lambda v: isinstance(v, bool),
    "release_at": _is_time,
    "pidns": lambda v: v is None or _is_int(v, 1),
    "host_pid": lambda v: v is None or _is_int(v),
}
#: what each key of a device must hold (``xid_base`` may be missing)
_DEVICE_KEYS: dict[str, Callable[[Any], bool]] = {
    "uuid": lambda v: isinstance(v, str),
    "index": _is_int,
    "name": lambda v: isinstance(v, str),
    "total_bytes": _is_int,
    "hang": lambda v: isinstance(v, bool),
    "xids": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "xid_base": _is_int,
}


def _check_state(state: dict[str, Any]) -> str | None:
    """What is wrong with the shape of a state read from the file, or None. Every
    job can write the file (a sandboxed one too), so nothing in it is taken on
    trust: a pid that is not a number never reaches a ``/proc`` path. An
    allocation written before PID namespaces were recorded gets ``pidns`` (the
    host's) and ``host_pid`` (its pid) here."""
    if not isinstance(state.get("devices"), list) or not isinstance(state.get("allocations"), list):
        return "devices and allocations must be lists"
    host = state.setdefault("host_pidns", None)
    if not (host is None or _is_int(host, 1)):
        return f"host_pidns is {reprlib.repr(host)}"
    if not _is_int(state.get("next_id"), 1):
        return f"next_id is {reprlib.repr(state.get('next_id'))}"
    delay = state.get("release_delay_s")
    if delay is None or not _is_time(delay) or delay < 0:
        return f"release_delay_s is {reprlib.repr(delay)}"
    for i, dev in enumerate(state["devices"]):
        if not isinstance(dev, dict):
            return f"device {i} is not an object"
        for key, value in dev.items():
            check = _DEVICE_KEYS.get(key)
            if check is None or not check(value):
                return f"device {i}: {reprlib.repr(key)} is {reprlib.repr(value)}"
        if missing := sorted(set(_DEVICE_KEYS) - {"xid_base"} - set(dev)):
            return f"device {i} has no {', '.join(missing)}"
    for i, a in enumerate(state["allocations"]):
        if not isinstance(a, dict):
            return f"allocation {i} is not an object"
        if "pidns" not in a:  # written before namespaces were recorded: the host's
            a["pidns"] = host
            a.setdefault("host_pid", a.get("pid"))
        a.setdefault("host_pid", None)
        for key, value in a.items():
            check = _ALLOCATION_KEYS.get(key)
            if check is None or not check(value):
                return f"allocation {i}: {reprlib.repr(key)} is {reprlib.repr(value)}"
        if missing := sorted(set(_ALLOCATION_KEYS) - set(a)):
            return f"allocation {i} has no {', '.join(missing)}"
    return None


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
            host = own_pidns()
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
                _rehost(state, host)
            state["host_pidns"] = host
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
        if (wrong := _check_state(state)) is not None:
            raise GpuProbeError(
                f"simulated GPU state {self.path} is malformed ({wrong}); a job may have "
                "written it: restart the broker with --mock-gpu to reset the simulated GPU"
            )
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
        pidns = own_pidns()
        with self._transaction() as state:
            dev = self._device(state, gpu_uuid)
            live = [a for a in state["allocations"] if a["gpu"] == gpu_uuid]
            used = sum(a["nbytes"] for a in live)
            free = dev["total_bytes"] - used
            if nbytes > free:
                raise SimOutOfMemoryError(_oom_message(dev, nbytes, max(0, free), live))
            alloc_id = int(state["next_id"])
            state["next_id"] = alloc_id + 1
            # a process in the host's namespace (or one that cannot tell which it
            # is in) is listed under its own pid; a sandboxed one once found
            host = state["host_pidns"]
            host_pid = pid if pidns is None or pidns == host else None
            alloc = SimAllocation(
                alloc_id, gpu_uuid, nbytes, pid, create_time, label, leak, None, pidns, host_pid
            )
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
        """Release every allocation of process ``pid`` (leaks included); return how many.

        ``pid`` is as the caller sees it: a job in a sandbox frees its own by
        the pid it has there (the client's ``free_all``); in the host's
        namespace (an operator, the broker) by the host pid readings list.
        """
        mine = own_pidns()

        def owned(a: dict[str, Any], host: int | None) -> bool:
            if a["pid"] == pid and a["pidns"] in (mine, None):
                return True
            return mine == host and a["host_pid"] == pid

        with self._transaction() as state:
            keep = [a for a in state["allocations"] if not owned(a, state["host_pidns"])]
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
        until freed explicitly. Foreign memory is never swept. Run in the host's
        PID namespace, it first finds the host pids of sandboxed owners (see
        the module docstring); a sandboxed owner that no process of the host
        is any more counts as gone.
        """
        with self._lock():
            state = self._load()
            if self._sweep(state, now):
                self._save(state)

    @staticmethod
    def _sweep(state: dict[str, Any], now: float) -> bool:
        """Find the host pids of sandboxed owners, notice owners gone, release
        what is due. A sweep in the host's namespace judges every owner; one
        run elsewhere (inside a sandbox) only the owners in its own namespace,
        since it cannot see the others."""
        delay = float(state["release_delay_s"])
        host = state["host_pidns"]
        here = own_pidns()
        at_host = here == host
        pending = [
            a for a in state["allocations"] if a["pid"] != FOREIGN_PID and a["release_at"] is None
        ]
        changed = at_host and _find_hosts(pending, host)
        keep: list[dict[str, Any]] = []
        for a in state["allocations"]:
            if a["pid"] != FOREIGN_PID and a["release_at"] is None:
                if at_host:
                    theirs = None if a["pidns"] in (None, host) else a["pidns"]
                    alive = a["host_pid"] is not None and _owner_alive(
                        a["host_pid"], a["create_time"], theirs
                    )
                elif a["pidns"] == here:
                    alive = _process_is_original(a["pid"], a["create_time"])
                else:
                    alive = True  # not this sweep's to judge
                if not alive:
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
            on_gpu = [a for a in state["allocations"] if a["gpu"] == dev["uuid"]]
            by_pid = _by_host_pid(on_gpu)
            extra = {"xid": str(dev["xids"][-1])} if dev["xids"] else {}
            out.append(
                GpuReading(
                    uuid=dev["uuid"],
                    name=dev["name"],
                    total_bytes=dev["total_bytes"],
                    used_bytes=sum(a["nbytes"] for a in on_gpu),
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
            alloc = SimAllocation(
                alloc_id, gpu_uuid, nbytes, FOREIGN_PID, None, label, host_pid=FOREIGN_PID
            )
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


def _rehost(state: dict[str, Any], host: int | None) -> None:
    """The device is opened by a broker in PID namespace ``host``: host pids found
    from another namespace mean nothing there, and are looked for again."""
    for a in state["allocations"]:
        if a["pid"] == FOREIGN_PID:
            continue
        if a["pidns"] is None:  # written before namespaces were recorded, or by a
            # process that could not tell its own: taken as the host's, as it said
            a["pidns"], a["host_pid"] = host, a["pid"]
        elif state["host_pidns"] != host:
            a["host_pid"] = a["pid"] if a["pidns"] == host else None


def _find_hosts(pending: list[dict[str, Any]], host: int | None) -> bool:
    """Give sandboxed owners not found yet their host pids (one pass over
    ``/proc`` for all of them); True if any was found. An owner is taken only
    when the process found has its create time: an owner that is gone and whose
    pid its namespace gave to another process is not. One not found stays
    without, and the sweep takes it for gone."""
    wanted = {
        (a["pidns"], a["pid"])
        for a in pending
        if a["host_pid"] is None and a["pidns"] is not None and a["pidns"] != host
    }
    if not wanted:
        return False
    found = find_host_pids(wanted)
    changed = False
    for a in pending:
        hit = found.get((a["pidns"], a["pid"])) if a["host_pid"] is None else None
        if hit is not None and _process_is_original(hit, a["create_time"]):
            a["host_pid"] = hit
            changed = True
    return changed


def _by_host_pid(allocations: list[dict[str, Any]]) -> dict[int, int]:
    """Bytes per host pid; memory of owners without one is listed under none."""
    by_pid: dict[int, int] = {}
    for a in allocations:
        if a["host_pid"] is not None:
            by_pid[a["host_pid"]] = by_pid.get(a["host_pid"], 0) + a["nbytes"]
    return by_pid


def _oom_message(dev: dict[str, Any], nbytes: int, free: int, live: list[dict[str, Any]]) -> str:
    by_pid = _by_host_pid(live)
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
