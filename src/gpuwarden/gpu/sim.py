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

Every job on the device may write its state file (a sandboxed one too): it is
no isolation boundary, and nothing in it is taken on trust. So the faults that
say something about the device itself (hangs, Xid codes, the release delay) are
not kept there but in a file of their own that jobs cannot write
(:func:`faults_path_for`: beside the state's folder when that folder is shared,
owned by the broker's user, read only when no one else may have written it).
And the broker never waits on the state's lock for long: a job may hold it
(:class:`SimProbe` waits :data:`PROBE_LOCK_WAIT_S` at most, then reads on from
its last reading, and fails closed once that is :data:`PROBE_STALE_S` old).

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
import logging
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
from gpuwarden.gpu.base import GpuReading, GpuSensors, ProcessUsage

log = logging.getLogger("gpuwarden.gpu.sim")

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
#: the largest faults file read
_MAX_FAULTS_BYTES = 1 << 20
_FAULTS_VERSION = 1
#: the faults file's mode: its owner writes it, everyone may read it (a broker
#: that is not root reads one root made)
FAULTS_MODE = 0o644

#: how long the broker's probe waits for the device's lock before it reads on
#: from its last reading (a job may hold the lock: it must not stall the loop)
PROBE_LOCK_WAIT_S = 0.05
#: after a wait that timed out, the probe does not try the lock again for this long
PROBE_RETRY_S = 0.5
#: the probe fails (VRAM admission pauses) once its last reading is this old
PROBE_STALE_S = 5.0
#: how long the broker waits for the lock when it opens the device at its start;
#: then it makes a fresh lock file (a process that keeps the old one keeps nothing)
CREATE_LOCK_WAIT_S = 5.0


class SimLockBusyError(GpuProbeError):
    """The simulated GPU's lock was held by another process for longer than the
    caller would wait."""


def faults_path_for(path: Path) -> Path:
    """Where the faults of the simulated device whose state is ``path`` are kept:
    in the folder above when the state's folder is one every uid may write (the
    broker's ``simgpu/``, where jobs write the state), else beside the state. Both
    are named ``<stem>-faults.json``: ``<state_dir>/simgpu-faults.json`` for the
    broker's device."""
    folder = path.parent
    try:
        shared = bool(folder.stat().st_mode & 0o002)
    except OSError:
        shared = False
    if shared:
        return folder.parent / f"{folder.name}-faults.json"
    return path.with_name(f"{path.stem}-faults.json")


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
#: what each key of a device must hold
_DEVICE_KEYS: dict[str, Callable[[Any], bool]] = {
    "uuid": lambda v: isinstance(v, str),
    "index": _is_int,
    "name": lambda v: isinstance(v, str),
    "total_bytes": _is_int,
}
#: the fault keys a device had in the state before faults had a file of their own:
#: ignored there (a job may have written them) and dropped at the next create
_OLD_FAULT_KEYS = ("hang", "xids", "xid_base")
#: what each key of a device's faults must hold (in the faults file)
_FAULT_KEYS: dict[str, Callable[[Any], bool]] = {
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
            if key in _OLD_FAULT_KEYS:
                continue
            check = _DEVICE_KEYS.get(key)
            if check is None or not check(value):
                return f"device {i}: {reprlib.repr(key)} is {reprlib.repr(value)}"
        if missing := sorted(set(_DEVICE_KEYS) - set(dev)):
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


def _check_faults(faults: Any) -> str | None:
    """What is wrong with the shape of a faults file, or None."""
    if not isinstance(faults, dict) or faults.get("version") != _FAULTS_VERSION:
        return "it has an unknown format"
    delay = faults.get("release_delay_s")
    if delay is not None and (not _is_time(delay) or delay < 0):
        return f"release_delay_s is {reprlib.repr(delay)}"
    devices = faults.get("devices")
    if not isinstance(devices, dict):
        return "devices must be an object"
    for uuid, dev in devices.items():
        if not isinstance(dev, dict):
            return f"device {reprlib.repr(uuid)} is not an object"
        for key, value in dev.items():
            check = _FAULT_KEYS.get(key)
            if check is None or not check(value):
                return f"device {reprlib.repr(uuid)}: {reprlib.repr(key)} is {reprlib.repr(value)}"
    return None


def _no_faults(release_delay_s: float | None = None) -> dict[str, Any]:
    return {"version": _FAULTS_VERSION, "release_delay_s": release_delay_s, "devices": {}}


def _flock(fd: int, timeout: float | None, shown: Path) -> None:
    """``flock(LOCK_EX)`` on ``fd``: blocking (``timeout`` None), or tried again
    and again for at most ``timeout`` seconds (:class:`SimLockBusyError`)."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SimLockBusyError(
                    f"the simulated GPU's lock {shown} is held by another process "
                    f"(waited {timeout:g} s); a job on the simulated GPU may keep it"
                ) from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)


class SimDevice:
    """The shared state of the simulated GPUs, backed by a JSON file.

    Every method is one transaction: take the lock, read the file, change it,
    replace it. Instances hold no state but the paths, so any number of them, in
    any number of processes, see the same devices. The faults (hangs, Xid codes,
    the release delay) are kept in ``faults_path`` (by default
    :func:`faults_path_for`), a file jobs cannot write: its writer is whoever may
    write that folder (the broker, a test, an operator), and it is read only when
    its owner is this process's user or root and no one else may write it.
    """

    def __init__(self, path: Path, faults_path: Path | None = None) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self.faults_path = faults_path_for(path) if faults_path is None else faults_path
        #: why the faults file was last not taken on trust ("" when it was): said once
        self._faults_refused = ""

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
        with device._taken_back():
            state: dict[str, Any] | None
            try:
                state = device._load()
            except GpuProbeError:
                state = None
            host = own_pidns()
            reset = state is None or state.get("config") != _config_key(config)
            if state is None or reset:
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
                for dev in state["devices"]:  # faults a job may have written there
                    for key in _OLD_FAULT_KEYS:
                        dev.pop(key, None)
                _rehost(state, host)
            state["host_pidns"] = host
            device._save(state)
        device._reset_faults(config.release_delay_s, keep=not reset)
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
    def _lock(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the device's lock: waiting for it as long as it takes (``timeout``
        None: a job's calls), or at most ``timeout`` seconds (the broker's: then
        :class:`SimLockBusyError`). Every job may write the folder and the lock
        file, so what is there is checked, and an error opening it is a probe error."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.lock_path, flags, DEVICE_MODE)  # a link there: ELOOP
        except OSError as exc:
            raise GpuProbeError(
                f"the simulated GPU's lock {self.lock_path} cannot be opened: {exc.strerror or exc}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise GpuProbeError(f"the simulated GPU's lock {self.lock_path} is not a file")
            # only its owner may, once is enough; and never a file linked elsewhere
            if st.st_uid == os.geteuid() and st.st_nlink == 1 and st.st_mode & 0o777 != DEVICE_MODE:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, DEVICE_MODE)
            _flock(fd, timeout, self.lock_path)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    @contextlib.contextmanager
    def _taken_back(self) -> Iterator[None]:
        """The lock, for the broker opening the device at its start: waited for
        :data:`CREATE_LOCK_WAIT_S` at most, then a fresh lock file is put in the
        old one's place (renamed over it) and taken: whoever keeps the old one (a
        job left over, or one that means to stall the broker) keeps nothing."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self._lock(CREATE_LOCK_WAIT_S))
            except SimLockBusyError as exc:
                log.warning("%s: taking the simulated GPU back with a fresh lock file", exc)
                self._fresh_lock_file()
                held.enter_context(self._lock(CREATE_LOCK_WAIT_S))
            yield

    def _fresh_lock_file(self) -> None:
        """Put a new, empty lock file in the old one's place (renamed over it)."""
        fd, tmp = tempfile.mkstemp(prefix=self.lock_path.name + ".", dir=self.lock_path.parent)
        try:
            os.fchmod(fd, DEVICE_MODE)
            os.close(fd)
            Path(tmp).replace(self.lock_path)
        except BaseException:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
            raise

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
        try:
            fd, tmp = tempfile.mkstemp(
                prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent
            )
        except OSError as exc:
            raise GpuProbeError(
                f"the simulated GPU's state cannot be written in {self.path.parent}: "
                f"{exc.strerror or exc}"
            ) from None
        try:
            os.fchmod(fd, DEVICE_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            Path(tmp).replace(self.path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
            if isinstance(exc, OSError):
                raise GpuProbeError(
                    f"the simulated GPU's state {self.path} cannot be written: "
                    f"{exc.strerror or exc}"
                ) from None
            raise

    # -- the faults file (jobs cannot write it) ----------------------------------------

    def _read_faults(self) -> dict[str, Any]:
        """The faults as the faults file says, or none: when it is missing, and when
        it is not taken on trust (a link, not a regular file, a hard link, owned by
        another user than this one or root, writable by others, in a folder others
        may write without the sticky bit, malformed; said once in the log)."""
        try:
            folder = self.faults_path.parent.stat()
            fd = safefs.open_file(self.faults_path)
        except FileNotFoundError:
            self._faults_refused = ""
            return _no_faults()
        except (OSError, safefs.UnsafePathError) as exc:
            return self._refuse_faults(str(exc))
        try:
            st = os.fstat(fd)
            why = ""
            if st.st_uid not in (0, os.geteuid()):
                why = f"it belongs to uid {st.st_uid}"
            elif st.st_mode & 0o022:
                why = f"others may write it (mode {stat.S_IMODE(st.st_mode):04o})"
            elif st.st_nlink != 1:
                why = f"it has {st.st_nlink} hard links"
            elif folder.st_mode & 0o002 and not folder.st_mode & stat.S_ISVTX:
                why = "every user may write its folder"
            if why:
                return self._refuse_faults(why)
            raw = b""
            while len(raw) <= _MAX_FAULTS_BYTES and (chunk := os.read(fd, 1 << 16)):
                raw += chunk
        except OSError as exc:
            return self._refuse_faults(exc.strerror or str(exc))
        finally:
            os.close(fd)
        if len(raw) > _MAX_FAULTS_BYTES:
            return self._refuse_faults(f"it is larger than {_MAX_FAULTS_BYTES} bytes")
        try:
            faults = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._refuse_faults("it is not valid JSON")
        if (wrong := _check_faults(faults)) is not None:
            return self._refuse_faults(wrong)
        self._faults_refused = ""
        return dict(faults)

    def _refuse_faults(self, why: str) -> dict[str, Any]:
        if why != self._faults_refused:
            log.warning(
                "the simulated GPU's faults file %s is not used (%s): no fault is injected",
                self.faults_path,
                why,
            )
            self._faults_refused = why
        return _no_faults()

    @contextlib.contextmanager
    def _faults_transaction(self) -> Iterator[dict[str, Any]]:
        """Change the faults file: under its own lock (beside it, the writer's
        alone, mode 0600), read, changed by the caller, replaced at once."""
        lock = self.faults_path.with_name(self.faults_path.name + ".lock")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(lock, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            faults = self._read_faults()
            yield faults
            data = json.dumps(faults, indent=1, sort_keys=True).encode()
            safefs.write_file(self.faults_path, data, mode=FAULTS_MODE)
        finally:
            os.close(fd)

    def _reset_faults(self, release_delay_s: float, *, keep: bool) -> None:
        """At create: the release delay from the config, and the devices' faults
        kept (``keep``: the devices were kept) or dropped. A folder this process
        cannot write leaves the faults file as it is (said in the log)."""
        try:
            with self._faults_transaction() as faults:
                if not keep:
                    faults["devices"] = {}
                faults["release_delay_s"] = float(release_delay_s)
        except OSError as exc:
            log.warning(
                "the simulated GPU's faults file %s cannot be written: %s",
                self.faults_path,
                exc.strerror or exc,
            )

    def _release_delay(self, state: dict[str, Any], faults: dict[str, Any]) -> float:
        """The faults file's release delay; the state's where that has none (a
        reader that cannot see the faults file, a device made before it existed)."""
        delay = faults.get("release_delay_s")
        return float(state["release_delay_s"] if delay is None else delay)

    @staticmethod
    def _faults_of(faults: dict[str, Any], gpu_uuid: str) -> dict[str, Any]:
        got = faults["devices"].get(gpu_uuid) or {}
        return {"hang": False, "xids": [], "xid_base": 0, **got}

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
        faults = self._read_faults()
        with self._lock():
            state = self._load()
            if self._sweep(state, now, self._release_delay(state, faults)):
                self._save(state)

    @staticmethod
    def _sweep(state: dict[str, Any], now: float, delay: float) -> bool:
        """Find the host pids of sandboxed owners, notice owners gone, release
        what is due (``delay`` after they were noticed). A sweep in the host's
        namespace judges every owner; one run elsewhere (inside a sandbox) only
        the owners in its own namespace, since it cannot see the others."""
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

    def readings(self, now: float, *, lock_timeout: float | None = None) -> list[GpuReading]:
        """Sweep, then read every GPU: used memory and per-process usage; the
        faults (hangs, Xid codes) are the faults file's, never the state's.

        Raises ``GpuProbeError`` if a GPU was set to hang, and
        :class:`SimLockBusyError` when the lock was not had in ``lock_timeout``
        seconds (None: waited for as long as it takes).
        """
        faults = self._read_faults()
        with self._lock(lock_timeout):
            state = self._load()
            if self._sweep(state, now, self._release_delay(state, faults)):
                self._save(state)
        for dev in state["devices"]:
            if self._faults_of(faults, dev["uuid"])["hang"]:
                raise GpuProbeError(
                    f"GPU {dev['uuid']} (index {dev['index']}) stopped answering (simulated hang)"
                )
        out: list[GpuReading] = []
        for dev in state["devices"]:
            on_gpu = [a for a in state["allocations"] if a["gpu"] == dev["uuid"]]
            by_pid = _by_host_pid(on_gpu)
            fault = self._faults_of(faults, dev["uuid"])
            extra = {"xid": str(fault["xids"][-1])} if fault["xids"] else {}
            used = sum(a["nbytes"] for a in on_gpu)
            out.append(
                GpuReading(
                    uuid=dev["uuid"],
                    name=dev["name"],
                    total_bytes=dev["total_bytes"],
                    used_bytes=used,
                    sensors=simulated_sensors(used, dev["total_bytes"], busy=bool(on_gpu)),
                    processes=tuple(ProcessUsage(p, n) for p, n in sorted(by_pid.items())),
                    index=dev["index"],
                    driver="sim",
                    extra=extra,
                    xids=tuple(
                        enumerate((int(x) for x in fault["xids"]), start=int(fault["xid_base"]) + 1)
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

    # the faults below are kept in the faults file (:attr:`faults_path`), which
    # only its folder's writers (the broker's user) may change: never a job

    def _known(self, gpu_uuid: str) -> None:
        """Raise ``GpuProbeError`` unless the device has a GPU ``gpu_uuid``."""
        with self._transaction(write=False) as state:
            self._device(state, gpu_uuid)

    def _change_fault(self, gpu_uuid: str, change: Callable[[dict[str, Any]], None]) -> None:
        self._known(gpu_uuid)
        with self._faults_transaction() as faults:
            dev = self._faults_of(faults, gpu_uuid)
            change(dev)
            faults["devices"][gpu_uuid] = dev

    def set_hang(self, gpu_uuid: str, hang: bool) -> None:
        """While set, reading the GPUs raises ``GpuProbeError`` (the GPU stopped answering)."""
        self._change_fault(gpu_uuid, lambda dev: dev.update(hang=bool(hang)))

    def inject_xid(self, gpu_uuid: str, code: int) -> None:
        """Record a hardware fault; readings carry the latest as ``extra["xid"]``."""
        self._change_fault(gpu_uuid, lambda dev: dev.update(xids=[*dev["xids"], int(code)]))

    def clear_xids(self, gpu_uuid: str) -> None:
        """Forget the GPU's recorded faults (an operator reset it). Event numbers
        keep counting up, so a reader never mistakes a new Xid for an old one."""
        self._change_fault(
            gpu_uuid,
            lambda dev: dev.update(xids=[], xid_base=int(dev["xid_base"]) + len(dev["xids"])),
        )

    def xids(self, gpu_uuid: str) -> list[int]:
        """Every Xid code injected on the GPU, oldest first (as the faults file says)."""
        self._known(gpu_uuid)
        return [int(x) for x in self._faults_of(self._read_faults(), gpu_uuid)["xids"]]

    def set_release_delay(self, seconds: float) -> None:
        """Slow (or speed up) memory release for owners not yet noticed gone."""
        if seconds < 0:
            raise ValueError(f"release delay cannot be negative: {seconds}")
        with self._faults_transaction() as faults:
            faults["release_delay_s"] = float(seconds)


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


def simulated_sensors(used: int, total: int, *, busy: bool) -> GpuSensors:
    """Plausible utilisation, temperature and power for a simulated GPU, from what
    it holds: idle 0 %, 30 °C and a tenth of its power; a GPU that holds memory
    works harder the fuller it is, up to 100 %, 80 °C and its whole power (700 W
    for 80 GiB or more, 450 W for 40 GiB or more, else 300 W)."""
    util = min(100.0, 35.0 + 65.0 * used / total) if busy and total > 0 else 0.0
    tdp = 700.0 if total >= 80 * GIB else 450.0 if total >= 40 * GIB else 300.0
    return GpuSensors(
        util_pct=round(util, 1),
        temp_c=round(30.0 + util / 2, 1),
        power_w=round(tdp * (0.1 + 0.9 * util / 100), 1),
    )


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
        #: the last reading and when it was had (``time.monotonic``)
        self._last: list[GpuReading] | None = None
        self._last_at = 0.0
        #: no try for the lock before this (``time.monotonic``), after one timed out
        self._retry_at = 0.0
        #: why the last try for the lock failed
        self._busy = ""

    def read(self) -> list[GpuReading]:
        """The device now. A job may hold the device's lock: it is waited for
        :data:`PROBE_LOCK_WAIT_S` at most, and not tried again for
        :data:`PROBE_RETRY_S`; meanwhile the last reading is given, until it is
        :data:`PROBE_STALE_S` old: then ``GpuProbeError`` (VRAM admission pauses)
        until the lock is had again. The broker's loop never waits longer."""
        mono = time.monotonic()
        if mono < self._retry_at:
            return self._stale(mono)
        try:
            readings = self.device.readings(self.clock(), lock_timeout=PROBE_LOCK_WAIT_S)
        except SimLockBusyError as exc:
            self._retry_at = mono + PROBE_RETRY_S
            self._busy = exc.message
            return self._stale(mono)
        self._last, self._last_at, self._busy = readings, mono, ""
        return readings

    def _stale(self, mono: float) -> list[GpuReading]:
        age = mono - self._last_at
        if self._last is not None and age < PROBE_STALE_S:
            return self._last
        raise GpuProbeError(
            f"the simulated GPU has not been read for {PROBE_STALE_S:g} s or more: {self._busy}"
        )

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": gpu_uuid or "", "GPUWARDEN_SIM_GPU": str(self.path)}

    def close(self) -> None:
        return None
