"""The record a warm server keeps for the next broker (SPEC.md, "Attempts outlive
the broker", "Warm servers across a restart").

A loaded warm server that a later broker can take over has one small file,
``<state>/warm/servers/<epoch>.json``, written atomically by the broker once the
model is loaded and removed once the server is confirmed gone. It names what a
new broker needs to find the server and trust it: its type, GPU and epoch, its
marker (``GPUWARDEN_ATTEMPT``), its supervisor's pid with that process's start
time in clock ticks and the boot id (a reused pid has another start time; a
reboot another boot id), its socket path, and the model's footprint and load
time. A broker that stops routinely or is killed leaves it behind.

The file lives in the broker's own (root-owned) state directory, yet it is read
as hostile: only regular files with a name of the broker's own form are opened,
never through a link, at most :data:`MAX_RECORD` bytes; every field must be
there with its type and range, and nothing else may be. :func:`verify` checks
the process it names against ``/proc`` (pid, start ticks, boot id, command line
with the marker) and against the supervisor's own ``started.json``: a record
that names any other process is refused, and that process is never signalled.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.launch import supervisor
from gpuwarden.launch.host import live_supervisor
from gpuwarden.launch.reaper import stat as proc_stat

__all__ = [
    "MAX_RECORD",
    "ServerRecord",
    "read_all",
    "records_dir",
    "remove",
    "verify",
    "write",
]

#: the largest record read, in bytes
MAX_RECORD = 4096
#: the most records looked at in one start (a node has one server per type)
MAX_RECORDS = 256
_NAME = re.compile(r"[0-9]{1,19}\.json")
_TYPE = re.compile(r"[A-Za-z0-9_.@-]{1,200}")
_GPU = re.compile(r"[A-Za-z0-9_.:,-]{0,400}")
_BOOT = re.compile(r"[0-9a-f-]{1,64}")
_TEXT_MAX = 1024


@dataclass(frozen=True, slots=True)
class ServerRecord:
    """One left warm server, as its record says."""

    type: str
    epoch: int
    gpu: str
    marker: str
    #: the server's supervisor (its only parent, outside any broker)
    pid: int
    #: when ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22)
    start_ticks: int
    boot_id: str
    socket: str
    footprint_bytes: int
    load_s: float
    device_bytes: int | None
    jobs_served: int


def records_dir(state_dir: Path) -> Path:
    return state_dir / "warm" / "servers"


def write(state_dir: Path, record: ServerRecord) -> None:
    """Write (or replace) ``record`` atomically: the whole file or none."""
    folder = records_dir(state_dir)
    for level in (folder.parent, folder):
        try:
            safefs.make_dir(level, mode=0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(level).st_mode):
                raise safefs.UnsafePathError(level, "is not a folder") from None
    data = json.dumps({"v": 1, **asdict(record)}, sort_keys=True).encode()
    safefs.write_file(folder / f"{record.epoch}.json", data)


def remove(state_dir: Path, name: str) -> None:
    """Remove the record ``name`` (``<epoch>.json``, or any entry a listing gave:
    a link is removed as the link); nothing when it is not there."""
    folder = records_dir(state_dir)
    try:
        fd = safefs.open_dir(folder)
    except (OSError, safefs.UnsafePathError):
        return
    try:
        os.unlink(name, dir_fd=fd)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        pass
    finally:
        os.close(fd)


def read_all(state_dir: Path) -> list[tuple[str, ServerRecord | None]]:
    """Every entry of the records' folder: its name and its record, or None when
    it is not one (a name not of the broker's form, a link, not a regular file,
    too large, not a record). At most :data:`MAX_RECORDS` entries."""
    folder = records_dir(state_dir)
    try:
        with os.scandir(folder) as entries:
            names = sorted(e.name for e in entries)[:MAX_RECORDS]
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[tuple[str, ServerRecord | None]] = []
    for name in names:
        record = None
        if _NAME.fullmatch(name):
            try:
                record = parse(safefs.read_bytes(folder / name, MAX_RECORD))
            except (OSError, safefs.UnsafePathError):
                record = None
            if record is not None and f"{record.epoch}.json" != name:
                record = None
        out.append((name, record))
    return out


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "type": str,
    "epoch": int,
    "gpu": str,
    "marker": str,
    "pid": int,
    "start_ticks": int,
    "boot_id": str,
    "socket": str,
    "footprint_bytes": int,
    "load_s": (int, float),
    "device_bytes": (int, type(None)),
    "jobs_served": int,
}


def parse(raw: bytes) -> ServerRecord | None:
    """The record in ``raw``, or None unless every field is there with its type
    and range and there is no other (a bool is no number here)."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or set(data) != set(_FIELDS):
        return None
    for key, kind in _FIELDS.items():
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            return None
    if data["v"] != 1 or not _in_range(data):
        return None
    data.pop("v")
    data["load_s"] = float(data["load_s"])
    return ServerRecord(**data)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _in_range(d: dict[str, Any]) -> bool:
    ints_ok = (
        0 < d["epoch"] < 2**63
        and 1 < d["pid"] < 2**22
        and 0 <= d["start_ticks"] < 2**63
        and 0 <= d["footprint_bytes"] < 2**60
        and 0 <= d["jobs_served"] < 2**63
        and (d["device_bytes"] is None or 0 <= d["device_bytes"] < 2**60)
    )
    return (
        ints_ok
        and math.isfinite(d["load_s"])
        and d["load_s"] >= 0
        and bool(_TYPE.fullmatch(d["type"]))
        and bool(_GPU.fullmatch(d["gpu"]))
        and bool(_BOOT.fullmatch(d["boot_id"]))
        and 0 < len(d["marker"]) <= _TEXT_MAX
        and 0 < len(d["socket"]) <= _TEXT_MAX
    )


def verify(record: ServerRecord, log_dir: Path) -> str | None:
    """Why the process ``record`` names is not its server's supervisor, or None
    when it is: it runs now (no zombie), started at the recorded clock tick in
    this boot, its command line is the supervisor's with the record's marker,
    and the supervisor's own ``started.json`` in ``log_dir`` names the same
    process. The caller checks the marker is the one it derives itself."""
    if record.boot_id != supervisor.boot_id():
        return "it was written before the host last booted"
    ticks = supervisor.start_ticks(record.pid)
    if ticks is None:
        return f"process {record.pid} is gone"
    if ticks != record.start_ticks:
        return f"process {record.pid} is another process (it started at another time)"
    st = proc_stat(record.pid)
    if st is None or st[0] in "ZX":
        return f"process {record.pid} has ended"
    live = live_supervisor(str(log_dir), record.marker)
    if live is None or live.pid != record.pid:
        return f"process {record.pid} is not the server's supervisor"
    return None
