"""``gpuwarden doctor``: the real CLI in subprocesses, against configs made here.

The sandbox checks start a real bubblewrap sandbox (skipped where ``bwrap`` is
not installed, unless GPUWARDEN_REQUIRE_CONTAINERS=1 makes that a failure).
No test sends traffic off this machine: the probe connects to a loopback
listener the doctor opens.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.config import load_config
from gpuwarden.gpu.base import GpuReading
from gpuwarden.launch.memcaps import find_memory_cgroups
from gpuwarden.tools.doctor import Host, check_cdi, check_toolkit, judge

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "src" / "gpuwarden" / "modules"
TEST_MODULES = REPO / "tests" / "modules"
GW = [sys.executable, "-m", "gpuwarden"]

NAMES = [
    "config",
    "runtime",
    "memory-caps",
    "gpu",
    "cdi",
    "toolkit",
    "modules",
    "weights",
    "queue-roots",
    "gpu-lock",
    "image",
    "sandbox",
    "sandbox-gpu",
]

REQUIRE_CONTAINERS = os.environ.get("GPUWARDEN_REQUIRE_CONTAINERS") == "1"


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra)
    return e


def write_config(tmp: Path, body: str = "", *, modules: str | None = None) -> Path:
    cfg = tmp / "gpuwarden.toml"
    paths = modules if modules is not None else f'["{MODULES}"]'
    cfg.write_text(f'state_dir = "state"\nnode_name = "doc"\nmodule_paths = {paths}\n{body}\n')
    return cfg


def doctor(
    cfg: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GW, "--config", str(cfg), *args, "doctor"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(**(extra_env or {})),
    )


def doctor_json(
    cfg: Path, *args: str, extra_env: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, dict[str, str]]]:
    proc = subprocess.run(
        [*GW, "--config", str(cfg), *args, "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(**(extra_env or {})),
    )
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"no JSON on stdout:\n{proc.stdout}\n{proc.stderr}") from None
    assert [c["name"] for c in data["checks"]] == NAMES, data
    for c in data["checks"]:
        assert set(c) == {"name", "status", "detail", "fix"}
        assert c["status"] in ("OK", "WARN", "FAIL")
        if c["status"] != "OK":
            assert c["fix"], c  # every WARN and FAIL says what to do
    assert data["ok"] == all(c["status"] != "FAIL" for c in data["checks"])
    return proc.returncode, data, {c["name"]: c for c in data["checks"]}


def need_bwrap() -> None:
    if shutil.which("bwrap") is None:
        if REQUIRE_CONTAINERS:
            pytest.fail("bwrap is not installed and GPUWARDEN_REQUIRE_CONTAINERS=1")
        pytest.skip(
            "bubblewrap (bwrap) is not installed; set GPUWARDEN_REQUIRE_CONTAINERS=1 to fail"
        )


# -- (a) local runtime, simulated GPU -------------------------------------------


def test_local_runtime_with_sim_gpu_passes(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, 'gpu = "sim"\nqueue_roots = ["queues/demo"]')
    rc, data, checks = doctor_json(cfg)
    assert rc == 0, data
    assert data["ok"] is True
    assert checks["config"]["status"] == "OK"
    assert checks["runtime"]["status"] == "OK"
    assert "no sandbox" in checks["runtime"]["detail"]
    assert "probe.sandbox" in checks["runtime"]["detail"]  # named among the refused types
    assert checks["gpu"]["status"] == "OK"
    assert "simulated" in checks["gpu"]["detail"]
    assert checks["modules"]["status"] == "WARN"  # container types are refused here
    assert "refused" in checks["modules"]["detail"]
    assert checks["queue-roots"]["status"] == "OK"
    assert "created at start" in checks["queue-roots"]["detail"]
    assert not (tmp_path / "queues").exists()  # the doctor creates no queue root
    for name in ("cdi", "toolkit", "image", "sandbox", "sandbox-gpu"):
        assert checks[name]["status"] == "OK"
        assert "not needed" in checks[name]["detail"]
    caps = checks["memory-caps"]
    if find_memory_cgroups() is not None:  # root with the memory controller (CI)
        assert caps["status"] == "OK", caps
        assert caps["detail"].startswith("memory caps: enforced; host jobs: enforced, a memory")
        assert "a test cgroup limited to 64 MiB was made, read back" in caps["detail"]
        assert not any(find_memory_cgroups().parent.glob("doctor-*"))  # and removed
    else:
        assert caps["status"] == "WARN" and "jobs that ask for ram_gib are" in caps["detail"]


def test_human_output_has_one_line_per_check(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, 'gpu = "none"\nallow_unsandboxed_containers = true')
    proc = doctor(cfg, "--mock-gpu")  # the flag wins over gpu = "none"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for name in NAMES:
        assert any(ln.split()[:2][1:] == [name] for ln in lines if ln.strip()), name
    gpu = next(ln for ln in lines if ln.split()[1:2] == ["gpu"])
    assert gpu.startswith("OK") and "simulated" in gpu
    runtime = next(ln for ln in lines if ln.split()[1:2] == ["runtime"])
    assert runtime.startswith("WARN") and "UNSANDBOXED" in runtime
    assert lines[-1].endswith("0 FAIL")


def test_a_config_that_cannot_be_read_exits_2_with_the_report(tmp_path: Path) -> None:
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text("no_such_key = 1\n")
    rc, _, checks = doctor_json(cfg)
    assert rc == 2
    assert checks["config"]["status"] == "FAIL"
    assert "no_such_key" in checks["config"]["detail"]
    assert checks["runtime"]["detail"].startswith("not checked")


# -- (b) an unpinned image -------------------------------------------------------


def test_unpinned_image_fails_config_and_image(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        'gpu = "sim"\ncontainer_runtime = "podman"\nsandbox_image = "localhost/whatever:tag"',
    )
    rc, data, checks = doctor_json(cfg)
    assert rc == 1
    assert data["ok"] is False
    assert checks["config"]["status"] == "FAIL"
    assert "pinned" in checks["config"]["detail"]
    assert checks["image"]["status"] == "FAIL"
    assert "not pinned" in checks["image"]["detail"]
    assert "images/build.sh --runtime podman --pin" in checks["image"]["fix"]
    # the rest is still checked from the config
    assert checks["gpu"]["status"] == "OK"
    assert checks["weights"]["status"] == "OK"
    assert checks["sandbox"]["status"] == "WARN"  # not started with a refused image
    assert "config" in checks["sandbox"]["detail"]


def test_unpinned_image_allowed_is_a_warning(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        'gpu = "sim"\ncontainer_runtime = "podman"\nsandbox_image = "localhost/whatever:tag"\n'
        "allow_unpinned_images = true",
    )
    _, _, checks = doctor_json(cfg)
    assert checks["config"]["status"] == "OK"
    assert "not pinned" in checks["image"]["detail"]
    assert "allow_unpinned_images" in checks["image"]["detail"]
    # FAIL when podman is here (the image is not), WARN when podman is not
    assert checks["image"]["status"] in ("WARN", "FAIL")


def test_a_modules_model_dir_is_checked_with_the_weights(tmp_path: Path) -> None:
    """[modules.<name>] model_dir: a missing one fails the weights check naming the
    key (the node itself would refuse to start); a readable one is OK."""
    (tmp_path / "sao").mkdir(mode=0o755)
    body = (
        'gpu = "sim"\n[modules.audiogen]\nmodel_dir = "sao"\n'
        '[modules.speech]\nmodel_dir = "nowhere"\n'
    )
    rc, _, checks = doctor_json(write_config(tmp_path, body))
    assert rc == 1
    weights = checks["weights"]
    assert weights["status"] == "FAIL"
    assert f"[modules.audiogen] model_dir {tmp_path / 'sao'}: readable" in weights["detail"]
    assert f"[modules.speech] model_dir {tmp_path / 'nowhere'} does not exist" in weights["detail"]
    assert "fix [modules.speech] model_dir" in weights["fix"]
    rc, _, checks = doctor_json(write_config(tmp_path, body.replace("nowhere", "sao")))
    assert checks["weights"]["status"] == "OK", checks["weights"]


# -- (c) queue roots -------------------------------------------------------------


def test_a_queue_root_that_is_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder\n")
    cfg = write_config(tmp_path, 'gpu = "sim"\nqueue_roots = ["afile"]')
    rc, _, checks = doctor_json(cfg)
    assert rc == 1
    assert checks["queue-roots"]["status"] == "FAIL"
    assert "afile is not a directory" in checks["queue-roots"]["detail"]
    assert "queue_roots" in checks["queue-roots"]["fix"]


def test_a_missing_queue_root_fails_without_create(tmp_path: Path) -> None:
    (tmp_path / "q" / "inbox").mkdir(parents=True)
    cfg = write_config(
        tmp_path, 'gpu = "sim"\ncreate_queue_roots = false\nqueue_roots = ["missing", "q"]'
    )
    rc, _, checks = doctor_json(cfg)
    assert rc == 1
    detail = checks["queue-roots"]["detail"]
    assert "missing does not exist" in detail
    assert "processing is missing" in detail


# -- (d) a real sandbox ------------------------------------------------------------


def test_bubblewrap_sandbox_start_is_checked_for_real(tmp_path: Path) -> None:
    need_bwrap()
    cfg = write_config(tmp_path, 'gpu = "sim"\ncontainer_runtime = "bubblewrap"')
    rc, data, checks = doctor_json(cfg)
    sandbox = checks["sandbox"]
    assert sandbox["status"] == "OK", sandbox
    assert rc == 0, data
    detail = sandbox["detail"]
    assert "probe.sandbox in bubblewrap" in detail
    assert "uid 65534" in detail
    assert "CapEff 0000000000000000" in detail
    assert "NoNewPrivs 1" in detail
    assert "interfaces lo," in detail
    assert "root read-only" in detail
    assert "input read-only" in detail
    assert "host marker hidden" in detail
    assert "127.0.0.1:" in detail and "failed" in detail  # the loopback listener
    assert checks["runtime"]["status"] == "OK"
    assert "bubblewrap" in checks["runtime"]["detail"]
    assert checks["sandbox-gpu"]["status"] == "OK"  # a simulated GPU: nothing to start
    assert not (tmp_path / "state" / "doctor").exists()  # it cleans up after itself


def test_sandbox_check_without_the_probe_module_warns(tmp_path: Path) -> None:
    # the shipped probe module is always found, unless a module of its name on
    # module_paths comes first: one without the probe.sandbox type
    mine = tmp_path / "mods" / "probe"
    (mine / "src").mkdir(parents=True)
    (mine / "module.toml").write_text(
        '[module]\nname = "probe"\n[types.other]\nlane = "cpu"\ncommand = ["true"]\n'
    )
    cfg = write_config(
        tmp_path,
        'gpu = "sim"\ncontainer_runtime = "bubblewrap"',
        modules=f'["{tmp_path / "mods"}", "{TEST_MODULES}"]',
    )
    _, _, checks = doctor_json(cfg)
    assert checks["sandbox"]["status"] == "WARN"
    assert "probe module missing" in checks["sandbox"]["detail"]


def test_judge_flags_an_unsandboxed_run(tmp_path: Path) -> None:
    """The probe run as a plain host process (no sandbox): the doctor's judgement
    must find what a sandbox would have stopped."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    marker = tmp_path / "marker"
    marker.write_text("host\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        params = tmp_path / "params.json"
        params.write_text(json.dumps({"marker": str(marker), "connect": target}))
        subprocess.run(
            [sys.executable, str(MODULES / "probe" / "src" / "probe.py")],
            env=env(
                GPUWARDEN_PARAMS=str(params),
                GPUWARDEN_OUTPUT_DIR=str(out),
                GPUWARDEN_SCRATCH_DIR=str(scratch),
            ),
            capture_output=True,
            timeout=60,
            check=True,
        )
    report = json.loads((out / "report.json").read_text())
    problems, _, found = judge(report, target)
    text = "; ".join(problems)
    assert f"connected to {target}" in text
    assert "visible inside" in text
    if os.geteuid() == 0:
        assert "runs as root" in text
    assert f"uid {os.getuid()}" in found


# -- (e) a runtime that is not there ----------------------------------------------


def test_docker_client_without_an_engine_fails_runtime(tmp_path: Path) -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker client here")
    cfg = write_config(
        tmp_path,
        'gpu = "sim"\ncontainer_runtime = "docker"\nsandbox_image = "sha256:' + "ab" * 32 + '"',
    )
    # an engine address where none listens: the client works, the engine cannot answer
    no_engine = {"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    rc, _, checks = doctor_json(cfg, extra_env=no_engine)
    assert rc == 1
    runtime = checks["runtime"]
    assert runtime["status"] == "FAIL"
    assert "no engine answers" in runtime["detail"]
    assert "start the Docker engine" in runtime["fix"]
    assert checks["sandbox"]["status"] == "WARN"
    assert "runtime" in checks["sandbox"]["detail"]


def test_a_runtime_missing_from_path_fails_with_the_install_command(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    cfg = write_config(tmp_path, 'gpu = "sim"\ncontainer_runtime = "bubblewrap"')
    rc, _, checks = doctor_json(cfg, extra_env={"PATH": str(empty)})
    assert rc == 1
    runtime = checks["runtime"]
    assert runtime["status"] == "FAIL"
    assert "bwrap is not on PATH" in runtime["detail"]
    assert "apt-get install bubblewrap" in runtime["fix"]


# -- GPU-only checks, with a stand-in probe and nvidia-ctk ---------------------------


class FakeNvml:
    """Reads like NVML with one GPU (the CDI and toolkit checks act on real GPUs only)."""

    kind = "nvml"

    def read(self) -> list[GpuReading]:
        return [GPU]

    def job_env(self, gpu_uuid: str | None) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": gpu_uuid or ""}

    def close(self) -> None:
        return None


GPU = GpuReading(
    uuid="GPU-12345678-aaaa-bbbb-cccc-1234567890ab",
    name="NVIDIA H200",
    total_bytes=141 * 2**30,
    used_bytes=0,
    driver="570.86.15",
)


def fake_ctk(bin_dir: Path, *, version: str, cdi: list[str]) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-ctk"
    listing = "\n".join(f"nvidia.com/gpu={name}" for name in cdi)
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        f'  printf "NVIDIA Container Toolkit CLI version {version}\\ncommit: abc\\n"; exit 0\n'
        "fi\n"
        'if [ "$1 $2" = "cdi list" ]; then\n'
        f'  echo "INFO[0000] Found {len(cdi)} CDI devices" >&2; printf "{listing}\\n"; exit 0\n'
        "fi\n"
        "exit 2\n"
    )
    script.chmod(0o755)


def gpu_host(tmp_path: Path) -> Host:
    cfg = write_config(
        tmp_path, 'container_runtime = "podman"\nsandbox_image = "sha256:' + "ab" * 32 + '"'
    )
    host = Host(config_path=cfg)
    host.config = load_config(cfg)
    host.probe = FakeNvml()
    host.readings = host.probe.read()
    return host


@pytest.mark.parametrize(
    ("version", "status"), [("1.17.7", "WARN"), ("1.17.8", "OK"), ("1.18.0", "OK")]
)
def test_toolkit_version_and_cve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, status: str
) -> None:
    fake_ctk(tmp_path / "bin", version=version, cdi=[GPU.uuid])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    check = check_toolkit(gpu_host(tmp_path))
    assert check.status.value == status, check
    assert version in check.detail
    if status == "WARN":
        assert "CVE-2025-23266" in check.detail
        assert "1.17.8" in check.fix


def test_cdi_must_name_every_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    fake_ctk(tmp_path / "bin", version="1.17.8", cdi=["0", "all"])
    check = check_cdi(gpu_host(tmp_path))
    assert check.status.value == "FAIL", check
    assert GPU.uuid in check.detail
    assert check.fix.startswith("sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml")
    fake_ctk(tmp_path / "bin", version="1.17.8", cdi=["0", GPU.uuid, "all"])
    assert check_cdi(gpu_host(tmp_path)).status.value == "OK"


def test_gpu_checks_need_the_toolkit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    host = gpu_host(tmp_path)
    for check in (check_cdi(host), check_toolkit(host)):
        assert check.status.value == "FAIL", check
        assert "nvidia-container-toolkit" in check.fix


def test_gpu_lock_off_then_its_folder_checked(tmp_path: Path) -> None:
    base = 'gpu = "sim"\nallow_unsandboxed_containers = true\n'
    _, _, checks = doctor_json(write_config(tmp_path, base))
    assert checks["gpu-lock"]["status"] == "OK" and "off" in checks["gpu-lock"]["detail"]
    folder = tmp_path / "locks"
    cfg = write_config(tmp_path, base + f'gpu_lock = "{folder}/<uuid>.lock"')
    _, _, checks = doctor_json(cfg)
    assert checks["gpu-lock"]["status"] == "OK", checks["gpu-lock"]
    folder.mkdir(mode=0o700)
    _, _, checks = doctor_json(cfg)
    assert checks["gpu-lock"]["status"] == "OK" and "usable (0700)" in checks["gpu-lock"]["detail"]
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    assert folder.is_symlink()  # the planted link is in place
    _, _, checks = doctor_json(cfg)
    assert checks["gpu-lock"]["status"] == "FAIL" and "symlink" in checks["gpu-lock"]["detail"]


def test_gpu_lock_in_a_sticky_folder_or_of_an_unknown_group_fails(tmp_path: Path) -> None:
    """Who may lock (issue 30, item 10): in a folder anyone may write, sticky or
    not (as /run/lock), anyone could make the lock file first and keep the GPU."""
    base = 'gpu = "sim"\nallow_unsandboxed_containers = true\n'
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    cfg = write_config(tmp_path, base + f'gpu_lock = "{folder}/<uuid>.lock"')
    _, _, checks = doctor_json(cfg)
    assert checks["gpu-lock"]["status"] == "FAIL", checks["gpu-lock"]
    assert "may be written by others" in checks["gpu-lock"]["detail"]
    folder.chmod(0o700)
    _, _, checks = doctor_json(cfg)
    assert checks["gpu-lock"]["status"] == "OK" and "who may lock" in checks["gpu-lock"]["detail"]
    lock = f'gpu_lock = "{folder}/<uuid>.lock"\ngpu_lock_group = "no-such-group-here"'
    _, _, checks = doctor_json(write_config(tmp_path, base + lock))
    check = checks["gpu-lock"]
    assert check["status"] == "FAIL" and "no such group" in check["detail"]
