"""The sandbox launcher: runs an attempt inside podman, docker or bubblewrap.

Every sandboxed attempt gets the same lock-down, built here and nowhere else:
no network, a non-root user, a read-only root, every capability dropped, no new
privileges, limits on processes, open files and CPU (and memory where the
runtime enforces it), the request's mounts (inputs and weights read-only;
output, scratch and the report folder writable) and nothing else of the host,
and a GPU only when the request names one, and then only that one. Nothing a
job spec says reaches these arguments: mounts and the GPU come from the
broker, the environment is rebuilt from an allow-list.

Process handling is the host launcher's (own session, logs to files, the whole
tree stopped and confirmed gone); for podman and docker this launcher also
stops the container by name on a stop or timeout, asks the runtime whether it
recorded an OOM kill, removes the container and confirms it gone before the
attempt ends, so its memory never counts free too early.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gpuwarden
from gpuwarden.core.launchrules import Runtime
from gpuwarden.launch.base import INSIDE, LaunchRequest, LaunchResult, Mount, inside_path
from gpuwarden.launch.host import KILL_CONFIRM_S, HostLauncher

__all__ = [
    "LABEL_ATTEMPT",
    "LABEL_INSTANCE",
    "LABEL_JOB",
    "SandboxLauncher",
    "SandboxLimits",
    "cgroups_usable",
    "container_name",
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
#: the nproc ulimit is per uid across every sandbox: this many sandboxes' worth
NPROC_SHARE = 8
#: runtime commands (inspect, stop, rm) get this long
_CTL_TIMEOUT_S = 30.0


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
    """A name unique to the broker instance, job and attempt, valid for both runtimes."""
    digest = hashlib.sha256(req.instance.encode()).hexdigest()[:10]
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", req.job_id)[:80]
    return f"gpuwarden-{digest}-{job}-{req.attempt}"


def sandbox_env(req: LaunchRequest, *, pythonpath: str = LIB_INSIDE) -> dict[str, str]:
    """The job's environment inside the sandbox: ``GPUWARDEN_*`` and an allow-list
    from the request, host paths rewritten to where the sandbox sees them, plus a
    fixed PATH, HOME (the scratch folder), locale and PYTHONPATH."""
    env: dict[str, str] = {}
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
        self._host = host or HostLauncher()
        #: podman on a host that mixes cgroup v1 controllers with a v2 mount runs
        #: in a private mount namespace without the v2 mount (found at start)
        mixed = not cgroups_usable() if mixed_cgroups is None else mixed_cgroups
        self.private_mount_ns = runtime is Runtime.PODMAN and mixed

    # -- what runs ----------------------------------------------------------

    @property
    def python(self) -> str:
        """What ``{python}`` in a job type's command means inside this sandbox."""
        if self.runtime is Runtime.BUBBLEWRAP:
            return sys.executable  # the host's interpreter, mounted read-only
        return self.limits.python

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

    def _bwrap_argv(self, req: LaunchRequest) -> list[str]:
        lim = self.limits
        limits = [f"--nproc={lim.pids}", f"--nofile={lim.nofile}"]
        if cpu := self._cpu_seconds(req):
            limits.append(f"--cpu={cpu}")
        args = ["prlimit", *limits, "--", self.executable]
        args += ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        args += ["--uid", str(lim.uid), "--gid", str(lim.gid), "--hostname", "gpuwarden"]
        for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", str(host.readlink()), f"/{name}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{name}"]
        if Path("/etc/ld.so.cache").exists():
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        # the interpreter (and its virtual environment) at their own paths, and
        # the broker's package for the serve worker helper
        for prefix in sorted({sys.base_prefix, sys.prefix}):
            if not prefix.startswith("/usr"):
                args += ["--ro-bind", prefix, prefix]
        args += ["--ro-bind", _package_dir(), f"{LIB_INSIDE}/gpuwarden"]
        for m in req.mounts:
            if m.tmpfs_bytes:
                args += ["--size", str(m.tmpfs_bytes), "--perms", "1777", "--tmpfs", m.target]
            else:
                args += ["--bind" if m.writable else "--ro-bind", m.source, m.target]
        for dev in self._device_paths(req):
            args += ["--dev-bind", dev, dev]
        args += ["--remount-ro", "/"]
        args += ["--chdir", inside_path(req.mounts, req.cwd), "--clearenv"]
        for key, value in sorted(sandbox_env(req).items()):
            args += ["--setenv", key, value]
        return [*args, "--", *self._inside_argv(req)]

    def _device_paths(self, req: LaunchRequest) -> list[str]:
        """bubblewrap: the nodes of the request's GPU and the driver's control nodes."""
        if req.gpu_uuid is None:
            return []
        from gpuwarden.gpu.nvml import device_nodes  # imports NVML: only with a real GPU

        return device_nodes(req.gpu_uuid)

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
        args += ["--ulimit", f"nofile={lim.nofile}:{lim.nofile}"]
        # RLIMIT_NPROC counts every process of the uid, in every sandbox at once:
        # a ceiling for all of them; --pids-limit is each container's own limit
        nproc = lim.pids * NPROC_SHARE
        args += ["--ulimit", f"nproc={nproc}:{nproc}", "--hostname", "gpuwarden"]
        # a tiny init as PID 1 passes SIGTERM on (a bare python as PID 1 ignores
        # it, so every stop would wait out its grace) and reaps orphans
        args += ["--init"]
        if podman and not lim.cgroups:
            args += ["--cgroups", "disabled"]
        else:
            memory = req.memory_bytes or lim.memory_bytes
            args += ["--pids-limit", str(lim.pids), "--cpus", f"{lim.cpus:g}"]
            args += ["--memory", str(memory), "--memory-swap", str(memory)]
        args += ["--tmpfs", "/tmp:rw,nosuid,nodev,size=268435456,mode=1777"]
        for m in req.mounts:
            if m.tmpfs_bytes:
                args += ["--tmpfs", f"{m.target}:rw,nosuid,nodev,size={m.tmpfs_bytes},mode=1777"]
            else:
                ro = "" if m.writable else ",readonly"
                args += ["--mount", f"type=bind,source={m.source},target={m.target}{ro}"]
        args += ["--mount", f"type=bind,source={_package_dir()},target={LIB_INSIDE}/gpuwarden"]
        args[-1] += ",readonly"
        if req.gpu_uuid is not None:
            if podman:
                args += ["--device", f"nvidia.com/gpu={req.gpu_uuid}"]
            else:
                args += ["--gpus", f"device={req.gpu_uuid}"]
        args += ["--workdir", inside_path(req.mounts, req.cwd)]
        for key, value in sorted(sandbox_env(req).items()):
            args += ["--env", f"{key}={value}"]
        return [*self._wrap(args), self.image, *self._inside_argv(req)]

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
        try:
            self._prepare_mounts(req)
        except OSError as exc:
            return _not_started(req, f"could not prepare the sandbox's folders: {exc}")
        # the runtime's client (and podman's conmon, which drops an "oom" file in
        # its working directory) runs in the attempt's folder, never the module's
        outer = dataclasses.replace(
            req, argv=tuple(self.argv(req)), env=self.client_env(req), cwd=req.attempt_dir
        )
        if self.runtime is Runtime.BUBBLEWRAP:
            return self._bwrap_result(self._host.run(outer, stop, on_start))
        return self._run_engine(req, outer, stop, on_start)

    def _prepare_mounts(self, req: LaunchRequest) -> None:
        """Every mount's source must exist; writable ones must be writable by the
        sandbox's user when the broker runs as root (a rootful engine keeps uids)."""
        for m in req.mounts:
            src = Path(m.source)
            if not src.exists():
                if not m.writable and not m.tmpfs_bytes:
                    raise FileNotFoundError(f"{src} does not exist")
                src.mkdir(parents=True, exist_ok=True)
            if m.writable and os.geteuid() == 0 and self.runtime.needs_image:
                _chown_tree(src, self.limits.uid, self.limits.gid)

    def _bwrap_result(self, result: LaunchResult) -> LaunchResult:
        """bubblewrap says what went wrong in its own setup as ``bwrap: ...`` and 1."""
        if result.exit_code == 1 and result.stderr.lstrip().startswith("bwrap:"):
            first = result.stderr.strip().splitlines()[0]
            return dataclasses.replace(
                result, launch_error=f"bubblewrap could not set up the sandbox: {first}"
            )
        return result

    def _run_engine(
        self,
        req: LaunchRequest,
        outer: LaunchRequest,
        stop: threading.Event,
        on_start: Callable[[int], None] | None,
    ) -> LaunchResult:
        name = container_name(req)
        self._ctl("rm", "--force", name)  # a leftover of the same name (a crash)
        deadline = time.monotonic() + req.timeout_s if math.isfinite(req.timeout_s) else None
        finished = threading.Event()
        client_stop = threading.Event()
        timed_out = threading.Event()

        def watch() -> None:
            while not finished.is_set():
                if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    if not stop.is_set():
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

        watcher = threading.Thread(target=watch, name=f"sandbox-{name}", daemon=True)
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

    def remove_leftovers(self, instance: str) -> list[str]:
        """Remove every container a crashed run of ``instance`` left (and only those).
        Returns the names removed; raises OSError when one cannot be removed."""
        removed = []
        for name in self.leftovers(instance):
            gone, _ = self._remove(name)
            if not gone:
                raise OSError(f"container {name} could not be removed")
            removed.append(name)
        return removed


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISLNK(p.lstat().st_mode):
                os.chown(p, uid, gid)


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
) -> tuple[Mount, ...]:
    """The mounts of one attempt, at the fixed places under ``/gpuwarden``."""
    mounts = [Mount(module_dir, str(INSIDE / "module"))]
    if input_dir is not None:
        mounts.append(Mount(input_dir, str(INSIDE / "input")))
    mounts.append(Mount(output_dir, str(INSIDE / "output"), writable=True))
    mounts.append(Mount(scratch_dir, str(INSIDE / "scratch"), True, tmpfs_bytes=scratch_bytes))
    if report_dir is not None:
        mounts.append(Mount(report_dir, str(INSIDE / "report"), writable=True))
    if params_file is not None:
        mounts.append(Mount(params_file, str(INSIDE / "params.json")))
    if weights_dir is not None:
        mounts.append(Mount(weights_dir, str(INSIDE / "weights")))
    mounts.extend(extra)
    return tuple(mounts)
