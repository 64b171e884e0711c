"""The Launcher port. A launcher runs one attempt to its end in a worker thread."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Protocol, runtime_checkable

#: environment variable that marks every process of an attempt ("INSTANCE/JOB_ID/ATTEMPT");
#: used to find and stop processes that left the attempt's process group.
ATTEMPT_ENV = "GPUWARDEN_ATTEMPT"


#: where a sandbox sees the attempt's files (see :class:`Mount`)
INSIDE = PurePosixPath("/gpuwarden")


@dataclass(frozen=True, slots=True)
class Mount:
    """A host path a sandboxed attempt may see, and where it sees it. A host
    launcher ignores mounts: the process sees the host paths themselves."""

    source: str
    target: str
    writable: bool = False
    #: a size-limited tmpfs at ``target`` (``source`` is the host folder a
    #: runtime without tmpfs limits falls back to); 0: a plain bind mount
    tmpfs_bytes: int = 0
    #: a writable folder that is the job's own (output, report, scratch on disk):
    #: the sandbox launcher makes it the sandbox user's (created fresh, or taken
    #: over only while it is still empty and not a link, by descriptor) and counts
    #: what is in it against ``[sandbox] output_mib``. False: mounted as it is,
    #: never chowned (a file, a socket, or a folder the broker shares, such as
    #: the simulated GPU's)
    job_owned: bool = False


def inside_path(mounts: Iterable[Mount], host_path: str) -> str:
    """``host_path`` as a sandbox with ``mounts`` sees it: the longest mount
    source that holds it is replaced by its target; other paths are unchanged."""
    best: Mount | None = None
    for m in mounts:
        holds = host_path == m.source or host_path.startswith(m.source.rstrip("/") + "/")
        if holds and (best is None or len(m.source) > len(best.source)):
            best = m
    if best is None:
        return host_path
    return best.target + host_path[len(best.source) :]


@dataclass(frozen=True, slots=True)
class ImageBuild:
    """The image a job from a commit runs in: built from ``context``'s
    ``Containerfile`` under ``tag`` (``launch/imagebuild.py``) unless it is there."""

    context: str
    tag: str
    timeout_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class RunAs:
    """The user a host command job runs as (SPEC.md, "Command jobs"): its uid, gid
    and supplementary groups, as the kernel told them when it was submitted."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    job_id: str
    attempt: int
    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    #: directory of this attempt: the launcher writes stdout.log and stderr.log here
    attempt_dir: str
    timeout_s: float
    #: stdout and stderr are clipped to this many characters in the result
    clip_chars: int = 16384
    #: seconds between SIGTERM and SIGKILL when the attempt is stopped
    kill_grace_s: float = 5.0
    #: the broker instance (node and state directory) that owns the attempt, so that
    #: two brokers on one host never take each other's processes for their own
    instance: str = ""
    #: what a sandbox may see (ignored by the host launcher); environment values,
    #: the working directory and arguments that are host paths under a mount's
    #: source are rewritten to the mount's target
    mounts: tuple[Mount, ...] = ()
    #: the GPU the attempt may use (the vram lane), by UUID; a multi-GPU job's
    #: GPUs comma-separated (``core.model.gpu_list``)
    gpu_uuid: str | None = None
    #: memory the sandbox may use, where the runtime enforces it (0: its default)
    memory_bytes: int = 0
    #: the job's RAM cap (its ``ram_gib``), enforced by the kernel: a memory
    #: cgroup of the attempt's own with swap off, or the runtime's ``--memory``
    #: (it wins over ``memory_bytes``); 0: no cap. A launcher that cannot enforce
    #: it (:meth:`Launcher.memory_caps`) refuses the attempt as a launch error
    ram_cap_bytes: int = 0
    #: a job from a commit: the image to build (or reuse) and run it in, instead
    #: of the launcher's own (podman and docker only)
    image_build: ImageBuild | None = None
    #: the id of the image built (or found) for ``image_build``: set by the launcher
    image_id: str = ""
    #: a service's attempt: it may outlive the broker (a restarted broker adopts
    #: it), so bubblewrap runs it without ``--die-with-parent``
    outlives_broker: bool = False
    #: a host command job of a user other than root: the starter drops to this
    #: user, then enters ``cwd`` as that user (the check at start that its working
    #: directory is there and its to enter), then runs ``argv``
    run_as: RunAs | None = None
    #: a sandboxed command job's own environment (checked at submission: no
    #: ``GPUWARDEN_*``, no GPU variables): a sandbox passes it as it is, where it
    #: passes only an allow-list of ``env``
    command_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def marker(self) -> str:
        return attempt_marker(self.instance, self.job_id, self.attempt)


