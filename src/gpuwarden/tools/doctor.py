"""``gpuwarden doctor``: check this host against the configuration.

Each check is a small function that looks at one thing (the config, the
container runtime, the GPUs, CDI, the NVIDIA container toolkit, the modules,
the weights folder, the queue roots, the sandbox image, a real sandboxed start)
and returns a :class:`Check`: ``OK``, ``WARN`` or ``FAIL``, what it found and,
for WARN and FAIL, what to do. A check never crashes the doctor: an exception
becomes a FAIL with its text. Checks that need what an earlier check could not
provide (a config, a runtime) say they were not run.

The sandbox checks run the ``probe`` module's ``probe.sandbox`` (and, with a
real GPU, ``probe.gpu``) through the same :class:`SandboxLauncher` and the same
kind of launch request the broker builds, and judge the report the probe writes
from inside: not root, no capabilities, no network, a read-only root, writable
output and scratch, read-only inputs, no sight of a host file placed next to
the attempt's folders, no user namespace, no mount, a seccomp filter that
refuses keyctl, and a /tmp no larger than ``[sandbox] tmp_mib``. How the
process limit is enforced (a pids cgroup per sandbox, or RLIMIT_NPROC shared
by all) is said too: the shared fallback is a WARN. The doctor opens no store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from gpuwarden import safefs
from gpuwarden.app import make_probe, sandbox_launcher
from gpuwarden.config import Config, load_config
from gpuwarden.core.launchrules import Runtime, image_is_pinned
from gpuwarden.core.model import MIB, JobType, LaunchMode, format_bytes
from gpuwarden.errors import ConfigError, GpuwardenError
from gpuwarden.gpu.base import GpuProbe, GpuReading
from gpuwarden.intake.queueroot import SUBFOLDERS
from gpuwarden.launch.base import LaunchRequest, inside_path
from gpuwarden.launch.sandbox import SandboxLauncher, mounts_for
from gpuwarden.node.attempts import AttemptLayout, job_env
from gpuwarden.registry import Registry

__all__ = ["CHECKS", "Check", "Host", "Status", "render", "run_checks", "run_doctor"]

#: the probe module's job types the sandbox checks run
PROBE_SANDBOX = "probe.sandbox"
PROBE_GPU = "probe.gpu"
#: seconds a sandbox check's probe may run
PROBE_TIMEOUT_S = 60.0
#: the largest report.json the doctor reads
REPORT_LIMIT = 4 * 2**20
#: what the sandbox launcher needs of bubblewrap (0.8.0 and later)
BWRAP_OPTIONS = ("--disable-userns", "--seccomp", "--size")
#: seconds a runtime or toolkit command may take
COMMAND_TIMEOUT_S = 30.0
#: the first NVIDIA Container Toolkit release with the fix for CVE-2025-23266
TOOLKIT_FIXED = (1, 17, 8)
#: probe kinds that read a real GPU
REAL_PROBES = ("nvml", "nvidia-smi")

_INSTALL = {
    Runtime.PODMAN: "install podman (sudo apt-get install podman)",
    Runtime.DOCKER: "install Docker Engine (sudo apt-get install docker.io) and start it",
    Runtime.BUBBLEWRAP: "install bubblewrap (sudo apt-get install bubblewrap)",
}
_INSTALL_TOOLKIT = (
    "install the NVIDIA Container Toolkit 1.17.8 or later (NVIDIA's apt repository: "
    "sudo apt-get install nvidia-container-toolkit)"
)
_CDI_GENERATE = "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"


class Status(StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str
    #: what to do (WARN and FAIL)
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "fix": self.fix,
        }


class Skip(Exception):
    """Raised inside a check that cannot run: it becomes a WARN saying why."""


@dataclass
class Host:
    """What the checks share: the inputs, and what earlier checks found."""

    config_path: Path | None
    state_dir: Path | None = None
    mock_gpu: bool = False
    config: Config | None = None
    #: the config could not be read at all (not just its sandbox settings)
    config_unreadable: bool = False
    #: check_sandbox() passed
    config_ok: bool = False
    runtime_ok: bool = False
    probe: GpuProbe | None = None
    readings: list[GpuReading] | None = None
    _registry: Registry | Exception | None = field(default=None, repr=False)

    def need_config(self) -> Config:
        if self.config is None:
            raise Skip("not checked: the config did not load")
        return self.config

    def registry(self) -> Registry:
        """The module registry under the config's launch rules (loaded once)."""
        if self._registry is None:
            config = self.need_config()
            try:
                self._registry = Registry.load(config.module_paths, config.launch_rules)
            except Exception as exc:
                self._registry = exc
        if isinstance(self._registry, Exception):
            raise self._registry
        return self._registry

    @property
    def real_gpus(self) -> list[GpuReading]:
        """The GPUs a real probe (NVML, nvidia-smi) read; [] for none or simulated."""
        if self.probe is None or self.probe.kind not in REAL_PROBES:
            return []
        return list(self.readings or [])

    def close(self) -> None:
        if self.probe is not None:
            with contextlib.suppress(Exception):
                self.probe.close()
            self.probe = None


# -- helpers ------------------------------------------------------------------


def _executable(runtime: Runtime) -> str:
    return "bwrap" if runtime is Runtime.BUBBLEWRAP else runtime.value


