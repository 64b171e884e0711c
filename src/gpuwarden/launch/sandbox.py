"""The sandbox launcher: runs an attempt inside podman, docker or bubblewrap.

Every sandboxed attempt gets the same lock-down, built here and nowhere else:
no network, a user that is unprivileged on the host (not only inside its
namespace), a read-only root, every capability dropped, no new privileges, no
nested user namespaces and a seccomp filter, limits on processes, open files,
CPU, ``/tmp`` and the output folder (and memory where the runtime enforces it),
the request's mounts (inputs and weights read-only; output, scratch and the
report folder writable) and nothing else of the host, and a GPU only when the
request names one, and then only that one. Nothing a job spec says reaches
these arguments: mounts and the GPU come from the broker, the environment is
rebuilt from an allow-list.

bubblewrap run by root would map the sandbox's user to root on the host, so a
root broker never runs it as root: :mod:`gpuwarden.launch.enter` (a small
script run as root) stages the mount sources in a private mount namespace,
joins a pids cgroup of the sandbox's own (:mod:`gpuwarden.launch.cgroups`)
and, for a job with a RAM cap, a memory cgroup of the attempt's own
(:mod:`gpuwarden.launch.memcaps`), drops to the sandbox's uid and gid and
only then executes bubblewrap, with the filter of :mod:`gpuwarden.launch.seccomp`.

The folders the job writes to (``Mount.job_owned``) are made the sandbox
user's by descriptor, only when the launcher creates them or while they are
still empty; their size is checked every second while the job runs, and at the
end: past ``[sandbox] output_mib`` the job is stopped (``limit_exceeded``).

Process handling is the host launcher's (own session, logs to files, the whole
tree stopped and confirmed gone); for podman and docker this launcher also
stops the container by name on a stop or timeout, asks the runtime whether it
recorded an OOM kill, removes the container and confirms it gone before the
attempt ends, so its memory never counts free too early.

One file because the lock-down is one policy for three runtimes: the arguments
that set each limit, the folders and filter prepared for them, and the checks
and clean-up that enforce them at the end must change together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gpuwarden
from gpuwarden import safefs
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import gpu_list
from gpuwarden.launch import enter
from gpuwarden.launch.base import (
    INSIDE,
    LaunchRequest,
    LaunchResult,
    MemoryCapSupport,
    Mount,
    attempt_name,
    attempt_name_of,
    inside_path,
    instance_prefix,
)
from gpuwarden.launch.cgroups import PidsCgroups, find_pids_cgroups
from gpuwarden.launch.host import KILL_CONFIRM_S, HostLauncher
from gpuwarden.launch.imagebuild import BUILD_LOG, ImageBuildError, image_for
from gpuwarden.launch.memcaps import (
    MemoryCgroups,
    cap_text,
    find_memory_cgroups,
    memory_caps_of,
)
from gpuwarden.launch.seccomp import bpf_program, engine_profile

__all__ = [
    "ENGINE_SECCOMP_FILE",
    "LABEL_ATTEMPT",
    "LABEL_INSTANCE",
    "LABEL_JOB",
    "OUTPUT_CHECK_S",
    "SECCOMP_FILE",
    "STAGE_DIR",
    "SandboxLauncher",
    "SandboxLimits",
    "cgroups_usable",
    "container_name",
    "output_limit_reason",
    "sandbox_env",
]

log = logging.getLogger(__name__)

LABEL_INSTANCE = "gpuwarden.instance"
LABEL_JOB = "gpuwarden.job"
LABEL_ATTEMPT = "gpuwarden.attempt"

#: where the broker's own ``gpuwarden`` package is mounted (the serve worker
#: helper): the protocol always matches the broker's
LIB_INSIDE = str(INSIDE / "lib")

#: environment variables a sandboxed job gets from the request, besides
#: ``GPUWARDEN_*``; everything else is dropped
_JOB_ENV = ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")
#: environment the runtime's own client needs from the broker's environment
_CLIENT_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "CONTAINER_HOST",
    "DOCKER_HOST",
    "DOCKER_CONFIG",
    "TMPDIR",
)
#: exit statuses with which podman and docker say they could not run the command
RUNTIME_EXITS = {
    125: "the container runtime failed to create or start the container",
    126: "the container's command could not be invoked",
    127: "the container's command was not found in the image",
}
#: the nproc ulimit is per uid across every sandbox: where each sandbox has a
#: pids limit of its own, the ulimit is a ceiling of this many sandboxes' worth
NPROC_SHARE = 8
#: runtime commands (inspect, stop, rm) get this long
_CTL_TIMEOUT_S = 30.0
#: how often the size of a job's own folders is checked while it runs (longer
#: when one walk takes long: never more than a fifth of the time)
OUTPUT_CHECK_S = 1.0
#: the filter bubblewrap loads (raw BPF) and the profile podman is given, written
#: to the attempt's own folder (the broker's, never mounted)
SECCOMP_FILE = "seccomp.bpf"
ENGINE_SECCOMP_FILE = "seccomp.json"
#: where the root-side starter shows the staged sources to bubblewrap
STAGE_DIR = enter.STAGE_DIR
#: where podman's default seccomp profile is found when ``podman info`` does not say
_PODMAN_PROFILES = ("/usr/share/containers/seccomp.json", "/etc/containers/seccomp.json")
_MIB = 2**20


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    uid: int = 65534
    gid: int = 65534
    pids: int = 512
    nofile: int = 4096
    cpus: float = 4.0
    memory_bytes: int = 16 * 2**30
    #: podman/docker limit memory, pids and CPU with cgroups (False: podman runs
    #: with ``--cgroups=disabled``, and those limits are not enforced)
    cgroups: bool = True
    #: the interpreter inside an image (``{python}``); bubblewrap uses the broker's
    python: str = "python3"
    #: size of the sandbox's /tmp (a tmpfs)
    tmp_bytes: int = 256 * _MIB
    #: most bytes in the job's own folders together (0: not checked)
    output_bytes: int = 16384 * _MIB


def output_limit_reason(limit_bytes: int) -> str:
    """What a result says of a job stopped for its output: ``output past N MiB``."""
    return f"output past {limit_bytes / _MIB:g} MiB"


def cgroups_usable(mounts: str | None = None) -> bool:
    """False on a host that mixes cgroup v1 controllers with a cgroup v2 mount at
    ``/sys/fs/cgroup/unified``: podman cannot create containers with cgroups
    there (set ``[sandbox] cgroups = false``). ``mounts``: /proc/self/mounts text."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return True
    types = {parts[1]: parts[2] for line in mounts.splitlines() if len(parts := line.split()) > 2}
    v1 = any(t == "cgroup" for t in types.values())
    return not (v1 and types.get("/sys/fs/cgroup/unified") == "cgroup2")


