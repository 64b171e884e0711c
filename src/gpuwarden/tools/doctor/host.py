"""The host's software: the config, the container runtime, the GPUs, CDI and the
NVIDIA container toolkit."""

from __future__ import annotations

import re
import shutil

from gpuwarden.app import make_probe, sandbox_launcher
from gpuwarden.config import Config, load_config
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import LaunchMode, format_bytes
from gpuwarden.errors import ConfigError, GpuwardenError
from gpuwarden.launch.memcaps import FIX, find_memory_cgroups, why_no_memory_cgroups
from gpuwarden.tools.doctor.base import (
    Check,
    Host,
    Status,
    captured,
    executable,
    run_command,
    tail,
)

#: what the sandbox launcher needs of bubblewrap (0.8.0 and later)
BWRAP_OPTIONS = ("--disable-userns", "--seccomp", "--size")
#: the first NVIDIA Container Toolkit release with the fix for CVE-2025-23266
TOOLKIT_FIXED = (1, 17, 8)
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


def check_memory_caps(host: Host) -> Check:
    """Whether a job's RAM cap (``ram_gib``) is enforced here, tried for real: a
    memory cgroup with a small limit is made, read back and removed."""
    config = host.need_config()
    memory = find_memory_cgroups()
    if memory is None:
        why = f"no memory cgroup can be made here: {why_no_memory_cgroups()}"
    else:
        try:
            why = f"{memory.describe()}; {memory.try_out()}"
        except (OSError, ValueError) as exc:
            why = f"a test memory cgroup under {memory.parent} failed: {exc}"
            memory = None
    said = [f"host jobs: {'enforced, ' if memory else 'not enforced: '}{why}"]
    enforced = memory is not None
    sandbox = sandbox_launcher(config, memory)
    if sandbox is not None:
        caps = sandbox.memory_caps()
        enforced = enforced and caps.enforced
        state = "enforced, " if caps.enforced else "not enforced: "
        said.append(f"{config.container_runtime.value} jobs: {state}{caps.how}")
    if enforced:
        return Check("memory-caps", Status.OK, "memory caps: enforced; " + "; ".join(said))
    return Check(
        "memory-caps",
        Status.WARN,
        "memory caps: not enforced here for every launch mode; jobs that ask for ram_gib are "
        "refused where they are not; " + "; ".join(said),
        FIX,
    )


def check_runtime(host: Host) -> Check:
    config = host.need_config()
    runtime = config.container_runtime
    if runtime is Runtime.LOCAL:
        return _local_runtime(host, config)
    exe = executable(runtime)
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
        client = run_command([exe, "--version"])
        server = run_command([exe, "version", "--format", "{{.Server.Version}}"])
        engine = server.stdout.strip()
        if server.returncode != 0 or not engine:
            said = tail(server.stderr) or f"exit {server.returncode}"
            return Check(
                "runtime",
                Status.FAIL,
                f"the docker client works ({tail(client.stdout) or path}) but no engine "
                f"answers: {said}",
                "start the Docker engine (sudo systemctl start docker), or point DOCKER_HOST "
                "at one; a user outside the docker group cannot reach /var/run/docker.sock. "
                'Or use container_runtime = "podman" or "bubblewrap"',
            )
        host.runtime_ok = True
        return Check("runtime", Status.OK, f"docker engine {engine} ({path})")
    done = run_command([exe, "--version"])
    version = tail(done.stdout) or tail(done.stderr)
    if done.returncode != 0:
        return Check(
            "runtime",
            Status.FAIL,
            f"{path} --version failed (exit {done.returncode}): {version}",
            f"repair or reinstall it: {_INSTALL[runtime]}",
        )
    if runtime is Runtime.BUBBLEWRAP:
        usage = run_command([exe, "--help"])
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
    with captured("gpuwarden.gpu") as notes:
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
        done = run_command(["docker", "info", "--format", "{{json .Runtimes}}"])
        if done.returncode != 0:
            return Check(
                "cdi",
                Status.WARN,
                f"cannot check docker's runtimes: docker info failed: {tail(done.stderr)}",
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
    done = run_command([ctk, "cdi", "list"])
    if done.returncode != 0:
        return Check(
            "cdi",
            Status.FAIL,
            f"nvidia-ctk cdi list failed (exit {done.returncode}): {tail(done.stderr)}",
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
    done = run_command([ctk, "--version"])
    text = done.stdout + "\n" + done.stderr
    match = re.search(r"version\s+v?(\d+)\.(\d+)\.(\d+)", text)
    if done.returncode != 0 or match is None:
        return Check(
            "toolkit",
            Status.WARN,
            f"cannot read the toolkit's version from `nvidia-ctk --version`: {tail(text)}",
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