def _run(argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a command; a command that cannot start or hangs answers 127 or 124."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer after {timeout:g} s")
    except OSError as exc:
        return subprocess.CompletedProcess(argv, 127, "", str(exc))


def _tail(text: str, lines: int = 1) -> str:
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[:600]


def _write_error(folder: Path) -> str | None:
    """None when a file can be created in ``folder``, else why not."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "no write permission"
    probe = folder / f".gpuwarden-doctor-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        return exc.strerror or str(exc)
    return None


@contextlib.contextmanager
def _captured(logger_name: str) -> Iterator[list[str]]:
    """Collect what ``logger_name`` logs (instead of printing it) while open."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, propagate = Collect(logging.INFO), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# -- the checks ------------------------------------------------------------------


def check_config(host: Host) -> Check:
    where = str(host.config_path) if host.config_path else "no config file: the defaults"
    try:
        host.config = load_config(host.config_path, state_dir=host.state_dir)
    except ConfigError as exc:
        error = exc.message
    else:
        c = host.config
        host.config_ok = True
        return Check(
            "config",
            Status.OK,
            f"{where}; state_dir {c.state_dir}; container_runtime {c.runtime_shown}; "
            f"node {c.node_name}",
        )
    try:
        host.config = load_config(host.config_path, state_dir=host.state_dir, check=False)
    except ConfigError:
        host.config_unreadable = True
        return Check(
            "config",
            Status.FAIL,
            f"{where}: {error}",
            "fix the config file (SPEC.md, 'Configuration', lists every key); the other "
            "checks need it",
        )
    runtime = host.config.container_runtime.value
    return Check(
        "config",
        Status.FAIL,
        f"{where}: {error}",
        f"build and pin a sandbox image: `images/build.sh --runtime {runtime} --pin`, "
        f"then put the sandbox_image line it prints into the config",
    )


def check_runtime(host: Host) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    if runtime is Runtime.LOCAL:
        return _local_runtime(host, config)
    exe = _executable(runtime)
    path = shutil.which(exe)
    if path is None:
        return Check(
            "runtime",
            Status.FAIL,
            f'container_runtime = "{runtime.value}" but {exe} is not on PATH',
            _INSTALL[runtime],
        )
    helpers: dict[str, str] = {}
    if runtime is Runtime.PODMAN and not config.sandbox.cgroups:
        helpers["unshare"] = "util-linux"
    for helper, package in helpers.items():
        if shutil.which(helper) is None:
            return Check(
                "runtime",
                Status.FAIL,
                f"{runtime.value} is installed ({path}) but {helper}, which the sandbox "
                f"launcher runs it through, is not on PATH",
                f"install {package} (sudo apt-get install {package})",
            )
    if runtime is Runtime.DOCKER:
        client = _run([exe, "--version"])
        server = _run([exe, "version", "--format", "{{.Server.Version}}"])
        engine = server.stdout.strip()
        if server.returncode != 0 or not engine:
            said = _tail(server.stderr) or f"exit {server.returncode}"
            return Check(
                "runtime",
                Status.FAIL,
                f"the docker client works ({_tail(client.stdout) or path}) but no engine "
                f"answers: {said}",
                "start the Docker engine (sudo systemctl start docker), or point DOCKER_HOST "
                "at one; a user outside the docker group cannot reach /var/run/docker.sock. "
                'Or use container_runtime = "podman" or "bubblewrap"',
            )
        host.runtime_ok = True
        return Check("runtime", Status.OK, f"docker engine {engine} ({path})")
    done = _run([exe, "--version"])
    version = _tail(done.stdout) or _tail(done.stderr)
    if done.returncode != 0:
        return Check(
            "runtime",
            Status.FAIL,
            f"{path} --version failed (exit {done.returncode}): {version}",
            f"repair or reinstall it: {_INSTALL[runtime]}",
        )
    if runtime is Runtime.BUBBLEWRAP:
        usage = _run([exe, "--help"])
        lacking = [o for o in BWRAP_OPTIONS if o not in usage.stdout + usage.stderr]
        if lacking:
            return Check(
                "runtime",
                Status.FAIL,
                f"{version} ({path}) lacks {', '.join(lacking)}: the sandbox blocks nested "
                "user namespaces and loads a seccomp filter with them",
                "install bubblewrap 0.8.0 or later (Debian 12, Ubuntu 24.04 have it)",
            )
    host.runtime_ok = True
    extra = f"; {', '.join(helpers)} found" if helpers else ""
    return Check("runtime", Status.OK, f"{version} ({path}){extra}")


def _local_runtime(host: Host, config: Config) -> Check:
    try:
        types = list(host.registry().types.values())
    except Exception:
        types = []  # the modules check says why
    sandboxable = sorted(t.name for t in types if t.launch is not LaunchMode.HOST)
    named = f": {', '.join(sandboxable)}" if sandboxable else ""
    local = (
        f'container_runtime = "auto" ({config.container_runtime_auto})'
        if config.container_runtime_auto
        else 'container_runtime = "local"'
    )
    if config.allow_unsandboxed_containers and sandboxable:
        return Check(
            "runtime",
            Status.WARN,
            f"{local}: no sandbox, and allow_unsandboxed_containers = true, "
            f"so container and serve types run UNSANDBOXED as plain host processes{named}",
            'install bubblewrap or podman and set container_runtime = "bubblewrap" or '
            '"podman" (then allow_unsandboxed_containers is not needed)',
        )
    if sandboxable:
        what = f"container and serve types are refused{named}"
    else:
        what = "no container or serve types are registered"
    return Check(
        "runtime",
        Status.OK,
        f"{local}: no sandbox; host types run as host processes, {what}",
    )