def container_name(req: LaunchRequest) -> str:
    """A name unique to the broker instance, job and attempt, valid for both
    runtimes (and for the attempt's cgroups under bubblewrap)."""
    return attempt_name(req)


def sandbox_env(req: LaunchRequest, *, pythonpath: str = LIB_INSIDE) -> dict[str, str]:
    """The job's environment inside the sandbox: ``GPUWARDEN_*`` and an allow-list
    from the request, host paths rewritten to where the sandbox sees them, plus a
    fixed PATH, HOME (the scratch folder), locale and PYTHONPATH."""
    env: dict[str, str] = dict(req.command_env)  # a command job's own (the fixed ones win)
    for key, value in req.env.items():
        if key.startswith("GPUWARDEN_") or key in _JOB_ENV:
            env[key] = inside_path(req.mounts, value)
    env["GPUWARDEN_ATTEMPT"] = req.marker
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["LANG"] = "C.UTF-8"
    env["PYTHONPATH"] = pythonpath
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["HOME"] = env.get("GPUWARDEN_SCRATCH_DIR", "/tmp")
    env["TMPDIR"] = "/tmp"
    return env


def _package_dir() -> str:
    return str(Path(gpuwarden.__file__).resolve().parent)


class SandboxLauncher:
    """A :class:`~gpuwarden.launch.base.Launcher` for one runtime."""

    def __init__(
        self,
        runtime: Runtime,
        limits: SandboxLimits | None = None,
        *,
        image: str = "",
        executable: str | None = None,
        host: HostLauncher | None = None,
        mixed_cgroups: bool | None = None,
        pids_cgroups: PidsCgroups | Literal["auto"] | None = "auto",
        as_root: bool | None = None,
        memory_cgroups: MemoryCgroups | Literal["auto"] | None = "auto",
    ) -> None:
        if runtime is Runtime.LOCAL:
            raise ValueError("the local runtime has no sandbox: use HostLauncher")
        if runtime.needs_image and not image:
            raise ValueError(f"{runtime.value} needs an image")
        self.runtime = runtime
        self.limits = limits or SandboxLimits()
        self.image = image
        default = "bwrap" if runtime is Runtime.BUBBLEWRAP else runtime.value
        self.executable = executable or default
        self._host = host or HostLauncher(None)
        #: podman on a host that mixes cgroup v1 controllers with a v2 mount runs
        #: in a private mount namespace without the v2 mount (found at start)
        mixed = not cgroups_usable() if mixed_cgroups is None else mixed_cgroups
        self.private_mount_ns = runtime is Runtime.PODMAN and mixed
        #: the broker runs as root: bubblewrap is started by the root-side
        #: starter, which drops to the sandbox's user first
        self.as_root = os.geteuid() == 0 if as_root is None else as_root
        #: bubblewrap: where each sandbox gets a pids cgroup of its own (None:
        #: RLIMIT_NPROC alone, shared by every sandbox of the node)
        if runtime is not Runtime.BUBBLEWRAP:
            pids_cgroups = None
        self.pids_cgroups = find_pids_cgroups() if pids_cgroups == "auto" else pids_cgroups
        #: bubblewrap: where an attempt with a RAM cap gets its memory cgroup
        #: (None: nowhere, and such an attempt is refused); podman and docker
        #: enforce a cap with their own --memory
        if runtime is not Runtime.BUBBLEWRAP:
            memory_cgroups = None
        self.memory_cgroups = find_memory_cgroups() if memory_cgroups == "auto" else memory_cgroups
        self._engine_profile: str | None = None
        self._profile_lock = threading.Lock()

    # -- what runs ----------------------------------------------------------

    @property
    def python(self) -> str:
        """What ``{python}`` in a job type's command means inside this sandbox."""
        if self.runtime is Runtime.BUBBLEWRAP:
            return sys.executable  # the host's interpreter, mounted read-only
        return self.limits.python

    @property
    def job_owner(self) -> tuple[int, int] | None:
        """Who files the broker makes for a sandboxed job must belong to (uid,
        gid), so that the job can write them; None when the broker is not root
        (the sandbox then runs as the broker's own user)."""
        if not self.as_root:
            return None
        return self.limits.uid, self.limits.gid

    def pids_limit(self) -> str:
        """How the process limit is enforced, in words (doctor, logs)."""
        lim = self.limits
        if self.runtime is Runtime.BUBBLEWRAP:
            if self.pids_cgroups is not None:
                return f"pids {lim.pids} per sandbox: {self.pids_cgroups.describe()}"
            return (
                f"RLIMIT_NPROC {lim.pids}: no pids cgroup can be made here, so the limit "
                f"counts every process of uid {lim.uid} on the node, all sandboxes together"
            )
        if self.runtime is Runtime.PODMAN and not lim.cgroups:
            return (
                f"RLIMIT_NPROC {lim.pids} (cgroups = false): it counts every process of "
                f"uid {lim.uid} on the node, all sandboxes together"
            )
        return f"pids {lim.pids} per container (--pids-limit)"

    def memory_caps(self) -> MemoryCapSupport:
        """Whether a job's RAM cap (``LaunchRequest.ram_cap_bytes``) is enforced, how."""
        if self.runtime is Runtime.BUBBLEWRAP:
            return memory_caps_of(self.memory_cgroups)
        if self.runtime is Runtime.PODMAN and not self.limits.cgroups:
            return MemoryCapSupport(
                False,
                "podman runs without cgroups here ([sandbox] cgroups = false), so it cannot "
                "limit memory; set cgroups = true on a host where podman's cgroups work, or "
                'use container_runtime = "bubblewrap" with the broker as root',
            )
        return MemoryCapSupport(
            True,
            f"{self.runtime.value}'s memory limit per container (--memory, and --memory-swap "
            "equal to it: swap off)",
        )

    def argv(self, req: LaunchRequest) -> list[str]:
        """The whole command line that runs ``req`` in the sandbox."""
        if self.runtime is Runtime.BUBBLEWRAP:
            return self._bwrap_argv(req)
        return self._engine_argv(req)

    def _inside_argv(self, req: LaunchRequest) -> list[str]:
        return [inside_path(req.mounts, a) for a in req.argv]

    def _cpu_seconds(self, req: LaunchRequest) -> int:
        """bubblewrap has no CPU rate limit: cap CPU time at cpus x the timeout."""
        if not math.isfinite(req.timeout_s):
            return 0
        return max(1, math.ceil(self.limits.cpus * (req.timeout_s + req.kill_grace_s)))

    def _nproc(self) -> int:
        """RLIMIT_NPROC: the limit itself where nothing else counts per sandbox,
        else a ceiling over every sandbox of the uid."""
        lim = self.limits
        if self.runtime is Runtime.BUBBLEWRAP:
            per_sandbox = self.pids_cgroups is not None
        else:
            per_sandbox = self.runtime is not Runtime.PODMAN or lim.cgroups
        return lim.pids * NPROC_SHARE if per_sandbox else lim.pids

    def cgroup_path(self, req: LaunchRequest) -> Path | None:
        """bubblewrap: the attempt's own pids cgroup, or None without one."""
        if self.runtime is not Runtime.BUBBLEWRAP or self.pids_cgroups is None:
            return None
        return self.pids_cgroups.path(container_name(req))

    def memory_cgroup_path(self, req: LaunchRequest) -> Path | None:
        """bubblewrap: the attempt's own memory cgroup (a job with a RAM cap), or None."""
        if req.ram_cap_bytes <= 0 or self.memory_cgroups is None:
            return None
        return self.memory_cgroups.path(container_name(req))

    def _bwrap_argv(self, req: LaunchRequest) -> list[str]:
        lim = self.limits
        staged: list[str] = []

        def source(path: str) -> str:
            """Where bubblewrap finds ``path``: staged by the root-side starter
            (it cannot search the broker's folders), or the path itself."""
            if not self.as_root:
                return path
            staged.append(path)
            return f"{STAGE_DIR}/{len(staged) - 1}"

        args = [self.executable, "--unshare-all", "--unshare-user", "--disable-userns"]
        if not req.outlives_broker:  # a service's is adopted by the next broker instead
            args += ["--die-with-parent"]
        args += ["--new-session", "--cap-drop", "ALL"]
        args += ["--uid", str(lim.uid), "--gid", str(lim.gid), "--hostname", "gpuwarden"]
        for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", str(host.readlink()), f"/{name}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{name}"]
        if Path("/etc/ld.so.cache").exists():
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--size", str(lim.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
        # the interpreter (and its virtual environment) at their own paths, and
        # the broker's package for the serve worker helper
        for prefix in sorted({sys.base_prefix, sys.prefix}):
            if not prefix.startswith("/usr"):  # staged by its real path: never a link
                args += ["--ro-bind", source(str(Path(prefix).resolve())), prefix]
        args += ["--ro-bind", source(_package_dir()), f"{LIB_INSIDE}/gpuwarden"]
        for m in req.mounts:
            if m.tmpfs_bytes:
                args += ["--size", str(m.tmpfs_bytes), "--perms", "1777", "--tmpfs", m.target]
            else:
                args += ["--bind" if m.writable else "--ro-bind", source(m.source), m.target]
        for dev in self._device_paths(req):
            args += ["--dev-bind", dev, dev]
        args += ["--remount-ro", "/"]
        args += ["--chdir", inside_path(req.mounts, req.cwd), "--clearenv"]
        for key, value in sorted(sandbox_env(req).items()):
            args += ["--setenv", key, value]
        args += ["--", *self._inside_argv(req)]

        starter = [sys.executable, "-I", "-S", str(Path(enter.__file__).resolve())]
        for path in staged:
            starter += ["--stage", path]
        for cgroup in (self.cgroup_path(req), self.memory_cgroup_path(req)):
            if cgroup is not None:
                starter += ["--cgroup", str(cgroup)]
        starter += ["--rlimit", f"NPROC={self._nproc()}", "--rlimit", f"NOFILE={lim.nofile}"]
        if cpu := self._cpu_seconds(req):
            starter += ["--rlimit", f"CPU={cpu}"]
        starter += ["--seccomp", str(Path(req.attempt_dir) / SECCOMP_FILE)]
        if self.as_root:
            starter += ["--user", f"{lim.uid}:{lim.gid}"]
        return [*starter, "--", *args]

    def _device_paths(self, req: LaunchRequest) -> list[str]:
        """bubblewrap: the nodes of the request's GPUs and the driver's control nodes."""
        if req.gpu_uuid is None:
            return []
        # pynvml takes ~80 ms to import: only a launch on a real GPU pays for it
        from gpuwarden.gpu.nvml import device_nodes  # noqa: PLC0415

        return list(dict.fromkeys(p for g in gpu_list(req.gpu_uuid) for p in device_nodes(g)))

    def _engine_argv(self, req: LaunchRequest) -> list[str]:
        lim = self.limits
        podman = self.runtime is Runtime.PODMAN
        args = [self.executable, "run", "--name", container_name(req)]
        args += [
            "--label",
            f"{LABEL_INSTANCE}={req.instance}",
            "--label",
            f"{LABEL_JOB}={req.job_id}",
            "--label",
            f"{LABEL_ATTEMPT}={req.attempt}",
        ]
        args += ["--network", "none", "--read-only", "--cap-drop", "all"]
        args += ["--security-opt", "no-new-privileges", "--user", f"{lim.uid}:{lim.gid}"]
        if podman:
            # podman's default profile lets a job make a user namespace (and mount,
            # use the keyring, ...): the same profile without those calls
            profile = Path(req.attempt_dir) / ENGINE_SECCOMP_FILE
            args += ["--security-opt", f"seccomp={profile}"]
        # docker: its built-in default profile already refuses them to a container
        # without CAP_SYS_ADMIN (never seccomp=unconfined)
        args += ["--ulimit", f"nofile={lim.nofile}:{lim.nofile}"]
        # RLIMIT_NPROC counts every process of the uid, in every sandbox at once:
        # a ceiling for all of them; --pids-limit is each container's own limit
        nproc = self._nproc()
        args += ["--ulimit", f"nproc={nproc}:{nproc}", "--hostname", "gpuwarden"]
        # a tiny init as PID 1 passes SIGTERM on (a bare python as PID 1 ignores
        # it, so every stop would wait out its grace) and reaps orphans
        args += ["--init"]
        if podman and not lim.cgroups:
            args += ["--cgroups", "disabled"]
        else:
            memory = req.ram_cap_bytes or req.memory_bytes or lim.memory_bytes
            args += ["--pids-limit", str(lim.pids), "--cpus", f"{lim.cpus:g}"]
            args += ["--memory", str(memory), "--memory-swap", str(memory)]
        args += ["--tmpfs", f"/tmp:rw,nosuid,nodev,size={lim.tmp_bytes},mode=1777"]
        for m in req.mounts:
            if m.tmpfs_bytes:
                args += ["--tmpfs", f"{m.target}:rw,nosuid,nodev,size={m.tmpfs_bytes},mode=1777"]
            else:
                ro = "" if m.writable else ",readonly"
                args += ["--mount", f"type=bind,source={m.source},target={m.target}{ro}"]
        args += ["--mount", f"type=bind,source={_package_dir()},target={LIB_INSIDE}/gpuwarden"]
        args[-1] += ",readonly"
        if req.gpu_uuid is not None:
            if podman:  # CDI: one device per GPU
                for gpu in gpu_list(req.gpu_uuid):
                    args += ["--device", f"nvidia.com/gpu={gpu}"]
            elif "," in req.gpu_uuid:  # docker reads --gpus as CSV: a list is one quoted field
                args += ["--gpus", f'"device={req.gpu_uuid}"']
            else:
                args += ["--gpus", f"device={req.gpu_uuid}"]
        args += ["--workdir", inside_path(req.mounts, req.cwd)]
        for key, value in sorted(sandbox_env(req).items()):
            args += ["--env", f"{key}={value}"]
        return [*self._wrap(args), self._image_of(req), *self._inside_argv(req)]

    def _image_of(self, req: LaunchRequest) -> str:
        """The image ``req`` runs in: its commit's (by the id the build found), or
        the node's ``sandbox_image``."""
        return req.image_id or self.image

    def _wrap(self, args: list[str]) -> list[str]:
        """podman on a host that mixes cgroup v1 controllers with a v2 mount (crun
        refuses "hybrid mode"): run it in a private mount namespace without the v2
        mount, where it sees a plain cgroup v1 host and its limits work."""
        if self.private_mount_ns:
            script = 'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
            return [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
                *args,
            ]
        return args

    def client_env(self, req: LaunchRequest) -> dict[str, str]:
        """The environment of the runtime's client process (not the job's)."""
        env = {k: v for k, v in os.environ.items() if k in _CLIENT_ENV}
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        return env

    # -- running ------------------------------------------------------------

    def run(
        self,
        req: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None = None,
    ) -> LaunchResult:
        """Run ``req`` in the sandbox to its end (see the module docstring)."""
        if shutil.which(self.executable) is None:
            return _not_started(req, f"the container runtime {self.executable!r} is not installed")
        if req.ram_cap_bytes > 0 and not (caps := self.memory_caps()).enforced:
            return _not_started(
                req,
                f"a RAM cap of {cap_text(req.ram_cap_bytes)} was asked, but this sandbox "
                f"cannot enforce memory caps ({caps.how})",
            )
        built: tuple[str, bool] | None = None
        if req.image_build is not None:
            if not self.runtime.needs_image:
                return _not_started(req, "a job from a commit needs podman or docker")
            try:
                built = image_for(
                    self.executable,
                    req.image_build,
                    Path(req.attempt_dir) / BUILD_LOG,
                    self.client_env(req),
                    self._wrap,
                )
            except (ImageBuildError, OSError) as exc:
                return _not_started(req, f"the image of {req.image_build.tag}: {exc}")
            req = dataclasses.replace(req, image_id=built[0])
        try:
            self._prepare_mounts(req)
            self._write_seccomp(req)
        except (OSError, safefs.UnsafePathError) as exc:
            return _not_started(req, f"could not prepare the sandbox: {exc}")
        cgroup, memory = self.cgroup_path(req), self.memory_cgroup_path(req)
        try:
            self._make_cgroups(req, cgroup, memory)
        except OSError as exc:
            return _not_started(req, str(exc))
        # the runtime's client (and podman's conmon, which drops an "oom" file in
        # its working directory) runs in the attempt's folder, never the module's;
        # the cap is the sandbox's, never its client's
        outer = dataclasses.replace(
            req,
            argv=tuple(self.argv(req)),
            env=self.client_env(req),
            cwd=req.attempt_dir,
            ram_cap_bytes=0,
        )
        watch = _OutputWatch.of(req, self.limits.output_bytes)
        kills: int = 0
        left: list[int] = []
        try:
            if self.runtime is Runtime.BUBBLEWRAP:
                result = self._bwrap_result(self._run_bwrap(outer, stop, on_start, watch))
            else:
                result = self._run_engine(req, outer, stop, on_start, watch)
        finally:
            kills, left = self._clear_cgroups(cgroup, memory)
        if left:
            result = dataclasses.replace(
                result, survivors=tuple(sorted({*result.survivors, *left}))
            )
        if req.ram_cap_bytes > 0:
            # bubblewrap: the attempt's memory cgroup counted OOM kills; podman
            # and docker: the runtime's record (_run_engine)
            oom = result.oom_killed if memory is None else kills > 0
            result = dataclasses.replace(result, ram_cap_bytes=req.ram_cap_bytes, oom_killed=oom)
        result = watch.finish(result, stop)
        if built is not None:
            result = dataclasses.replace(result, image_id=built[0], image_reused=built[1])
        return result

    def _make_cgroups(self, req: LaunchRequest, pids: Path | None, memory: Path | None) -> None:
        """Make the attempt's pids cgroup and (a RAM cap) its memory cgroup; OSError
        says which could not be made (none is left behind)."""
        if pids is not None:
            assert self.pids_cgroups is not None
            try:
                self.pids_cgroups.create(pids.name, self.limits.pids)
            except OSError as exc:
                raise OSError(f"could not make the sandbox's pids cgroup: {exc}") from exc
        if memory is not None:
            assert self.memory_cgroups is not None
            try:
                self.memory_cgroups.create(memory.name, req.ram_cap_bytes)
            except (OSError, ValueError) as exc:
                if pids is not None:
                    self._clear_cgroups(pids, None)
                raise OSError(f"could not make the attempt's memory cgroup: {exc}") from exc

    def _clear_cgroups(self, pids: Path | None, memory: Path | None) -> tuple[int, list[int]]:
        """Stop whatever is left in the attempt's cgroups and remove them: the OOM
        kills its memory cgroup counted (read first), and the pids that outlived
        SIGKILL (they keep their cgroup)."""
        mem = self.memory_cgroups if memory is not None else None
        kills = 0 if mem is None or memory is None else mem.oom_kills(memory)
        left: set[int] = set()
        if pids is not None:
            assert self.pids_cgroups is not None
            stuck = self.pids_cgroups.kill_all(pids)
            if stuck:
                log.error("sandbox cgroup %s: processes %s survived SIGKILL", pids, stuck)
                left.update(stuck)
            else:
                self.pids_cgroups.remove(pids)
        if mem is not None and memory is not None:
            left.update(mem.finish(memory)[1])
        return kills, sorted(left)

    def _prepare_mounts(self, req: LaunchRequest) -> None:
        """Every mount's source must exist. The job's own folders are made the
        sandbox user's (fresh, or taken over while still empty), and a socket
        it is given is chowned to it, both by descriptor; nothing else changes
        owner (podman/docker keep uids, and bubblewrap runs as the sandbox's user)."""
        owner = self.job_owner
        for m in req.mounts:
            if m.tmpfs_bytes:
                continue  # a tmpfs of the runtime's: nothing on the host
            if m.job_owned and m.writable:
                _own_folder(Path(m.source), owner)
                continue
            try:
                st = os.lstat(m.source)
            except FileNotFoundError:
                raise FileNotFoundError(f"{m.source} does not exist") from None
            if m.writable and stat.S_ISSOCK(st.st_mode) and owner is not None:
                _chown_node(m.source, owner)

    def _write_seccomp(self, req: LaunchRequest) -> None:
        """The attempt's filter (bubblewrap) or profile (podman), in its folder."""
        folder = Path(req.attempt_dir)
        if self.runtime is Runtime.BUBBLEWRAP:
            folder.mkdir(parents=True, exist_ok=True)
            _write_private(folder / SECCOMP_FILE, bpf_program())
        elif self.runtime is Runtime.PODMAN:
            folder.mkdir(parents=True, exist_ok=True)
            _write_private(folder / ENGINE_SECCOMP_FILE, self._podman_profile().encode())

    def _podman_profile(self) -> str:
        """podman's own default seccomp profile without the deny-list (cached)."""
        with self._profile_lock:
            if self._engine_profile is None:
                done = self._ctl(
                    "info", "--format", "{{.Host.Security.SECCOMPProfilePath}}", timeout=30
                )
                said = done.stdout.strip() if done.returncode == 0 else ""
                candidates = [said] if said else []
                candidates += [p for p in _PODMAN_PROFILES if p not in candidates]
                for path in candidates:
                    try:
                        default = json.loads(Path(path).read_text())
                    except (OSError, ValueError):
                        continue
                    if isinstance(default, dict) and "syscalls" in default:
                        self._engine_profile = json.dumps(engine_profile(default), indent=1)
                        break
                else:
                    raise OSError(
                        "cannot read podman's default seccomp profile (looked at "
                        f"{', '.join(candidates)}): the sandbox's profile is podman's "
                        "without the calls gpuwarden refuses; install containers-common"
                    )
            return self._engine_profile

    def _bwrap_result(self, result: LaunchResult) -> LaunchResult:
        """bubblewrap says what went wrong in its own setup as ``bwrap: ...`` and 1,
        the root-side starter as ``gpuwarden-sandbox: ...`` and 1."""
        said = result.stderr.lstrip()
        if result.exit_code == 1 and said.startswith(("bwrap:", enter.PREFIX)):
            first = result.stderr.strip().splitlines()[0]
            return dataclasses.replace(
                result, launch_error=f"bubblewrap could not set up the sandbox: {first}"
            )
        return result

    def _run_bwrap(
        self,
        outer: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None,
        watch: _OutputWatch,
    ) -> LaunchResult:
        """The host launcher runs the starter (then bubblewrap) as the attempt's
        process tree; a watcher passes ``stop`` on and stops it for its output."""
        inner = threading.Event()
        finished = threading.Event()

        def supervise() -> None:
            while not finished.is_set():
                if stop.is_set() or watch.exceeded():
                    inner.set()
                    return
                finished.wait(0.02)

        watcher = threading.Thread(target=supervise, name=f"bwrap-{outer.marker}", daemon=True)
        watcher.start()
        try:
            return self._host.run(outer, inner, on_start)
        finally:
            finished.set()
            watcher.join()

    def _run_engine(
        self,
        req: LaunchRequest,
        outer: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None,
        watch: _OutputWatch,
    ) -> LaunchResult:
        name = container_name(req)
        self._ctl("rm", "--force", name)  # a leftover of the same name (a crash)
        deadline = time.monotonic() + req.timeout_s if math.isfinite(req.timeout_s) else None
        finished = threading.Event()
        client_stop = threading.Event()
        timed_out = threading.Event()

        def watch_container() -> None:
            while not finished.is_set():
                late = deadline is not None and time.monotonic() >= deadline
                if stop.is_set() or late or watch.exceeded():
                    if late and not stop.is_set() and watch.reason is None:
                        timed_out.set()
                    grace = str(max(1, math.ceil(req.kill_grace_s)))
                    self._ctl("stop", "--time", grace, name, timeout=req.kill_grace_s + 30)
                    client_stop.set()
                    return
                finished.wait(0.05)

        def started(pid: int) -> None:
            if on_start is not None:
                on_start(pid)
            threading.Thread(target=report_container_pid, daemon=True).start()

        def report_container_pid() -> None:
            # GPU memory is attributed by process tree: the container's processes
            # are children of the runtime's monitor, not of the client
            for _ in range(100):
                if finished.is_set():
                    return
                pid = self._container_pid(name)
                if pid:
                    if on_start is not None:
                        on_start(pid)
                    return
                time.sleep(0.1)

        watcher = threading.Thread(target=watch_container, name=f"sandbox-{name}", daemon=True)
        watcher.start()
        try:
            unbounded = dataclasses.replace(outer, timeout_s=math.inf)
            result = self._host.run(unbounded, client_stop, started)
        finally:
            finished.set()
            watcher.join()
        oom = self._oom_killed(name, Path(req.attempt_dir))
        gone, pid = self._remove(name)
        launch_error = result.launch_error
        stopped = stop.is_set() and not timed_out.is_set()
        if (
            launch_error is None
            and not stopped
            and not timed_out.is_set()
            and watch.reason is None
            and result.exit_code in RUNTIME_EXITS
        ):
            tail = _last_line(result.stderr)
            launch_error = f"{RUNTIME_EXITS[result.exit_code]} (exit {result.exit_code})"
            if tail:
                launch_error += f": {tail}"
        survivors = result.survivors if gone else (*result.survivors, pid or -1)
        return dataclasses.replace(
            result,
            timed_out=timed_out.is_set(),
            stopped=stopped,
            launch_error=launch_error,
            oom_killed=oom,
            survivors=survivors,
        )

    # -- the runtime's control commands ----------------------------------------

    def _ctl(self, *args: str, timeout: float = _CTL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a control command (inspect, stop, rm, ps); they work from the
        host's own mount namespace on containers started in a private one."""
        argv = [self.executable, *args]
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={k: v for k, v in os.environ.items() if k in _CLIENT_ENV},
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(argv, 255, "", str(exc))

    def _container_pid(self, name: str) -> int | None:
        done = self._ctl("inspect", "--format", "{{.State.Pid}}", name, timeout=5)
        value = done.stdout.strip()
        return int(value) if done.returncode == 0 and value.isdigit() and value != "0" else None

    def _oom_killed(self, name: str, client_dir: Path) -> bool | None:
        """Whether the runtime recorded an OOM kill: the container's state says
        so, or podman's monitor (conmon) left its ``oom`` file in its working
        directory, the attempt's folder (podman 4 does not always carry that
        into the state). None when the runtime cannot say."""
        if (client_dir / "oom").exists():
            return True
        done = self._ctl("inspect", "--format", "{{.State.OOMKilled}}", name)
        if done.returncode != 0:
            return None
        return done.stdout.strip().lower() == "true"

    def exists(self, name: str) -> bool:
        if self.runtime is Runtime.PODMAN:
            return self._ctl("container", "exists", name).returncode == 0
        return self._ctl("inspect", "--type", "container", name).returncode == 0

    def _remove(self, name: str) -> tuple[bool, int | None]:
        """Remove the container (killing what still runs) and confirm it is gone.
        Returns whether it is gone, and its main pid if it is not."""
        deadline = time.monotonic() + KILL_CONFIRM_S
        while True:
            self._ctl("rm", "--force", name)
            if not self.exists(name):
                return True, None
            if time.monotonic() >= deadline:
                log.error("container %s could not be removed: its memory stays counted", name)
                return False, self._container_pid(name)
            time.sleep(0.2)

    def leftovers(self, instance: str) -> list[str]:
        """Names of the containers this broker instance started (any state)."""
        if self.runtime is Runtime.BUBBLEWRAP:
            return []  # no containers: the broker finds bwrap processes by marker
        return self._engine_leftovers(instance)

    def _engine_leftovers(self, instance: str) -> list[str]:
        done = self._ctl(
            "ps",
            "--all",
            "--filter",
            f"label={LABEL_INSTANCE}={instance}",
            "--format",
            "{{.Names}}",
        )
        if done.returncode != 0:
            raise OSError(f"{self.executable} ps failed: {_last_line(done.stderr)}")
        return [n for n in done.stdout.split() if n]

    def remove_leftovers(self, instance: str, but: Sequence[str] = ()) -> list[str]:
        """Remove every container a crashed run of ``instance`` left (and only those),
        but those named in ``but`` (the attempts adopted: :func:`attempt_name_of`).
        Returns the names removed; raises OSError when one cannot be removed.
        bubblewrap has no containers: the pids cgroups a crashed run left are
        emptied and removed (logged), and nothing is returned."""
        if self.runtime is Runtime.BUBBLEWRAP:
            self._remove_leftover_cgroups(instance, frozenset(but))
            return []
        removed = []
        for name in self.leftovers(instance):
            if name in but:
                continue
            gone, _ = self._remove(name)
            if not gone:
                raise OSError(f"container {name} could not be removed")
            removed.append(name)
        return removed

    def _remove_leftover_cgroups(self, instance: str, but: frozenset[str]) -> None:
        prefix = instance_prefix(instance)
        for cgroups in (self.pids_cgroups, self.memory_cgroups):
            if cgroups is None or not cgroups.parent.is_dir():
                continue
            for path in sorted(cgroups.parent.glob(f"{prefix}*")):
                if path.name in but:
                    continue
                if path.is_dir() and not path.is_symlink():
                    left = cgroups.kill_all(path)
                    if left:
                        raise OSError(f"processes {left} in the cgroup {path} outlived SIGKILL")
                    cgroups.remove(path)
                    log.info("removed the cgroup %s a crashed run left", path)

    # -- adoption (node/adoption.py) ---------------------------------------------

    def adoptable_pid(self, instance: str, job_id: str, attempt: int, recorded: int) -> int | None:
        """The process an adopted service attempt is watched by and reached through,
        or None (it does not run). bubblewrap: the PID the store recorded
        (bubblewrap's own, whose tree holds the sandbox); podman, docker: the main
        process of the attempt's container, found by its name and running, with
        its labels this instance's, job's and attempt's (never a bare PID)."""
        if self.runtime is Runtime.BUBBLEWRAP:
            return recorded
        name = attempt_name_of(instance, job_id, attempt)
        done = self._ctl("inspect", "--type", "container", name, timeout=10)
        if done.returncode != 0:
            return None
        try:
            (found,) = json.loads(done.stdout)
            state, labels = found["State"], found["Config"]["Labels"] or {}
            pid = int(state["Pid"])
        except (ValueError, TypeError, KeyError):
            return None
        wanted = {LABEL_INSTANCE: instance, LABEL_JOB: job_id, LABEL_ATTEMPT: str(attempt)}
        if not state.get("Running") or pid <= 0:
            return None
        return pid if all(labels.get(k) == v for k, v in wanted.items()) else None

    def release_adopted(self, instance: str, job_id: str, attempt: int) -> None:
        """An adopted attempt ended (its processes are stopped): remove its
        container (podman, docker) or its cgroups (bubblewrap), as its own end
        would have."""
        name = attempt_name_of(instance, job_id, attempt)
        if self.runtime is not Runtime.BUBBLEWRAP:
            self._remove(name)
            return
        pids = self.pids_cgroups.path(name) if self.pids_cgroups is not None else None
        memory = self.memory_cgroups.path(name) if self.memory_cgroups is not None else None
        self._clear_cgroups(
            pids if pids is not None and pids.is_dir() else None,
            memory if memory is not None and memory.is_dir() else None,
        )


class _OutputWatch:
    """The size of a job's own folders (``Mount.job_owned``, on disk), against
    ``[sandbox] output_mib``: checked while it runs and once more at its end."""

    def __init__(self, folders: Sequence[str], limit_bytes: int) -> None:
        self.folders = tuple(folders)
        self.limit_bytes = limit_bytes
        #: why the job is past its limit, once it is
        self.reason: str | None = None
        self._next = time.monotonic() + OUTPUT_CHECK_S

    @classmethod
    def of(cls, req: LaunchRequest, limit_bytes: int) -> _OutputWatch:
        folders = [m.source for m in req.mounts if m.job_owned and not m.tmpfs_bytes]
        return cls(folders if limit_bytes > 0 else (), limit_bytes)

    def check(self) -> str | None:
        """Walk the folders now (bounded, never following a link); the reason
        when they hold more than the limit, or more entries than a walk lists."""
        if self.reason is not None or not self.folders:
            return self.reason
        total = 0
        for folder in self.folders:
            try:
                listing = safefs.walk(folder)
            except (OSError, safefs.UnsafePathError) as exc:
                log.warning("cannot measure the sandbox's folder %s: %s", folder, exc)
                continue
            total += listing.total_bytes
            if listing.truncated is not None:
                self.reason = f"output past {safefs.MAX_ENTRIES} files and folders"
                return self.reason
        if total > self.limit_bytes:
            self.reason = output_limit_reason(self.limit_bytes)
        return self.reason

    def exceeded(self) -> bool:
        """:meth:`check` when it is due (every :data:`OUTPUT_CHECK_S`, or five
        times as long as the last walk took); True once past the limit."""
        if self.reason is not None:
            return True
        now = time.monotonic()
        if not self.folders or now < self._next:
            return False
        self.check()
        took = time.monotonic() - now
        self._next = time.monotonic() + max(OUTPUT_CHECK_S, 5 * took)
        return self.reason is not None

    def finish(self, result: LaunchResult, stop: threading.Event) -> LaunchResult:
        """The result as the job's: past its limit (checked once more now that
        its processes are gone) it failed for that, whatever its exit status."""
        if self.reason is None and result.launch_error is None and not stop.is_set():
            self.check()
        if self.reason is None:
            return result
        note = f"\n[gpuwarden: {self.reason}; the job was stopped]\n"
        return dataclasses.replace(
            result,
            limit_exceeded=self.reason,
            stopped=False,
            timed_out=False,
            stderr=result.stderr + note,
        )


def _own_folder(path: Path, owner: tuple[int, int] | None) -> None:
    """Make the job's own folder ``path`` belong to ``owner``: created fresh, or,
    when the broker made it already, taken over only while it is an empty folder
    of the broker's (never a link, never anything with content), by descriptor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        safefs.make_dir(path, mode=0o700, owner=owner)
        return
    except FileExistsError:
        pass
    fd = safefs.open_dir(path)  # a link or a non-folder is refused here
    try:
        st = os.fstat(fd)
        if owner is None or (st.st_uid, st.st_gid) == owner:
            return
        if st.st_uid != os.geteuid() or os.listdir(fd):  # noqa: PTH208 - by descriptor
            raise safefs.UnsafePathError(
                path,
                "is not a fresh folder for the sandbox (it has content, or is not the "
                "broker's): the job's folders are handed over only while empty",
            )
        os.fchown(fd, *owner)
    finally:
        os.close(fd)


def _chown_node(path: str, owner: tuple[int, int]) -> None:
    """Chown what ``path`` names (a socket), never what a link there points at."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise safefs.UnsafePathError(path, "is a symlink; links are not followed")
        os.chown(f"/proc/self/fd/{fd}", *owner)  # the descriptor's own file
    finally:
        os.close(fd)


def _write_private(path: Path, data: bytes) -> None:
    """Write a file of the broker's own, readable only by it, replacing any."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    tmp.replace(path)


def _last_line(text: str) -> str:
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")[:300]


def _not_started(req: LaunchRequest, why: str) -> LaunchResult:
    now = time.time()
    return LaunchResult(
        job_id=req.job_id,
        attempt=req.attempt,
        exit_code=None,
        started_at=now,
        ended_at=now,
        launch_error=why,
    )


def mounts_for(
    *,
    module_dir: str,
    input_dir: str | None,
    output_dir: str,
    scratch_dir: str,
    report_dir: str | None,
    params_file: str | None,
    weights_dir: str | None,
    scratch_bytes: int,
    extra: Sequence[Mount] = (),
    model_dir: str | None = None,
) -> tuple[Mount, ...]:
    """The mounts of one attempt, at the fixed places under ``/gpuwarden``
    (``model_dir``: its module's model folder, read-only at ``/gpuwarden/model``;
    ``module_dir`` "": a command job's, which has no module folder)."""
    mounts = [Mount(module_dir, str(INSIDE / "module"))] if module_dir else []
    if input_dir is not None:
        mounts.append(Mount(input_dir, str(INSIDE / "input")))
    mounts.append(Mount(output_dir, str(INSIDE / "output"), writable=True, job_owned=True))
    mounts.append(
        Mount(scratch_dir, str(INSIDE / "scratch"), True, tmpfs_bytes=scratch_bytes, job_owned=True)
    )
    if report_dir is not None:
        mounts.append(Mount(report_dir, str(INSIDE / "report"), writable=True, job_owned=True))
    if params_file is not None:
        mounts.append(Mount(params_file, str(INSIDE / "params.json")))
    if weights_dir is not None:
        mounts.append(Mount(weights_dir, str(INSIDE / "weights")))
    if model_dir is not None:
        mounts.append(Mount(model_dir, str(INSIDE / "model")))
    mounts.extend(extra)
    return tuple(mounts)
