"""A real sandboxed start: the ``probe`` module's ``probe.sandbox`` (and, with a
real GPU, ``probe.gpu``) run through the same :class:`SandboxLauncher`, with the
same kind of launch request the broker builds, and the report it writes from
inside judged (:func:`judge`)."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shlex
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden import safefs
from gpuwarden.app import sandbox_launcher
from gpuwarden.config import Config
from gpuwarden.core.launchrules import Runtime
from gpuwarden.core.model import MIB, JobType, format_bytes
from gpuwarden.gpu.base import GpuReading
from gpuwarden.launch.base import LaunchRequest, inside_path
from gpuwarden.launch.sandbox import SandboxLauncher, mounts_for
from gpuwarden.node.attempts import AttemptLayout, job_env
from gpuwarden.registry import Registry
from gpuwarden.tools.doctor.base import (
    Check,
    Host,
    Skip,
    Status,
    tail,
)

log = logging.getLogger("gpuwarden.tools.doctor")

#: the probe module's job types the sandbox checks run
PROBE_SANDBOX = "probe.sandbox"
PROBE_GPU = "probe.gpu"
#: seconds a sandbox check's probe may run
PROBE_TIMEOUT_S = 60.0
#: the largest report.json the doctor reads
REPORT_LIMIT = 4 * 2**20


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
            log.info("doctor runs: %s", shlex.join(launcher.argv(req)))
            result = launcher.run(req, threading.Event())
        stderr = tail(result.stderr, 6)
        said = f"; stderr: {stderr}" if stderr else ""
        if result.launch_error and tail(result.stderr) in result.launch_error:
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
    _judge_files(report, problems, found)
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


def _judge_files(report: dict[str, Any], problems: list[str], found: list[str]) -> None:
    """A read-only root, writable output and scratch, read-only inputs."""
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