def check_gpu(host: Host) -> Check:
    config = host.need_config()
    kind = "sim" if host.mock_gpu else config.gpu
    with _captured("gpuwarden.gpu") as notes:
        try:
            host.probe = make_probe(config, mock_gpu=host.mock_gpu)
            host.readings = host.probe.read()
        except GpuwardenError as exc:
            return Check(
                "gpu",
                Status.FAIL,
                f"the GPU probe ({kind}) fails: {exc.message}",
                'check the driver: `nvidia-smi` must list the GPUs; or set gpu = "none" '
                '(no GPU) or gpu = "sim" (simulated) in the config',
            )
    probe = host.probe
    if not host.readings:
        said = "; ".join(notes) or "no GPU found; vram jobs will wait"
        return Check(
            "gpu",
            Status.WARN,
            f"probe {probe.kind} (gpu = {kind!r}): {said}",
            "install the NVIDIA driver (`nvidia-smi` must list the GPUs), or use --mock-gpu "
            'or gpu = "sim" to try gpuwarden on a simulated GPU',
        )
    gpus = "; ".join(
        f"{r.uuid} {r.name} {format_bytes(r.total_bytes)}"
        + (f" driver {r.driver}" if r.driver else "")
        for r in host.readings
    )
    simulated = " (simulated)" if probe.kind == "sim" else ""
    said = f" ({'; '.join(notes)})" if notes else ""  # e.g. why NVML gave way to nvidia-smi
    return Check(
        "gpu",
        Status.OK,
        f"probe {probe.kind}{simulated}: {len(host.readings)} GPU(s): {gpus}{said}",
    )


def check_cdi(host: Host) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    gpus = host.real_gpus
    if runtime not in (Runtime.PODMAN, Runtime.DOCKER):
        how = (
            "binds the GPU's device nodes itself"
            if runtime is Runtime.BUBBLEWRAP
            else ("runs no containers")
        )
        return Check("cdi", Status.OK, f"not needed: {runtime.value} {how}")
    if not gpus:
        return Check("cdi", Status.OK, "not needed: no real GPU on this host")
    if runtime is Runtime.DOCKER:
        done = _run(["docker", "info", "--format", "{{json .Runtimes}}"])
        if done.returncode != 0:
            return Check(
                "cdi",
                Status.WARN,
                f"cannot check docker's runtimes: docker info failed: {_tail(done.stderr)}",
                "start the Docker engine, then run the doctor again",
            )
        if "nvidia" in done.stdout:
            return Check("cdi", Status.OK, "docker info lists the nvidia runtime")
        return Check(
            "cdi",
            Status.WARN,
            f"docker info lists no nvidia runtime ({done.stdout.strip() or 'none'}): "
            f"--gpus may not reach the GPU",
            "sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker",
        )
    ctk = shutil.which("nvidia-ctk")
    if ctk is None:
        return Check(
            "cdi",
            Status.FAIL,
            "nvidia-ctk is not installed: podman reaches a GPU through a CDI spec it writes",
            f"{_INSTALL_TOOLKIT}, then {_CDI_GENERATE}",
        )
    done = _run([ctk, "cdi", "list"])
    if done.returncode != 0:
        return Check(
            "cdi",
            Status.FAIL,
            f"nvidia-ctk cdi list failed (exit {done.returncode}): {_tail(done.stderr)}",
            _CDI_GENERATE,
        )
    names = set(re.findall(r"nvidia\.com/gpu=(\S+)", done.stdout + "\n" + done.stderr))
    missing = [g.uuid for g in gpus if g.uuid not in names]
    if missing:
        return Check(
            "cdi",
            Status.FAIL,
            f"the CDI spec names no device for {', '.join(missing)} "
            f"(it lists: {', '.join(sorted(names)) or 'nothing'}); podman cannot give that "
            f"GPU to a job",
            f"{_CDI_GENERATE} (again after every driver upgrade)",
        )
    return Check(
        "cdi", Status.OK, f"CDI names nvidia.com/gpu=<UUID> for all {len(gpus)} GPU(s) ({ctk})"
    )


def check_toolkit(host: Host) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    if runtime not in (Runtime.PODMAN, Runtime.DOCKER):
        return Check("toolkit", Status.OK, f"not needed: {runtime.value} uses no container hooks")
    if not host.real_gpus:
        return Check("toolkit", Status.OK, "not needed: no real GPU on this host")
    ctk = shutil.which("nvidia-ctk")
    if ctk is None:
        return Check(
            "toolkit",
            Status.FAIL,
            f"the NVIDIA Container Toolkit is not installed (no nvidia-ctk): {runtime.value} "
            f"cannot give a GPU to a container",
            _INSTALL_TOOLKIT,
        )
    done = _run([ctk, "--version"])
    text = done.stdout + "\n" + done.stderr
    match = re.search(r"version\s+v?(\d+)\.(\d+)\.(\d+)", text)
    if done.returncode != 0 or match is None:
        return Check(
            "toolkit",
            Status.WARN,
            f"cannot read the toolkit's version from `nvidia-ctk --version`: {_tail(text)}",
            f"check it is 1.17.8 or later (CVE-2025-23266); {_INSTALL_TOOLKIT}",
        )
    version = tuple(int(g) for g in match.groups())
    shown = ".".join(map(str, version))
    if version < TOOLKIT_FIXED:
        return Check(
            "toolkit",
            Status.WARN,
            f"NVIDIA Container Toolkit {shown} is older than 1.17.8: vulnerable to "
            f"CVE-2025-23266 (a container image can get root on the host through the "
            f"toolkit's enable-cuda-compat hook)",
            "upgrade: sudo apt-get install --only-upgrade nvidia-container-toolkit "
            f"(1.17.8 or later), then {_CDI_GENERATE}",
        )
    return Check("toolkit", Status.OK, f"NVIDIA Container Toolkit {shown} ({ctk})")