def attempt_marker(instance: str, job_id: str, attempt: int) -> str:
    """The value of ``ATTEMPT_ENV`` for one attempt of one broker instance."""
    return f"{instance}/{job_id}/{attempt}"


def instance_prefix(instance: str) -> str:
    """What every :func:`attempt_name` of one broker instance starts with."""
    return f"gpuwarden-{hashlib.sha256(instance.encode()).hexdigest()[:10]}-"


def attempt_name(req: LaunchRequest) -> str:
    """A name unique to the broker instance, job and attempt: a container's name,
    and the name of the attempt's own cgroups (one path component, no ``/``)."""
    return attempt_name_of(req.instance, req.job_id, req.attempt)


def attempt_name_of(instance: str, job_id: str, attempt: int) -> str:
    """:func:`attempt_name` of attempt ``attempt`` of ``job_id`` under ``instance``."""
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:80]
    return f"{instance_prefix(instance)}{job}-{attempt}"


@dataclass(frozen=True, slots=True)
class MemoryCapSupport:
    """Whether a launcher enforces a job's RAM cap (``LaunchRequest.ram_cap_bytes``),
    and ``how``: one sentence, how caps are enforced, or why not and what to do."""

    enforced: bool
    how: str


@dataclass(frozen=True, slots=True)
class LaunchResult:
    job_id: str
    attempt: int
    exit_code: int | None
    started_at: float
    ended_at: float
    pid: int | None = None
    timed_out: bool = False
    #: the attempt was stopped because ``stop`` was set (cancel or shutdown)
    stopped: bool = False
    #: the process could not be started at all (a launch error, not the job's fault)
    launch_error: str | None = None
    stdout: str = ""
    stderr: str = ""
    #: pids that were still alive at the stop and were confirmed gone afterwards
    reaped: tuple[int, ...] = field(default_factory=tuple)
    #: pids that outlived SIGKILL: their memory must not be counted free
    survivors: tuple[int, ...] = field(default_factory=tuple)
    #: the warm server running the job died, hung or spoke garbage (infrastructure)
    worker_error: str | None = None
    #: the container runtime recorded an OOM kill (None: no runtime, or it cannot say)
    oom_killed: bool | None = None
    #: the sandbox stopped the job for passing one of its limits, and which one
    #: (``"output past 16384 MiB"``): the job's own failure, never retried
    limit_exceeded: str | None = None
    #: the RAM cap that was in place for the attempt (``LaunchRequest.ram_cap_bytes``,
    #: enforced by the kernel), 0 for none; with a cap, ``oom_killed`` says whether
    #: the kernel killed a process of the attempt for passing it
    ram_cap_bytes: int = 0
    #: a job from a commit: the id of the image it ran in, and whether that image
    #: was built before (None: the launcher's own image)
    image_id: str | None = None
    image_reused: bool | None = None
    #: the attempt's supervisor stopped the job because its lease passed without
    #: renewal (its agent is gone: self-fencing)
    fenced: bool = False
    #: the attempt's supervisor died before the job ended (no exit record): the
    #: job was stopped, and the attempt is interrupted (infrastructure)
    supervisor_lost: str | None = None
    #: the signals the supervisor passed on to the job (``SIGUSR1``...)
    signals: tuple[str, ...] = ()


class Launcher(Protocol):
    def run(
        self,
        req: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None = None,
    ) -> LaunchResult:
        """Run the attempt to its end and return its result. Blocks: called on a
        worker thread. When ``stop`` is set, or ``req.timeout_s`` passes, stop the
        whole process tree (SIGTERM, then SIGKILL after ``kill_grace_s``). Return
        only once every process of the attempt is confirmed gone. Never raise for
        a failure of the job itself; a process that cannot be started gives a
        result with ``launch_error`` set. ``on_start`` is called with the main
        process's PID as soon as it runs (the broker attributes GPU memory by it)."""
        ...

    def memory_caps(self) -> MemoryCapSupport:
        """Whether this launcher enforces ``LaunchRequest.ram_cap_bytes`` here, and how
        (or why not): a job that asks for a cap is refused where it is not."""
        ...


class Joinable(Protocol):
    """What waits for an attempt's end: a worker thread, or a starter's handle."""

    def join(self, timeout: float | None = None) -> None: ...


@runtime_checkable
class Starter(Protocol):
    """A launcher that can start an attempt without a thread of its own (the host
    launcher, through its one reaper): ``start`` returns once the process runs
    and ``on_end`` gets the result, exactly once, on another thread."""

    def start(
        self,
        req: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None,
        on_end: Callable[[LaunchResult], None],
    ) -> Joinable: ...
