"""Per-attempt memory cgroups: a job's RAM cap (``ram_gib``), enforced by the kernel.

A job that asks for a cap (``LaunchRequest.ram_cap_bytes``) runs in a memory
cgroup of its attempt's own, ``<memory hierarchy>/gpuwarden/<attempt name>``,
made before the job's first process runs: the root-side starter
(:mod:`gpuwarden.launch.enter`) joins it and only then executes the job (host
jobs) or bubblewrap, so every descendant is in it too. Its limit is the cap,
with swap off:

- cgroup v1 (a ``cgroup`` mount with the ``memory`` controller):
  ``memory.limit_in_bytes``, then ``memory.memsw.limit_in_bytes`` equal to it
  where the kernel accounts swap (that file exists), and ``memory.swappiness``
  0 where it may be written;
- cgroup v2 (``memory`` in the root's ``cgroup.controllers``, enabled down the
  way in ``cgroup.subtree_control``): ``memory.max`` and ``memory.swap.max`` 0.

The limit is read back before the cgroup is used: a cap that did not hold is a
launch error, never a job run without it. Past its cap the kernel's OOM killer
kills in the cgroup; its counter (v1 ``memory.oom_control``, v2
``memory.events``: ``oom_kill N``) is read at the attempt's end, before what
is left is killed and the cgroup removed. systemd-run is not used: the broker
makes the cgroup itself wherever the hierarchy is writable (root, or a
delegated v2 subtree). Podman and docker enforce a cap with their own
``--memory``/``--memory-swap``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from gpuwarden.launch.base import MemoryCapSupport
from gpuwarden.launch.cgroups import (
    CgroupTree,
    cgroup_mounts,
    find_hierarchy,
    remove_cgroup,
    v2_controllers,
    writable,
    write_control,
)

__all__ = [
    "FIX",
    "MemoryCgroups",
    "cap_text",
    "find_memory_cgroups",
    "memory_caps_of",
    "oom_kills",
    "why_no_memory_cgroups",
]

log = logging.getLogger(__name__)

#: what to do where no memory cgroup can be made
FIX = (
    "run the broker as root on a host with the memory controller (cgroup v1 memory, or "
    "v2 with memory in cgroup.controllers), or use podman/docker"
)
#: the limit of the cgroup :meth:`MemoryCgroups.try_out` makes
TRY_BYTES = 64 * 2**20


def cap_text(cap_bytes: int) -> str:
    """``2147483648`` -> ``"2.00 GiB"``: how a cap is written in reasons."""
    return f"{cap_bytes / 2**30:.2f} GiB"


def oom_kills(text: str) -> int:
    """The ``oom_kill N`` count of a v1 ``memory.oom_control`` or a v2
    ``memory.events`` file's text (0 when it has none)."""
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key == "oom_kill":
            with contextlib.suppress(ValueError):
                return int(value.strip())
    return 0


