"""The exact command lines each runtime is started with. These pin the lock-down
flags; tests/integration/test_sandbox.py checks from inside that they work."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest

from gpuwarden.core.launchrules import Runtime
from gpuwarden.launch import enter
from gpuwarden.launch.base import LaunchRequest, Mount, inside_path
from gpuwarden.launch.cgroups import PidsCgroups
from gpuwarden.launch.memcaps import MemoryCgroups
from gpuwarden.launch.sandbox import (
    LABEL_INSTANCE,
    SandboxLauncher,
    SandboxLimits,
    container_name,
    mounts_for,
    sandbox_env,
)

A = "/state/jobs/j1/attempt-2"
MOUNTS = mounts_for(
    module_dir="/mods/echo",
    input_dir="/queue/staging/b/inputs",
    output_dir=f"{A}/out",
    scratch_dir=f"{A}/scratch",
    report_dir=f"{A}/report",
    params_file=f"{A}/params.json",
    weights_dir="/srv/weights",
    scratch_bytes=64 * 2**20,
)
ENV = {
    "GPUWARDEN_PARAMS": f"{A}/params.json",
    "GPUWARDEN_INPUT_DIR": "/queue/staging/b/inputs",
    "GPUWARDEN_OUTPUT_DIR": f"{A}/out",
    "GPUWARDEN_SCRATCH_DIR": f"{A}/scratch",
    "GPUWARDEN_RESULT": f"{A}/report/message.json",
    "CUDA_VISIBLE_DEVICES": "GPU-1",
    "LD_PRELOAD": "/evil.so",
    "PATH": "/host/bin",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "SECRET_TOKEN": "x",
}


def request(**changes: object) -> LaunchRequest:
    fields: dict[str, object] = {
        "job_id": "j1",
        "attempt": 2,
        "argv": ("python3", "src/echo.py", f"{A}/params.json"),
        "cwd": "/mods/echo",
        "env": ENV,
        "attempt_dir": A,
        "timeout_s": 60.0,
        "kill_grace_s": 5.0,
        "instance": "node-abc",
        "mounts": MOUNTS,
    }
    fields.update(changes)
    return LaunchRequest(**fields)  # type: ignore[arg-type]


FORBIDDEN = ("--privileged", "--cap-add", "--pid=host", "--ipc=host", "--network=host", "host")


def pairs(argv: list[str]) -> set[tuple[str, str]]:
    return set(itertools.pairwise(argv))


def test_inside_path_uses_the_longest_mount_and_leaves_others() -> None:
    assert inside_path(MOUNTS, f"{A}/out/x/y.txt") == "/gpuwarden/output/x/y.txt"
    assert inside_path(MOUNTS, f"{A}/params.json") == "/gpuwarden/params.json"
    assert inside_path(MOUNTS, "/mods/echo") == "/gpuwarden/module"
    assert inside_path(MOUNTS, "/mods/echoes") == "/mods/echoes"  # a prefix, not a parent
    assert inside_path(MOUNTS, "/etc/passwd") == "/etc/passwd"


def test_sandbox_env_keeps_only_the_allow_list_and_rewrites_paths() -> None:
    env = sandbox_env(request())
    assert env["GPUWARDEN_OUTPUT_DIR"] == "/gpuwarden/output"
    assert env["GPUWARDEN_RESULT"] == "/gpuwarden/report/message.json"
    assert env["GPUWARDEN_ATTEMPT"] == "node-abc/j1/2"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    for dropped in ("LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES", "SECRET_TOKEN"):
        assert dropped not in env
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"


@pytest.mark.parametrize("runtime", [Runtime.PODMAN, Runtime.DOCKER])
def test_engine_argv_locks_everything_down(runtime: Runtime) -> None:
    launcher = SandboxLauncher(
        runtime, SandboxLimits(), image="sha256:" + "a" * 64, mixed_cgroups=False
    )
    argv = launcher.argv(request())
    p = pairs(argv)
    assert argv[:2] == [runtime.value, "run"]
    for flag in (
        ("--network", "none"),
        ("--cap-drop", "all"),
        ("--security-opt", "no-new-privileges"),
        ("--tmpfs", f"/tmp:rw,nosuid,nodev,size={256 * 2**20},mode=1777"),
        ("--user", "65534:65534"),
        ("--ulimit", "nofile=4096:4096"),
        ("--ulimit", "nproc=4096:4096"),  # per uid, across sandboxes: 8 x pids
        ("--pids-limit", "512"),
        ("--cpus", "4"),
        ("--memory", str(16 * 2**30)),
        ("--label", f"{LABEL_INSTANCE}=node-abc"),
        ("--label", "gpuwarden.job=j1"),
        ("--label", "gpuwarden.attempt=2"),
        ("--name", container_name(request())),
        ("--workdir", "/gpuwarden/module"),
    ):
        assert flag in p, flag
    assert "--read-only" in argv and "--init" in argv
    seccomp = [b for a, b in p if a == "--security-opt" and b.startswith("seccomp")]
    if runtime is Runtime.PODMAN:
        # podman's default profile lets a job unshare a user namespace: its own
        # profile without those calls, written to the attempt's folder
        assert seccomp == [f"seccomp={A}/seccomp.json"]
    else:
        assert seccomp == []  # docker's built-in default profile refuses them already
    assert not any("unconfined" in a for a in argv)
    assert ("--mount", "type=bind,source=/mods/echo,target=/gpuwarden/module,readonly") in p
    assert (
        "--mount",
        "type=bind,source=/queue/staging/b/inputs,target=/gpuwarden/input,readonly",
    ) in p
    assert ("--mount", "type=bind,source=/srv/weights,target=/gpuwarden/weights,readonly") in p
    assert ("--mount", f"type=bind,source={A}/out,target=/gpuwarden/output") in p
    assert any(a.startswith("/gpuwarden/scratch:rw") and "size=67108864" in a for a in argv)
    for bad in FORBIDDEN:
        assert bad not in argv
    assert not any("docker.sock" in a or "podman.sock" in a for a in argv)
    assert not any(a.startswith("--device") or a == "--gpus" for a in argv)  # no GPU asked
    assert argv[-3:] == ["python3", "src/echo.py", "/gpuwarden/params.json"]
    assert not any("LD_PRELOAD" in a or "SECRET_TOKEN" in a for a in argv)


def test_podman_names_the_gpu_by_cdi_and_docker_by_uuid() -> None:
    req = request(gpu_uuid="GPU-1234")
    podman = SandboxLauncher(Runtime.PODMAN, image="x" * 12).argv(req)
    assert ("--device", "nvidia.com/gpu=GPU-1234") in pairs(podman)
    docker = SandboxLauncher(Runtime.DOCKER, image="x" * 12).argv(req)
    assert ("--gpus", "device=GPU-1234") in pairs(docker)


def test_podman_on_a_mixed_cgroup_host_runs_in_a_private_mount_namespace() -> None:
    mixed = SandboxLauncher(Runtime.PODMAN, image="a" * 12, mixed_cgroups=True)
    argv = mixed.argv(request())
    assert argv[0] == "unshare" and "umount /sys/fs/cgroup/unified" in argv[argv.index("-c") + 1]
    assert ("--memory", str(16 * 2**30)) in pairs(argv)  # cgroup v1 limits work there
    plain = SandboxLauncher(Runtime.PODMAN, image="a" * 12, mixed_cgroups=False).argv(request())
    assert plain[:2] == ["podman", "run"]
    docker = SandboxLauncher(Runtime.DOCKER, image="a" * 12, mixed_cgroups=True).argv(request())
    assert docker[:2] == ["docker", "run"]  # the docker daemon handles its own cgroups


def test_podman_without_cgroups_enforces_only_the_ulimits() -> None:
    launcher = SandboxLauncher(Runtime.PODMAN, SandboxLimits(cgroups=False), image="a" * 12)
    argv = launcher.argv(request())
    assert ("--cgroups", "disabled") in pairs(argv)
    assert "--memory" not in argv and "--pids-limit" not in argv  # need cgroups
    # without a pids limit of its own, RLIMIT_NPROC is the limit (shared by all)
    assert ("--ulimit", "nproc=512:512") in pairs(argv)
    assert launcher.pids_limit().startswith("RLIMIT_NPROC 512")


PIDS = PidsCgroups(Path("/sys/fs/cgroup/pids"), 1)


def split_bwrap(argv: list[str]) -> tuple[list[str], list[str]]:
    """The root-side starter's options and bubblewrap's command line."""
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def staged_binds(starter: list[str], bwrap: list[str]) -> set[tuple[str, str, str]]:
    """(flag, host source, target) of each bind, with staged sources resolved."""
    stage = [b for a, b in itertools.pairwise(starter) if a == "--stage"]
    out = set()
    for i, arg in enumerate(bwrap):
        if arg in ("--bind", "--ro-bind") and bwrap[i - 1] != "--size":
            src = bwrap[i + 1]
            if src.startswith("/tmp/"):
                src = stage[int(src.removeprefix("/tmp/"))]
            out.add((arg, src, bwrap[i + 2]))
    return out


def test_bwrap_as_root_is_started_by_the_starter_which_drops_to_the_sandbox_user() -> None:
    launcher = SandboxLauncher(Runtime.BUBBLEWRAP, pids_cgroups=PIDS, as_root=True)
    argv = launcher.argv(request(argv=(sys.executable, "src/echo.py")))
    starter, bwrap = split_bwrap(argv)
    p, b = pairs(starter), pairs(bwrap)
    assert starter[:4] == [sys.executable, "-I", "-S", str(Path(enter.__file__).resolve())]
    assert ("--user", "65534:65534") in p  # uid and gid on the host, no groups
    assert ("--cgroup", f"/sys/fs/cgroup/pids/gpuwarden/{container_name(request())}") in p
    # the pids cgroup is the sandbox's own limit; the ulimit a ceiling over all
    assert ("--rlimit", "NPROC=4096") in p and ("--rlimit", "NOFILE=4096") in p
    assert ("--rlimit", f"CPU={math.ceil(4 * 65)}") in p
    assert ("--seccomp", f"{A}/seccomp.bpf") in p
    assert bwrap[0] == "bwrap"
    assert "--unshare-all" in bwrap and "--die-with-parent" in bwrap and "--new-session" in bwrap
    assert "--unshare-user" in bwrap and "--disable-userns" in bwrap
    assert ("--cap-drop", "ALL") in b and ("--uid", "65534") in b and ("--gid", "65534") in b
    assert ("--remount-ro", "/") in b and "--clearenv" in bwrap
    i = bwrap.index("/tmp") - 1
    assert bwrap[i - 4 : i + 2] == [
        "--size",
        str(256 * 2**20),
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
    ]
    binds = staged_binds(starter, bwrap)
    assert ("--ro-bind", "/mods/echo", "/gpuwarden/module") in binds
    assert ("--bind", f"{A}/out", "/gpuwarden/output") in binds
    assert ("--bind", f"{A}/report", "/gpuwarden/report") in binds
    assert ("--ro-bind", "/queue/staging/b/inputs", "/gpuwarden/input") in binds
    assert ("--ro-bind", f"{A}/params.json", "/gpuwarden/params.json") in binds
    if not sys.base_prefix.startswith("/usr"):  # the interpreter, at its own path
        assert ("--ro-bind", sys.base_prefix, sys.base_prefix) in binds
    # every mount of the request is staged: bubblewrap never names a broker path
    assert not any(a.startswith(("/mods", "/queue", "/state", "/srv")) for a in bwrap[:-3])
    assert ("--tmpfs", "/gpuwarden/scratch") in b and ("--size", str(64 * 2**20)) in b
    assert "--share-net" not in bwrap and "--dev-bind" not in bwrap
    assert bwrap[bwrap.index("--", 1) + 1 :] == [sys.executable, "src/echo.py"]
    assert ("--setenv", "LD_PRELOAD") not in b
    assert launcher.job_owner == (65534, 65534)


def test_a_services_bubblewrap_outlives_the_broker_so_that_the_next_one_adopts_it() -> None:
    launcher = SandboxLauncher(Runtime.BUBBLEWRAP, pids_cgroups=PIDS, as_root=True)
    _, bwrap = split_bwrap(launcher.argv(request(outlives_broker=True)))
    assert "--die-with-parent" not in bwrap
    assert "--unshare-all" in bwrap and "--new-session" in bwrap  # the rest as ever
    _, bwrap = split_bwrap(launcher.argv(request()))
    assert "--die-with-parent" in bwrap


def test_bwrap_without_a_pids_cgroup_limits_nproc_to_pids() -> None:
    launcher = SandboxLauncher(Runtime.BUBBLEWRAP, pids_cgroups=None, as_root=True)
    starter, _ = split_bwrap(launcher.argv(request()))
    assert ("--rlimit", "NPROC=512") in pairs(starter) and "--cgroup" not in starter
    said = launcher.pids_limit()
    assert said.startswith("RLIMIT_NPROC 512") and "all sandboxes together" in said


def test_bwrap_run_by_a_user_binds_its_paths_and_changes_no_uid() -> None:
    launcher = SandboxLauncher(Runtime.BUBBLEWRAP, pids_cgroups=None, as_root=False)
    starter, bwrap = split_bwrap(launcher.argv(request()))
    assert "--user" not in starter and "--stage" not in starter
    assert ("--bind", f"{A}/out") in pairs(bwrap) and ("--ro-bind", "/mods/echo") in pairs(bwrap)
    assert launcher.job_owner is None


def test_engines_never_get_a_pids_cgroup_of_ours() -> None:
    podman = SandboxLauncher(Runtime.PODMAN, image="a" * 12, pids_cgroups=PIDS)
    assert podman.pids_cgroups is None and podman.cgroup_path(request()) is None


def test_launcher_refuses_to_be_built_without_what_it_needs() -> None:
    with pytest.raises(ValueError, match="no sandbox"):
        SandboxLauncher(Runtime.LOCAL)
    with pytest.raises(ValueError, match="needs an image"):
        SandboxLauncher(Runtime.PODMAN)


def test_container_names_are_valid_and_distinct() -> None:
    a = container_name(request())
    b = container_name(request(attempt=3))
    c = container_name(request(instance="other"))
    assert len({a, b, c}) == 3
    weird = container_name(request(job_id="a/b c"))
    assert all(ch.isalnum() or ch in "_.-" for ch in weird)


def test_mounts_for_sandbox_have_fixed_targets() -> None:
    targets = {m.target: m for m in MOUNTS}
    assert targets["/gpuwarden/input"] == Mount("/queue/staging/b/inputs", "/gpuwarden/input")
    assert targets["/gpuwarden/output"].writable
    assert not targets["/gpuwarden/weights"].writable
    assert not targets["/gpuwarden/params.json"].writable
    # the job's own folders, handed to the sandbox's user and counted for output_mib
    owned = {m.target for m in MOUNTS if m.job_owned}
    assert owned == {"/gpuwarden/output", "/gpuwarden/report", "/gpuwarden/scratch"}


def test_a_ram_cap_is_the_engines_memory_limit_with_swap_off() -> None:
    cap = 3 * 2**30
    for runtime in (Runtime.PODMAN, Runtime.DOCKER):
        launcher = SandboxLauncher(runtime, image="a" * 12, mixed_cgroups=False)
        assert launcher.memory_caps().enforced and "--memory-swap" in launcher.memory_caps().how
        p = pairs(launcher.argv(request(ram_cap_bytes=cap, memory_bytes=2**30)))
        assert ("--memory", str(cap)) in p and ("--memory-swap", str(cap)) in p
        assert ("--memory", str(2**30)) not in p  # the cap wins over the type's default
    no_cgroups = SandboxLauncher(Runtime.PODMAN, SandboxLimits(cgroups=False), image="a" * 12)
    said = no_cgroups.memory_caps()
    assert not said.enforced and "cgroups = false" in said.how


def test_bwrap_with_a_cap_joins_the_attempts_memory_cgroup_beside_its_pids_cgroup() -> None:
    memory = MemoryCgroups(Path("/sys/fs/cgroup/memory"), 1)
    launcher = SandboxLauncher(
        Runtime.BUBBLEWRAP, pids_cgroups=PIDS, as_root=True, memory_cgroups=memory
    )
    starter, _ = split_bwrap(launcher.argv(request(ram_cap_bytes=2**30)))
    joined = [b for a, b in itertools.pairwise(starter) if a == "--cgroup"]
    name = container_name(request())
    assert joined == [
        f"/sys/fs/cgroup/pids/gpuwarden/{name}",
        f"/sys/fs/cgroup/memory/gpuwarden/{name}",
    ]
    starter, _ = split_bwrap(launcher.argv(request()))  # no cap: the pids cgroup alone
    assert [b for a, b in itertools.pairwise(starter) if a == "--cgroup"] == joined[:1]
    without = SandboxLauncher(Runtime.BUBBLEWRAP, pids_cgroups=PIDS, memory_cgroups=None)
    assert not without.memory_caps().enforced