def check_modules(host: Host) -> Check:
    config = host.need_config()
    paths = ", ".join(map(str, config.module_paths)) or "none"
    try:
        registry = host.registry()
    except GpuwardenError as exc:
        return Check(
            "modules",
            Status.FAIL,
            exc.message,
            "fix the module.toml it names (docs/MODULE_GUIDE.md), or take that folder off "
            "module_paths",
        )
    if not registry.types:
        return Check(
            "modules",
            Status.WARN,
            f"no job types found on module_paths ({paths})",
            "set module_paths to the folders that hold your modules (each a folder with "
            "a module.toml)",
        )
    sources = "; ".join(sorted({str(m.source) for m in registry.modules.values()}))
    found = f"{len(registry.modules)} module(s), {len(registry.types)} type(s) from {sources}"
    # one line per kind of refusal: the reasons differ only in the type's name
    refused: dict[str, list[str]] = {}
    for t in sorted(registry.types.values(), key=lambda t: t.name):
        if (why := registry.rules.refusal(t)) is not None:
            refused.setdefault(why.replace(t.name, "\0"), []).append(t.name)
    if refused:
        count = sum(map(len, refused.values()))
        return Check(
            "modules",
            Status.WARN,
            f"{found}; {count} refused on this node: "
            + "; ".join(
                f"{', '.join(names)} ({why.replace(chr(0), 'each' if names[1:] else names[0])})"
                for why, names in refused.items()
            ),
            "jobs of these types are refused at submission; change container_runtime or "
            "the allow_* settings if they should run here",
        )
    return Check("modules", Status.OK, f"{found}; every type may run on this node")


def check_weights(host: Host) -> Check:
    config = host.need_config()
    weights = config.sandbox.weights_dir
    if weights is None:
        return Check("weights", Status.OK, "none ([sandbox] weights_dir is not set)")
    fix = f"create {weights} and put the model weights there, or fix [sandbox] weights_dir"
    if not weights.exists():
        return Check("weights", Status.FAIL, f"weights_dir {weights} does not exist", fix)
    if not weights.is_dir():
        return Check("weights", Status.FAIL, f"weights_dir {weights} is not a directory", fix)
    try:
        entries = sum(1 for _ in weights.iterdir())
        st = weights.stat()
    except OSError as exc:
        return Check(
            "weights",
            Status.FAIL,
            f"weights_dir {weights} cannot be read: {exc.strerror}",
            f"make it readable by the broker's user (uid {os.geteuid()})",
        )
    if not os.access(weights, os.R_OK | os.X_OK):
        return Check(
            "weights",
            Status.FAIL,
            f"weights_dir {weights} is not readable by this user (uid {os.geteuid()})",
            f"chmod a+rx {weights}, or run the broker as a user that can read it",
        )
    found = f"weights_dir {weights}: readable, {entries} entries, mounted read-only"
    s = config.sandbox
    mode = st.st_mode
    sandbox_reads = (
        (st.st_uid == s.uid and mode & 0o500 == 0o500)
        or (st.st_gid == s.gid and mode & 0o050 == 0o050)
        or mode & 0o005 == 0o005
    )
    if config.container_runtime is not Runtime.LOCAL and not sandbox_reads:
        return Check(
            "weights",
            Status.WARN,
            f"{found}, but its mode {oct(mode & 0o777)} may keep the sandbox's user "
            f"({s.uid}:{s.gid}) out",
            f"chmod -R o+rX {weights}",
        )
    return Check("weights", Status.OK, found)


def check_queue_roots(host: Host) -> Check:
    config = host.need_config()
    if not config.queue_roots:
        return Check(
            "queue-roots", Status.OK, "none configured (jobs come in through `gpuwarden submit`)"
        )
    problems: list[str] = []
    found: list[str] = []
    for root in config.queue_roots:
        problem = _queue_root_problem(root, create=config.create_queue_roots)
        if problem:
            problems.append(problem)
        elif not root.exists():
            found.append(f"{root} (created at start)")
        else:
            found.append(str(root))
    if problems:
        return Check(
            "queue-roots",
            Status.FAIL,
            "; ".join(problems),
            "make each queue root a directory gpuwarden can write (with inbox/, processing/, "
            "outbox/, failed/ in it, or create_queue_roots = true), or fix queue_roots",
        )
    return Check("queue-roots", Status.OK, f"writable: {', '.join(found)}")