@dataclass(frozen=True, slots=True)
class MemoryCgroups(CgroupTree):
    """Where per-attempt memory cgroups are made: ``root/gpuwarden/<name>``."""

    CONTROLLER: ClassVar[str] = "memory"
    WHAT: ClassVar[str] = "the attempt's memory cgroup"

    def describe(self) -> str:
        return f"a memory cgroup per attempt under {self.parent} (cgroup v{self.version}), swap off"

    def create(self, name: str, limit_bytes: int) -> Path:
        """Make (or reuse, after a crash) the cgroup ``name`` limited to
        ``limit_bytes`` with swap off, and read the limit back. Raises OSError
        when it cannot be made or the limit does not hold (the cgroup is then
        removed again)."""
        if limit_bytes <= 0:
            raise ValueError(f"a memory cap must be positive, not {limit_bytes}")
        path = self.make(name)
        try:
            self._limit(path, limit_bytes)
            got = self.limit(path)
            if got != limit_bytes:
                raise OSError(f"the memory limit of {path} reads {got}, not {limit_bytes}")
        except BaseException:
            remove_cgroup(path, 0.5, what="a memory cgroup whose limit failed")
            raise
        return path

    def _limit(self, path: Path, limit_bytes: int) -> None:
        if self.version == 2:
            write_control(path / "memory.max", str(limit_bytes))
            if (path / "memory.swap.max").exists():
                write_control(path / "memory.swap.max", "0")
            return
        # memsw (memory + swap) may never be below the memory limit: memory first
        write_control(path / "memory.limit_in_bytes", str(limit_bytes))
        if (path / "memory.memsw.limit_in_bytes").exists():
            write_control(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
        with contextlib.suppress(OSError):  # refused where the hierarchy sets it
            write_control(path / "memory.swappiness", "0")

    def limit(self, path: Path) -> int | None:
        """The cgroup's memory limit (None: ``max``, or v1's no-limit value)."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        text = (path / name).read_text().strip()
        if text == "max":
            return None
        value = int(text)
        return None if value >= 2**62 else value

    def swap_limit(self, path: Path) -> int | None:
        """v2 ``memory.swap.max``, v1 ``memory.memsw.limit_in_bytes`` (memory and
        swap together); None where the kernel does not account swap."""
        name = "memory.swap.max" if self.version == 2 else "memory.memsw.limit_in_bytes"
        try:
            text = (path / name).read_text().strip()
        except FileNotFoundError:
            return None
        return None if text == "max" else int(text)

    def oom_kills(self, path: Path) -> int:
        """How many processes the kernel's OOM killer killed in the cgroup."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            return oom_kills((path / name).read_text())
        except OSError:
            return 0

    def finish(self, path: Path) -> tuple[int, list[int]]:
        """At an attempt's end: (its OOM kills, the pids that outlived SIGKILL).
        The count is read first, then what is left is killed and the cgroup
        removed (kept while a process outlives SIGKILL)."""
        kills = self.oom_kills(path)
        left = self.kill_all(path)
        if left:
            log.error("memory cgroup %s: processes %s survived SIGKILL", path, left)
        else:
            self.remove(path)
        return kills, left

    def try_out(self) -> str:
        """Make a cgroup with a small limit, read it back and remove it (doctor):
        what was seen. Raises OSError when that fails."""
        name = f"doctor-{os.getpid()}-{secrets.token_hex(4)}"
        path = self.create(name, TRY_BYTES)
        try:
            swap = self.swap_limit(path)
        finally:
            self.remove(path, 1.0)
        if path.exists():
            raise OSError(f"the test cgroup {path} could not be removed")
        swap_said = (
            "swap not accounted by this kernel"
            if swap is None
            else f"swap limit {'0' if self.version == 2 else 'equal'}"
        )
        return f"a test cgroup limited to 64 MiB was made, read back ({swap_said}) and removed"


def find_memory_cgroups(
    mounts: str | None = None, *, euid: int | None = None
) -> MemoryCgroups | None:
    """Where this process may make per-attempt memory cgroups, or None.

    ``mounts`` is ``/proc/self/mounts`` text (read when None). cgroup v1 with a
    ``memory`` mount comes first; then cgroup v2 with ``memory`` in the root's
    ``cgroup.controllers``. Either must be writable by this process (``euid``)."""
    found = find_hierarchy("memory", mounts, euid=euid)
    return None if found is None else MemoryCgroups(*found)


def why_no_memory_cgroups(mounts: str | None = None, *, euid: int | None = None) -> str:
    """Why :func:`find_memory_cgroups` finds none, in words."""
    v1, v2 = cgroup_mounts("memory", mounts)
    uid = os.geteuid() if euid is None else euid
    if v1 is not None:
        return f"the cgroup v1 memory hierarchy {v1} is not writable by uid {uid}"
    if v2 is None:
        return "there is no cgroup v1 memory mount and no cgroup v2 mount"
    if "memory" not in v2_controllers(v2):
        return f"the cgroup v2 mount {v2} has no memory controller"
    if not writable(v2, uid):
        return f"the cgroup v2 hierarchy {v2} is not writable by uid {uid}"
    return "no writable memory cgroup hierarchy was found"


def memory_caps_of(cgroups: MemoryCgroups | None) -> MemoryCapSupport:
    """What a launcher that caps with ``cgroups`` (host, bubblewrap) says."""
    if cgroups is not None:
        return MemoryCapSupport(True, cgroups.describe())
    return MemoryCapSupport(
        False, f"no memory cgroup can be made here: {why_no_memory_cgroups()}; {FIX}"
    )