def _queue_root_problem(root: Path, *, create: bool) -> str | None:
    if not root.exists():
        if root.is_symlink():
            return f"{root} is a link to nothing"
        if not create:
            return f"{root} does not exist (and create_queue_roots = false)"
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            return f"{root} does not exist and cannot be created: {parent} is not a directory"
        if why := _write_error(parent):
            return f"{root} does not exist and cannot be created in {parent} ({why})"
        return None
    if not root.is_dir():
        return f"{root} is not a directory"
    for sub in SUBFOLDERS:
        folder = root / sub
        if not folder.exists() and not folder.is_symlink():
            if not create:
                return f"{folder} is missing (and create_queue_roots = false)"
            if why := _write_error(root):
                return f"{folder} is missing and {root} is not writable ({why})"
        elif not folder.is_dir():
            return f"{folder} is not a directory"
        elif why := _write_error(folder):
            return f"{folder} is not writable ({why})"
    return None


def check_image(host: Host) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    if not runtime.needs_image:
        how = "uses the host's /usr and Python" if runtime is Runtime.BUBBLEWRAP else "no sandbox"
        return Check("image", Status.OK, f"not needed: {runtime.value} ({how})")
    image = config.sandbox_image
    fix = (
        f"`images/build.sh --runtime {runtime.value} --pin`, then put the sandbox_image line "
        f"it prints into the config"
    )
    if not image:
        return Check("image", Status.FAIL, "sandbox_image is not set", fix)
    problems: list[str] = []
    warnings: list[str] = []
    if image_is_pinned(image):
        found = f"sandbox_image {image} is pinned"
    elif config.allow_unpinned_images:
        found = f"sandbox_image {image}"
        warnings.append("it is not pinned (allowed by allow_unpinned_images = true)")
    else:
        found = f"sandbox_image {image}"
        problems.append("it is not pinned: a tag can be moved to another image")
    if not host.runtime_ok:
        warnings.append(f"not checked whether it is present: {runtime.value} is not usable")
    else:
        exe = _executable(runtime)
        argv = [exe, "image", "exists", image] if runtime is Runtime.PODMAN else [
            exe, "image", "inspect", image,
        ]  # fmt: skip
        done = _run(argv)
        if done.returncode == 0:
            found += ", present locally"
        else:
            said = _tail(done.stderr)
            problems.append(f"it is not present locally{f' ({said})' if said else ''}")
    if problems:
        return Check("image", Status.FAIL, f"{found}; " + "; ".join(problems + warnings), fix)
    if warnings:
        return Check(
            "image",
            Status.WARN,
            f"{found}; " + "; ".join(warnings),
            f"pin it: {fix}" if not image_is_pinned(image) else "fix the runtime check first",
        )
    return Check("image", Status.OK, found)


def check_sandbox(host: Host) -> Check:
    return _sandbox_check(host, "sandbox", PROBE_SANDBOX, gpu=None)


def check_sandbox_gpu(host: Host) -> Check:
    config = host.need_config()
    if config.container_runtime is Runtime.LOCAL:
        return Check("sandbox-gpu", Status.OK, "not needed: no sandbox (container_runtime local)")
    gpus = host.real_gpus
    if not gpus:
        return Check("sandbox-gpu", Status.OK, "not needed: no real GPU on this host")
    return _sandbox_check(host, "sandbox-gpu", PROBE_GPU, gpu=gpus[0])


def _sandbox_check(host: Host, name: str, type_name: str, gpu: GpuReading | None) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    if runtime is Runtime.LOCAL:
        return Check(name, Status.OK, "not needed: no sandbox (container_runtime local)")
    try:
        registry = host.registry()
    except Exception:
        raise Skip("cannot check: the modules did not load") from None
    jobtype = registry.types.get(type_name)
    if jobtype is None:
        raise Skip(f"cannot check: probe module missing ({type_name} is not on module_paths)")
    if not host.config_ok:
        raise Skip("not checked: the config check failed")
    if not host.runtime_ok:
        raise Skip("not checked: the runtime check failed")
    launcher = sandbox_launcher(config)
    if launcher is None:  # pragma: no cover - not local, so there is one
        raise Skip("not checked: no sandbox launcher")
    run = _run_probe(
        host, config=config, registry=registry, launcher=launcher, jobtype=jobtype, gpu=gpu
    )
    if run.error:
        return Check(
            name,
            Status.FAIL,
            f"{type_name} did not run in {runtime.value}: {run.error}",
            _sandbox_fix(runtime, run.error),
        )
    assert run.report is not None
    problems, warnings, found = judge(run.report, run.target, tmp_bytes=launcher.limits.tmp_bytes)
    pids = launcher.pids_limit()
    found += f"; {pids}"
    if "all sandboxes together" in pids:
        warnings.append(f"processes are limited by {pids.split(':')[0]} alone, per uid")
    if gpu is not None:
        cuda_problem, cuda_found = _judge_cuda(run.report, gpu.uuid)
        found += f"; {cuda_found}"
        if cuda_problem:
            problems.append(cuda_problem)
    if problems:
        return Check(
            name,
            Status.FAIL,
            f"{type_name} in {runtime.value}: " + "; ".join(problems) + f" (found: {found})",
            f"the sandbox is not locked down: run no jobs here until this passes. Upgrade "
            f"{runtime.value}, see the exact command with `gpuwarden -v doctor`, and report "
            f"it to gpuwarden if {runtime.value} is current",
        )
    if warnings:
        fixes = []
        if any("marker" in w for w in warnings):
            fixes.append(
                "put the state directory where the sandbox's user could search every folder "
                "on the way, so that the check can tell"
            )
        if any("per uid" in w for w in warnings):
            fixes.append(_PIDS_FIX[runtime])
        return Check(
            name,
            Status.WARN,
            f"{type_name} in {runtime.value}: {found}; " + "; ".join(warnings),
            "; ".join(fixes),
        )
    return Check(name, Status.OK, f"{type_name} in {runtime.value}: {found}")


_PIDS_FIX = {
    Runtime.BUBBLEWRAP: (
        "one job can use up the process limit of every sandbox on the node: run the broker "
        "as root on a host with a pids cgroup controller (cgroup v1 pids, or v2 with pids "
        "in cgroup.controllers)"
    ),
    Runtime.PODMAN: (
        "one job can use up the process limit of every sandbox on the node: podman needs "
        "cgroups for --pids-limit ([sandbox] cgroups = true on a host where they work)"
    ),
    Runtime.DOCKER: "",
    Runtime.LOCAL: "",
}


def _sandbox_fix(runtime: Runtime, error: str) -> str:
    if runtime is Runtime.PODMAN and "cgroup" in error:
        return (
            "this host's cgroup layout does not work with podman's limits: set cgroups = false "
            "under [sandbox] (memory, pids and CPU-rate limits are then not enforced; "
            "ulimits still are)"
        )
    if runtime is Runtime.BUBBLEWRAP:
        return (
            "bubblewrap needs user namespaces (or root): check `bwrap --unshare-all "
            "--ro-bind / / true` works for the broker's user, and "
            "sysctl kernel.unprivileged_userns_clone / apparmor_restrict_unprivileged_userns"
        )
    return (
        f"run the printed {runtime.value} command by hand (gpuwarden -v doctor logs it) and "
        f"fix what {runtime.value} says; rebuild the image with `images/build.sh --runtime "
        f"{runtime.value} --pin` if it lacks python3"
    )


@dataclass(frozen=True, slots=True)
class ProbeRun:
    report: dict[str, Any] | None
    #: why no report came back (a launch error, a failed probe), with stderr's tail
    error: str
    #: the host address the probe tried to connect to
    target: str


@contextlib.contextmanager
def _listener() -> Iterator[str]:
    """A TCP listener on the host's loopback: a sandbox without network cannot reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _run_probe(
    host: Host,
    *,
    config: Config,
    registry: Registry,
    launcher: SandboxLauncher,
    jobtype: JobType,
    gpu: GpuReading | None,
) -> ProbeRun:
    """Run ``jobtype`` once through ``launcher`` with a request built as the broker
    builds one (``gpuwarden.node.attempts.Launching.request``: the same folder
    layout and job environment), in a folder under the state directory."""
    base = config.state_dir / "doctor"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="doctor-", dir=base))
    try:
        work.chmod(0o755)  # a marker that leaked would be visible, not just unreadable
        with _listener() as target:
            req = _probe_request(
                host,
                config=config,
                registry=registry,
                launcher=launcher,
                jobtype=jobtype,
                gpu=gpu,
                work=work,
                target=target,
            )
            logging.getLogger(__name__).info("doctor runs: %s", shlex.join(launcher.argv(req)))
            result = launcher.run(req, threading.Event())
        stderr = _tail(result.stderr, 6)
        said = f"; stderr: {stderr}" if stderr else ""
        if result.launch_error and _tail(result.stderr) in result.launch_error:
            said = ""  # the launch error quotes it already
        if result.launch_error:
            return ProbeRun(None, f"{result.launch_error}{said}", target)
        if result.timed_out:
            return ProbeRun(None, f"timed out after {req.timeout_s:g} s{said}", target)
        if result.exit_code != 0:
            return ProbeRun(None, f"the probe exited {result.exit_code}{said}", target)
        try:  # written by the sandbox's user: never through a link, bounded
            report = json.loads(safefs.read_text("out/report.json", REPORT_LIMIT, under=work))
        except (OSError, ValueError, safefs.UnsafePathError) as exc:
            return ProbeRun(None, f"no readable report.json ({exc}){said}", target)
        if not isinstance(report, dict):
            return ProbeRun(None, "report.json is not a JSON object", target)
        return ProbeRun(report, "", target)
    finally:
        with contextlib.suppress(OSError):
            safefs.remove_tree(work)  # the sandbox wrote in it: no link is followed
        with contextlib.suppress(OSError):
            base.rmdir()  # only when no other doctor uses it


def _probe_request(
    host: Host,
    *,
    config: Config,
    registry: Registry,
    launcher: SandboxLauncher,
    jobtype: JobType,
    gpu: GpuReading | None,
    work: Path,
    target: str,
) -> LaunchRequest:
    layout = AttemptLayout(work, sandboxed=True)
    for d in layout.folders():
        d.mkdir(mode=0o755)
    weights = config.sandbox.weights_dir
    mounts = mounts_for(
        module_dir=jobtype.module_dir,
        input_dir=str(layout.inputs),
        output_dir=str(layout.out),
        scratch_dir=str(layout.scratch),
        report_dir=str(layout.report),
        params_file=str(layout.params),
        weights_dir=str(weights) if weights is not None else None,
        scratch_bytes=int(config.sandbox.scratch_mib * MIB),
    )
    given = layout.inputs / "doctor-input.txt"
    given.write_text("gpuwarden doctor: an input the job may read but not write\n")
    marker = work / f"marker-{secrets.token_hex(6)}"  # beside the mounts, never in one
    marker.write_text("a host file no sandbox may see\n")
    params: dict[str, Any] = {
        "marker": str(marker),  # a host path: it must not be there inside
        "connect": target,
        "input": inside_path(mounts, str(given)),  # where the job sees its input
    }
    if jobtype.param("cuda") is not None:
        params["cuda"] = True
    layout.params.write_text(json.dumps(params, indent=2))
    gpu_uuid = gpu.uuid if gpu is not None else None
    # the probe's GPU variables alone: none of the broker's own environment
    base = dict(host.probe.job_env(gpu_uuid)) if host.probe else {"CUDA_VISIBLE_DEVICES": ""}
    env = job_env(
        layout,
        job_id=f"doctor-{jobtype.name}",
        job_type=jobtype.name,
        attempt=1,
        base=base,
        weights_dir=weights,
    )
    return LaunchRequest(
        job_id=f"doctor-{jobtype.name}",
        attempt=1,
        argv=registry.argv(jobtype, launcher.python),
        cwd=jobtype.module_dir,
        env=env,
        attempt_dir=str(work / "attempt"),
        timeout_s=PROBE_TIMEOUT_S if gpu is None else max(PROBE_TIMEOUT_S, jobtype.timeout_s),
        clip_chars=config.broker.clip_chars,
        kill_grace_s=config.broker.kill_grace_s,
        instance=f"doctor-{secrets.token_hex(4)}",
        mounts=mounts,
        gpu_uuid=gpu_uuid,
        memory_bytes=jobtype.ram_bytes,
    )


def _ok(value: Any) -> bool:
    """A probe's path check ({"ok": ...}) or a plain bool."""
    return bool(value.get("ok")) if isinstance(value, dict) else bool(value)


def _error(value: Any) -> str:
    return str(value.get("error") or "") if isinstance(value, dict) else ""


def judge(
    report: dict[str, Any], target: str, *, tmp_bytes: int | None = None
) -> tuple[list[str], list[str], str]:
    """What the probe's report shows that a sandbox must not allow (problems),
    what it could not tell (warnings), and a one-line summary of what it found.
    ``tmp_bytes``: the largest /tmp allowed (``[sandbox] tmp_mib``)."""
    problems: list[str] = []
    warnings: list[str] = []
    found: list[str] = []
    uid, euid = report.get("uid"), report.get("euid")
    found.append(f"uid {uid}")
    if uid == 0 or euid == 0:
        problems.append("the job runs as root (uid 0)")
    cap = report.get("cap_eff")
    found.append(f"CapEff {cap}")
    try:
        caps = int(str(cap), 16)
    except ValueError:
        problems.append(f"its capabilities could not be read (CapEff {cap!r})")
    else:
        if caps:
            problems.append(f"the job holds capabilities (CapEff {cap})")
    nnp = report.get("no_new_privs")
    found.append(f"NoNewPrivs {nnp}")
    if nnp != 1:
        problems.append(f"no_new_privs is {nnp}, not 1 (setuid programs could gain privileges)")
    names = report.get("interfaces")
    if not isinstance(names, list):
        problems.append("its network interfaces could not be listed")
        found.append("interfaces ?")
    else:
        found.append(f"interfaces {','.join(map(str, names)) or 'none'}")
        if others := [n for n in names if n != "lo"]:
            problems.append(f"network interfaces besides lo: {', '.join(map(str, others))}")
    conn = report.get("connect") or {}
    if _ok(conn):
        problems.append(f"it connected to {target} on the host: it shares the host's network")
        found.append(f"connect to {target} ok")
    else:
        found.append(f"connect to {target} failed ({conn.get('kind') or _error(conn)})")
    roots = report.get("root_writable")
    if isinstance(roots, dict):
        writable = [str(p) for p, v in roots.items() if _ok(v)]
    else:
        writable = ["/"] if roots else []
    if writable:
        problems.append(f"the root file system is writable ({', '.join(writable)})")
    else:
        found.append("root read-only")
    for key, what in (("output_writable", "output"), ("scratch_writable", "scratch")):
        value = report.get(key)
        if not _ok(value):
            problems.append(f"the {what} folder is not writable ({_error(value) or value})")
    if _ok(report.get("output_writable")) and _ok(report.get("scratch_writable")):
        found.append("output and scratch writable")
    if _ok(report.get("input_dir_writable")):
        problems.append("the input folder is writable (inputs must be read-only)")
    if report.get("input_readable") is not None and not _ok(report["input_readable"]):
        problems.append(f"the input file is not readable ({_error(report['input_readable'])})")
    if report.get("input_writable") is not None:
        if _ok(report["input_writable"]):
            problems.append("the input file is writable (inputs must be read-only)")
        else:
            found.append("input read-only")
    _judge_kernel(report, problems, found)
    tmp = report.get("tmp")
    size = tmp.get("size_bytes") if isinstance(tmp, dict) else None
    if not isinstance(size, int):
        problems.append("the size of /tmp could not be read")
    else:
        found.append(f"/tmp {format_bytes(size)}")
        if tmp_bytes is not None and size > tmp_bytes:
            problems.append(
                f"/tmp holds {format_bytes(size)}, more than [sandbox] tmp_mib "
                f"({format_bytes(tmp_bytes)})"
            )
    seen = report.get("marker_visible")
    visible = seen.get("visible") if isinstance(seen, dict) else seen
    if seen is None:
        warnings.append("the marker was not checked")
    elif visible is True:
        problems.append(f"a host file beside the job's folders is visible inside ({seen})")
    elif visible is None:
        warnings.append(f"could not tell whether the host marker is hidden ({_error(seen)})")
    else:
        found.append("host marker hidden")
    return problems, warnings, ", ".join(found)


def _judge_kernel(report: dict[str, Any], problems: list[str], found: list[str]) -> None:
    """No nested user namespace, no mount, and a seccomp filter that refuses keyctl."""
    userns = report.get("userns")
    if not isinstance(userns, dict):
        problems.append("the probe did not say whether it can make a user namespace")
    elif userns.get("ok"):
        problems.append(
            "the job can make a user namespace (unshare -U), which gives it capabilities "
            "inside and the kernel's namespaced attack surface"
        )
    else:
        found.append(f"user namespace refused ({_error(userns).split(':')[0]})")
    mount = report.get("mount")
    if isinstance(mount, dict) and mount.get("ok"):
        problems.append("the job can mount a file system")
    mode = report.get("seccomp")
    keyctl = report.get("keyctl")
    if mode != 2:
        problems.append(f"no seccomp filter is loaded (Seccomp {mode})")
    elif isinstance(keyctl, dict) and keyctl.get("ok"):
        problems.append("a seccomp filter is loaded but lets keyctl through (not gpuwarden's)")
    else:
        found.append(f"seccomp filter (keyctl {_error(keyctl).split(':')[0] or 'refused'})")


def _judge_cuda(report: dict[str, Any], uuid: str) -> tuple[str | None, str]:
    gpu = report.get("gpu") or {}
    cuda = gpu.get("cuda") if isinstance(gpu, dict) else None
    if not isinstance(cuda, dict):
        return "CUDA was not tried (no gpu.cuda in the report)", "cuda ?"
    if not cuda.get("ok"):
        lib, tch = cuda.get("libcuda") or {}, cuda.get("torch") or {}
        why = "; ".join(e for e in (_error(lib), _error(tch)) if e) or "no reason given"
        return f"CUDA did not initialise in the sandbox on {uuid}: {why}", "cuda failed"
    count = cuda.get("device_count")
    via = "+".join(cuda.get("via") or [])
    found = f"CUDA initialised on {uuid}: {count} device(s) via {via}"
    if isinstance(count, int) and count > 1:
        return f"the job sees {count} GPUs; it must see only the one it was given", found
    return None, found


# -- running them ---------------------------------------------------------------

#: every check, in the order they run and are shown
CHECKS: tuple[tuple[str, Callable[[Host], Check]], ...] = (
    ("config", check_config),
    ("runtime", check_runtime),
    ("gpu", check_gpu),
    ("cdi", check_cdi),
    ("toolkit", check_toolkit),
    ("modules", check_modules),
    ("weights", check_weights),
    ("queue-roots", check_queue_roots),
    ("image", check_image),
    ("sandbox", check_sandbox),
    ("sandbox-gpu", check_sandbox_gpu),
)


def run_checks(host: Host) -> list[Check]:
    """Every check in order; none raises."""
    checks: list[Check] = []
    try:
        for name, fn in CHECKS:
            try:
                checks.append(fn(host))
            except Skip as skip:
                checks.append(Check(name, Status.WARN, str(skip), "fix the checks above first"))
            except Exception as exc:
                checks.append(
                    Check(
                        name,
                        Status.FAIL,
                        f"the check itself failed: {type(exc).__name__}: {exc}",
                        "report this as a bug in gpuwarden doctor, with the line above",
                    )
                )
    finally:
        host.close()
    return checks


_STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}


def render(console: Console, checks: list[Check]) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        console.print(
            f"[{_STYLE[c.status]}]{c.status.value:<4}[/] {c.name:<{width}}  {escape(c.detail)}"
        )
        if c.fix and c.status is not Status.OK:
            console.print(f"{'':<{width + 6}}[bold]fix:[/] {escape(c.fix)}")
    counts = {s: sum(1 for c in checks if c.status is s) for s in Status}
    console.print(f"{counts[Status.OK]} OK, {counts[Status.WARN]} WARN, {counts[Status.FAIL]} FAIL")


def run_doctor(
    config_path: Path | None,
    *,
    state_dir: Path | None,
    mock_gpu: bool,
    console: Console,
    json_out: bool,
) -> int:
    """Run every check and print the report. Exit status: 0 when none FAILs, 1
    otherwise, 2 when the config cannot be read at all."""
    host = Host(config_path=config_path, state_dir=state_dir, mock_gpu=mock_gpu)
    checks = run_checks(host)
    ok = not any(c.status is Status.FAIL for c in checks)
    if json_out:
        console.print_json(json.dumps({"checks": [c.to_json() for c in checks], "ok": ok}))
    else:
        render(console, checks)
    if host.config_unreadable:
        return 2
    return 0 if ok else 1
